"""The control socket of a running `shard-router dev up`: how other commands ask that process to
change its cluster (`dev add-shard`), so the processes they add belong to it and stop with it.

A Unix socket in the data directory, one JSON request line and one JSON answer line per
connection. A socket, not a request file: a refused connection says at once that no cluster is
running (a stale file from a killed `dev up` refuses too), and a `dev up` that dies mid-request
closes the connection, so the asking command never waits for an answer that cannot come. Requests
are served one at a time, in the order they arrive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Its name in the data directory.
SOCKET_NAME = "dev-up.sock"
#: The longest path a Unix socket may have (sun_path is 108 bytes with its terminating NUL).
_MAX_SOCKET_PATH = 107
_ACCEPT_POLL_S = 0.2

Answer = dict[str, Any]
Handler = Callable[[Mapping[str, Any]], Answer]


class ControlError(RuntimeError):
    """The control socket cannot be served or asked; the message says why and what to do."""


class NoClusterRunning(ControlError):
    """Nothing serves the control socket of this data directory: no `dev up` runs on it."""


def socket_path(data_dir: Path) -> Path:
    """Where a `dev up` with this data directory listens."""
    return data_dir / SOCKET_NAME


def cluster_running(data_dir: Path) -> bool:
    """Whether a `dev up` serves this data directory's control socket right now."""
    try:
        with _connected(socket_path(data_dir), timeout_s=2.0):
            return True
    except (OSError, ControlError):
        return False


class ControlServer:
    """Serves one data directory's control socket on a daemon thread until `stop`.

    `handlers` maps a request's name to the function that answers it (run on the serving thread,
    one at a time); an exception it raises is answered as {"ok": false, "error": message}.
    """

    def __init__(self, data_dir: Path, handlers: Mapping[str, Handler]) -> None:
        self.path = socket_path(data_dir)
        self._handlers = dict(handlers)
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the socket (replacing a stale one) and serve; ControlError if another `dev up`
        serves it or the path is too long for a Unix socket."""
        _check_length(self.path)
        if self.path.exists() or self.path.is_symlink():
            if cluster_running(self.path.parent):
                raise ControlError(f"a local cluster is already running with data in {self.path.parent}")
            self.path.unlink()  # left by a `dev up` that was killed
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)  # it starts processes: only this user may ask
            listener.listen()
            listener.settimeout(_ACCEPT_POLL_S)  # accept wakes up to see `stop`
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._thread = threading.Thread(target=self._serve, name="dev-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop taking requests and remove the socket; a request being answered finishes first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _serve(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                log.exception("control socket failed; dev add-shard is not available any more")
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)  # the request line is sent at once; answering may take long
        try:
            request = json.loads(_read_line(conn))
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
        except (OSError, ValueError) as exc:
            _send(conn, {"ok": False, "error": f"bad request: {exc}"})
            return
        handler = self._handlers.get(str(request.get("request")))
        if handler is None:
            _send(conn, {"ok": False, "error": f"unknown request {request.get('request')!r}"})
            return
        try:
            answer: Answer = {"ok": True, **handler(request)}
        except ValueError as exc:  # a request that cannot be done as asked: the asker's mistake
            log.warning("control request %s refused: %s", request.get("request"), exc)
            answer = {"ok": False, "error": str(exc) or type(exc).__name__}
        except Exception as exc:  # the asking command shows it; dev up keeps running
            log.exception("control request %s failed", request.get("request"))
            answer = {"ok": False, "error": str(exc) or type(exc).__name__}
        _send(conn, answer)


def ask(data_dir: Path, request: Mapping[str, Any], *, timeout_s: float) -> Answer:
    """Send one request to the `dev up` of this data directory and wait for its answer.

    NoClusterRunning when no `dev up` serves it; ControlError when it stops before answering, does
    not answer within `timeout_s`, or refuses (its message).
    """
    path = socket_path(data_dir)
    with _connected(path, timeout_s=timeout_s) as conn:
        _send(conn, dict(request))
        try:
            line = _read_line(conn)
        except TimeoutError:
            raise ControlError(f"the cluster did not answer within {timeout_s:.0f} s") from None
    if not line:
        raise ControlError("the cluster stopped before it answered")
    try:
        answer = json.loads(line)
    except ValueError as exc:
        raise ControlError(f"the cluster's answer is not JSON: {exc}") from None
    if not isinstance(answer, dict) or not answer.get("ok"):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise ControlError(f"the cluster refused: {error}")
    return answer


@contextlib.contextmanager
def _connected(path: Path, *, timeout_s: float) -> Iterator[socket.socket]:
    _check_length(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout_s)
    try:
        conn.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        raise NoClusterRunning(
            f"no local cluster is running with data in {path.parent} "
            "(start one with `shard-router dev up`, or name its --data-dir)"
        ) from None
    except BaseException:
        conn.close()
        raise
    with conn:
        yield conn


def _check_length(path: Path) -> None:
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ControlError(
            f"the data directory's path is too long for its control socket {path} "
            f"(a Unix socket path has at most {_MAX_SOCKET_PATH} bytes): use a shorter --data-dir"
        )


def _send(conn: socket.socket, message: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the asker left: nothing to tell
        conn.sendall(json.dumps(message).encode() + b"\n")


def _read_line(conn: socket.socket) -> str:
    """One line (without its newline); "" when the other side closed first."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return ""
        data += chunk
    return data.decode()


__all__ = [
    "SOCKET_NAME",
    "Answer",
    "ControlError",
    "ControlServer",
    "Handler",
    "NoClusterRunning",
    "ask",
    "cluster_running",
    "socket_path",
]
