"""Callers written against the library's former name (`shardclient`) keep working, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

import shardrouter.client


def test_the_former_name_is_the_same_library_and_warns() -> None:
    sys.modules.pop("shardclient", None)
    with pytest.warns(DeprecationWarning, match="now shardrouter.client"):
        former = importlib.import_module("shardclient")
    assert former.__all__ == shardrouter.client.__all__
    for name in former.__all__:
        assert getattr(former, name) is getattr(shardrouter.client, name)
