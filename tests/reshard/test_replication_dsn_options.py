"""How `shard-router reshard` is told the connection string a move's subscription uses to reach the
old owner (`--replication-dsn SHARD=DSN`, `--replication-databases FILE`): read, checked before
anything connects, and left out (the subscription takes the shard's own DSN) when not given.
The checks need no database; the last test shows, on the session's PostgreSQL, that the server
honours the sslmode of a subscription's connection string."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import psycopg
import pytest

from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.reshard import cli, replication
from shardrouter.reshard.move import ShardDatabases
from shardrouter.reshard.plan import MoveError

DSNS = {
    "shard-0": "postgresql://shardd:s3cret@postgres-shard-0-rw.shard-router:5432/shardd",
    "shard-1": "postgresql://shardd:s3cret@postgres-shard-1-rw.shard-router:5432/shardd",
}
VERIFIED = DSNS["shard-0"] + "?sslmode=verify-full&sslrootcert=/projected/shard-databases-ca/shard-0/ca.crt"


def databases(*argv: str, tmp_path: Path) -> ShardDatabases:
    path = tmp_path / "databases.yaml"
    path.write_text(json.dumps(DSNS), encoding="utf-8")
    args = cli._parser(None).parse_intermixed_args(["status", "--databases", str(path), *argv])
    return cli._databases(args, None)


def test_without_a_replication_dsn_the_subscription_uses_the_shards_own_dsn(tmp_path: Path) -> None:
    found = databases(tmp_path=tmp_path)
    assert found.replication_dsns is None
    assert found.replication_dsn("shard-0") == DSNS["shard-0"]


def test_a_replication_dsn_is_used_for_its_shard_only(tmp_path: Path) -> None:
    found = databases(f"--replication-dsn=shard-0={VERIFIED}", tmp_path=tmp_path)
    assert found.replication_dsn("shard-0") == VERIFIED
    assert found.replication_dsn("shard-1") == DSNS["shard-1"]
    assert found.dsn("shard-0") == DSNS["shard-0"], "the command's own connections keep the DSN"


def test_replication_databases_file_gives_every_shards_and_the_flag_wins(tmp_path: Path) -> None:
    replication = {s: d + "?sslmode=verify-full&sslrootcert=/projected/x/ca.crt" for s, d in DSNS.items()}
    path = tmp_path / "replication.yaml"
    path.write_text(json.dumps(replication), encoding="utf-8")
    found = databases("--replication-databases", str(path), tmp_path=tmp_path)
    assert found.replication_dsns == replication
    found = databases(
        "--replication-databases", str(path), f"--replication-dsn=shard-1={VERIFIED}", tmp_path=tmp_path
    )
    assert found.replication_dsn("shard-0") == replication["shard-0"]
    assert found.replication_dsn("shard-1") == VERIFIED


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replication-dsn=shard-9=" + VERIFIED], "--replication-dsn: shard 'shard-9' has no database"),
        (["--replication-dsn=shard-0"], "--replication-dsn: give SHARD=DSN (no '=' in the value)"),
        (["--replication-dsn=shard-0="], "--replication-dsn 'shard-0': give SHARD=DSN"),
        # SHARD= forgotten: the DSN splits at its own '=', and is shown nowhere
        (
            ["--replication-dsn=postgresql://shardd:s3cret@h/shardd?sslmode=verify-full"],
            "--replication-dsn: SHARD of SHARD=DSN has no database (known: shard-0, shard-1)",
        ),
        (["--replication-dsn=postgresql://shardd:s3cret@h/shardd"], "give SHARD=DSN (no '=' in the value)"),
        (["--replication-dsn=shard-0=host=h password=s3cret port"], "not a connection string libpq can read"),
        (["--replication-dsn=shard-0=" + DSNS["shard-0"] + "?sslmode=verify"], "sslmode=verify; give one of"),
        (["--replication-dsn=shard-0=host=h password=s3cret sslmode=full"], "sslmode=full; give one of"),
    ],
)
def test_a_bad_replication_dsn_stops_the_command_before_it_connects(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(MoveError) as caught:
        databases(*argv, tmp_path=tmp_path)
    assert message in str(caught.value)
    path = tmp_path / "databases.yaml"
    # the command line says so and exits 2, without the password
    assert cli.main(["status", "--databases", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "s3cret" not in err


def test_a_bad_replication_databases_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "replication.yaml"
    bad.write_text("- not a mapping\n", encoding="utf-8")
    with pytest.raises(MoveError, match=re.escape(f"--replication-databases {bad}: must be a mapping")):
        databases("--replication-databases", str(bad), tmp_path=tmp_path)
    with pytest.raises(MoveError, match=r"^--replication-databases .*: cannot read it"):
        databases("--replication-databases", str(tmp_path / "missing.yaml"), tmp_path=tmp_path)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(json.dumps({"shard-7": VERIFIED}), encoding="utf-8")
    with pytest.raises(
        MoveError, match=re.escape(f"--replication-databases {unknown}: shard 'shard-7' has no database")
    ):
        databases("--replication-databases", str(unknown), tmp_path=tmp_path)


def test_the_subscription_honours_the_sslmode_of_its_connection_string(postgres: LocalPostgres) -> None:
    """What a replication DSN's sslmode is for: the new owner's server connects with it, and with
    verify-full does not replicate unless TLS verifies the old owner (the embedded server's libpq
    has no TLS at all, so it refuses at once: never plain text; without sslmode it connects, as
    every move test shows)."""
    source, target = (f"r{uuid.uuid4().hex[:10]}" for _ in range(2))
    for name in (source, target):
        postgres.create_database(name)
    with psycopg.connect(postgres.dsn_for(source), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    verified = postgres.dsn_for(source) + "?sslmode=verify-full&sslrootcert=/projected/x/shard-0/ca.crt"
    try:
        with psycopg.connect(postgres.dsn_for(target), autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
            with pytest.raises(psycopg.Error, match="could not connect to the publisher") as refused:
                replication.create_subscription(
                    conn, "verified", source_conninfo=verified, publication="p", slot="s"
                )
            assert "ssl" in str(refused.value).lower(), refused.value
            assert conn.execute(
                "SELECT count(*) FROM pg_subscription WHERE subname = 'verified'"
            ).fetchone() == (0,)
    finally:
        with psycopg.connect(postgres.dsn_for(source), autocommit=True) as conn:
            replication.drop_slot(conn, "s")
