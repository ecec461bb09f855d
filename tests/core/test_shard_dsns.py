"""Shard DSNs given as a file or as SHARD=DSN values: read strictly, and no message about a bad one
repeats a DSN or a line of the file (a DSN may hold a password)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardrouter.core.shard_dsns import parse_shard_dsn_pairs, read_shard_dsns

SECRET = "s3cret-p4ss"


def test_pairs_are_read_and_a_later_one_wins() -> None:
    pairs = ["shard-0=postgresql://a/x", "shard-1=host=b dbname=y", "shard-0=postgresql://c/z"]
    assert parse_shard_dsn_pairs("--dsn", pairs) == {
        "shard-0": "postgresql://c/z",
        "shard-1": "host=b dbname=y",
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (f"postgresql://shardd:{SECRET}@h/db", "--dsn: give SHARD=DSN (no '=' in the value)"),
        ("shard-0=", "--dsn 'shard-0': give SHARD=DSN"),
        (f"={SECRET}", "--dsn '': give SHARD=DSN"),
    ],
)
def test_a_bad_pair_is_named_by_its_flag_never_by_its_value(value: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_shard_dsn_pairs("--dsn", [value])
    assert str(refused.value) == message
    assert SECRET not in str(refused.value)


def test_a_file_that_is_not_yaml_is_refused_without_quoting_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "databases.yaml"
    path.write_text(f"shard-0: postgresql://shardd:{SECRET}@h/db\n  shard-1: [unclosed {SECRET}\n")
    with pytest.raises(ValueError) as refused:
        read_shard_dsns(path)
    assert str(refused.value).startswith(f"--databases {path}: cannot read it: ")
    assert "line 2" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_a_file_of_another_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "databases.yaml"
    path.write_text("- shard-0\n- shard-1\n")
    with pytest.raises(ValueError, match="must be a mapping of shard id to DSN"):
        read_shard_dsns(path)
