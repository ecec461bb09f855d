"""An in-test stand-in for a shard: a real gRPC server on loopback that records what reaches it.

It serves every TransferService method as bytes in, bytes out; a test sets `behaviour` to decide
the answer (default: echo the request bytes back) and reads `calls` to see what the router sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc


@dataclass
class SeenCall:
    """One call as the fake shard received it."""

    method: str
    request: bytes
    metadata: tuple[tuple[str, str | bytes], ...]
    time_remaining: float | None
    peer_common_name: str | None = None


Behaviour = Callable[[SeenCall, grpc.ServicerContext], bytes]


def echo(call: SeenCall, context: grpc.ServicerContext) -> bytes:
    return call.request


@dataclass
class FakeShard:
    """A running fake shard."""

    server: grpc.Server
    port: int
    behaviour: Behaviour = echo
    calls: list[SeenCall] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def reset(self, behaviour: Behaviour = echo) -> None:
        with self.lock:
            self.calls.clear()
            self.behaviour = behaviour

    def stop(self) -> None:
        self.server.stop(0).wait(5)


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, owner: list[FakeShard]) -> None:
        self._owner = owner

    def service(self, details: grpc.HandlerCallDetails):
        if not details.method.startswith("/shardrouter.v1.TransferService/"):
            return None
        method = details.method

        def behave(raw: bytes, context: grpc.ServicerContext) -> bytes:
            shard = self._owner[0]
            names = context.auth_context().get("x509_common_name")
            seen = SeenCall(
                method=method,
                request=raw,
                metadata=tuple((k, v) for k, v in context.invocation_metadata()),
                time_remaining=context.time_remaining(),
                peer_common_name=names[0].decode() if names else None,
            )
            with shard.lock:
                shard.calls.append(seen)
                behaviour = shard.behaviour
            return behaviour(seen, context)

        return grpc.unary_unary_rpc_method_handler(behave)


def start_fake_shard(
    port: int = 0, credentials: grpc.ServerCredentials | None = None, workers: int = 16
) -> FakeShard:
    """Start a fake shard on 127.0.0.1 (a free port unless given)."""
    holder: list[FakeShard] = []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        options=[("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((_Handler(holder),))
    address = f"127.0.0.1:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    assert bound, f"cannot bind {address}"
    fake = FakeShard(server=server, port=bound)
    holder.append(fake)
    server.start()
    return fake


def single_shard_map(address: str) -> dict[str, object]:
    """A shard map document sending every slot to one shard."""
    return {"slots": 16384, "shards": [{"id": "fake-0", "address": address, "slot_ranges": [[0, 16383]]}]}


__all__ = ["FakeShard", "SeenCall", "echo", "single_shard_map", "start_fake_shard"]
