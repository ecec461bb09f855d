"""What the two-release tests share: the previous release, installed once per module."""

from __future__ import annotations

import pytest

from tests.upgrade.releases import Release, install_release, is_shallow_clone, previous_release_commit


@pytest.fixture(scope="module")
def previous_release() -> Release:
    """The release a rolling update replaces, installed into its own venv (cached by commit)."""
    if is_shallow_clone():
        pytest.skip("a shallow clone holds no previous release to install (git fetch --unshallow)")
    commit, schema = previous_release_commit()
    return install_release(commit, schema)
