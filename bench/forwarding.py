"""Forwarding throughput of the router (`grpc.aio`) versus a sync `grpc.server` forwarder.

Run from the repository root:  .venv/bin/python -m bench.forwarding [seconds [rounds]]   (defaults 5 and 3)

Each variant runs in its own process between the same echo upstream (a bytes echo on loopback, its
own process) and the same load generator (a `grpc.aio` client with 32 calls in flight, its own
process), so the figures differ only by the forwarder. "router" is the real router
(`shardrouter.router.server`).
The sync forwarder below is the router as it was before it moved to asyncio - a thread-pool
`grpc.server` with sync channels doing the same hot-path work (decode a copy to read the routing
account, look up the shard, filter metadata, pass the deadline, cancel the shard call when the
caller goes away, relay response bytes and trailers) - and exists only here, to be compared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from concurrent import futures
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    _GenericHandler = grpc.GenericRpcHandler[bytes, bytes]
    _MethodHandler = grpc.RpcMethodHandler[bytes, bytes]
else:
    _GenericHandler = grpc.GenericRpcHandler
    _MethodHandler = grpc.RpcMethodHandler

CONCURRENCY = 32
WARMUP_S = 1.0
SERVICE = "shardrouter.v1.TransferService"
METHOD = f"/{SERVICE}/GetBalance"
MAX_DEADLINE_S = 60.0
WORKERS = 32  # the router's default `workers`; the sync forwarder's thread pool


# --- echo upstream (stands in for a shard) -------------------------------------------------------------


def _run_echo(port_out: Queue[int], stop: Event) -> None:
    def echo(raw: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata((("x-shard", "echo"),))
        return raw

    class Handler(_GenericHandler):
        def service(self, details: grpc.HandlerCallDetails) -> _MethodHandler | None:
            return grpc.unary_unary_rpc_method_handler(echo)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((Handler(),))
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)


# --- the two forwarders ---------------------------------------------------------------------------------


def _run_router(map_path: str, port_out: Queue[int], stop: Event) -> None:
    """The real router (asyncio)."""
    from shardrouter.router.server import start_router
    from shardrouter.router.settings import RouterSettings

    async def main() -> None:
        router = await start_router(
            RouterSettings(
                listen="127.0.0.1:0",
                shard_map=map_path,
                dev_mode=True,
                metrics_port=0,
                log_level="WARNING",
                max_deadline_s=MAX_DEADLINE_S,
            )
        )
        port_out.put(router.port)
        await asyncio.to_thread(stop.wait)
        await router.stop(0)

    asyncio.run(main())


def _run_sync_forwarder(map_path: str, port_out: Queue[int], stop: Event) -> None:
    """The previous design: sync `grpc.server` with a thread pool, sync channels to the shards."""
    from shardrouter.core import grpcserver
    from shardrouter.core.shardmap import load_shard_map
    from shardrouter.router.channels import CHANNEL_OPTIONS
    from shardrouter.router.metadata import forwardable
    from shardrouter.router.routing import METHODS_BY_PATH, routing_account

    shard_map = load_shard_map(map_path)
    channels: dict[str, grpc.Channel] = {}

    @dataclass(frozen=True)
    class Relayed(grpc.Status):
        code: grpc.StatusCode
        details: str
        trailing_metadata: tuple[tuple[str, str | bytes], ...]

    def handler_for(path: str) -> _MethodHandler:
        method = METHODS_BY_PATH[path]

        def forward(raw: bytes, context: grpc.ServicerContext) -> bytes:
            account = routing_account(method, raw)
            shard = shard_map.shard_for(account)
            channel = channels.get(shard.address)
            if channel is None:
                channel = channels[shard.address] = grpc.insecure_channel(
                    shard.address, options=list(CHANNEL_OPTIONS)
                )
            remaining = context.time_remaining()
            timeout = MAX_DEADLINE_S if remaining is None or remaining > MAX_DEADLINE_S else remaining
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None).future(
                raw, timeout=timeout, metadata=tuple(forwardable(context.invocation_metadata()))
            )
            if not context.add_callback(call.cancel):
                call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves Future.cancel untyped
            with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
                call.result()
            initial = forwardable(call.initial_metadata() or ())
            if initial:
                context.send_initial_metadata(tuple(initial))
            if call.code() is not grpc.StatusCode.OK:
                context.abort_with_status(
                    Relayed(call.code(), call.details() or "", tuple(call.trailing_metadata() or ()))
                )
            context.set_trailing_metadata(tuple(call.trailing_metadata() or ()))
            return call.result()  # type: ignore[no-any-return]

        return grpc.unary_unary_rpc_method_handler(forward)

    handlers = {path: handler_for(path) for path in METHODS_BY_PATH}

    class Handler(_GenericHandler):
        def service(self, details: grpc.HandlerCallDetails) -> _MethodHandler | None:
            return handlers.get(details.method)

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=WORKERS),
        options=grpcserver.server_options(
            max_message_bytes=64 * 1024, max_metadata_bytes=16 * 1024, max_streams=WORKERS * 4
        ),
        maximum_concurrent_rpcs=WORKERS * 8,
    )
    server.add_generic_rpc_handlers((Handler(),))
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)


# --- load generator -------------------------------------------------------------------------------------


def _run_load(port: int, seconds: float, result_out: Queue[tuple[float, int]]) -> None:
    from shardrouter.v1 import transfer_pb2

    request = transfer_pb2.GetBalanceRequest(account_id="acct-bench").SerializeToString()
    metadata = (
        ("idempotency-key", "0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"),
        ("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
    )

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD, None, None)
            await call(request, timeout=5, metadata=metadata)
            done = 0
            errors = 0
            end = time.monotonic() + WARMUP_S + seconds
            start_count = time.monotonic() + WARMUP_S

            async def worker() -> None:
                nonlocal done, errors
                while (now := time.monotonic()) < end:
                    try:
                        reply = await call(request, timeout=5, metadata=metadata)
                        ok = reply == request
                    except grpc.aio.AioRpcError:
                        ok = False
                    if now >= start_count:
                        if ok:
                            done += 1
                        else:
                            errors += 1

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            result_out.put((done / seconds, errors))

    asyncio.run(main())


def _measure(port: int, seconds: float, ctx: SpawnContext) -> tuple[float, int]:
    out = ctx.Queue()
    load = ctx.Process(target=_run_load, args=(port, seconds, out))
    load.start()
    rps, errors = out.get(timeout=seconds + 60)
    load.join(10)
    return rps, errors


def main(argv: list[str]) -> int:
    """Measure each variant `rounds` times for `seconds` each, alternating them, and print the medians."""
    seconds = float(argv[0]) if argv else 5.0
    rounds = int(argv[1]) if len(argv) > 1 else 3
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ports = ctx.Queue()
    echo = ctx.Process(target=_run_echo, args=(ports, stop), daemon=True)
    echo.start()
    echo_port = ports.get(timeout=30)
    variants = (
        ("router (grpc.aio)", _run_router),
        ("sync grpc.server forwarder", _run_sync_forwarder),
    )
    results: dict[str, list[tuple[float, int]]] = {"direct to echo (baseline)": []}
    results.update({name: [] for name, _ in variants})
    with tempfile.TemporaryDirectory() as tmp:
        map_path = Path(tmp) / "shard-map.json"
        map_path.write_text(
            json.dumps(
                {
                    "slots": 16384,
                    "shards": [
                        {"id": "echo-0", "address": f"127.0.0.1:{echo_port}", "slot_ranges": [[0, 16383]]}
                    ],
                }
            )
        )
        # Rounds alternate the variants, so drift in the machine's load hits both alike.
        for _ in range(rounds):
            results["direct to echo (baseline)"].append(_measure(echo_port, seconds, ctx))
            for name, target in variants:
                router_stop = ctx.Event()
                router = ctx.Process(target=target, args=(str(map_path), ports, router_stop), daemon=True)
                router.start()
                port = ports.get(timeout=30)
                results[name].append(_measure(port, seconds, ctx))
                router_stop.set()
                router.join(10)
    stop.set()
    echo.join(10)
    print(
        f"unary GetBalance forwarding, {CONCURRENCY} calls in flight, {rounds} rounds x {seconds:.0f} s "
        f"per variant, {mp.cpu_count()} CPUs"
    )
    for name, runs in results.items():
        figures = sorted(rps for rps, _ in runs)
        errors = sum(e for _, e in runs)
        print(
            f"  {name:28s} median {statistics.median(figures):7.0f} rps  "
            f"(runs: {', '.join(f'{r:.0f}' for r in figures)})  errors={errors}"
        )
    aio, sync = (statistics.median(rps for rps, _ in results[name]) for name, _ in variants)
    print(f"  router (grpc.aio) / sync forwarder: {aio / sync:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
