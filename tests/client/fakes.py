"""A scripted TransferService on 127.0.0.1: answers each call from a list of actions, records calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from shardrouter.core.errors import ERROR_DOMAIN, RETRY_PUSHBACK_TRAILER
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

Action = Callable[[Any, grpc.ServicerContext], Any]
FIXED_TRANSFER_ID = "0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"


@dataclass
class RecordedCall:
    method: str
    metadata: dict[str, str]
    request: Any
    at: float  # time.monotonic() when the server saw it


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def ok(replayed: bool = False) -> Action:
    """Answer OK with a fixed response (and optionally the replay trailer)."""

    def act(request: Any, context: grpc.ServicerContext) -> Any:
        if replayed:
            context.set_trailing_metadata((("idempotency-replayed", "true"),))
        if isinstance(request, transfer_pb2.TransferRequest):
            return transfer_pb2.TransferResponse(
                transfer=transfer_pb2.Transfer(
                    transfer_id=FIXED_TRANSFER_ID,
                    source_account_id=request.source_account_id,
                    destination_account_id=request.destination_account_id,
                    amount=request.amount,
                    state=transfer_pb2.TRANSFER_STATE_COMPLETED,
                )
            )
        return transfer_pb2.DepositResponse(entry_id=FIXED_TRANSFER_ID, balance=request.amount)

    return act


def fail(
    code: grpc.StatusCode,
    message: str = "scripted failure",
    *,
    reason: str | None = None,
    retry_ms: int | None = None,
    pushback_ms: int | None = None,
) -> Action:
    """Answer with a rich status: ErrorInfo (if reason), RetryInfo (if retry_ms), pushback trailer."""

    def act(request: Any, context: grpc.ServicerContext) -> Any:
        status = status_pb2.Status(code=code.value[0], message=message)
        if reason:
            status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN))
        if retry_ms is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(retry_ms)
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        base = rpc_status.to_status(status)
        trailers = tuple(base.trailing_metadata)
        if pushback_ms is not None:
            trailers += ((RETRY_PUSHBACK_TRAILER, str(pushback_ms)),)
        context.abort_with_status(_Status(base.code, base.details, trailers))

    return act


def sleep_then(seconds: float, action: Action) -> Action:
    """Sleep (past the caller's deadline, typically), then act."""

    def act(request: Any, context: grpc.ServicerContext) -> Any:
        time.sleep(seconds)
        return action(request, context)

    return act


@dataclass
class ScriptedService(transfer_pb2_grpc.TransferServiceServicer):
    """Answers the n-th mutating call with script[n] (the last action repeats)."""

    script: list[Action]
    calls: list[RecordedCall] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _answer(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        with self.lock:
            index = len(self.calls)
            self.calls.append(
                RecordedCall(
                    method,
                    {k: v for k, v in context.invocation_metadata() if isinstance(v, str)},
                    request,
                    time.monotonic(),
                )
            )
        action = self.script[min(index, len(self.script) - 1)]
        return action(request, context)

    def Transfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._answer("Transfer", request, context)

    def Deposit(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._answer("Deposit", request, context)

    def GetBalance(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    def GetTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    @property
    def keys(self) -> list[str]:
        return [c.metadata.get("idempotency-key", "") for c in self.calls]


@contextmanager
def scripted_server(*script: Action) -> Iterator[tuple[str, ScriptedService]]:
    """A TransferService on 127.0.0.1:<free port> playing `script`; yields (address, service)."""
    service = ScriptedService(list(script))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)])
    transfer_pb2_grpc.add_TransferServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", service
    finally:
        server.stop(0).wait()
