"""The router process against in-test fake shards: transparency, metadata, deadlines, retries, reload.

A fake shard is a real gRPC server on loopback that records what arrives and answers as each test
says, so these tests see exactly what the router sends and compare byte for byte what it returns.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from shardrouter.core.errors import ERROR_DOMAIN, Reason
from shardrouter.core.keys import new_key
from shardrouter.core.wire_names import WAIT_METADATA
from shardrouter.v1 import transfer_pb2
from tests.processes import ServiceProcess, router_process
from tests.router.fakeshard import FakeShard, SeenCall, single_shard_map, start_fake_shard

SERVICE = "/shardrouter.v1.TransferService/"
MAX_DEADLINE_S = 20.0


def _by_key(metadata: object) -> list[tuple[str, str | bytes]]:
    """Metadata in a canonical order: by key, with repeated keys in their original order."""
    return sorted(((k, v) for k, v in metadata), key=lambda kv: kv[0])  # type: ignore[attr-defined]


def _details_of(error: grpc.RpcError) -> dict[str, object]:
    """The rich details of a failed call, by type."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, f"no rich status in {error}"
    out: dict[str, object] = {}
    for detail in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.BadRequest):
            message = kind()
            if detail.Unpack(message):
                out[kind.DESCRIPTOR.name] = message
    return out


class ConfigMapDir:
    """A shard map file mounted the way kubelet mounts a ConfigMap; `publish` swaps it atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "shard-map.yaml"
        self._version = 0
        root.mkdir(parents=True)

    def publish(self, content: str) -> None:
        self._version += 1
        version_dir = self.root / f"..v{self._version}"
        version_dir.mkdir()
        (version_dir / "shard-map.yaml").write_text(content)
        tmp_link = self.root / "..data_tmp"
        tmp_link.symlink_to(version_dir.name)
        os.replace(tmp_link, self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to("..data/shard-map.yaml")


@dataclass
class Setup:
    fakes: list[FakeShard]
    mount: ConfigMapDir
    router: ServiceProcess
    channel: grpc.Channel

    def raw(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)

    def route_to(self, fake_index: int, timeout_s: float = 5.0) -> None:
        """Publish a map sending everything to one fake and wait until calls arrive there."""
        fake = self.fakes[fake_index]
        self.mount.publish(json.dumps(single_shard_map(fake.address)))
        _wait_until_routed(self, fake, timeout_s)


def _wait_until_routed(setup: Setup, fake: FakeShard, timeout_s: float) -> None:
    probe = transfer_pb2.GetBalanceRequest(account_id="probe").SerializeToString()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = len(fake.calls)
        with contextlib.suppress(grpc.RpcError):
            setup.raw("GetBalance")(probe, timeout=1)
        if len(fake.calls) > before:
            return
        time.sleep(0.05)
    raise AssertionError(f"calls never reached {fake.address}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("router-fwd")
    fakes = [start_fake_shard(), start_fake_shard()]
    mount = ConfigMapDir(tmp / "config")
    mount.publish(json.dumps(single_shard_map(fakes[0].address)))
    router = router_process(
        tmp,
        shard_map=mount.path,
        extra_env={"ROUTER_MAX_DEADLINE_S": str(MAX_DEADLINE_S), "ROUTER_FORWARD_RETRIES": "2"},
    )
    router.start()
    channel = grpc.insecure_channel(router.address)
    try:
        yield Setup(fakes, mount, router, channel)
    finally:
        channel.close()
        router.kill()
        for fake in fakes:
            fake.stop()


@pytest.fixture
def fake(setup: Setup) -> FakeShard:
    """The fake every call is routed to; reset before each test."""
    for f in setup.fakes:
        f.reset()
    return setup.fakes[0]


# --- what reaches the shard --------------------------------------------------------------------------


def test_caller_metadata_reaches_the_shard_unchanged(setup: Setup, fake: FakeShard) -> None:
    key = str(new_key())
    sent = [
        ("idempotency-key", key),
        ("x-caller-id", "alice@example"),
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("tracestate", "vendor=opaque"),
        ("x-foo", "first"),
        ("x-foo", "second"),
        ("x-blob-bin", b"\x00\xffbinary"),
    ]
    request = transfer_pb2.DepositRequest(
        account_id="acct-1", amount=transfer_pb2.Money(amount_minor=1, currency="EUR")
    )
    setup.raw("Deposit")(request.SerializeToString(), metadata=sent, timeout=5)
    (seen,) = fake.calls
    assert seen.method == SERVICE + "Deposit"
    assert seen.request == request.SerializeToString()
    forwarded = [(k, v) for k, v in seen.metadata if k != "user-agent"]
    # gRPC itself may move entries it knows (e.g. traceparent) to the front; entries of one key keep
    # their order, which is what matters.
    assert _by_key(forwarded) == _by_key(sent)


def test_caller_deadline_reaches_the_shard(setup: Setup, fake: FakeShard) -> None:
    setup.raw("GetBalance")(transfer_pb2.GetBalanceRequest(account_id="a").SerializeToString(), timeout=2.0)
    setup.raw("GetBalance")(transfer_pb2.GetBalanceRequest(account_id="a").SerializeToString())  # no deadline
    with_deadline, without = fake.calls
    # (grpc-timeout on the wire is rounded up a little, hence the slack above the limits.)
    assert with_deadline.time_remaining is not None and 1.0 < with_deadline.time_remaining <= 2.2
    # No deadline from the caller: the router still gives the shard one, capped.
    assert without.time_remaining is not None
    assert MAX_DEADLINE_S - 5 < without.time_remaining <= MAX_DEADLINE_S + 0.5


def test_caller_cancellation_reaches_the_shard(setup: Setup, fake: FakeShard) -> None:
    stopped = threading.Event()

    def wait_for_cancel(call: SeenCall, context: grpc.ServicerContext) -> bytes:
        give_up = time.monotonic() + 8
        while context.is_active() and time.monotonic() < give_up:
            time.sleep(0.01)
        if not context.is_active():
            stopped.set()
        return b""

    fake.reset(wait_for_cancel)
    future = setup.raw("GetBalance").future(
        transfer_pb2.GetBalanceRequest(account_id="a").SerializeToString(), timeout=10
    )
    deadline = time.monotonic() + 5
    while not fake.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.calls
    cancelled_at = time.monotonic()
    future.cancel()
    assert stopped.wait(3), "the shard's call went on after the caller cancelled"
    assert time.monotonic() - cancelled_at < 2


# --- what comes back ---------------------------------------------------------------------------------


def test_success_bytes_and_metadata_come_back_untouched(setup: Setup, fake: FakeShard) -> None:
    # Unknown field 99 appended: a router that decoded and re-encoded the response would still keep
    # it, but one that re-serialised a typed copy in another order would not be byte-identical.
    payload = (
        transfer_pb2.GetBalanceResponse(
            account_id="acct-7", balance=transfer_pb2.Money(amount_minor=12, currency="EUR")
        ).SerializeToString()
        + b"\x9a\x06\x03xyz"
    )
    trailers = (
        ("idempotency-replayed", "true"),
        ("idempotency-expires-at", "2030-01-01T00:00:00.000+00:00"),
        ("x-shard-bin", b"\x01\x02\x03"),
    )

    def answer(call: SeenCall, context: grpc.ServicerContext) -> bytes:
        context.send_initial_metadata((("x-initial", "hello"),))
        context.set_trailing_metadata(trailers)
        return payload

    fake.reset(answer)
    response, call = setup.raw("GetBalance").with_call(
        transfer_pb2.GetBalanceRequest(account_id="acct-7").SerializeToString(), timeout=5
    )
    assert response == payload
    assert _by_key(call.trailing_metadata()) == _by_key(trailers)
    assert ("x-initial", "hello") in tuple(call.initial_metadata())


def _rich_status(
    code: grpc.StatusCode, message: str, reason: str, domain: str = ERROR_DOMAIN, retry_ms: int | None = None
) -> bytes:
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(
        error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata={"account_id": "a"})
    )
    if retry_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(retry_ms)
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status.SerializeToString()


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


@pytest.mark.parametrize(
    ("code", "reason", "retry_ms"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, Reason.INSUFFICIENT_FUNDS, None),
        (grpc.StatusCode.ABORTED, Reason.IDEMPOTENCY_KEY_IN_FLIGHT, 100),
        (grpc.StatusCode.NOT_FOUND, Reason.ACCOUNT_NOT_FOUND, None),
        (grpc.StatusCode.INVALID_ARGUMENT, Reason.IDEMPOTENCY_KEY_INVALID, None),
        # The shard's own UNAVAILABLE (its database is down) is an answer: passed through, not retried.
        (grpc.StatusCode.UNAVAILABLE, Reason.DATABASE_UNAVAILABLE, 200),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.RATE_LIMITED, 1000),
        (grpc.StatusCode.INTERNAL, Reason.INTERNAL, None),
    ],
)
def test_shard_errors_come_back_untouched(
    setup: Setup, fake: FakeShard, code: grpc.StatusCode, reason: str, retry_ms: int | None
) -> None:
    message = f"{reason.lower()}: Konto hält 5 € (nicht genug)"
    trailers: tuple[tuple[str, str | bytes], ...] = (
        ("idempotency-replayed", "true"),
        ("idempotency-expires-at", "2030-01-01T00:00:00.000+00:00"),
        *((("grpc-retry-pushback-ms", str(retry_ms)),) if retry_ms else ()),
        ("x-blob-bin", b"\x00\x01"),
        ("grpc-status-details-bin", _rich_status(code, message, reason, retry_ms=retry_ms)),
    )

    def fail(call: SeenCall, context: grpc.ServicerContext) -> bytes:
        context.abort_with_status(_Status(code, message, trailers))

    fake.reset(fail)
    request = transfer_pb2.TransferRequest(source_account_id="acct-1", destination_account_id="acct-2")
    with pytest.raises(grpc.RpcError) as caught:
        setup.raw("Transfer")(
            request.SerializeToString(), metadata=[("idempotency-key", str(new_key()))], timeout=5
        )
    error = caught.value
    assert error.code() == code
    assert error.details() == message
    assert _by_key(error.trailing_metadata()) == _by_key(trailers)
    details = _details_of(error)
    assert details["ErrorInfo"].reason == reason  # type: ignore[attr-defined]
    assert len(fake.calls) == 1  # an answer from the shard is never retried


# --- the router's own answers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "request_message", "field"),
    [
        ("Transfer", transfer_pb2.TransferRequest(destination_account_id="acct-2"), "source_account_id"),
        ("Deposit", transfer_pb2.DepositRequest(account_id="no spaces allowed"), "account_id"),
        ("GetTransfer", transfer_pb2.GetTransferRequest(source_account_id="é"), "source_account_id"),
        ("GetBalance", transfer_pb2.GetBalanceRequest(account_id="x" * 65), "account_id"),
    ],
)
def test_malformed_routing_account_is_refused_by_the_router(
    setup: Setup, fake: FakeShard, method: str, request_message: object, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        setup.raw(method)(request_message.SerializeToString(), timeout=5)  # type: ignore[attr-defined]
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = _details_of(error)
    assert details["ErrorInfo"].reason == Reason.INVALID_REQUEST  # type: ignore[attr-defined]
    assert details["ErrorInfo"].domain == ERROR_DOMAIN  # type: ignore[attr-defined]
    assert [v.field for v in details["BadRequest"].field_violations] == [field]  # type: ignore[attr-defined]
    assert fake.calls == []  # never forwarded


def test_undecodable_request_is_refused_by_the_router(setup: Setup, fake: FakeShard) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        setup.raw("Transfer")(b"\x0a\xff\xff\xff\x0f", timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details_of(caught.value)["ErrorInfo"].reason == Reason.INVALID_REQUEST  # type: ignore[attr-defined]
    assert fake.calls == []


def test_internal_shard_api_is_not_exposed(setup: Setup, fake: FakeShard) -> None:
    credit = setup.channel.unary_unary(
        "/shardrouter.internal.v1.ShardLedgerService/CreditTransfer",
        request_serializer=None,
        response_deserializer=None,
    )
    with pytest.raises(grpc.RpcError) as caught:
        credit(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert fake.calls == []


def _fail_first(n: int):
    """A behaviour failing the first `n` calls the way a transport failure looks, then echoing."""
    attempts = itertools.count(1)

    def behaviour(call: SeenCall, context: grpc.ServicerContext) -> bytes:
        if next(attempts) <= n:
            # No rich details: what a connection failure looks like from the router's side.
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset by peer")
        return call.request

    return behaviour


def test_keyless_deposit_is_not_retried_keyed_one_is(setup: Setup, fake: FakeShard) -> None:
    request = transfer_pb2.DepositRequest(
        account_id="acct-1", amount=transfer_pb2.Money(amount_minor=1, currency="EUR")
    ).SerializeToString()

    fake.reset(_fail_first(2))
    with pytest.raises(grpc.RpcError) as caught:
        setup.raw("Deposit")(request, timeout=5)
    assert len(fake.calls) == 1, "a keyless call was retried"
    error = caught.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    details = _details_of(error)
    assert details["ErrorInfo"].reason == Reason.SHARD_UNAVAILABLE  # type: ignore[attr-defined]
    assert details["ErrorInfo"].metadata["shard_id"] == "fake-0"  # type: ignore[attr-defined]
    assert details["RetryInfo"].retry_delay.ToMilliseconds() > 0  # type: ignore[attr-defined]

    fake.reset(_fail_first(2))
    key = str(new_key())
    response = setup.raw("Deposit")(request, metadata=[("idempotency-key", key)], timeout=5)
    assert response == request  # the third attempt reached the echo
    assert len(fake.calls) == 3
    assert all(c.request == request and ("idempotency-key", key) in c.metadata for c in fake.calls)
    # A resend asks the daemon to wait for a twin in flight (its own earlier attempt, on a daemon that
    # died with the key claimed, holds it until that session has exited); the first send does not.
    waits = [[int(v) for k, v in c.metadata if k == WAIT_METADATA] for c in fake.calls]
    assert waits[0] == [] and all(len(w) == 1 and 0 < w[0] <= 5000 for w in waits[1:]), waits


def test_a_read_is_resent_like_a_keyed_call(setup: Setup, fake: FakeShard) -> None:
    """A shard restarted a moment ago: the first connections fail while they reconnect. A read has
    nothing to apply twice, so it gets the same rounds as a keyed call, not a needless UNAVAILABLE."""
    request = transfer_pb2.GetBalanceRequest(account_id="acct-1").SerializeToString()
    fake.reset(_fail_first(2))
    assert setup.raw("GetBalance")(request, timeout=5) == request  # the third attempt reached the echo
    assert len(fake.calls) == 3
    assert not any(k == WAIT_METADATA for c in fake.calls for k, _ in c.metadata)  # no key, no twin


def test_keyed_retries_are_bounded(setup: Setup, fake: FakeShard) -> None:
    fake.reset(_fail_first(100))
    request = transfer_pb2.DepositRequest(account_id="acct-1").SerializeToString()
    with pytest.raises(grpc.RpcError) as caught:
        setup.raw("Deposit")(request, metadata=[("idempotency-key", str(new_key()))], timeout=5)
    assert len(fake.calls) == 3  # one attempt and ROUTER_FORWARD_RETRIES=2 retries
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _details_of(caught.value)["ErrorInfo"].reason == Reason.SHARD_UNAVAILABLE  # type: ignore[attr-defined]
    assert ("grpc-retry-pushback-ms", "500") in tuple(caught.value.trailing_metadata())


def test_health_and_reflection(setup: Setup) -> None:
    health = health_pb2_grpc.HealthStub(setup.channel)
    for service in ("", "shardrouter.v1.TransferService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(setup.channel)
    (reply,) = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for s in reply.list_services_response.service}
    assert "shardrouter.v1.TransferService" in names


# --- shard map reloads (these tests change the routing; they restore it at the end) ------------------


def test_shard_map_reload_while_running(setup: Setup, fake: FakeShard) -> None:
    other = setup.fakes[1]
    setup.route_to(1)
    before = len(fake.calls)
    setup.raw("GetBalance")(
        transfer_pb2.GetBalanceRequest(account_id="acct-9").SerializeToString(), timeout=5
    )
    assert len(fake.calls) == before
    assert other.calls[-1].request == transfer_pb2.GetBalanceRequest(account_id="acct-9").SerializeToString()

    # A bad new map is refused and logged; the last good one stays in force.
    setup.mount.publish("shards: [ {id: Bad_Id, address: nowhere} ]")
    deadline = time.monotonic() + 5
    while "keeping the last good map" not in setup.router.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    warning = next(
        json.loads(line)
        for line in setup.router.log_text().splitlines()
        if "keeping the last good map" in line
    )
    assert warning["level"] == "warning"
    assert str(setup.mount.path) in warning["msg"]
    count = len(other.calls)
    setup.raw("GetBalance")(
        transfer_pb2.GetBalanceRequest(account_id="acct-9").SerializeToString(), timeout=5
    )
    assert len(other.calls) == count + 1

    setup.route_to(0)


def test_unreachable_shard_is_the_routers_unavailable(setup: Setup, fake: FakeShard) -> None:
    from shardrouter.localcluster.postgres import free_port

    dead = {
        "slots": 16384,
        "shards": [{"id": "gone-7", "address": f"127.0.0.1:{free_port()}", "slot_ranges": [[0, 16383]]}],
    }
    setup.mount.publish(json.dumps(dead))
    try:
        error = _first_error_from(setup, "gone-7")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        details = _details_of(error)
        assert details["ErrorInfo"].reason == Reason.SHARD_UNAVAILABLE  # type: ignore[attr-defined]
        assert details["ErrorInfo"].metadata["shard_id"] == "gone-7"  # type: ignore[attr-defined]
        assert details["RetryInfo"].retry_delay.ToMilliseconds() == 500  # type: ignore[attr-defined]
        assert error.details() is not None and "127.0.0.1" not in error.details()  # no topology leak
    finally:
        setup.route_to(0)


def _first_error_from(setup: Setup, shard_id: str, timeout_s: float = 5.0) -> grpc.RpcError:
    """Call until the router answers with an error naming `shard_id` (once the new map is in force)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            setup.raw("Deposit")(
                transfer_pb2.DepositRequest(account_id="acct-1").SerializeToString(),
                metadata=[("idempotency-key", str(new_key()))],
                timeout=5,
            )
        except grpc.RpcError as error:
            info = _details_of(error).get("ErrorInfo")
            if info is not None and info.metadata.get("shard_id") == shard_id:  # type: ignore[attr-defined]
                return error
        time.sleep(0.05)
    raise AssertionError(f"no error naming {shard_id} within {timeout_s} s")
