"""Which database failures a call may retry with its key: PostgreSQL's internal error for a
publication dropped under a write (a move's clean-up) is one; any other internal error is not."""

from __future__ import annotations

import pytest
from psycopg import errors

from shardrouter.core.errors import Unavailable
from shardrouter.shardd.db import mapped_database_errors


def test_a_publication_dropped_under_a_write_is_unavailable_and_retried() -> None:
    with pytest.raises(Unavailable) as mapped, mapped_database_errors(250):
        raise errors.InternalError_("cache lookup failed for publication 28017")
    assert mapped.value.retry_after_ms == 250
    assert "retry with the same idempotency key" in mapped.value.message


def test_any_other_internal_error_stays_unexpected() -> None:
    with pytest.raises(errors.InternalError_), mapped_database_errors(250):
        raise errors.InternalError_("cache lookup failed for relation 1234")
