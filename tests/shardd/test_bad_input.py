"""Bad input sent straight to a shard daemon, for every RPC.

Every RPC the proto declares (public and internal, read from `shardrouter.core.rpcs`, so a new one is
in the matrices with no edit here) gets bad idempotency keys, bad caller ids, bad fields, oversized
metadata and messages, bytes that are not protobuf, unknown fields and wrong HTTP/2 framing; and
`test_every_declared_rpc_has_bad_input_coverage` fails while a declared RPC lacks a valid request or
bad-field cases of its own. Each must get one specific status with a clear message and rich details,
and must write nothing (a stored NOT_FOUND writes exactly its idempotency record).
`tests/shardd/test_interceptor_outcomes.py` covers the Deposit basics; this file extends them to every
RPC and to what arrives below the gRPC client library.

All tests share one module-scoped shard (real gRPC server on loopback, real PostgreSQL) so the matrix
stays fast; each test snapshots the tables right before its call and compares right after it.

What grpcio lets a client send (found by trying, grpcio 1.85):
- Metadata names must be lower case and values of non-`-bin` entries printable ASCII (0x20-0x7E):
  anything else (non-ASCII str, latin-1 or UTF-8 bytes, control characters, upper-case names) is
  refused inside the client with INTERNAL "Invalid metadata" and never leaves the process.
- A raw HTTP/2 client (the `h2` package) can send such bytes anyway: grpc core on the server passes
  non-ASCII values through, and grpc Python decodes them as UTF-8, falling back to latin-1. The server
  then sees a text value that the key and caller checks refuse.
- `-bin` entries are a different metadata name: `idempotency-key-bin` is not `idempotency-key`.
- The server's metadata limit (`grpc.max_metadata_size`, 16 KiB) is a soft limit: between it and the
  hard limit (1.25 x, 20 KiB) grpc core rejects a random share of calls; above 20 KiB every call gets
  RESOURCE_EXHAUSTED before any application code runs.
- The request content-type is neither checked by grpc core nor shown to the application (it is not
  in invocation_metadata), so a protobuf body labelled text/plain is served; a body that is not
  protobuf is refused by the decoder whatever its label. Framing errors (compressed flag without an
  encoding, upper-case header names) are answered by grpc core with INTERNAL.

The raw HTTP/2 tests use the `h2` package (a dev dependency).
"""

from __future__ import annotations

import base64
import hashlib
import socket
import struct
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from shardrouter.core.keys import new_key
from shardrouter.core.rpcs import INTERNAL_SERVICE, PUBLIC_SERVICE, RpcDeclaration
from shardrouter.core.rpcs import RPCS as DECLARED_RPCS
from shardrouter.internal.v1 import ledger_pb2
from shardrouter.localcluster.postgres import LocalPostgres
from shardrouter.shardd.server import ShardDaemon, start_shard
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import deposit, make_settings, money

PUBLIC = f"/{PUBLIC_SERVICE}/"
INTERNAL = f"/{INTERNAL_SERVICE}/"
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
KEY = "idempotency-key"
CALLER = "x-caller-id"
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------------------------------------
# The shared shard and how to talk to it


@dataclass
class Lab:
    """One shard daemon with seeded accounts, a channel to it and a database connection."""

    daemon: ShardDaemon
    channel: grpc.Channel
    stub: transfer_pb2_grpc.TransferServiceStub
    db: psycopg.Connection[Any]
    completed_transfer_id: str = ""

    @property
    def port(self) -> int:
        return self.daemon.port

    def pending_transfer(self, amount: int = 100) -> str:
        """A transfer from alice left PENDING (as one to another shard is), debited as the shard does."""
        transfer_id, key = new_key(), new_key()
        with self.db.transaction():
            self.db.execute("UPDATE accounts SET balance = balance - %s WHERE id = 'alice'", (amount,))
            self.db.execute(
                "INSERT INTO transfers (id, source_account_id, destination_account_id,"
                " destination_shard_id, amount_minor, currency, state)"
                " VALUES (%s, 'alice', 'remote-bob', 'shard-9', %s, 'EUR', 'pending')",
                (transfer_id, amount),
            )
            self.db.execute(
                "INSERT INTO ledger_entries (id, account_id, amount_minor, kind, transfer_id, idempotency_key)"
                " VALUES (%s, 'alice', %s, 'transfer_out', %s, %s)",
                (new_key(), -amount, transfer_id, key),
            )
        return str(transfer_id)


@pytest.fixture(scope="module")
def lab(postgres: LocalPostgres) -> Iterator[Lab]:
    """A shard with alice (EUR, well funded), bob (EUR), carol (USD) and one completed transfer."""
    name = f"bad_input_{uuid.uuid4().hex[:8]}"
    postgres.create_database(name)
    dsn = postgres.dsn_for(name)
    daemon = start_shard(make_settings(dsn))
    channel = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
    conn = psycopg.connect(dsn, autocommit=True)
    stub = transfer_pb2_grpc.TransferServiceStub(channel)
    lab = Lab(daemon, channel, stub, conn)
    deposit(stub, "alice", 1_000_000)
    deposit(stub, "bob", 1)
    deposit(stub, "carol", 100, "USD")
    created = stub.Transfer(
        transfer_pb2.TransferRequest(
            source_account_id="alice", destination_account_id="bob", amount=money(3)
        ),
        metadata=[(KEY, str(new_key()))],
    )
    lab.completed_transfer_id = created.transfer.transfer_id
    yield lab
    conn.close()
    channel.close()
    daemon.stop(0.5)


@dataclass
class Answer:
    """What one call got back: status, message, trailers, response bytes and the rich details."""

    code: grpc.StatusCode
    message: str
    trailers: dict[str, Any]
    body: bytes | None
    reason: str | None = None
    error_metadata: dict[str, str] = field(default_factory=dict)
    violations: list[tuple[str, str]] = field(default_factory=list)
    details_bin: bytes | None = None

    @property
    def fields(self) -> list[str]:
        return [f for f, _ in self.violations]


def _parse_details(answer: Answer) -> Answer:
    raw = answer.trailers.get("grpc-status-details-bin")
    if raw is None:
        return answer
    answer.details_bin = raw
    status = status_pb2.Status.FromString(raw)
    assert status.code == answer.code.value[0], "grpc-status-details-bin disagrees with the status code"
    assert status.message == answer.message, "grpc-status-details-bin disagrees with the status message"
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            assert info.domain == "shardrouter.v1"
            answer.reason, answer.error_metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            answer.violations = [(v.field, v.description) for v in bad.field_violations]
    return answer


def call(lab: Lab, path: str, body: bytes, metadata: Sequence[tuple[str, Any]] = ()) -> Answer:
    """Call `path` with raw request bytes (no serializers: bytes in, bytes out)."""
    method = lab.channel.unary_unary(path)
    try:
        response, state = method.with_call(body, metadata=tuple(metadata), timeout=10)
    except grpc.RpcError as err:
        trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
        return _parse_details(Answer(err.code(), err.details() or "", trailers, None))  # type: ignore[attr-defined]
    return Answer(OK, "", dict(state.trailing_metadata() or ()), response)


def fresh_key() -> list[tuple[str, str]]:
    return [(KEY, str(new_key()))]


def snapshot(lab: Lab) -> dict[str, object]:
    """Everything a call could have written."""
    q = lab.db.execute
    return {
        "idempotency_record": q("SELECT count(*) FROM idempotency_record").fetchone()[0],  # type: ignore[index]
        "ledger_entries": q("SELECT count(*), coalesce(sum(amount_minor), 0) FROM ledger_entries").fetchone(),
        "accounts": q("SELECT id, balance, currency, state FROM accounts ORDER BY id").fetchall(),
        "transfers": q("SELECT id, state FROM transfers ORDER BY id").fetchall(),
        "outbox": q("SELECT count(*) FROM outbox").fetchone()[0],  # type: ignore[index]
    }


def assert_nothing_written(lab: Lab, before: dict[str, object]) -> None:
    after = snapshot(lab)
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not changed, f"a refused call wrote to the database: {changed}"


# --------------------------------------------------------------------------------------------------
# Every declared RPC and a valid request for each


def _credit(**overrides: Any) -> ledger_pb2.CreditTransferRequest:
    values: dict[str, Any] = {
        "transfer_id": str(new_key()),
        "source_shard_id": "shard-9",
        "source_account_id": "zoe",
        "destination_account_id": "bob",
        "amount": money(7),
    }
    values.update(overrides)
    return ledger_pb2.CreditTransferRequest(**values)


#: A request each declared RPC accepts, by method path: the baseline every bad input below departs
#: from. A newly declared RPC is fuzzed by every test below that needs no valid request as it is;
#: the others fail for it (and so does `test_every_declared_rpc_has_bad_input_coverage`) until its
#: valid request is added here.
VALID_REQUESTS: dict[str, Callable[[Lab], Message]] = {
    PUBLIC + "Transfer": lambda lab: transfer_pb2.TransferRequest(
        source_account_id="alice", destination_account_id="bob", amount=money(10), reference="rent"
    ),
    PUBLIC + "Deposit": lambda lab: transfer_pb2.DepositRequest(
        account_id="alice", amount=money(5), reference="top-up"
    ),
    PUBLIC + "GetTransfer": lambda lab: transfer_pb2.GetTransferRequest(
        source_account_id="alice", transfer_id=lab.completed_transfer_id
    ),
    PUBLIC + "GetBalance": lambda lab: transfer_pb2.GetBalanceRequest(account_id="bob"),
    INTERNAL + "CreditTransfer": lambda lab: _credit(),
    INTERNAL + "VoidCredit": lambda lab: ledger_pb2.VoidCreditRequest(
        transfer_id=str(new_key()), reason="gave up"
    ),
    INTERNAL + "RefundTransfer": lambda lab: ledger_pb2.RefundTransferRequest(
        transfer_id=lab.pending_transfer(), reason="credit failed for good"
    ),
}


@dataclass(frozen=True)
class Rpc:
    """One RPC of the shard, as the proto declares it (`shardrouter.core.rpcs`)."""

    declaration: RpcDeclaration

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def path(self) -> str:
        return self.declaration.full_name

    @property
    def mutating(self) -> bool:
        return self.declaration.keyed

    def valid(self, lab: Lab) -> Message:
        """A request this RPC accepts (from VALID_REQUESTS)."""
        build = VALID_REQUESTS.get(self.path)
        if build is None:
            pytest.fail(f"{self.path} is declared but VALID_REQUESTS has no valid request for it: add one")
        return build(lab)

    def __str__(self) -> str:
        return self.name


#: Every RPC the proto declares, public and internal: a new one is in every matrix below.
RPCS = [Rpc(d) for d in DECLARED_RPCS]
MUTATING = [r for r in RPCS if r.mutating]
READS = [r for r in RPCS if not r.mutating]
BY_NAME = {r.name: r for r in RPCS}


def test_every_valid_request_is_accepted(lab):
    """The baseline: each builder's request succeeds, so every refusal below is due to the bad input."""
    for rpc in RPCS:
        answer = call(lab, rpc.path, rpc.valid(lab).SerializeToString(), fresh_key())
        assert answer.code == OK, (rpc.name, answer.code, answer.message)


# --------------------------------------------------------------------------------------------------
# Idempotency keys


def _v7_without_hyphens() -> str:
    return str(new_key()).replace("-", "")


def _shifted_hyphens() -> str:
    text = str(new_key()).replace("-", "")
    return f"{text[:9]}-{text[9:13]}-{text[13:17]}-{text[17:21]}-{text[21:]}"  # 9-4-4-4-11: 36 chars


def _ncs_variant_v7() -> str:
    return str(uuid.UUID(int=new_key().int & ~(0b11 << 62)))  # version nibble 7, variant bits 00


@dataclass(frozen=True)
class KeyCase:
    """Key metadata that a mutating call must refuse."""

    id: str
    metadata: Callable[[], list[tuple[str, Any]]]
    code: grpc.StatusCode
    reason: str
    fragment: str


KEY_CASES = [
    KeyCase("missing", lambda: [], INVALID, "IDEMPOTENCY_KEY_MISSING", "missing idempotency-key"),
    KeyCase("empty", lambda: [(KEY, "")], INVALID, "IDEMPOTENCY_KEY_INVALID", "got 0 characters"),
    KeyCase(
        "nil-uuid",
        lambda: [(KEY, str(uuid.UUID(int=0)))],
        INVALID,
        "IDEMPOTENCY_KEY_INVALID",
        "almost always a client bug",
    ),
    KeyCase(
        "10KB", lambda: [(KEY, "k" * 10_000)], INVALID, "IDEMPOTENCY_KEY_INVALID", "got 10000 characters"
    ),
    KeyCase(
        "256-characters",
        lambda: [(KEY, "k" * 256)],
        INVALID,
        "IDEMPOTENCY_KEY_INVALID",
        "got 256 characters, at most 255",
    ),
    KeyCase(
        "space", lambda: [(KEY, "two words")], INVALID, "IDEMPOTENCY_KEY_INVALID", "character 4 is a space"
    ),
    KeyCase(
        "binary-only",
        lambda: [("idempotency-key-bin", new_key().bytes)],
        INVALID,
        "IDEMPOTENCY_KEY_MISSING",
        "missing idempotency-key",
    ),
    KeyCase(
        "twice-same",
        lambda: [(KEY, key := str(new_key())), (KEY, key)],
        INVALID,
        "IDEMPOTENCY_KEY_INVALID",
        "sent 2 times",
    ),
    KeyCase(
        "twice-different",
        lambda: [(KEY, str(new_key())), (KEY, str(new_key()))],
        INVALID,
        "IDEMPOTENCY_KEY_INVALID",
        "sent 2 times",
    ),
    KeyCase(
        "three-times",
        lambda: [(KEY, str(new_key())) for _ in range(3)],
        INVALID,
        "IDEMPOTENCY_KEY_INVALID",
        "sent 3 times",
    ),
    KeyCase(
        "dated-year-3000",
        lambda: [(KEY, str(new_key(int(datetime(3000, 1, 1, tzinfo=UTC).timestamp() * 1000))))],
        INVALID,
        "IDEMPOTENCY_KEY_FROM_FUTURE",
        "further in the future",
    ),
    KeyCase(
        "dated-1970",
        lambda: [(KEY, str(new_key(0)))],
        grpc.StatusCode.FAILED_PRECONDITION,
        "IDEMPOTENCY_KEY_EXPIRED",
        "retention window",
    ),
]


#: Keys once refused for not being a UUIDv7, now accepted: any UUID (dated by receipt unless a
#: UUIDv7), and any other 1-255 visible ASCII characters as an opaque key, taken as sent.
ACCEPTED_KEYS: dict[str, Callable[[], str]] = {
    "uuid4": lambda: str(uuid.uuid4()),
    "uuid1": lambda: str(uuid.uuid1()),
    "ncs-variant": _ncs_variant_v7,
    "no-hyphens": _v7_without_hyphens,
    "shifted-hyphens": _shifted_hyphens,
    "braces": lambda: "{" + str(new_key()) + "}",
    "urn-form": lambda: "urn:uuid:" + str(new_key()),
    # What a client that percent-encodes non-ASCII text sends: the server does not decode it.
    "percent-encoded-non-ascii": lambda: urllib.parse.quote("éé") + str(new_key())[12:],
    "255-characters": lambda: uuid.uuid4().hex * 7 + "~" * 31,
}


@pytest.mark.parametrize("make_key", ACCEPTED_KEYS.values(), ids=ACCEPTED_KEYS.keys())
def test_any_uuid_or_opaque_key_is_applied_once_and_replayed(lab, make_key):
    key = make_key()
    body = transfer_pb2.DepositRequest(account_id="alice", amount=money(3)).SerializeToString()
    first = call(lab, PUBLIC + "Deposit", body, [(KEY, key)])
    assert first.code == OK, first.message
    assert "idempotency-replayed" not in first.trailers
    before = snapshot(lab)
    again = call(lab, PUBLIC + "Deposit", body, [(KEY, key)])
    assert again.code == OK and again.body == first.body
    assert again.trailers["idempotency-replayed"] == "true"
    assert again.trailers["idempotency-expires-at"] == first.trailers["idempotency-expires-at"]
    assert_nothing_written(lab, before)
    stored = lab.db.execute("SELECT key FROM idempotency_record WHERE key = %s", (key.lower(),)).fetchall()
    stored += lab.db.execute("SELECT key FROM idempotency_record WHERE key = %s", (str(key),)).fetchall()
    assert {row[0] for row in stored} == {key.lower() if _is_canonical_uuid(key) else key}


def _is_canonical_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text.lower() and len(text) == 36
    except ValueError:
        return False


@pytest.mark.parametrize("case", KEY_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("rpc", MUTATING, ids=str)
def test_bad_key_is_refused_before_anything_is_written(lab, rpc, case):
    body = rpc.valid(lab).SerializeToString()
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, case.metadata())
    assert answer.code == case.code, answer.message
    assert answer.reason == case.reason
    assert case.fragment in answer.message
    if case.code == INVALID and case.reason != "IDEMPOTENCY_KEY_FROM_FUTURE":
        assert "UUIDv7" in answer.message or "sent" in case.fragment, "the message must say what a key may be"
    expected_outcome = "expired" if case.reason == "IDEMPOTENCY_KEY_EXPIRED" else "invalid"
    assert answer.trailers["idempotency-outcome"] == expected_outcome
    assert_nothing_written(lab, before)


@pytest.mark.parametrize("case", KEY_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("rpc", READS, ids=str)
def test_reads_ignore_the_key_entirely(lab, rpc, case):
    """Reads are not guarded: whatever key metadata comes along, the answer is the plain read."""
    body = rpc.valid(lab).SerializeToString()
    baseline = call(lab, rpc.path, body)
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, case.metadata())
    assert answer.code == OK, answer.message
    assert answer.body == baseline.body
    assert "idempotency-outcome" not in answer.trailers
    assert_nothing_written(lab, before)


# Keys whose 48-bit time lies past datetime's year 9999: `key_time` (or `moment + retention`) raises
# ValueError/OverflowError in the interceptor outside its ShardRouterError handling.
_YEAR_10000_MS = int(datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp() * 1000) + 1000
_FAR_KEYS = {
    "max-48-bit-time": (1 << 48) - 1,
    "year-10000": _YEAR_10000_MS,
    "last-day-of-9999": _YEAR_10000_MS - 86_400_000,  # its expiry (time + 30 days) overflows instead
}


@pytest.mark.parametrize("ms", _FAR_KEYS.values(), ids=_FAR_KEYS.keys())
@pytest.mark.parametrize("rpc", MUTATING, ids=str)
def test_key_dated_past_year_9999_is_invalid_not_unknown(lab, rpc, ms):
    body = rpc.valid(lab).SerializeToString()
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, [(KEY, str(new_key(ms)))])
    try:
        assert answer.code == INVALID, answer.message
        assert answer.reason in ("IDEMPOTENCY_KEY_FROM_FUTURE", "IDEMPOTENCY_KEY_INVALID")
        assert "future" in answer.message
    finally:
        assert_nothing_written(lab, before)  # true today as well: the crash happens before any claim


def test_upper_case_key_is_the_same_key_as_lower_case(lab):
    """RFC 9562 reads hex case-insensitively: an upper-case key names the same record (a replay)."""
    key = new_key()
    body = transfer_pb2.DepositRequest(account_id="alice", amount=money(11)).SerializeToString()
    first = call(lab, PUBLIC + "Deposit", body, [(KEY, str(key).upper())])
    assert first.code == OK
    before = snapshot(lab)
    again = call(lab, PUBLIC + "Deposit", body, [(KEY, str(key))])
    assert again.code == OK
    assert again.body == first.body
    assert again.trailers["idempotency-replayed"] == "true"
    assert_nothing_written(lab, before)


def test_a_key_next_to_its_binary_twin_is_used_and_the_twin_ignored(lab):
    """`idempotency-key-bin` is another metadata name; with a text key present it changes nothing."""
    key = new_key()
    body = transfer_pb2.DepositRequest(account_id="alice", amount=money(12)).SerializeToString()
    first = call(lab, PUBLIC + "Deposit", body, [(KEY, str(key)), ("idempotency-key-bin", new_key().bytes)])
    assert first.code == OK
    again = call(lab, PUBLIC + "Deposit", body, [(KEY, str(key))])
    assert again.body == first.body
    assert again.trailers["idempotency-replayed"] == "true"


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_metadata_beyond_the_hard_limit_is_resource_exhausted(lab, rpc):
    """32 KiB of key: over the 20 KiB hard limit, grpc core answers before the application runs."""
    body = rpc.valid(lab).SerializeToString()
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, [(KEY, "k" * 32 * 1024)])
    assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "metadata size exceeds hard limit" in answer.message
    assert_nothing_written(lab, before)


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_many_small_metadata_entries_beyond_the_hard_limit_are_resource_exhausted(lab, rpc):
    body = rpc.valid(lab).SerializeToString()
    before = snapshot(lab)
    padding = [(f"x-pad-{i}", "p" * 200) for i in range(150)]  # ~30 KiB in total, no entry large
    answer = call(lab, rpc.path, body, fresh_key() + padding)
    assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "metadata size exceeds" in answer.message
    assert_nothing_written(lab, before)


def test_metadata_between_soft_and_hard_limit_is_refused_one_way_or_the_other(lab):
    """17 KiB of bad key: grpc core rejects a random share (RESOURCE_EXHAUSTED), the rest reach the key check."""
    body = BY_NAME["Deposit"].valid(lab).SerializeToString()
    before = snapshot(lab)
    seen = set()
    for _ in range(8):
        answer = call(lab, PUBLIC + "Deposit", body, [(KEY, "k" * 17 * 1024)])
        seen.add(answer.code)
        if answer.code == INVALID:
            assert answer.reason == "IDEMPOTENCY_KEY_INVALID"
            assert f"got {17 * 1024} characters" in answer.message
        else:
            assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "soft limit" in answer.message
    assert seen <= {INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert_nothing_written(lab, before)


# --------------------------------------------------------------------------------------------------
# Non-ASCII metadata


@pytest.mark.parametrize(
    "metadata",
    [
        [(KEY, "é" * 36)],
        [(KEY, ("é" * 36).encode("latin-1"))],
        [(KEY, ("é" * 18).encode())],
        [(KEY, str(new_key())[:-1] + "\x01")],
        [(KEY.upper(), str(new_key()))],
        [(KEY, str(new_key())), (CALLER, "tëam")],
    ],
    ids=[
        "non-ascii-str",
        "latin-1-bytes",
        "utf-8-bytes",
        "control-char",
        "upper-case-name",
        "non-ascii-caller",
    ],
)
def test_grpcio_refuses_non_ascii_metadata_inside_the_client(lab, metadata):
    """Documents the client library: such metadata never leaves the process (local INTERNAL)."""
    before = snapshot(lab)
    answer = call(lab, PUBLIC + "Deposit", BY_NAME["Deposit"].valid(lab).SerializeToString(), metadata)
    assert answer.code == grpc.StatusCode.INTERNAL
    assert answer.message == "Invalid metadata"
    assert answer.details_bin is None  # not a server answer
    assert_nothing_written(lab, before)


# ---- raw HTTP/2, below grpcio: what a hand-made or buggy client can put on the wire


@dataclass
class H2Answer:
    """A raw HTTP/2 exchange's outcome."""

    headers: dict[bytes, bytes]
    data: bytes
    reset: int | None

    @property
    def grpc_status(self) -> int:
        return int(self.headers[b"grpc-status"])

    @property
    def grpc_message(self) -> str:
        return urllib.parse.unquote(self.headers.get(b"grpc-message", b"").decode())

    @property
    def reason(self) -> str | None:
        raw = self.headers.get(b"grpc-status-details-bin")
        if raw is None:
            return None
        status = status_pb2.Status.FromString(base64.b64decode(raw + b"=" * (-len(raw) % 4)))
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                return info.reason
        return None


@pytest.fixture(scope="module")
def h2_call(lab: Lab) -> Callable[..., H2Answer]:
    """Send one gRPC-over-HTTP/2 request by hand (with the `h2` package)."""
    import h2.config as h2_config
    import h2.connection as h2_connection
    import h2.events as h2_events

    def send(
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        *,
        content_type: bytes | None = b"application/grpc",
        frame: bytes | None = None,
    ) -> H2Answer:
        config = h2_config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=False,
        )
        conn = h2_connection.H2Connection(config=config)
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        request_headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", f"127.0.0.1:{lab.port}".encode()),
            (b"te", b"trailers"),
        ]
        if content_type is not None:
            request_headers.append((b"content-type", content_type))
        conn.send_headers(stream, request_headers + list(headers))
        conn.send_data(
            stream,
            frame if frame is not None else b"\x00" + struct.pack(">I", len(body)) + body,
            end_stream=True,
        )
        answer = H2Answer({}, b"", None)
        with socket.create_connection(("127.0.0.1", lab.port), timeout=10) as sock:
            sock.sendall(conn.data_to_send())
            done = False
            while not done:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                for event in conn.receive_data(chunk):
                    if isinstance(event, h2_events.ResponseReceived | h2_events.TrailersReceived):
                        answer.headers.update(dict(event.headers))
                        done = done or event.stream_ended is not None
                    elif isinstance(event, h2_events.DataReceived):
                        answer.data += event.data
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2_events.StreamReset):
                        answer.reset, done = event.error_code, True
                    elif isinstance(event, h2_events.StreamEnded | h2_events.ConnectionTerminated):
                        done = True
                sock.sendall(conn.data_to_send())
        return answer

    return send


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (
            ("é" * 36).encode("latin-1"),
            "character 1 is a non-ASCII character (U+00E9)",
        ),  # invalid UTF-8: grpc Python falls back to latin-1
        (
            ("é" * 18).encode(),
            "character 1 is a non-ASCII character (U+00E9)",
        ),  # valid UTF-8: 36 bytes, 18 characters
        (str(new_key())[:-2].encode() + "é".encode(), "character 35 is a non-ASCII character"),
        (
            str(new_key())[:-1].encode() + b"\x01",
            "character 36 is a control character (U+0001)",
        ),  # grpc core lets a control byte through
        (str(new_key())[:-1].encode() + b"\x7f", "character 36 is a control character (U+007F)"),
    ],
    ids=["latin-1", "utf-8", "utf-8-in-a-v7", "control-byte", "del-byte"],
)
@pytest.mark.parametrize("rpc", MUTATING, ids=str)
def test_non_ascii_key_bytes_on_the_wire_are_invalid_argument(lab, h2_call, rpc, value, fragment):
    body = rpc.valid(lab).SerializeToString()
    before = snapshot(lab)
    answer = h2_call(rpc.path, body, [(KEY.encode(), value)])
    assert answer.grpc_status == INVALID.value[0], answer.grpc_message
    assert answer.reason == "IDEMPOTENCY_KEY_INVALID"
    assert fragment in answer.grpc_message
    assert answer.headers[b"idempotency-outcome"] == b"invalid"
    assert_nothing_written(lab, before)


@pytest.mark.parametrize(
    "value",
    ["tëam".encode("latin-1"), "tëam".encode(), "团队".encode(), b"team\x01"],
    ids=["latin-1", "utf-8", "cjk", "control-byte"],
)
@pytest.mark.parametrize("rpc", MUTATING, ids=str)
def test_non_ascii_caller_bytes_on_the_wire_are_invalid_caller(lab, h2_call, rpc, value):
    body = rpc.valid(lab).SerializeToString()
    before = snapshot(lab)
    answer = h2_call(rpc.path, body, [(KEY.encode(), str(new_key()).encode()), (CALLER.encode(), value)])
    assert answer.grpc_status == INVALID.value[0], answer.grpc_message
    assert answer.reason == "INVALID_CALLER"
    assert "x-caller-id metadata entry must be" in answer.grpc_message
    assert_nothing_written(lab, before)


def test_upper_case_metadata_name_on_the_wire_is_refused_by_grpc_core(lab, h2_call):
    """HTTP/2 forbids upper-case header names; grpc core answers INTERNAL before the application runs."""
    before = snapshot(lab)
    body = BY_NAME["Deposit"].valid(lab).SerializeToString()
    answer = h2_call(PUBLIC + "Deposit", body, [(b"Idempotency-Key", str(new_key()).encode())])
    assert answer.grpc_status == grpc.StatusCode.INTERNAL.value[0]
    assert "Illegal header key" in answer.grpc_message
    assert_nothing_written(lab, before)


# --------------------------------------------------------------------------------------------------
# Caller identity


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ([(CALLER, "team-a"), (CALLER, "team-a")], "sent 2 times"),
        ([(CALLER, "team-a"), (CALLER, "team-b")], "sent 2 times"),
        ([(CALLER, "")], "must be 1-512 characters"),
        ([(CALLER, "team a")], "must be 1-512 characters"),
        ([(CALLER, "-team")], "must be 1-512 characters"),
        ([(CALLER, "t" * 513)], "must be 1-512 characters"),
        ([(CALLER, "team,b")], "must be 1-512 characters"),
        ([(CALLER, urllib.parse.quote("tëam"))], "must be 1-512 characters"),
    ],
    ids=[
        "twice-same",
        "twice-different",
        "empty",
        "space",
        "leading-dash",
        "513-chars",
        "comma",
        "percent-encoded",
    ],
)
@pytest.mark.parametrize("rpc", MUTATING, ids=str)
def test_bad_caller_is_invalid_caller_and_writes_nothing(lab, rpc, metadata, fragment):
    body = rpc.valid(lab).SerializeToString()
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, fresh_key() + metadata)
    assert answer.code == INVALID, answer.message
    assert answer.reason == "INVALID_CALLER"
    assert fragment in answer.message
    assert "x-caller-id" in answer.message
    assert answer.trailers["idempotency-outcome"] == "invalid"
    assert_nothing_written(lab, before)


def test_binary_caller_entry_is_another_name_and_the_call_is_anonymous(lab):
    key = new_key()
    body = transfer_pb2.DepositRequest(account_id="alice", amount=money(13)).SerializeToString()
    answer = call(lab, PUBLIC + "Deposit", body, [(KEY, str(key)), ("x-caller-id-bin", b"\xff\x00team")])
    assert answer.code == OK
    scope = lab.db.execute("SELECT scope FROM idempotency_record WHERE key = %s", (str(key),)).fetchone()
    assert scope == ("/shardrouter.v1.TransferService/Deposit|anonymous",)


# --------------------------------------------------------------------------------------------------
# Bad fields


@dataclass(frozen=True)
class FieldCase:
    """A request whose fields the RPC must refuse with INVALID_ARGUMENT."""

    rpc: str
    id: str
    build: Callable[[Lab], Message]
    fields: tuple[str, ...]  # BadRequest field violations expected (public RPCs)
    fragment: str


def _transfer(**overrides: Any) -> transfer_pb2.TransferRequest:
    values: dict[str, Any] = {
        "source_account_id": "alice",
        "destination_account_id": "bob",
        "amount": money(10),
    }
    values.update(overrides)
    return transfer_pb2.TransferRequest(**values)


def _get_transfer(**overrides: Any) -> transfer_pb2.GetTransferRequest:
    values: dict[str, Any] = {"source_account_id": "alice"}
    values.update(overrides)
    return transfer_pb2.GetTransferRequest(**values)


def _deposit(**overrides: Any) -> transfer_pb2.DepositRequest:
    values: dict[str, Any] = {"account_id": "alice", "amount": money(5)}
    values.update(overrides)
    return transfer_pb2.DepositRequest(**values)


_POSITIVE = "must be positive"
_AT_MOST = "must be at most 1000000000000000"
_ISO = "must be an ISO 4217 code in upper case"
_ACCOUNT = "must be 1-64 characters"
_RETURNED = "must be the UUID returned by Transfer"

# fmt: off
PUBLIC_FIELD_CASES = [
    FieldCase("Transfer", "amount-zero", lambda lab: _transfer(amount=money(0)), ("amount.amount_minor",), _POSITIVE),
    FieldCase("Transfer", "amount-negative", lambda lab: _transfer(amount=money(-1)), ("amount.amount_minor",), _POSITIVE),
    FieldCase("Transfer", "amount-int64-min", lambda lab: _transfer(amount=money(INT64_MIN)), ("amount.amount_minor",), _POSITIVE),
    FieldCase("Transfer", "amount-int64-max", lambda lab: _transfer(amount=money(INT64_MAX)), ("amount.amount_minor",), _AT_MOST),
    FieldCase("Transfer", "amount-above-cap", lambda lab: _transfer(amount=money(10**15 + 1)), ("amount.amount_minor",), _AT_MOST),
    FieldCase("Transfer", "amount-missing", lambda lab: _transfer(amount=None), ("amount",), "amount is required"),
    FieldCase("Transfer", "currency-unknown", lambda lab: _transfer(amount=money(10, "XXX")), ("amount.currency",), _ISO),
    FieldCase("Transfer", "currency-lower", lambda lab: _transfer(amount=money(10, "eur")), ("amount.currency",), _ISO),
    FieldCase("Transfer", "currency-empty", lambda lab: _transfer(amount=money(10, "")), ("amount.currency",), _ISO),
    FieldCase("Transfer", "currency-4-letters", lambda lab: _transfer(amount=money(10, "EURO")), ("amount.currency",), _ISO),
    FieldCase("Transfer", "currency-symbol", lambda lab: _transfer(amount=money(10, "€")), ("amount.currency",), _ISO),
    FieldCase("Transfer", "same-account", lambda lab: _transfer(destination_account_id="alice"),
              ("destination_account_id",), "must differ from source_account_id"),
    FieldCase("Transfer", "source-empty", lambda lab: _transfer(source_account_id=""), ("source_account_id",),
              "must not be empty"),
    FieldCase("Transfer", "source-unicode", lambda lab: _transfer(source_account_id="älice"), ("source_account_id",),
              _ACCOUNT),
    FieldCase("Transfer", "source-leading-dot", lambda lab: _transfer(source_account_id=".alice"), ("source_account_id",),
              _ACCOUNT),
    FieldCase("Transfer", "destination-newline", lambda lab: _transfer(destination_account_id="bob\n"),
              ("destination_account_id",), _ACCOUNT),
    FieldCase("Transfer", "destination-65-chars", lambda lab: _transfer(destination_account_id="b" * 65),
              ("destination_account_id",), _ACCOUNT),
    FieldCase("Transfer", "destination-nul", lambda lab: _transfer(destination_account_id="bob\x00"),
              ("destination_account_id",), _ACCOUNT),
    FieldCase("Transfer", "reference-141", lambda lab: _transfer(reference="r" * 141), ("reference",),
              "at most 140 characters"),
    FieldCase("Transfer", "reference-escape", lambda lab: _transfer(reference="\x1b[31mred"), ("reference",),
              "control characters"),
    FieldCase("Transfer", "reference-line-separator", lambda lab: _transfer(reference="a\u2028b"), ("reference",),
              "control characters"),
    FieldCase("Transfer", "everything-wrong",
              lambda lab: _transfer(destination_account_id="alice", amount=money(0, "eur"), reference="\t"),
              ("destination_account_id", "amount.amount_minor", "amount.currency", "reference"),
              "invalid Transfer request"),
    FieldCase("Deposit", "amount-int64-min", lambda lab: _deposit(amount=money(INT64_MIN)), ("amount.amount_minor",),
              _POSITIVE),
    FieldCase("Deposit", "amount-int64-max", lambda lab: _deposit(amount=money(INT64_MAX)), ("amount.amount_minor",),
              _AT_MOST),
    FieldCase("Deposit", "currency-empty", lambda lab: _deposit(amount=money(5, "")), ("amount.currency",), _ISO),
    FieldCase("Deposit", "currency-mixed-case", lambda lab: _deposit(amount=money(5, "Eur")), ("amount.currency",), _ISO),
    FieldCase("Deposit", "currency-padded", lambda lab: _deposit(amount=money(5, " EUR")), ("amount.currency",), _ISO),
    FieldCase("Deposit", "account-unicode", lambda lab: _deposit(account_id="ålice"), ("account_id",), _ACCOUNT),
    FieldCase("Deposit", "account-fullwidth", lambda lab: _deposit(account_id="\uff41lice"), ("account_id",), _ACCOUNT),
    FieldCase("Deposit", "reference-141", lambda lab: _deposit(reference="é" * 141), ("reference",),
              "at most 140 characters"),
    FieldCase("Deposit", "everything-wrong", lambda lab: _deposit(account_id="", amount=money(-3, "XXX"), reference="\x7f"),
              ("account_id", "amount.amount_minor", "amount.currency", "reference"), "invalid Deposit request"),
    FieldCase("GetBalance", "account-empty", lambda lab: transfer_pb2.GetBalanceRequest(), ("account_id",),
              "must not be empty"),
    FieldCase("GetBalance", "account-unicode", lambda lab: transfer_pb2.GetBalanceRequest(account_id="bøb"),
              ("account_id",), _ACCOUNT),
    FieldCase("GetBalance", "account-space", lambda lab: transfer_pb2.GetBalanceRequest(account_id="b b"),
              ("account_id",), _ACCOUNT),
    FieldCase("GetBalance", "account-65", lambda lab: transfer_pb2.GetBalanceRequest(account_id="b" * 65),
              ("account_id",), _ACCOUNT),
    FieldCase("GetTransfer", "transfer-id-empty", lambda lab: _get_transfer(transfer_id=""), ("transfer_id",), _RETURNED),
    FieldCase("GetTransfer", "transfer-id-upper-case",
              lambda lab: _get_transfer(transfer_id=lab.completed_transfer_id.upper()), ("transfer_id",), _RETURNED),
    FieldCase("GetTransfer", "transfer-id-garbage",
              lambda lab: _get_transfer(transfer_id="'; DROP TABLE transfers; --"), ("transfer_id",), _RETURNED),
    FieldCase("GetTransfer", "source-unicode",
              lambda lab: _get_transfer(source_account_id="älice", transfer_id=lab.completed_transfer_id),
              ("source_account_id",), _ACCOUNT),
    FieldCase("GetTransfer", "wait-too-long",
              lambda lab: _get_transfer(transfer_id=lab.completed_transfer_id, wait_for_completion_ms=30_001),
              ("wait_for_completion_ms",), "must be at most 30000"),
    FieldCase("GetTransfer", "wait-uint32-max",
              lambda lab: _get_transfer(transfer_id=lab.completed_transfer_id, wait_for_completion_ms=2**32 - 1),
              ("wait_for_completion_ms",), "must be at most 30000"),
]

_CREDIT_IDS = "invalid CreditTransfer request"
_CREDIT_AMOUNT = "invalid CreditTransfer request: amount"
_TRANSFER_ID = "transfer_id must be a UUID"

INTERNAL_FIELD_CASES = [
    FieldCase("CreditTransfer", "amount-zero", lambda lab: _credit(amount=money(0)), ("amount.amount_minor",),
              _CREDIT_AMOUNT),
    FieldCase("CreditTransfer", "amount-negative", lambda lab: _credit(amount=money(-7)), ("amount.amount_minor",),
              _CREDIT_AMOUNT),
    FieldCase("CreditTransfer", "amount-int64-min", lambda lab: _credit(amount=money(INT64_MIN)),
              ("amount.amount_minor",), _CREDIT_AMOUNT),
    FieldCase("CreditTransfer", "amount-int64-max", lambda lab: _credit(amount=money(INT64_MAX)),
              ("amount.amount_minor",), _CREDIT_AMOUNT),
    FieldCase("CreditTransfer", "amount-missing", lambda lab: _credit(amount=None), ("amount",), _CREDIT_AMOUNT),
    FieldCase("CreditTransfer", "currency-unknown", lambda lab: _credit(amount=money(7, "XXX")), ("amount.currency",),
              _CREDIT_AMOUNT),
    FieldCase("CreditTransfer", "currency-lower", lambda lab: _credit(amount=money(7, "eur")), ("amount.currency",),
              _CREDIT_AMOUNT),
    FieldCase("CreditTransfer", "destination-empty", lambda lab: _credit(destination_account_id=""),
              ("destination_account_id",), _CREDIT_IDS),
    FieldCase("CreditTransfer", "destination-unicode", lambda lab: _credit(destination_account_id="böb"),
              ("destination_account_id",), _CREDIT_IDS),
    FieldCase("CreditTransfer", "transfer-id-empty", lambda lab: _credit(transfer_id=""), ("transfer_id",), _CREDIT_IDS),
    FieldCase("CreditTransfer", "transfer-id-upper-case", lambda lab: _credit(transfer_id=str(new_key()).upper()),
              ("transfer_id",), _CREDIT_IDS),
    FieldCase("CreditTransfer", "transfer-id-braces", lambda lab: _credit(transfer_id="{" + str(new_key()) + "}"),
              ("transfer_id",), _CREDIT_IDS),
]
for _name, _cls in (("VoidCredit", ledger_pb2.VoidCreditRequest), ("RefundTransfer", ledger_pb2.RefundTransferRequest)):
    INTERNAL_FIELD_CASES += [
        FieldCase(_name, "transfer-id-empty", lambda lab, c=_cls: c(reason="x"), ("transfer_id",), _TRANSFER_ID),
        FieldCase(_name, "transfer-id-garbage", lambda lab, c=_cls: c(transfer_id="transfer-1"), ("transfer_id",),
                  _TRANSFER_ID),
        FieldCase(_name, "transfer-id-upper-case", lambda lab, c=_cls: c(transfer_id=str(new_key()).upper()),
                  ("transfer_id",), _TRANSFER_ID),
        FieldCase(_name, "transfer-id-no-hyphens", lambda lab, c=_cls: c(transfer_id=new_key().hex), ("transfer_id",),
                  _TRANSFER_ID),
    ]
# fmt: on


def _case_id(case: FieldCase) -> str:
    return f"{case.rpc}-{case.id}"


def test_every_declared_rpc_has_bad_input_coverage():
    """Each RPC the proto declares is in the matrices, has a valid request to depart from and bad-field
    cases of its own (public ones with field violations); nothing here names an RPC no longer declared."""
    declared = {d.full_name for d in DECLARED_RPCS}
    assert {r.path for r in RPCS} == declared
    assert {r.path for r in MUTATING} == {d.full_name for d in DECLARED_RPCS if d.keyed}
    assert len(BY_NAME) == len(RPCS), "two declared RPCs share a name: the cases below name RPCs by name"
    assert not declared - set(VALID_REQUESTS), "declared RPCs without a valid request in VALID_REQUESTS"
    assert not set(VALID_REQUESTS) - declared, "VALID_REQUESTS names RPCs that are not declared"
    for cases, service in ((PUBLIC_FIELD_CASES, PUBLIC_SERVICE), (INTERNAL_FIELD_CASES, INTERNAL_SERVICE)):
        named = {case.rpc for case in cases}
        assert named <= set(BY_NAME), f"field cases name RPCs that are not declared: {named - set(BY_NAME)}"
        assert {BY_NAME[n].path for n in named} == {
            d.full_name for d in DECLARED_RPCS if d.service == service
        }, f"every RPC of {service} needs bad-field cases, and only those"


@pytest.mark.parametrize("case", PUBLIC_FIELD_CASES, ids=_case_id)
def test_bad_public_fields_are_invalid_request_with_field_violations(lab, case):
    rpc = BY_NAME[case.rpc]
    body = case.build(lab).SerializeToString()
    key = new_key()
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, [(KEY, str(key))])
    assert answer.code == INVALID, answer.message
    assert answer.reason == "INVALID_REQUEST"
    assert set(answer.fields) == set(case.fields), answer.violations
    assert case.fragment in answer.message
    assert f"invalid {case.rpc} request" in answer.message
    assert_nothing_written(lab, before)
    if rpc.mutating:  # validation runs before the claim: the key is still free
        assert lab.db.execute(
            "SELECT count(*) FROM idempotency_record WHERE key = %s", (str(key),)
        ).fetchone() == (0,)


@pytest.mark.parametrize("case", INTERNAL_FIELD_CASES, ids=_case_id)
def test_bad_internal_fields_are_invalid_argument_and_write_nothing(lab, case):
    rpc = BY_NAME[case.rpc]
    body = case.build(lab).SerializeToString()
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, fresh_key())
    assert answer.code == INVALID, answer.message
    assert case.fragment in answer.message
    assert answer.trailers["idempotency-outcome"] == "invalid"
    assert_nothing_written(lab, before)


@pytest.mark.parametrize("case", INTERNAL_FIELD_CASES[::3], ids=_case_id)
def test_bad_internal_fields_carry_invalid_request_reason_and_field_violations(lab, case):
    answer = call(lab, BY_NAME[case.rpc].path, case.build(lab).SerializeToString(), fresh_key())
    assert answer.code == INVALID
    assert answer.reason == "INVALID_REQUEST"
    assert set(case.fields) <= set(answer.fields)


def test_credit_with_same_source_and_destination_account_is_invalid(lab):
    body = _credit(source_account_id="bob", destination_account_id="bob").SerializeToString()
    before = snapshot(lab)
    answer = call(lab, INTERNAL + "CreditTransfer", body, fresh_key())
    try:
        assert answer.code == INVALID, answer.message
    finally:
        if answer.code != OK:
            assert_nothing_written(lab, before)


def test_refund_reason_with_nul_is_invalid_argument(lab):
    body = ledger_pb2.RefundTransferRequest(transfer_id=lab.pending_transfer(), reason="bad\x00reason")
    before = snapshot(lab)
    answer = call(lab, INTERNAL + "RefundTransfer", body.SerializeToString(), fresh_key())
    try:
        assert answer.code == INVALID, (answer.code, answer.message)
        assert answer.reason == "INVALID_REQUEST"
    finally:
        assert_nothing_written(lab, before)  # true today too: the failed insert rolls back


def test_refund_reason_with_nul_writes_nothing_today(lab):
    """Pins what the bug above does at least get right: the transaction rolls back, the key stays free."""
    key = new_key()
    body = ledger_pb2.RefundTransferRequest(transfer_id=lab.pending_transfer(), reason="bad\x00reason")
    before = snapshot(lab)
    answer = call(lab, INTERNAL + "RefundTransfer", body.SerializeToString(), [(KEY, str(key))])
    assert answer.code != OK
    assert_nothing_written(lab, before)


def test_client_library_refuses_amounts_outside_int64(lab):
    with pytest.raises(ValueError, match="out of range"):
        money(INT64_MAX + 1)
    with pytest.raises(ValueError, match="out of range"):
        money(INT64_MIN - 1)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _money_bytes(amount_varint: bytes, currency: bytes = b"EUR") -> bytes:
    return b"\x08" + amount_varint + b"\x12" + bytes([len(currency)]) + currency


def _wire(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


@pytest.mark.parametrize(
    ("amount_varint", "fragment"),
    [
        (_varint(2**64 - 1), _POSITIVE),  # what a uint64 max on the wire reads as: -1
        (_varint(2**63), _POSITIVE),  # int64 min
        (_varint(2**63 - 1), _AT_MOST),
        (b"\xff" * 10 + b"\x01", "not a valid"),  # an 11-byte varint: no int64 at all
        (b"\xff\xff", "not a valid"),  # truncated varint
    ],
    ids=["uint64-max", "2^63", "int64-max", "11-byte-varint", "truncated"],
)
@pytest.mark.parametrize("rpc_name", ["Transfer", "Deposit", "CreditTransfer"])
def test_overflowing_amounts_on_the_wire_are_invalid_argument(lab, rpc_name, amount_varint, fragment):
    amount = _money_bytes(amount_varint)
    if rpc_name == "Transfer":
        body = _wire(1, b"alice") + _wire(2, b"bob") + _wire(3, amount)
    elif rpc_name == "Deposit":
        body = _wire(1, b"alice") + _wire(2, amount)
    else:
        body = _wire(1, str(new_key()).encode()) + _wire(4, b"bob") + _wire(5, amount)
    before = snapshot(lab)
    answer = call(lab, BY_NAME[rpc_name].path, body, fresh_key())
    assert answer.code == INVALID, answer.message
    if rpc_name == "CreditTransfer" and fragment != "not a valid":
        assert _CREDIT_AMOUNT in answer.message
    else:
        assert fragment in answer.message
        assert answer.reason == "INVALID_REQUEST"
    assert_nothing_written(lab, before)


# --------------------------------------------------------------------------------------------------
# Unknown accounts and transfers


@pytest.mark.parametrize(
    ("rpc_name", "build", "reason", "fragment"),
    [
        (
            "Transfer",
            lambda lab: _transfer(source_account_id="ghost"),
            "ACCOUNT_NOT_FOUND",
            "account ghost does not exist",
        ),
        (
            "Transfer",
            lambda lab: _transfer(source_account_id="ghost", destination_account_id="ghoul"),
            "ACCOUNT_NOT_FOUND",
            "account ghost does not exist",
        ),
        (
            "CreditTransfer",
            lambda lab: _credit(destination_account_id="ghost"),
            "ACCOUNT_NOT_FOUND",
            "account ghost does not exist",
        ),
        (
            "RefundTransfer",
            lambda lab: ledger_pb2.RefundTransferRequest(transfer_id=str(new_key()), reason="x"),
            "TRANSFER_NOT_FOUND",
            "no transfer",
        ),
    ],
    ids=["transfer-from-ghost", "transfer-ghost-to-ghoul", "credit-to-ghost", "refund-of-unknown-transfer"],
)
def test_unknown_account_is_a_stored_not_found_and_replays(lab, rpc_name, build, reason, fragment):
    rpc = BY_NAME[rpc_name]
    body = build(lab).SerializeToString()
    key = new_key()
    before = snapshot(lab)
    first = call(lab, rpc.path, body, [(KEY, str(key))])
    assert first.code == NOT_FOUND, first.message
    assert first.reason == reason
    assert fragment in first.message
    if reason == "ACCOUNT_NOT_FOUND":
        assert first.error_metadata == {"account_id": "ghost"}
    records = lab.db.execute(
        "SELECT status_code, method, response FROM idempotency_record WHERE key = %s", (str(key),)
    ).fetchall()
    assert records == [(NOT_FOUND.value[0], rpc.path, None)]
    after = snapshot(lab)
    assert after["idempotency_record"] == before["idempotency_record"] + 1  # type: ignore[operator]
    assert {k: v for k, v in after.items() if k != "idempotency_record"} == {
        k: v for k, v in before.items() if k != "idempotency_record"
    }
    second = call(lab, rpc.path, body, [(KEY, str(key))])
    assert (second.code, second.message, second.details_bin) == (first.code, first.message, first.details_bin)
    assert second.trailers["idempotency-replayed"] == "true"
    assert snapshot(lab) == after


@pytest.mark.parametrize(
    ("rpc_name", "build", "reason"),
    [
        ("GetBalance", lambda lab: transfer_pb2.GetBalanceRequest(account_id="ghost"), "ACCOUNT_NOT_FOUND"),
        (
            "GetTransfer",
            lambda lab: transfer_pb2.GetTransferRequest(
                source_account_id="alice", transfer_id=str(new_key())
            ),
            "TRANSFER_NOT_FOUND",
        ),
        (
            "GetTransfer",
            lambda lab: transfer_pb2.GetTransferRequest(
                source_account_id="ghost", transfer_id=lab.completed_transfer_id
            ),
            "TRANSFER_NOT_FOUND",
        ),
    ],
    ids=["balance-of-ghost", "unknown-transfer", "transfer-of-another-account"],
)
def test_unknown_things_read_are_not_found_and_nothing_is_stored(lab, rpc_name, build, reason):
    before = snapshot(lab)
    answer = call(lab, BY_NAME[rpc_name].path, build(lab).SerializeToString(), fresh_key())
    assert answer.code == NOT_FOUND
    assert answer.reason == reason
    assert_nothing_written(lab, before)


# --------------------------------------------------------------------------------------------------
# Messages too large, bytes that are not protobuf


def _with_megabyte(rpc: Rpc) -> Message:
    """The RPC's request with a megabyte in its routing field (a string on every RPC, by declaration):
    grpc core refuses the size before anything reads a field, so no valid request is needed."""
    return rpc.declaration.request_type(**{rpc.declaration.routing_field: "m" * 1_000_000})


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_megabyte_message_is_resource_exhausted(lab, rpc):
    body = _with_megabyte(rpc).SerializeToString()
    before = snapshot(lab)
    answer = call(lab, rpc.path, body, fresh_key())
    assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Received message larger than max" in answer.message
    assert "65536" in answer.message
    assert_nothing_written(lab, before)


def test_message_just_under_the_limit_reaches_validation(lab):
    body = _deposit(reference="r" * 65_000).SerializeToString()
    assert len(body) < 64 * 1024
    before = snapshot(lab)
    answer = call(lab, PUBLIC + "Deposit", body, fresh_key())
    assert answer.code == INVALID
    assert answer.fields == ["reference"]
    over = call(lab, PUBLIC + "Deposit", _deposit(reference="r" * 66_000).SerializeToString(), fresh_key())
    assert over.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_nothing_written(lab, before)


GARBAGE = {
    "field-number-too-large": b"\xff\xff\xff\xff\x0f",
    "truncated-length": b"\x0a\x10abc",
    "field-number-0": b"\x00\x01",
    "wire-type-7": b"\x0f",
    "wire-type-6": b"\x0e",
    "truncated-varint": b"\x10\xff",
    "invalid-utf8-in-string": b"\x0a\x02\xff\xfe",  # field 1 is a string in every request message
    "end-group-without-start": b"\x0c",
    "unterminated-group": b"\x0b\x08\x01",
    "11-byte-varint": b"\x18" + b"\xff" * 10 + b"\x01",
    "json": b'{"account_id": "alice", "amount": {"amount_minor": 5, "currency": "EUR"}}',
    "lone-0xff": b"\xff",
}


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
@pytest.mark.parametrize("rpc", MUTATING, ids=str)
def test_bytes_that_are_not_protobuf_are_invalid_request(lab, rpc, garbage):
    before = snapshot(lab)
    answer = call(lab, rpc.path, garbage, fresh_key())
    assert answer.code == INVALID, answer.message
    assert answer.reason == "INVALID_REQUEST"
    assert f"the request body is not a valid {rpc.path} request message (protobuf)" == answer.message
    assert answer.trailers["idempotency-outcome"] == "invalid"
    assert_nothing_written(lab, before)


@pytest.mark.parametrize(
    "garbage",
    [GARBAGE["field-number-too-large"], GARBAGE["invalid-utf8-in-string"]],
    ids=["field-number-too-large", "invalid-utf8-in-string"],
)
@pytest.mark.parametrize("rpc", READS, ids=str)
def test_reads_answer_bytes_that_are_not_protobuf_with_invalid_request(lab, rpc, garbage):
    before = snapshot(lab)
    answer = call(lab, rpc.path, garbage)
    try:
        assert answer.code == INVALID, (answer.code, answer.message)
        assert answer.reason == "INVALID_REQUEST"
    finally:
        assert_nothing_written(lab, before)


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_empty_body_is_the_empty_message_and_fails_validation(lab, rpc):
    """b'' is a valid protobuf encoding (every field default), so it reaches the validators."""
    before = snapshot(lab)
    answer = call(lab, rpc.path, b"", fresh_key())
    assert answer.code == INVALID, answer.message
    assert "not a valid" not in answer.message
    assert_nothing_written(lab, before)


@pytest.mark.parametrize(
    "path",
    [
        PUBLIC + "Withdraw",
        PUBLIC + "transfer",  # method names are case-sensitive
        INTERNAL + "DebitTransfer",
        "/shardrouter.v2.TransferService/Transfer",
        "/shardrouter.internal.v1.ShardLedgerService",
        "/",
    ],
)
def test_unknown_method_path_is_unimplemented(lab, path):
    body = BY_NAME["Deposit"].valid(lab).SerializeToString()
    before = snapshot(lab)
    answer = call(lab, path, body, fresh_key())
    assert answer.code == grpc.StatusCode.UNIMPLEMENTED
    assert "Method not found" in answer.message
    assert_nothing_written(lab, before)


# --------------------------------------------------------------------------------------------------
# Wrong content types and framing (raw HTTP/2)


def test_content_type_is_not_checked_a_valid_protobuf_body_is_served(lab, h2_call):
    """grpc core does not check the request content-type and does not show it to the application
    (it is not in invocation_metadata), so the shard cannot refuse it: a protobuf body labelled
    application/json, text/plain or with no content-type is served like application/grpc. Pinned here
    so a grpc upgrade that starts answering 415 / UNIMPLEMENTED is noticed.
    """
    for content_type in (b"application/json", b"text/plain", b"application/grpc+json", None):
        key = new_key()
        body = _deposit(amount=money(2)).SerializeToString()
        answer = h2_call(
            PUBLIC + "Deposit", body, [(KEY.encode(), str(key).encode())], content_type=content_type
        )
        assert answer.headers[b":status"] == b"200"
        assert answer.grpc_status == 0, (content_type, answer.grpc_message)
        entries = lab.db.execute(
            "SELECT count(*) FROM ledger_entries WHERE idempotency_key = %s", (str(key),)
        ).fetchone()
        assert entries == (1,)
        # ... and it is the same operation as the properly labelled request: a retry replays it.
        replay = call(lab, PUBLIC + "Deposit", body, [(KEY, str(key))])
        assert replay.trailers["idempotency-replayed"] == "true"
        assert b"\x00" + struct.pack(">I", len(replay.body or b"")) + (replay.body or b"") == answer.data


@pytest.mark.parametrize(
    "content_type", [b"application/json", b"text/plain", b"application/x-www-form-urlencoded"]
)
def test_wrong_content_type_with_a_body_that_is_not_protobuf_is_invalid_request(lab, h2_call, content_type):
    before = snapshot(lab)
    body = {
        b"application/json": GARBAGE["json"],
        b"text/plain": b"deposit 5 EUR to alice\xff",
        b"application/x-www-form-urlencoded": b"\x0b\x08\x01account_id=alice&amount=5",
    }[content_type]
    answer = h2_call(
        PUBLIC + "Deposit", body, [(KEY.encode(), str(new_key()).encode())], content_type=content_type
    )
    assert answer.grpc_status == INVALID.value[0], answer.grpc_message
    assert answer.reason == "INVALID_REQUEST"
    assert "not a valid" in answer.grpc_message
    assert_nothing_written(lab, before)


def test_compressed_flag_without_an_encoding_is_refused_by_grpc_core(lab, h2_call):
    """Framing errors are answered by grpc core (INTERNAL) before any application code runs."""
    body = _deposit().SerializeToString()
    before = snapshot(lab)
    answer = h2_call(
        PUBLIC + "Deposit",
        body,
        [(KEY.encode(), str(new_key()).encode())],
        frame=b"\x01" + struct.pack(">I", len(body)) + body,
    )
    assert answer.grpc_status == grpc.StatusCode.INTERNAL.value[0]
    assert "Compression bit set" in answer.grpc_message
    assert_nothing_written(lab, before)


# --------------------------------------------------------------------------------------------------
# Unknown fields

_UNKNOWN = b"\xa0\x06\x01"  # field 100, varint 1: no request message has a field 100


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_unknown_fields_are_accepted_like_the_known_ones(lab, rpc):
    plain = call(lab, rpc.path, rpc.valid(lab).SerializeToString(), fresh_key())
    extended = call(lab, rpc.path, rpc.valid(lab).SerializeToString() + _UNKNOWN, fresh_key())
    assert plain.code == extended.code == OK, (plain.message, extended.message)


def _record(lab: Lab, key: uuid.UUID) -> tuple[bytes, bytes]:
    row = lab.db.execute(
        "SELECT request_hash, response FROM idempotency_record WHERE key = %s", (str(key),)
    ).fetchone()
    assert row is not None
    return bytes(row[0]), bytes(row[1])


def test_unknown_fields_are_not_part_of_the_request_hash(lab):
    """The request hash is sha256(method, NUL, deterministic serialisation of the fields this shard
    knows): unknown fields cannot change what it does, so a newer client's request retried by an older
    one (or the other way round) is the same request and replays. Known fields in another wire order
    or a repeated scalar (last one wins) serialise identically and replay too; another known value is
    a different request (IDEMPOTENCY_KEY_REUSED).
    """
    path = PUBLIC + "Deposit"
    known = _deposit(amount=money(21)).SerializeToString()
    body = known + _UNKNOWN
    key = new_key()
    md = [(KEY, str(key))]
    first = call(lab, path, body, md)
    assert first.code == OK
    request_hash, response = _record(lab, key)
    assert request_hash == hashlib.sha256(path.encode() + b"\x00" + known).digest()
    assert response == first.body
    before = snapshot(lab)

    again = call(lab, path, body, md)
    assert again.body == first.body
    assert again.trailers["idempotency-replayed"] == "true"

    account, amount = _wire(1, b"alice"), _wire(2, _money_bytes(_varint(21)))
    assert account + amount == known
    for equivalent in (
        known,  # without the unknown field (an older client)
        known + b"\xa0\x06\x02",  # another unknown value
        known + _UNKNOWN + _UNKNOWN,
        amount + account + _UNKNOWN,  # known fields in another order
        _UNKNOWN + account + amount,  # the unknown field first
        _wire(1, b"mallory") + account + amount + _UNKNOWN,  # a repeated scalar: the last value wins
    ):
        replay = call(lab, path, equivalent, md)
        assert replay.code == OK, replay.message
        assert replay.body == first.body
        assert replay.trailers["idempotency-replayed"] == "true"

    different = _deposit(amount=money(22)).SerializeToString() + _UNKNOWN
    reused = call(lab, path, different, md)
    assert reused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert reused.reason == "IDEMPOTENCY_KEY_REUSED"
    assert "already used for a different request" in reused.message
    assert_nothing_written(lab, before)


def test_unknown_fields_do_not_smuggle_a_second_amount(lab):
    """A second Money under an unknown number is ignored: the known amount is what moves."""
    key = new_key()
    alice_before = lab.stub.GetBalance(
        transfer_pb2.GetBalanceRequest(account_id="alice")
    ).balance.amount_minor
    body = _deposit(amount=money(4)).SerializeToString() + _wire(9, _money_bytes(_varint(10**15)))
    answer = call(lab, PUBLIC + "Deposit", body, [(KEY, str(key))])
    assert answer.code == OK
    reply = transfer_pb2.DepositResponse.FromString(answer.body or b"")
    assert reply.balance.amount_minor == alice_before + 4
    assert lab.db.execute(
        "SELECT amount_minor FROM ledger_entries WHERE idempotency_key = %s", (str(key),)
    ).fetchall() == [(4,)]


# --------------------------------------------------------------------------------------------------
# Authorization: hostile callers and accounts against a shard with a policy (dev mode, so the
# x-caller-id entry is the caller; tests/shardd/test_authorization.py has the mTLS cases)

AUTHZ_POLICY = {
    "name": "alice-only",
    "allow_policies": [
        {
            "name": "alice-app",
            "source": {"principals": ["alice-app"]},
            "request": {"paths": ["/shardrouter.v1.TransferService/*"], "accounts": ["alice"]},
        },
        {"name": "shards", "source": {"principals": ["relay:*"]}, "request": {"paths": [INTERNAL + "*"]}},
    ],
}
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def authz_lab(postgres: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A shard whose policy lets alice-app touch only the account alice, and relays the internal API."""
    import json

    name = f"bad_authz_{uuid.uuid4().hex[:8]}"
    postgres.create_database(name)
    dsn = postgres.dsn_for(name)
    policy = tmp_path_factory.mktemp("authz") / "policy.json"
    policy.write_text(json.dumps(AUTHZ_POLICY))
    daemon = start_shard(make_settings(dsn, authz_policy_file=str(policy)))
    channel = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
    conn = psycopg.connect(dsn, autocommit=True)
    lab = Lab(daemon, channel, transfer_pb2_grpc.TransferServiceStub(channel), conn)
    lab.stub.Deposit(
        transfer_pb2.DepositRequest(account_id="alice", amount=money(1_000)),
        metadata=[(KEY, str(new_key())), (CALLER, "alice-app")],
    )
    conn.execute("INSERT INTO accounts (id, currency) VALUES ('bob', 'EUR')")
    conn.execute("INSERT INTO accounts (id, currency) VALUES ('zoe', 'EUR')")
    yield lab
    conn.close()
    channel.close()
    daemon.stop(0.5)


def _authz_metadata(rpc: Rpc, caller: str) -> list[tuple[str, str]]:
    return [*(fresh_key() if rpc.mutating else []), (CALLER, caller)]


@pytest.mark.parametrize("rpc", RPCS, ids=str)
@pytest.mark.parametrize("caller", ["mallory", "alice-app-2", "ALICE-APP", "relay-shard-0"])
def test_a_caller_the_policy_does_not_name_is_refused_on_every_rpc(authz_lab, rpc, caller):
    body = rpc.valid(authz_lab).SerializeToString()
    before = snapshot(authz_lab)
    answer = call(authz_lab, rpc.path, body, _authz_metadata(rpc, caller))
    assert answer.code == PERMISSION_DENIED, answer
    assert answer.reason == "PERMISSION_DENIED"
    assert answer.error_metadata["caller"] == caller and answer.error_metadata["method"] == rpc.path
    assert f"caller {caller} may not call {rpc.path}" in answer.message
    assert_nothing_written(authz_lab, before)


@pytest.mark.parametrize(
    "account",
    [
        "Alice",
        "alice ",
        " alice",
        "alicex",
        "xalice",
        "alic",
        "alice\x00",
        "al*",
        "*",
        "\uff41lice",
        "a" * 10_000,
    ],
    ids=lambda a: repr(a[:12]),
)
def test_accounts_that_only_look_like_an_allowed_one_are_refused(authz_lab, account):
    body = transfer_pb2.DepositRequest(account_id=account, amount=money(5), reference="secret-ref-42")
    before = snapshot(authz_lab)
    answer = call(
        authz_lab, PUBLIC + "Deposit", body.SerializeToString(), [*fresh_key(), (CALLER, "alice-app")]
    )
    assert answer.code == PERMISSION_DENIED, answer
    assert "secret-ref-42" not in answer.message  # the request's content is never echoed
    shown = answer.error_metadata["account"]
    assert len(shown) <= 131 and shown.isprintable()
    assert_nothing_written(authz_lab, before)


@pytest.mark.parametrize("caller", ["*", "alice-*", "", " alice-app", "alice-app*"])
def test_a_caller_that_is_a_pattern_or_no_name_is_invalid_not_matched(authz_lab, caller):
    before = snapshot(authz_lab)
    body = BY_NAME["Deposit"].valid(authz_lab).SerializeToString()
    answer = call(authz_lab, PUBLIC + "Deposit", body, [*fresh_key(), (CALLER, caller)])
    assert answer.code == INVALID, answer
    assert answer.reason == "INVALID_CALLER"
    assert_nothing_written(authz_lab, before)


def test_two_caller_entries_are_refused_not_the_friendlier_one_believed(authz_lab):
    before = snapshot(authz_lab)
    body = BY_NAME["Deposit"].valid(authz_lab).SerializeToString()
    metadata = [*fresh_key(), (CALLER, "mallory"), (CALLER, "alice-app")]
    answer = call(authz_lab, PUBLIC + "Deposit", body, metadata)
    assert answer.code == INVALID and answer.reason == "INVALID_CALLER", answer
    assert_nothing_written(authz_lab, before)


@pytest.mark.parametrize("caller", ["mallory", "alice-app"])
@pytest.mark.parametrize(
    "body", [b"\xff\xff\xff", b"\x0a\xff", b"\x0a\x05al"], ids=["garbage", "bad-length", "short"]
)
def test_bytes_that_are_no_request_are_invalid_for_any_caller(authz_lab, caller, body):
    before = snapshot(authz_lab)
    answer = call(authz_lab, PUBLIC + "Deposit", body, [*fresh_key(), (CALLER, caller)])
    assert answer.code == INVALID and answer.reason == "INVALID_REQUEST", answer
    assert_nothing_written(authz_lab, before)


def test_the_allowed_caller_on_its_account_still_works(authz_lab):
    body = transfer_pb2.DepositRequest(account_id="alice", amount=money(5)).SerializeToString()
    answer = call(authz_lab, PUBLIC + "Deposit", body, [*fresh_key(), (CALLER, "alice-app")])
    assert answer.code == OK, answer
    # An unknown field cannot smuggle a second account past the routing field's check.
    smuggled = transfer_pb2.DepositRequest(account_id="bob", amount=money(5)).SerializeToString()
    smuggled += _wire(99, b"alice")
    before = snapshot(authz_lab)
    answer = call(authz_lab, PUBLIC + "Deposit", smuggled, [*fresh_key(), (CALLER, "alice-app")])
    assert answer.code == PERMISSION_DENIED, answer
    assert_nothing_written(authz_lab, before)
    # A repeated routing field: protobuf keeps the last one, and so does the check.
    doubled = (
        transfer_pb2.DepositRequest(account_id="alice", amount=money(5)).SerializeToString()
        + transfer_pb2.DepositRequest(account_id="bob").SerializeToString()
    )
    answer = call(authz_lab, PUBLIC + "Deposit", doubled, [*fresh_key(), (CALLER, "alice-app")])
    assert answer.code == PERMISSION_DENIED and answer.error_metadata["account"] == "bob", answer
    assert_nothing_written(authz_lab, before)


def test_ledger_stays_balanced_after_all_of_the_above(lab):
    """Runs last in this module: every balance equals the sum of its entries, none negative."""
    rows = lab.db.execute(
        "SELECT a.id, a.balance, coalesce(sum(e.amount_minor), 0) FROM accounts a"
        " LEFT JOIN ledger_entries e ON e.account_id = a.id GROUP BY a.id, a.balance"
    ).fetchall()
    assert rows
    for account_id, balance, entries in rows:
        assert balance == entries, account_id
        assert balance >= 0, account_id
