"""Property test: fuzzed request fields and metadata against a real shard, checking invariants.

Hypothesis draws Deposit and Transfer requests (account ids valid and not, unicode included; amounts
over the whole int64 range; currencies valid and not; references with control characters and over
the length limit) with fuzzed metadata (UUIDv7 keys of every age, v4 keys, opaque keys, garbage, none, a
binary key, duplicates, keys reused from earlier examples; valid, malformed and duplicated caller ids) and
sends each twice to one shard daemon (real gRPC on loopback, real PostgreSQL). After every send:

- the status is one of OK, INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION: never UNKNOWN or
  INTERNAL, and nothing transient (ABORTED, UNAVAILABLE) on an idle shard;
- a refusal before the claim (bad key, expired or future key, bad request, bad caller) has the status
  and ErrorInfo reason of the first check that fails, in the interceptor's order, and writes nothing;
- INVALID_ARGUMENT writes nothing at all, in particular no row for that key;
- OK writes exactly the ledger entries of that operation for that key (one for a deposit, one per leg
  for a local transfer) and moves the balances by exactly the amount, nothing else;
- a stored refusal (NOT_FOUND, FAILED_PRECONDITION) writes its idempotency record and nothing else;
- an existing record for (scope, key) replays if the request hash matches, else IDEMPOTENCY_KEY_REUSED;
- the second send of the same (key, request) returns the same bytes (OK, with the replayed trailer) or
  the same status, message and details, and writes nothing;
- always: every balance equals the sum of its ledger entries and is never negative.

Metadata is limited to printable ASCII because grpcio refuses anything else inside the client
(see tests/shardd/test_bad_input.py, which sends non-ASCII bytes with a raw HTTP/2 client). Keys dated
past the year 9999 are covered by test_bad_input.py::test_key_dated_past_year_9999_is_invalid_not_unknown.

Why not atheris: it is not a dependency of the project, its `atheris.Fuzz()` loop owns the process
(it never returns to pytest, and exits on the first finding), and coverage guidance buys little
here: the inputs that matter are structured (protobuf fields, metadata entries), which Hypothesis
generates directly, shrinks to a minimal failing example, and runs within a bounded test.
"""

from __future__ import annotations

import hashlib
import re
import string
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shardrouter.core.errors import InvalidArgument
from shardrouter.core.keys import IdempotencyKey, parse_key
from shardrouter.core.validation import validate_deposit, validate_transfer
from shardrouter.shardd.server import ShardDaemon
from shardrouter.v1 import transfer_pb2
from tests.helpers import money

PUBLIC = "/shardrouter.v1.TransferService/"
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
RETENTION = timedelta(days=30)  # the shard's defaults (make_settings does not change them)
MAX_SKEW = timedelta(seconds=300)
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
FAILED = grpc.StatusCode.FAILED_PRECONDITION
ALLOWED = {OK, INVALID, grpc.StatusCode.NOT_FOUND, FAILED}
CALLER_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,511}"  # core/callers.py's rule, restated

FUNDED = {"alice": (1_000_000, "EUR"), "bob": (1_000, "EUR"), "carol": (500, "USD")}
VALID_ACCOUNTS = ("alice", "bob", "carol", "d.e-f_9", "Zed")  # the last two start unopened
INVALID_ACCOUNTS = ("", " ", "al ice", "-x", ".x", "a" * 65, "ålice", "bob\n", "bob\x00", "\u202ebob", "b;ob")
PRINTABLE_ASCII = string.printable[:-5]  # 0x20-0x7E without \t\n\r\x0b\x0c

_USED_KEYS: list[str] = []  # keys sent in earlier examples, for reuse with another request
_USED_CASES: list[Case] = []  # earlier examples, to send again later


# --------------------------------------------------------------------------------------------------
# Strategies


def _v7(ms: int, rand: int) -> str:
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return str(uuid.UUID(int=value))


def _now_ms() -> int:
    return int(datetime.now(UTC).timestamp() * 1000)


_DAY_MS = 86_400_000
_START_MS = _now_ms()  # fixes the strategies' bounds; the keys' ages count from each call's now
_YEAR_9000_MS = int(datetime(9000, 1, 1, tzinfo=UTC).timestamp() * 1000)
_rand = st.integers(0, 2**74 - 1)


GOOD_KEYS = ["fresh"] * 5 + ["days-old", "near-future", "upper", "v4", "opaque", "reuse", "reuse"]
BAD_KEYS = ["expired", "future", "garbage", "missing", "binary", "duplicated"]
VISIBLE_ASCII = PRINTABLE_ASCII[:-1]  # 0x21-0x7E: string.printable ends in the space here


@st.composite
def key_entries(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """The idempotency-key metadata entries of one call: usually a usable key, else a bad one."""
    usable = draw(st.sampled_from([True, True, True, False]))  # (Hypothesis favours the first)
    kind = draw(st.sampled_from(GOOD_KEYS if usable else BAD_KEYS))
    now = _now_ms()
    if kind == "fresh":
        return [("idempotency-key", _v7(now - draw(st.integers(0, 60_000)), draw(_rand)))]
    if kind == "days-old":
        return [("idempotency-key", _v7(now - draw(st.integers(1, 29)) * _DAY_MS, draw(_rand)))]
    if kind == "near-future":  # within the allowed clock skew
        return [("idempotency-key", _v7(now + draw(st.integers(1_000, 120_000)), draw(_rand)))]
    if kind == "upper":
        return [("idempotency-key", _v7(now, draw(_rand)).upper())]
    if kind == "reuse":
        # A key from an earlier example (a fresh one before there is any). Both are drawn every time,
        # so what is drawn never depends on that outside state (Hypothesis requires it).
        index, fresh = draw(st.integers(0, 10_000)), _v7(now, draw(_rand))
        return [("idempotency-key", _USED_KEYS[index % len(_USED_KEYS)] if _USED_KEYS else fresh)]
    if kind == "expired":  # from 31 days old back to the epoch (ms 0)
        age = draw(st.integers(31 * _DAY_MS, _START_MS))
        return [("idempotency-key", _v7(max(0, now - age), draw(_rand)))]
    if kind == "future":  # from 10 minutes ahead up to the year 9000
        ahead = draw(st.integers(600_000, _YEAR_9000_MS - _START_MS))
        return [("idempotency-key", _v7(now + ahead, draw(_rand)))]
    if kind == "v4":  # dated by its first receipt
        value = str(uuid.UUID(int=draw(st.integers(0, 2**128 - 1)), version=4))
        return [("idempotency-key", draw(st.sampled_from([value, value.upper()])))]
    if kind == "opaque":  # 1-255 visible ASCII characters, taken as sent
        return [("idempotency-key", draw(st.text(alphabet=VISIBLE_ASCII, min_size=1, max_size=255)))]
    if kind == "garbage":  # now and then valid (an opaque key); the oracle asks parse_key
        return [("idempotency-key", draw(st.text(alphabet=PRINTABLE_ASCII, max_size=300)))]
    if kind == "missing":
        return []
    if kind == "binary":
        return [("idempotency-key-bin", draw(st.binary(max_size=20)))]
    first = _v7(now, draw(_rand))  # duplicated: the same key twice, or two keys
    second = draw(st.sampled_from([first, _v7(now, draw(_rand))]))
    return [("idempotency-key", first), ("idempotency-key", second)]


good_callers = st.one_of(st.none(), st.sampled_from(["team-a", "svc:b@x/y", "router.internal"]))
bad_callers = st.one_of(
    st.sampled_from(["", "bad caller", "-x", "t" * 513, "a,b", "team%20a"]),
    st.text(alphabet=PRINTABLE_ASCII, max_size=130),  # now and then a valid one
    st.just(["team-a", "team-a"]),
    st.just(["team-a", "team-b"]),
)

good_accounts = st.sampled_from(VALID_ACCOUNTS)
bad_accounts = st.one_of(st.sampled_from(INVALID_ACCOUNTS), st.text(max_size=70))
good_amounts = st.one_of(st.integers(1, 5_000), st.sampled_from([1, 10**6, 10**15]))
bad_amounts = st.one_of(
    st.sampled_from([0, -1, 10**15 + 1, INT64_MAX, INT64_MIN, INT64_MIN + 1]),
    st.integers(INT64_MIN, INT64_MAX),
)
good_currencies = st.sampled_from(["EUR", "EUR", "EUR", "USD", "JPY"])
bad_currencies = st.one_of(
    st.sampled_from(["eur", "XXX", "", "EURO", "€", " EUR", "EU"]), st.text(max_size=4)
)
good_references = st.one_of(
    st.just(""),
    st.text(alphabet=PRINTABLE_ASCII, max_size=40),
    st.text(alphabet=st.characters(categories=["L", "M", "N", "P", "S"]), max_size=20),  # printable unicode
)
bad_references = st.one_of(
    st.text(alphabet=st.characters(categories=["Cc", "Cf", "Zl", "Zp"]), min_size=1, max_size=4).map(
        lambda s: "ref" + s
    ),
    st.text(min_size=130, max_size=160),  # over 140 now and then
)


@dataclass(frozen=True)
class Case:
    """One fuzzed call."""

    method: str  # "Deposit" | "Transfer"
    request: transfer_pb2.DepositRequest | transfer_pb2.TransferRequest
    keys: list[tuple[str, Any]]
    caller: str | list[str] | None

    @property
    def path(self) -> str:
        return PUBLIC + self.method

    @property
    def metadata(self) -> list[tuple[str, Any]]:
        md = list(self.keys)
        if isinstance(self.caller, list):
            md += [("x-caller-id", c) for c in self.caller]
        elif self.caller is not None:
            md.append(("x-caller-id", self.caller))
        return md

    @property
    def key_texts(self) -> list[str]:
        return [v for k, v in self.keys if k == "idempotency-key"]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A request whose fields are all good, or one of them bad, or all of them fuzzed; or, now and then,
    an earlier example again (same key, caller and request: it must replay whatever happened since).
    """
    repeat = draw(st.sampled_from([False] * 5 + [True]))
    earlier = draw(st.integers(0, 10_000))  # drawn every time, used only if there is an earlier case
    method = draw(st.sampled_from(["Deposit", "Transfer", "Transfer"]))
    names = ["account", "amount", "currency", "reference"] + (["destination"] if method == "Transfer" else [])
    shape = draw(st.sampled_from(["good", "good", "one-bad", "all-fuzzed"]))
    bad: set[str] = set()  # the fields drawn from their fuzz strategy as well
    if shape == "one-bad":
        bad = {draw(st.sampled_from(names))}
    elif shape == "all-fuzzed":
        bad = set(names)

    def pick(name: str, good: st.SearchStrategy[Any], fuzzed: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(good, fuzzed) if name in bad else good)

    account = pick("account", good_accounts, bad_accounts)
    amount_minor = pick("amount", good_amounts, bad_amounts)
    currency = pick("currency", good_currencies, bad_currencies)
    reference = pick("reference", good_references, bad_references)
    missing = "amount" in bad and draw(st.sampled_from([False] * 7 + [True]))
    amount = None if missing else money(amount_minor, currency)
    request: transfer_pb2.DepositRequest | transfer_pb2.TransferRequest
    if method == "Deposit":
        request = transfer_pb2.DepositRequest(account_id=account, amount=amount, reference=reference)
    else:
        others = st.sampled_from([a for a in VALID_ACCOUNTS if a != account])
        same_or_bad = st.one_of(st.just(account), bad_accounts)  # the source itself is a bad destination
        destination = pick("destination", others, same_or_bad)
        request = transfer_pb2.TransferRequest(
            source_account_id=account, destination_account_id=destination, amount=amount, reference=reference
        )
    caller = draw(st.sampled_from([good_callers] * 5 + [bad_callers]).flatmap(lambda strategy: strategy))
    case = Case(method, request, draw(key_entries()), caller)
    return _USED_CASES[earlier % len(_USED_CASES)] if repeat and _USED_CASES else case


# --------------------------------------------------------------------------------------------------
# Talking to the shard and reading its state


@dataclass
class Answer:
    """One call's outcome."""

    code: grpc.StatusCode
    message: str
    trailers: dict[str, Any]
    body: bytes | None
    details_bin: bytes | None = None
    reason: str | None = None


def send(channel: grpc.Channel, case: Case) -> Answer:
    method = channel.unary_unary(case.path)  # bytes in, bytes out: replays are compared byte for byte
    try:
        body, state = method.with_call(case.request.SerializeToString(), metadata=case.metadata, timeout=10)
    except grpc.RpcError as err:
        trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
        answer = Answer(err.code(), err.details() or "", trailers, None)  # type: ignore[attr-defined]
        raw = trailers.get("grpc-status-details-bin")
        if raw is not None:
            answer.details_bin = raw
            for detail in status_pb2.Status.FromString(raw).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    answer.reason = info.reason
        return answer
    return Answer(OK, "", dict(state.trailing_metadata() or ()), body)


@dataclass(frozen=True)
class State:
    """Everything a call can change."""

    balances: dict[str, int]
    entries: tuple[int, int]
    records: int
    transfers: int

    @staticmethod
    def read(db: psycopg.Connection[Any]) -> State:
        balances = dict(db.execute("SELECT id, balance FROM accounts").fetchall())
        entries = db.execute("SELECT count(*), coalesce(sum(amount_minor), 0) FROM ledger_entries").fetchone()
        records = db.execute("SELECT count(*) FROM idempotency_record").fetchone()
        transfers = db.execute("SELECT count(*) FROM transfers").fetchone()
        assert entries is not None and records is not None and transfers is not None
        return State(balances, (int(entries[0]), int(entries[1])), int(records[0]), int(transfers[0]))


def _entries_of(db: psycopg.Connection[Any], key: IdempotencyKey | None) -> list[tuple[str, int, str]]:
    if key is None:
        return []
    rows = db.execute(
        "SELECT account_id, amount_minor, kind FROM ledger_entries WHERE idempotency_key = %s", (key.text,)
    ).fetchall()
    return sorted((str(a), int(m), str(k)) for a, m, k in rows)


def _stored_hash(db: psycopg.Connection[Any], scope: str, key: IdempotencyKey | None) -> bytes | None:
    if key is None:
        return None
    row = db.execute(
        "SELECT request_hash FROM idempotency_record WHERE scope = %s AND key = %s", (scope, key.text)
    ).fetchone()
    return None if row is None else bytes(row[0])


# --------------------------------------------------------------------------------------------------
# The oracle for refusals before the claim (the interceptor's order of checks)


def _parsed_key(case: Case) -> IdempotencyKey | None:
    texts = case.key_texts
    if len(texts) != 1:
        return None
    try:
        return parse_key(texts[0])
    except InvalidArgument:
        return None


def _caller_ok(caller: str | list[str] | None) -> bool:
    if caller is None:
        return True
    return isinstance(caller, str) and re.fullmatch(CALLER_PATTERN, caller) is not None


def expected_refusal(case: Case, now: datetime) -> tuple[grpc.StatusCode, str] | None:
    """(status, reason) of the first pre-claim check that fails, or None if the call reaches the claim."""
    texts = case.key_texts
    if not texts:
        return INVALID, "IDEMPOTENCY_KEY_MISSING"
    if len(texts) == 1:
        try:
            parse_key(texts[0])
        except InvalidArgument as refused:  # e.g. a UUIDv7 dated after the year 9000: FROM_FUTURE
            return INVALID, refused.reason
    key = _parsed_key(case)
    if key is None:
        return INVALID, "IDEMPOTENCY_KEY_INVALID"
    moment = key.dated_at  # None: dated by its receipt, so neither expired nor from the future
    if moment is not None and moment + RETENTION <= now:
        return FAILED, "IDEMPOTENCY_KEY_EXPIRED"
    if moment is not None and moment - now > MAX_SKEW:
        return INVALID, "IDEMPOTENCY_KEY_FROM_FUTURE"
    try:
        (validate_deposit if case.method == "Deposit" else validate_transfer)(case.request)  # type: ignore[operator]
    except InvalidArgument:
        return INVALID, "INVALID_REQUEST"
    if not _caller_ok(case.caller):
        return INVALID, "INVALID_CALLER"
    return None


def _scope(case: Case) -> str:
    caller = case.caller if isinstance(case.caller, str) else "anonymous"
    return f"{case.path}|{caller or 'anonymous'}"


def _request_hash(case: Case) -> bytes:
    return hashlib.sha256(
        case.path.encode() + b"\x00" + case.request.SerializeToString(deterministic=True)
    ).digest()


# --------------------------------------------------------------------------------------------------
# The property


@pytest.fixture
def channel(shard: ShardDaemon) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{shard.port}") as ch:
        yield ch


def _seed(channel: grpc.Channel, db: psycopg.Connection[Any]) -> None:
    if db.execute("SELECT 1 FROM accounts WHERE id = 'alice'").fetchone():
        return
    _USED_KEYS.clear()
    _USED_CASES.clear()
    for account, (amount, currency) in FUNDED.items():
        request = transfer_pb2.DepositRequest(account_id=account, amount=money(amount, currency))
        key = _v7(_now_ms(), int.from_bytes(uuid.uuid4().bytes[:9], "big"))
        channel.unary_unary(PUBLIC + "Deposit")(
            request.SerializeToString(), metadata=[("idempotency-key", key)]
        )


def check_invariants(db: psycopg.Connection[Any]) -> None:
    rows = db.execute(
        "SELECT a.id, a.balance, coalesce(sum(e.amount_minor), 0) FROM accounts a"
        " LEFT JOIN ledger_entries e ON e.account_id = a.id GROUP BY a.id, a.balance"
    ).fetchall()
    for account_id, balance, entries in rows:
        assert balance == entries, f"balance of {account_id!r} is {balance}, its entries sum to {entries}"
        assert balance >= 0, f"balance of {account_id!r} is negative: {balance}"
    total = db.execute(
        "SELECT (SELECT coalesce(sum(balance), 0) FROM accounts), (SELECT coalesce(sum(amount_minor), 0) FROM ledger_entries)"
    ).fetchone()
    assert total is not None and total[0] == total[1]
    orphans = db.execute(
        "SELECT count(*) FROM ledger_entries WHERE account_id NOT IN (SELECT id FROM accounts)"
    ).fetchone()
    assert orphans == (0,)


def _check_first(
    db: psycopg.Connection[Any],
    case: Case,
    answer: Answer,
    before: State,
    after: State,
    expected: tuple[grpc.StatusCode, str] | None,
    stored: bytes | None,
    entries_before: list[tuple[str, int, str]],
) -> None:
    assert answer.code in ALLOWED, f"{answer.code}: {answer.message}"
    if answer.code != OK:
        assert answer.details_bin is not None, "every refusal carries google.rpc.Status details"
        assert answer.reason, "every refusal carries an ErrorInfo reason"
    if expected is not None:
        assert (answer.code, answer.reason) == expected, answer.message
        # Nothing at all, so in particular no idempotency record and no ledger entry for this key.
        assert after == before, "a refusal before the claim wrote something"
        return
    if answer.code == INVALID:
        pytest.fail(f"INVALID_ARGUMENT for a request that passes every pre-claim check: {answer.message}")
    key = _parsed_key(case)
    assert key is not None
    if stored is not None:  # the key is taken in this scope
        if stored == _request_hash(case):
            assert answer.trailers.get("idempotency-replayed") == "true", (answer.code, answer.message)
        else:
            assert (answer.code, answer.reason) == (FAILED, "IDEMPOTENCY_KEY_REUSED"), answer.message
        assert after == before, "a replay or a refused reuse wrote something"
        return
    assert "idempotency-replayed" not in answer.trailers
    assert after.records == before.records + 1, "a new key's outcome must be stored"
    new_entries = _entries_of(db, key)
    for entry in entries_before:
        new_entries.remove(entry)
    if answer.code != OK:  # a stored refusal (NOT_FOUND, FAILED_PRECONDITION): nothing else moves
        assert new_entries == []
        assert (after.balances, after.entries, after.transfers) == (
            before.balances,
            before.entries,
            before.transfers,
        )
        return
    amount = case.request.amount.amount_minor
    moved = dict(before.balances)
    if isinstance(case.request, transfer_pb2.DepositRequest):
        account = case.request.account_id
        assert new_entries == [(account, amount, "deposit")]
        moved[account] = moved.get(account, 0) + amount
        assert after.transfers == before.transfers
        assert after.entries == (before.entries[0] + 1, before.entries[1] + amount)
    else:
        src, dst = case.request.source_account_id, case.request.destination_account_id
        assert new_entries == sorted([(src, -amount, "transfer_out"), (dst, amount, "transfer_in")])
        moved[src] -= amount
        moved[dst] += amount
        assert after.transfers == before.transfers + 1
        assert after.entries == (before.entries[0] + 2, before.entries[1])
    assert after.balances == moved, "OK must move the balances by exactly the amount"


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(case=cases())
def test_fuzzed_requests_keep_the_ledger_invariants(channel, db, case):
    _seed(channel, db)
    key = _parsed_key(case)
    before = State.read(db)
    entries_before = _entries_of(db, key)
    stored = _stored_hash(db, _scope(case), key)
    expected = expected_refusal(case, datetime.now(UTC))

    first = send(channel, case)
    replayed = " (replay)" if first.trailers.get("idempotency-replayed") == "true" else ""
    event(f"{case.method}: {first.code.name} {first.reason or ''}".strip() + replayed)
    middle = State.read(db)
    _check_first(db, case, first, before, middle, expected, stored, entries_before)
    check_invariants(db)

    second = send(channel, case)
    assert second.code in ALLOWED, f"{second.code}: {second.message}"
    if first.code == OK:
        assert second.code == OK, second.message
        assert second.body == first.body, "a replay must return the stored response bytes"
        assert second.trailers.get("idempotency-replayed") == "true"
    else:
        assert (second.code, second.message, second.details_bin) == (
            first.code,
            first.message,
            first.details_bin,
        )
    assert State.read(db) == middle, "the second send of the same request wrote something"
    check_invariants(db)
    _USED_KEYS.extend(case.key_texts)
    _USED_CASES.append(case)
