"""A rolling update of two shards and their router from the previous release, under cross-shard load.

Two shards, each over its own database and served by a daemon of the previous release with its relay
on, behind a router of the previous release. Through the routers (each attempt to the next one in the
rotation, as a load balancer spreads calls) the checker's workload runs (`shardrouter.check`): deposits,
transfers within a shard and across shards, transfers to accounts nobody opened (refunded), duplicates
in flight and after the answer, keys reused with another body, expired keys. Meanwhile, one process at
a time, as a rolling update replaces pods: a daemon of this release starts on shard 0 (it migrates the
schema while the old one serves), joins the map beside the old one, the old one leaves the map and
stops; the same on shard 1; a router of this release joins the rotation, the old one leaves it and
stops.

While a shard's two daemons serve side by side, both relays deliver its credits: the test waits until
the old daemon's relay delivered a credit a new daemon's transfer queued, and the reverse, and each
daemon replays keys the other release stored. Who did what is read from the database: each daemon's
connections carry its release in a setting of their own (`PGOPTIONS`), and audit triggers the test
adds to each database (after the previous release made its schema) record the release whose connection
queued a credit, delivered it, and stored each key's record.

Then the checker's proofs over the whole history and both databases: one definite answer per key,
replays byte-identical, nothing acknowledged missing, nothing applied twice, every cross-shard transfer
credited or refunded exactly once, balances equal to their ledgers and the answers, money conserved;
and no call answered other than definitely or with a status a caller retries, no operation left
without a definite answer, and every key the previous release stored replayed alike by this one.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest

from shardrouter.check.drive import Sender, Workload, plan, request_bytes, run_operation
from shardrouter.check.history import DEFINITE_CODES, History, HistoryWriter, Operation, read_history
from shardrouter.check.http import Exchange
from shardrouter.check.ledgers import owners
from shardrouter.check.verify import answers_of, prove
from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import even_shard_map, write_shard_map
from shardrouter.localcluster.postgres import LocalPostgres, free_port
from shardrouter.shardd import migrations
from tests.processes import ServiceProcess
from tests.upgrade.releases import (
    Release,
    release_router,
    release_shardd,
    this_release_router,
    this_release_shardd,
)

SHARDS = ("shard-0", "shard-1")
#: The answers a caller resends the same key after: they say nothing about whether it applied.
TRANSIENT = frozenset({"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
#: The release a daemon's database connections name in the session setting `upgrade.release`.
PREVIOUS, THIS = "previous", "this"
#: Test instrumentation, added once the previous release made its schema: who queued each credit,
#: who marked it delivered, who stored each key's record.
AUDIT = """
CREATE TABLE upgrade_audit (what text NOT NULL, id text NOT NULL, by text NOT NULL);
CREATE FUNCTION upgrade_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO upgrade_audit VALUES (TG_ARGV[0], to_jsonb(NEW) ->> TG_ARGV[1], coalesce(current_setting('upgrade.release', true), '?'));
    RETURN NULL;
END $$;
CREATE TRIGGER upgrade_audit_queued AFTER INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION upgrade_audit('queued', 'transfer_id');
CREATE TRIGGER upgrade_audit_delivered AFTER UPDATE OF delivered_at ON outbox
    FOR EACH ROW WHEN (OLD.delivered_at IS NULL AND NEW.delivered_at IS NOT NULL)
    EXECUTE FUNCTION upgrade_audit('delivered', 'transfer_id');
CREATE TRIGGER upgrade_audit_stored AFTER INSERT ON idempotency_record
    FOR EACH ROW EXECUTE FUNCTION upgrade_audit('stored', 'key');
"""
#: Keys of the load each release stores on a shard before the other replays them.
SIDE_BY_SIDE_KEYS = 30
WORKLOAD = Workload(
    operations=20_000,  # more than the run can start: the load runs until stopped
    concurrency=6,
    seed=37,
    accounts=12,
    attempt_timeout_s=5.0,
    operation_timeout_s=30.0,
    caller="upgrade-check",  # one caller through the routers and straight to a daemon: one key scope
)


class Routers(Sender):
    """The routers a caller's attempts are spread over, in turn (a load balancer's ready backends)."""

    def __init__(self, writer: HistoryWriter, workload: Workload) -> None:
        super().__init__("127.0.0.1:9", writer, workload)  # its own channel is never used
        self._members: dict[str, Sender] = {}
        self._every: list[Sender] = []  # also those removed: closed last
        self._turn = itertools.count()
        self._guard = threading.Lock()

    def add(self, router: ServiceProcess) -> None:
        with self._guard:
            self._members[router.address] = Sender(router.address, self._writer, self._workload)
            self._every.append(self._members[router.address])

    def remove(self, router: ServiceProcess) -> None:
        with self._guard:
            self._members.pop(router.address)  # attempts under way on it finish; it takes no new one

    def _grpc(self, key: str, method: str, body: bytes) -> Exchange:
        with self._guard:
            members = list(self._members.values())
        return members[next(self._turn) % len(members)]._grpc(key, method, body)

    def close(self) -> None:
        for sender in self._every:
            sender.close()
        super().close()


class Load:
    """The workload's operations, started one every 20 ms on the workload's threads until stopped
    (an operation not begun by then is never sent)."""

    def __init__(
        self, sender: Sender, writer: HistoryWriter, workload: Workload, ops: list[Operation]
    ) -> None:
        self._stop = threading.Event()
        self._errors: list[BaseException] = []

        def one(index: int, op: Operation) -> None:
            if self._stop.is_set():
                return
            try:
                run_operation(sender, writer, workload, op, workload.seed * 1_000_003 + index)
            except BaseException as exc:
                self._errors.append(exc)
                raise

        def submit() -> None:
            with ThreadPoolExecutor(workload.concurrency, thread_name_prefix="upgrade-load") as pool:
                for index, op in enumerate(ops):
                    if self._stop.wait(0.02):
                        break
                    pool.submit(one, index, op)

        self._thread = threading.Thread(target=submit, name="upgrade-load")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the load did not stop"
        assert not self._errors, f"{len(self._errors)} operations raised: {self._errors[0]!r}"


def _history_so_far(path: Path, tmp: Path) -> History:
    """The history written so far (its whole lines: a line is written and flushed at once)."""
    text = path.read_text(encoding="utf-8")
    snapshot = tmp / "history-snapshot.jsonl"
    snapshot.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
    return read_history(snapshot)


def _audit(dsn: str, sql: str) -> list[tuple[str, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(str(v) for v in row) for row in conn.execute(sql).fetchall()]


def _relayed(dsn: str) -> Counter[tuple[str, str]]:
    """Credits delivered, by (who queued it, whose relay delivered it)."""
    rows = _audit(
        dsn,
        "SELECT q.by, d.by, count(*) FROM upgrade_audit q JOIN upgrade_audit d ON d.id = q.id"
        " AND d.what = 'delivered' WHERE q.what = 'queued' GROUP BY 1, 2",
    )
    return Counter({(queued, delivered): int(n) for queued, delivered, n in rows})


def _stored_by(dsn: str) -> dict[str, str]:
    """Key -> who stored its record."""
    return {key: by for key, by in _audit(dsn, "SELECT id, by FROM upgrade_audit WHERE what = 'stored'")}


def _wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, seen: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}; seen {seen()}"
        time.sleep(0.1)


def _replays(history: History, keys: list[str], address: str, tmp: Path) -> Counter[str]:
    """Each key's own request sent again to the daemon (or router) at `address`: its answer must be
    the key's first definite one, byte for byte, and (if OK) marked replayed. The first answers'
    codes, counted."""
    writer = HistoryWriter(tmp / f"replays-{address.replace(':', '-')}-{new_key()}.jsonl")
    sender = Sender(address, writer, WORKLOAD)
    seen: Counter[str] = Counter()
    try:
        for key in keys:
            first = answers_of(history.attempts.get(key, [])).first
            assert first is not None, key
            method, body = request_bytes(history.operations[key])
            again, _ = sender.once(key, method, body, "later_duplicate")
            assert again.answer() == first.answer(), (address, key, first, again)
            assert again.replayed or first.code != "OK", (address, key)
            seen[first.code] += 1
    finally:
        sender.close()
        writer.close()
    return seen


def _keys_stored(history: History, dsn: str, by: str, limit: int) -> list[str]:
    """Up to `limit` keys of the history with a definite answer whose record `by` stored."""
    stored = _stored_by(dsn)
    keys = [
        k
        for k in history.operations
        if stored.get(k) == by and answers_of(history.attempts.get(k, [])).first is not None
    ]
    return keys[:: max(1, len(keys) // limit)][:limit]


class Cluster:
    """The two shards' databases, the map, and every process of both releases (not started)."""

    def __init__(self, release: Release, postgres: LocalPostgres, tmp: Path) -> None:
        self.tmp = tmp
        self.dsns: dict[str, str] = {}
        for sid in SHARDS:
            name = f"up_{sid.replace('-', '_')}_{new_key().hex[:8]}"
            postgres.create_database(name)
            self.dsns[sid] = postgres.dsn_for(name)
        self.map_path = tmp / "shard-map.yaml"
        self.version = 0
        env = {"SHARDD_RELAY_WORKERS": "1", "SHARDD_SHARD_MAP_RELOAD_S": "0.2"}
        previous, this = ({**env, "PGOPTIONS": f"-c upgrade.release={r}"} for r in (PREVIOUS, THIS))
        self.old = {
            sid: release_shardd(
                release,
                tmp,
                shard_id=sid,
                dsn=dsn,
                name=f"old-{sid}",
                shard_map=self.map_path,
                port=free_port(),
                extra_env=previous,
            )
            for sid, dsn in self.dsns.items()
        }
        self.new = {
            sid: this_release_shardd(
                tmp,
                shard_id=sid,
                dsn=dsn,
                name=f"new-{sid}",
                shard_map=self.map_path,
                port=free_port(),
                extra_env=this,
            )
            for sid, dsn in self.dsns.items()
        }
        self.serving: dict[str, list[ServiceProcess]] = {sid: [self.old[sid]] for sid in SHARDS}
        self.old_router = release_router(release, tmp, shard_map=self.map_path, name="old-router")
        self.new_router = this_release_router(tmp, shard_map=self.map_path, name="new-router")
        self.publish()

    @property
    def processes(self) -> list[ServiceProcess]:
        return [*self.old.values(), *self.new.values(), self.old_router, self.new_router]

    def publish(self) -> None:
        """Write the map of the daemons now serving, under the next version, and give every process
        time to follow it (each looks every 0.2 s)."""
        self.version += 1
        addresses = {sid: [d.address for d in daemons] for sid, daemons in self.serving.items()}
        write_shard_map(self.map_path, even_shard_map(addresses, version=self.version))
        time.sleep(0.8)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.log_text()[-1500:]}" for p in self.processes if p.log_path.exists()
        )


def _replace_daemon(cluster: Cluster, sid: str, history_path: Path) -> tuple[Counter[tuple[str, str]], str]:
    """Shard `sid`'s rolling update under the load: this release's daemon starts (migrating the
    schema), joins the map beside the old one; both relays deliver credits the other's daemon queued;
    each replays keys the other release stored; the old one leaves the map and stops."""
    old, new, dsn = cluster.old[sid], cluster.new[sid], cluster.dsns[sid]
    new.start()
    with psycopg.connect(dsn) as conn:
        assert migrations.schema_version(conn) == migrations.LATEST_VERSION
    cluster.serving[sid].append(new)
    cluster.publish()

    def side_by_side() -> tuple[Counter[tuple[str, str]], Counter[str]]:
        history = _history_so_far(history_path, cluster.tmp)
        return _relayed(dsn), Counter(by for k, by in _stored_by(dsn).items() if k in history.operations)

    def both_ways() -> bool:
        relayed, stored = side_by_side()
        crossed = relayed[PREVIOUS, THIS] and relayed[THIS, PREVIOUS]  # (queued by, delivered by)
        return bool(crossed) and stored[PREVIOUS] >= SIDE_BY_SIDE_KEYS and stored[THIS] >= SIDE_BY_SIDE_KEYS

    _wait_for(
        f"{sid}: each release's relay delivered a credit the other's daemon queued, and each release "
        f"stored {SIDE_BY_SIDE_KEYS} keys of the load",
        both_ways,
        30.0,
        side_by_side,
    )
    history = _history_so_far(history_path, cluster.tmp)
    replayed = Counter[str]()
    for stored_by, daemon in ((PREVIOUS, new), (THIS, old)):
        keys = _keys_stored(history, dsn, stored_by, 2 * SIDE_BY_SIDE_KEYS)
        assert len(keys) >= SIDE_BY_SIDE_KEYS // 2, f"{sid}: {len(keys)} answered keys stored by {stored_by}"
        replayed.update(
            {
                f"{stored_by} -> {daemon.name}": sum(
                    _replays(history, keys, daemon.address, cluster.tmp).values()
                )
            }
        )
    cluster.serving[sid].remove(old)
    cluster.publish()  # out of the map first (as out of a Service's endpoints), then SIGTERM
    assert old.terminate() == 0, old.log_text()[-2000:]
    return _relayed(dsn), ", ".join(f"{k}: {v}" for k, v in replayed.items())


def test_a_rolling_update_of_two_shards_and_the_router_fails_no_call(
    previous_release: Release, postgres: LocalPostgres, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    cluster = Cluster(previous_release, postgres, tmp_path)
    history_path = tmp_path / "history.jsonl"
    writer = HistoryWriter(history_path)
    routers = Routers(writer, WORKLOAD)
    load: Load | None = None
    try:
        for sid in SHARDS:
            cluster.old[sid].start()
            with psycopg.connect(cluster.dsns[sid], autocommit=True) as conn:
                assert migrations.schema_version(conn) == previous_release.schema
                conn.execute(AUDIT)
        cluster.old_router.start()
        routers.add(cluster.old_router)
        load = _start_load(routers, writer, cluster)
        time.sleep(2.0)
        relayed, replayed = {}, {}
        for sid in SHARDS:
            relayed[sid], replayed[sid] = _replace_daemon(cluster, sid, history_path)
        cluster.new_router.start()
        routers.add(cluster.new_router)
        time.sleep(2.0)  # both routers serve
        routers.remove(cluster.old_router)
        assert cluster.old_router.terminate() == 0, cluster.old_router.log_text()[-2000:]
        time.sleep(2.0)
        load.stop()
        load = None
        writer.close()
        history = read_history(history_path)
        verdict = prove(history, cluster.dsns, settle_s=30.0)
        assert verdict.ok, [str(v) for v in verdict.violations[:10]]
        assert verdict.pending == [] and verdict.in_flight == []
        after = _check_answers(history)
        # Every key the previous release stored, replayed by this release's router and daemons.
        stored_before = [
            k for sid in SHARDS for k in _keys_stored(history, cluster.dsns[sid], PREVIOUS, 10_000)
        ]
        _replays(history, stored_before, cluster.new_router.address, tmp_path)
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        if load is not None:
            load.stop()
        writer.close()
        routers.close()
        cluster.kill()
    with capsys.disabled():
        print(
            f"\nrolling update of 2 shards and the router ({previous_release.commit[:9]}, schema "
            f"{previous_release.schema} -> {migrations.LATEST_VERSION}): {verdict.figures}; money {verdict.money}; "
            f"answers {after}; credits delivered (queued by, delivered by) {dict(relayed)}; replayed side by "
            f"side {replayed}; replayed by this release after {len(stored_before)}; "
            f"{time.monotonic() - started:.1f} s"
        )
    figures = verdict.figures
    assert figures["cross_shard"] > 50 and figures["credited"] > 50 and figures["refunded"] > 0
    assert figures["in_flight_duplicates"] > 0 and figures["later_duplicates"] > 0
    assert figures["expired_refused"] == figures["expired_keys"] == WORKLOAD.expired_keys


def _start_load(routers: Routers, writer: HistoryWriter, cluster: Cluster) -> Load:
    """Open the workload's accounts (a seed deposit each, through the routers), then start its mix."""
    writer.header(
        target="rotation", seed=WORKLOAD.seed, tag="upgrade", started_at=time.time(), workload=vars(WORKLOAD)
    )
    seeds = [
        Operation(str(new_key()), "deposit", "seed", f"up-{i}", "", WORKLOAD.seed_amount, WORKLOAD.currency)
        for i in range(WORKLOAD.accounts)
    ]
    once = replace(WORKLOAD, in_flight_duplicates=0, later_duplicates=0, reused_bodies=0)
    for i, op in enumerate(seeds):
        run_operation(routers, writer, once, op, i)
    shards_of = owners(cluster.dsns, [op.account for op in seeds])
    assert sorted(set(shards_of.values())) == list(SHARDS), shards_of
    ops = plan(WORKLOAD, shards_of, "upgrade")
    # The expired keys first (the plan scatters them over more operations than the run starts).
    ops.sort(key=lambda op: op.label != "expired_key")
    load = Load(routers, writer, WORKLOAD, ops)
    load.start()
    return load


def _check_answers(history: History) -> dict[str, int]:
    """No attempt answered but definitely or with a status a caller retries; every refusal one the
    workload asked for (a reused body, an expired key, an unopened account). The answers' figures."""
    codes = Counter(a.code for attempts in history.attempts.values() for a in attempts)
    assert set(codes) <= DEFINITE_CODES | TRANSIENT, codes
    for key, op in history.operations.items():
        first = answers_of(history.attempts.get(key, [])).first
        assert first is not None, f"{key} ({op.label}) got no definite answer"
        if first.code != "OK":
            assert op.label in {"expired_key", "to_unopened"}, (op, first)
    return dict(codes)
