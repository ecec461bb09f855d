"""A pytest plugin for `tests/test_tiers.py` (`-p tests.tier_listing`): after collection it prints
each test's module with its tier, so one collection shows both the fast tier and everything."""

from __future__ import annotations

import pytest

#: The first word of each line this plugin prints.
FAST, OTHER = "tier:fast", "tier:other"


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        tier = FAST if item.get_closest_marker("fast") else OTHER
        print(f"{tier} {item.nodeid.split('::', 1)[0]}")
