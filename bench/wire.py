"""A counting TCP proxy between one client (a shard daemon) and PostgreSQL: round trips on the wire.

It forwards bytes unchanged both ways and parses only the *frontend* stream (client to server) of the
PostgreSQL protocol: after the untyped startup packet (4-byte length, then the payload; an
SSLRequest or GSSENCRequest is followed by another startup packet, so the harness starts the
client with `sslmode=disable` and none is sent), every message is 1 type byte, a 4-byte big-endian
length that counts itself, and the payload.

A client waits for the server only after it sent a Sync ('S'), a Flush ('H') or a simple Query
('Q'): before one of those the server has nothing it must answer (extended-protocol messages are
buffered until Sync or Flush). A Sync or Flush that follows another with no message between them
asks for nothing new (psycopg ends a pipeline with a Sync and then a Flush), so it is not counted.
The count is the round trips the client could have waited for: exact for a client that waits after
each, an upper bound for one that sends several requests before it reads. Parse,
Bind and Execute ('P', 'B', 'E') are counted too, and the bytes each way.

The counts are kept in a `WireCounter` (thread-safe: `snapshot()`, `reset()`); the proxy runs its
own asyncio loop in a thread and `close()` stops it, closing every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

#: Request codes of the untyped packets that are followed by another startup packet.
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
#: Message types after which a client may wait for the server.
WAIT_POINTS = {ord("S"): "sync", ord("H"): "flush", ord("Q"): "query"}
COUNTED = {**WAIT_POINTS, ord("P"): "parse", ord("B"): "bind", ord("E"): "execute", ord("X"): "terminate"}
FIELDS = (
    "round_trips",
    "sync",
    "flush",
    "query",
    "parse",
    "bind",
    "execute",
    "terminate",
    "messages",
    "connections",
    "bytes_up",
    "bytes_down",
)


class WireCounter:
    """Message counts summed over every connection of one proxy; safe to read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FIELDS, 0)

    def add(self, counts: dict[str, int]) -> None:
        """Add a batch of counts (one parsed chunk)."""
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        """The counts so far."""
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._counts = dict.fromkeys(FIELDS, 0)


@dataclass
class FrontendParser:
    """The client-to-server stream cut into messages, counting their types; fed chunk by chunk.

    Only message headers are kept across chunks; payloads are skipped, never copied.
    """

    startup: bool = True
    #: Payload bytes still to skip of the current message.
    skip: int = 0
    header: bytearray = field(default_factory=bytearray)
    #: Messages since the last Sync or Flush (a wait point after none asks for nothing new).
    since_wait_point: int = 0

    def feed(self, data: bytes) -> dict[str, int]:
        """Counts of the messages whose header completed in `data`."""
        counts: dict[str, int] = {"messages": 0, "bytes_up": len(data)}
        i, n = 0, len(data)
        while i < n:
            if self.skip:
                step = min(self.skip, n - i)
                self.skip -= step
                i += step
                continue
            need = 8 if self.startup else 5
            take = min(need - len(self.header), n - i)
            self.header += data[i : i + take]
            i += take
            if len(self.header) < need:
                break
            if self.startup:
                length = int.from_bytes(self.header[0:4], "big")
                code = int.from_bytes(self.header[4:8], "big")
                # After an SSL/GSS request the client sends its startup packet (again untyped).
                self.startup = code in (SSL_REQUEST, GSSENC_REQUEST)
                self.skip = max(0, length - 8)
            else:
                kind = self.header[0]
                length = int.from_bytes(self.header[1:5], "big")
                self.skip = max(0, length - 4)
                name = COUNTED.get(kind)
                if name is not None:
                    counts[name] = counts.get(name, 0) + 1
                if kind == ord("Q") or (kind in WAIT_POINTS and self.since_wait_point):
                    counts["round_trips"] = counts.get("round_trips", 0) + 1
                self.since_wait_point = 0 if kind in WAIT_POINTS else self.since_wait_point + 1
            counts["messages"] += 1
            self.header.clear()
        return counts


class WireProxy:
    """127.0.0.1:<port> -> upstream host:port, counting the frontend messages (see the module doc)."""

    def __init__(self, upstream_host: str, upstream_port: int, name: str = "wire") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.name = name
        self.counter = WireCounter()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"bench-{name}", daemon=True)
        self._closed = False

    def start(self) -> WireProxy:
        """Listen on a free loopback port (`port`) and serve in a background thread."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = future.result(timeout=10)
        return self

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(client_writer)
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            self._writers.discard(client_writer)
            self._tasks.discard(task)
            return
        self._writers.add(server_writer)
        self.counter.add({"connections": 1})
        parser = FrontendParser()
        try:
            await asyncio.gather(
                self._pipe(client_reader, server_writer, parser),
                self._pipe(server_reader, client_writer, None),
            )
        finally:
            for writer in (client_writer, server_writer):
                writer.close()
                self._writers.discard(writer)
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, parser: FrontendParser | None
    ) -> None:
        try:
            while data := await reader.read(65536):
                # Counted before forwarding (a few microseconds): once the peer has the bytes,
                # a snapshot includes them.
                if parser is not None:
                    self.counter.add(parser.feed(data))
                else:
                    self.counter.add({"bytes_down": len(data)})
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side ended: end the other (PostgreSQL connections do not half-close).
            with contextlib.suppress(Exception):
                writer.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def close(self) -> None:
        """Stop listening, close every connection and stop the loop's thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_running():
            self._loop.close()
