"""The counting proxy of the bench (bench/wire.py): the frontend parser and the proxy itself."""

from __future__ import annotations

import socket
import struct
import threading

from bench.wire import GSSENC_REQUEST, SSL_REQUEST, FrontendParser, WireProxy


def _startup() -> bytes:
    payload = struct.pack("!I", 196608) + b"user\0postgres\0database\0shard_a\0\0"
    return struct.pack("!I", 4 + len(payload)) + payload


def _message(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + struct.pack("!I", 4 + len(payload)) + payload


def _extended_query() -> bytes:
    return b"".join(
        [
            _message(b"P", b"\0SELECT 1\0\0\0"),
            _message(b"B", b"\0\0" + b"\0" * 6),
            _message(b"D", b"P\0"),
            _message(b"E", b"\0\0\0\0\0"),
            _message(b"S"),
        ]
    )


STREAM = (
    _startup()
    + _message(b"Q", b"BEGIN\0")
    + _extended_query()
    + _message(b"B", b"stmt\0" + b"x" * 70000)  # a payload longer than one read
    + _message(b"E", b"\0\0\0\0\0")
    + _message(b"H")
    + _message(b"X")
)


def _expect(counts: dict[str, int]) -> None:
    assert counts["sync"] == 1 and counts["flush"] == 1 and counts["query"] == 1, counts
    assert counts["parse"] == 1 and counts["bind"] == 2 and counts["execute"] == 2, counts
    assert counts["terminate"] == 1 and counts["messages"] == 11, counts


def _feed(parser: FrontendParser, data: bytes, step: int) -> dict[str, int]:
    total: dict[str, int] = {}
    for i in range(0, len(data), step):
        for name, n in parser.feed(data[i : i + step]).items():
            total[name] = total.get(name, 0) + n
    return total


def test_the_parser_counts_messages_however_the_stream_is_cut() -> None:
    for step in (1, 3, 5, 7, 4096, len(STREAM)):
        counts = _feed(FrontendParser(), STREAM, step)
        _expect(counts)
        assert counts["bytes_up"] == len(STREAM)


def test_an_ssl_or_gss_request_is_followed_by_the_startup_packet() -> None:
    for code in (SSL_REQUEST, GSSENC_REQUEST):
        request = struct.pack("!II", 8, code)
        counts = _feed(FrontendParser(), request + STREAM, 2)
        _expect(counts | {"messages": counts["messages"] - 1})


def test_the_proxy_forwards_bytes_unchanged_and_counts_the_frontend() -> None:
    upstream = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def serve() -> None:  # reads the frontend stream, answers a fixed reply, closes on EOF
        conn, _ = upstream.accept()
        with conn:
            while data := conn.recv(65536):
                received.extend(data)
                if received.endswith(_message(b"H")):
                    conn.sendall(b"reply")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    proxy = WireProxy("127.0.0.1", upstream.getsockname()[1], "test").start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
            client.sendall(STREAM[: -len(_message(b"X"))])
            assert client.recv(5) == b"reply"
            client.sendall(_message(b"X"))
        server.join(5)
        assert bytes(received) == STREAM
        counts = proxy.counter.snapshot()
        _expect(counts)
        assert counts["round_trips"] == 3 and counts["connections"] == 1, counts
        assert counts["bytes_up"] == len(STREAM) and counts["bytes_down"] == 5, counts
        proxy.counter.reset()
        assert proxy.counter.snapshot()["round_trips"] == 0
    finally:
        proxy.close()
        upstream.close()
    assert not proxy._thread.is_alive()


def test_a_wait_point_right_after_another_is_not_a_round_trip() -> None:
    """psycopg ends a pipeline with a Sync and then a Flush: the Flush asks for nothing new."""
    stream = (
        _startup()
        + _message(b"B", b"\0\0" + b"\0" * 6)
        + _message(b"E", b"\0\0\0\0\0")
        + _message(b"H")  # a fetch inside the pipeline: one round trip
        + _message(b"B", b"\0\0" + b"\0" * 6)
        + _message(b"E", b"\0\0\0\0\0")
        + _message(b"S")  # the pipeline's end: one round trip
        + _message(b"H")  # ...and its trailing flush: none
        + _message(b"S")  # nor a second Sync with nothing before it
    )
    counts = _feed(FrontendParser(), stream, 3)
    assert counts["round_trips"] == 2 and counts["sync"] == 2 and counts["flush"] == 2, counts
