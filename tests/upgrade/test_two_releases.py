"""Two releases side by side on one shard database, as a rolling update runs them.

The previous release (from the git history, in its own venv: `releases.py`) serves the shard under
duplicate-laden load (`tests/faults/load.py`: Deposits sent 1 to 3 times, retried on transient
answers, spread over every daemon in the rotation); a daemon of this release starts beside it and
migrates the schema while the old one keeps serving; the stored outcomes of each release are replayed
by the other, byte for byte; a second new daemon comes up, the old one leaves the rotation and is
stopped. Then: no call failed, nothing was lost, nothing applied twice, the balances are the ledger's.

And the same harness fails on purpose: a planted contract migration that drops a column the previous
release writes, applied while it serves, makes its calls fail, and this release refuses to start
against the schema it leaves.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest

from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.core.wire_names import REPLAYED_TRAILER, REPLAYED_VALUE
from shardrouter.shardd import migrations
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.faults.load import DepositLoad, Ledger, LoadResult
from tests.processes import ServiceProcess, run_shardd
from tests.upgrade.releases import release_shardd
from tests.upgrade.releases import this_release_shardd as new_shardd

DEPOSIT = "/shardrouter.v1.TransferService/Deposit"
#: A contract step that drops what the previous release writes with every Deposit.
PLANTED_CONTRACT = (
    migrations.LATEST_VERSION + 1,
    "planted: drop the ledger entries' reference",
    "ALTER TABLE ledger_entries DROP COLUMN reference;",
)


@pytest.fixture
def database(empty_database: str) -> str:
    """Empty: the previous release's daemon makes its schema, as it did before the update."""
    return empty_database


class Rotation:
    """The daemons a caller's calls are spread over (a Service's ready endpoints), round robin."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._turn = itertools.count()

    def add(self, daemon: ServiceProcess) -> None:
        with self._lock:
            self._channels[daemon.address] = grpc.insecure_channel(daemon.address)

    def remove(self, daemon: ServiceProcess) -> None:
        with self._lock:
            self._channels.pop(daemon.address)  # calls under way on it finish; the channel is dropped

    def Deposit(self, request, metadata, timeout):  # the stub's method, for DepositLoad
        with self._lock:
            channels = list(self._channels.values())
        channel = channels[next(self._turn) % len(channels)]
        return transfer_pb2_grpc.TransferServiceStub(channel).Deposit(
            request, metadata=metadata, timeout=timeout
        )


def _replay(address: str, key: str, account: str, amount: int) -> tuple[bytes, bool]:
    """A Deposit sent again with its key: the answer's bytes and whether it says it is a replay."""
    request = transfer_pb2.DepositRequest(
        account_id=account, amount=transfer_pb2.Money(amount_minor=amount, currency="EUR")
    )
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(DEPOSIT)
        answer, info = call.with_call(request.SerializeToString(), metadata=[(KEY_METADATA, key)], timeout=10)
    replayed = (REPLAYED_TRAILER, REPLAYED_VALUE) in tuple(info.trailing_metadata() or ())
    return answer, replayed


def _stored(dsn: str, keys: set[str]) -> dict[str, tuple[str, int, bytes]]:
    """Each key's deposit (account, amount) and the answer its record stored."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT e.idempotency_key::text, e.account_id, e.amount_minor, r.response FROM ledger_entries e"
            " JOIN idempotency_record r ON r.key::text = e.idempotency_key::text WHERE e.idempotency_key::text = ANY(%s)",
            (sorted(keys),),
        ).fetchall()
    return {key: (account, int(amount), bytes(response)) for key, account, amount, response in rows}


def _replayed_alike(dsn: str, keys: set[str], daemons: list[ServiceProcess]) -> Counter[str]:
    """Every key replayed by every daemon: each answer is the stored one, marked as a replay."""
    seen: Counter[str] = Counter()
    for key, (account, amount, response) in _stored(dsn, keys).items():
        for daemon in daemons:
            answer, replayed = _replay(daemon.address, key, account, amount)
            assert (answer, replayed) == (response, True), (daemon.name, key)
            seen[daemon.name] += 1
    return seen


def _twins(first: ServiceProcess, second: ServiceProcess, count: int) -> tuple[int, Counter[str]]:
    """`count` Deposits each sent twice at the same moment, one copy to each daemon (retried while the
    other holds the key): both copies get the same answer. Returns the amount deposited and the
    transient answers seen (in-flight conflicts)."""
    seen: Counter[str] = Counter()
    total = 0

    def send(address: str, key: str, request: bytes) -> bytes:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(DEPOSIT)
            for _ in range(100):
                try:
                    return call(request, metadata=[(KEY_METADATA, key)], timeout=10)
                except grpc.RpcError as err:
                    if err.code() is not grpc.StatusCode.ABORTED:
                        raise
                    seen[err.code().name] += 1
                    time.sleep(0.02)
        raise AssertionError(f"{key} stayed in flight")

    with ThreadPoolExecutor(8) as pool:
        for n in range(count):
            key, amount = str(new_key()), 1 + n % 50
            request = transfer_pb2.DepositRequest(
                account_id=f"twin-{n % 5}", amount=transfer_pb2.Money(amount_minor=amount, currency="EUR")
            ).SerializeToString()
            a = pool.submit(send, first.address, key, request)
            b = pool.submit(send, second.address, key, request)
            assert a.result() == b.result(), key
            total += amount
    return total, seen


def _check(result: LoadResult, dsn: str, extra: int = 0) -> Ledger:
    ledger = Ledger.read([dsn])
    assert result.failed == set(), {k: result.outcomes[k] for k in sorted(result.failed)[:5]}
    assert result.lost(ledger) == []
    assert ledger.duplicates_applied == 0
    assert result.applied_unreported(ledger) == []
    assert ledger.unfinished == 0 and ledger.orphans == 0 and ledger.empty == 0
    assert ledger.balance == result.expected_balance(ledger) + extra
    return ledger


# The rolling update across two shards, router and relays included
# (test_rolling_update_across_shards.py), runs by default; this one-shard variant with --run-slow.
@pytest.mark.slow
def test_a_rolling_update_from_the_previous_release_fails_no_call(
    previous_release, database, tmp_path, capsys
):
    started = time.monotonic()
    old = release_shardd(previous_release, tmp_path, shard_id="shard-a", dsn=database, name="old")
    new_a = new_shardd(tmp_path, shard_id="shard-a", dsn=database, name="new-a")
    new_b = new_shardd(tmp_path, shard_id="shard-a", dsn=database, name="new-b")
    daemons = [old, new_a, new_b]
    rotation = Rotation()
    try:
        old.start()
        with psycopg.connect(database) as conn:
            assert migrations.schema_version(conn) == previous_release.schema
        rotation.add(old)
        load = DepositLoad(rotation, seed=37, accounts=12, workers=6, interval_s=0.01)  # type: ignore[arg-type]
        load.start()
        time.sleep(1.5)
        migrating = time.monotonic()
        new_a.start()  # migrates to this release's schema while the old daemon serves under load
        migrated = time.monotonic()
        with psycopg.connect(database) as conn:
            assert migrations.schema_version(conn) == migrations.LATEST_VERSION
        rotation.add(new_a)
        time.sleep(1.5)
        # Each release replays what the other stored (the keys so far were answered by either one).
        with load._lock:  # a snapshot of the keys answered so far
            answered = set(load._result.completed)
        side_by_side = _replayed_alike(database, answered, [old, new_a])
        # Twins in flight at once, one on each release: one claim wins, the other replays it.
        twin_amount, twin_conflicts = _twins(old, new_a, 60)
        new_b.start()
        rotation.add(new_b)
        rotation.remove(old)  # out of the endpoints first, as Kubernetes does, then SIGTERM
        assert old.terminate() == 0, old.log_text()[-2000:]
        time.sleep(1.5)
        result = load.stop()
        ledger = _check(result, database, twin_amount)
        after = _replayed_alike(database, set(result.completed) - answered, [new_a, new_b])
    finally:
        for daemon in daemons:
            daemon.kill()
    # The longest call answered while the new daemon started and migrated (through the old one).
    stall = max((d for t, d in result.latencies if t <= migrated and t + d >= migrating), default=0.0)
    with capsys.disabled():
        transient = {k: v for k, v in result.counts.items() if k.isupper()}
        print(
            f"\ntwo releases ({previous_release.commit[:9]}, schema {previous_release.schema} -> "
            f"{migrations.LATEST_VERSION}): operations {len(result.outcomes)}, duplicates sent "
            f"{result.counts['duplicates sent']}, transient answers {transient}, ledger keys {len(ledger.entries)}; "
            f"replayed side by side {dict(side_by_side)}, after {dict(after)}; twins in flight 60 "
            f"({dict(twin_conflicts)}); longest call while migration {migrations.LATEST_VERSION} ran "
            f"{stall:.3f} s; {time.monotonic() - started:.1f} s"
        )
    assert side_by_side["old"] > 20 and side_by_side["new-a"] == side_by_side["old"]
    assert stall < 1.0


def test_a_planted_contract_migration_fails_the_previous_releases_calls(
    previous_release, database, tmp_path, monkeypatch
):
    old = release_shardd(previous_release, tmp_path, shard_id="shard-a", dsn=database, name="old")
    rotation = Rotation()
    try:
        old.start()
        rotation.add(old)
        load = DepositLoad(rotation, seed=38, accounts=12, workers=4, interval_s=0.01, give_up_after_s=2.0)  # type: ignore[arg-type]
        load.start()
        time.sleep(1.0)
        # This release's runner, with the planted step appended (as a newer release would ship it).
        monkeypatch.setattr(migrations, "MIGRATIONS", (*migrations.MIGRATIONS, PLANTED_CONTRACT))
        monkeypatch.setitem(
            migrations.COMPATIBILITY,
            PLANTED_CONTRACT[0],
            migrations.Compatibility(
                migrations.Step.CONTRACT, "planted", serves_code_from=PLANTED_CONTRACT[0]
            ),
        )
        with psycopg.connect(database, autocommit=True) as conn:
            assert migrations.apply_migrations(conn) == [migrations.LATEST_VERSION, PLANTED_CONTRACT[0]]
        monkeypatch.undo()
        time.sleep(3.0)
        result = load.stop()
    finally:
        old.kill()
    # The harness sees it: calls of the previous release failed for good.
    assert result.failed, "the previous release kept working after its column was dropped"
    assert {outcome for key in result.failed for outcome in result.outcomes[key]} >= {"FAILED:INTERNAL"}
    logged = old.log_text().replace('\\"', '"')  # JSON lines
    assert 'column "reference" of relation "ledger_entries" does not exist' in logged
    # And this release refuses to start against the schema the contract step left, naming both versions.
    refused = run_shardd("migrate", "--dsn", database)
    assert refused.returncode == 2, refused.stderr
    assert (
        f"schema is at version {PLANTED_CONTRACT[0]}, newer than this release's {migrations.LATEST_VERSION}, "
        f"and only releases of schema {PLANTED_CONTRACT[0]} or newer serve it" in refused.stderr
    )
