"""The shared policy of every client of the shard daemons: options, rotation timing, "not reached"."""

from __future__ import annotations

import uuid
from concurrent import futures

import grpc

from shardrouter.core.channels import (
    CHANNEL_OPTIONS,
    CertificateRotation,
    channel_options,
    retire_after_s,
    unreached,
)
from shardrouter.core.errors import Reason, Unavailable, to_grpc_status
from shardrouter.core.shardmap import even_shard_map
from shardrouter.shardd.relay import ShardClients
from tests.helpers import make_settings


def test_options_are_the_shared_ones_plus_message_sizes_and_a_local_pool_for_several_connections() -> None:
    one = dict(channel_options(max_message_bytes=1024))
    assert set(CHANNEL_OPTIONS) <= set(one.items())
    assert one["grpc.keepalive_permit_without_calls"] == 1
    assert one["grpc.max_reconnect_backoff_ms"] == 1_000
    assert one["grpc.max_send_message_length"] == 1024
    assert one["grpc.max_receive_message_length"] == 4 * 1024 * 1024
    assert "grpc.use_local_subchannel_pool" not in one
    assert dict(channel_options(connections=2))["grpc.use_local_subchannel_pool"] == 1
    assert retire_after_s(5.0) == 6.0


def test_only_an_unavailable_without_our_error_info_is_not_reached() -> None:
    ours = to_grpc_status(Unavailable("database down", reason=Reason.DATABASE_UNAVAILABLE))
    assert unreached(grpc.StatusCode.UNAVAILABLE, ())
    assert unreached(grpc.StatusCode.UNAVAILABLE, (("grpc-status-details-bin", b"\xff\xff"),))
    assert not unreached(grpc.StatusCode.UNAVAILABLE, tuple(ours.trailing_metadata))
    assert not unreached(grpc.StatusCode.DEADLINE_EXCEEDED, ())


class _Files:
    """A stand-in for `tls.ClientCertificateFiles` that counts how often it is asked."""

    def __init__(self) -> None:
        self.credentials = object()
        self.looks = 0
        self.next: object | None = None

    def changed(self) -> object | None:
        self.looks += 1
        return self.next


def test_certificate_files_are_looked_at_no_more_often_than_the_interval() -> None:
    now = [100.0]
    files = _Files()
    rotation = CertificateRotation(files, 1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert rotation.renewed() is None and files.looks == 0
    assert rotation.wait_s() == 1.0
    now[0] += 1.0
    files.next = renewed = object()
    assert rotation.renewed() is renewed and files.looks == 1
    files.next = None
    now[0] += 0.5
    assert rotation.renewed() is None and files.looks == 1
    assert CertificateRotation(None).renewed() is None
    assert CertificateRotation(None).credentials is None


class _Daemon(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """A daemon that answers every call with `status` (None: OK), counting the calls."""

    def __init__(self, status: grpc.Status | None) -> None:
        self.status = status
        self.calls = 0

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:  # type: ignore[type-arg]
        def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.calls += 1
            if self.status is not None:
                context.abort_with_status(self.status)
            return b""

        return grpc.unary_unary_rpc_method_handler(answer)


def _serve(daemon: _Daemon) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((daemon,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _call_twice(addresses: list[str]) -> list[grpc.StatusCode]:
    shard_map = even_shard_map({"shard-1": addresses})
    clients = ShardClients(make_settings("postgresql://unused"), lambda: shard_map)
    try:
        return [clients.call("shard-1", "CreditTransfer", b"", uuid.uuid4(), 5.0)[0] for _ in range(2)]
    finally:
        clients.close()


def test_the_relay_goes_on_to_the_next_daemon_when_one_was_not_reached() -> None:
    daemon = _Daemon(None)
    server, address = _serve(daemon)
    closed = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    closed_port = closed.add_insecure_port("127.0.0.1:0")  # bound, never started: refused
    try:
        assert _call_twice([f"127.0.0.1:{closed_port}", address]) == [grpc.StatusCode.OK] * 2
    finally:
        server.stop(0)
    assert daemon.calls == 2


def test_a_daemons_own_unavailable_is_an_answer_the_relay_does_not_send_on() -> None:
    """Before, the relay sent the call on to the shard's other daemons (same database) at once."""
    status = to_grpc_status(Unavailable("database down", reason=Reason.DATABASE_UNAVAILABLE))
    daemons = [_Daemon(status), _Daemon(status)]
    served = [_serve(d) for d in daemons]
    try:
        assert _call_twice([address for _, address in served]) == [grpc.StatusCode.UNAVAILABLE] * 2
    finally:
        for server, _ in served:
            server.stop(0)
    assert [d.calls for d in daemons] == [1, 1]  # one call each, in turn; none sent on
