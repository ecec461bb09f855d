"""A fake Kubernetes API server for tests: a real HTTP server on 127.0.0.1 serving just enough of the
ConfigMap API for the `kubernetes` client: GET one ConfigMap, PUT one with the resourceVersion
precondition (409 on a mismatch), and a watch of one ConfigMap (`?watch=true&fieldSelector=
metadata.name=X&resourceVersion=R`) streaming JSON lines, with a 410 ERROR event for a version older
than what it keeps. It can drop every open watch, forget its history (so old versions get 410), and
restart on the same port, so tests can break the watchers' connections on purpose.

`write_kubeconfig` writes a kubeconfig that points the client at it (`KUBECONFIG`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

_PREFIX = "/api/v1/namespaces/"


class FakeKube:
    """The fake API server's state (kept across `restart`) and its HTTP server."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._rv = 100
        #: (resourceVersion, event type, object) of every change, oldest first.
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        #: Watches from a version below this one are answered 410 Gone.
        self._oldest = 0
        self._drops = 0
        self._abrupt_drops = 0
        self.gone_answered = 0
        self.port = 0
        self.watches_opened = 0
        self.puts = 0
        self.conflicts = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    # --- the server -----------------------------------------------------------------------------

    def start(self) -> None:
        """Serve (on the port it had before, after a `stop`)."""
        handler = type("Handler", (_Handler,), {"fake": self})
        server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and end every open watch."""
        with self._cond:
            self._drops += 1  # ends the open watches even if a restart follows at once
            self._abrupt_drops += 1
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)

    def restart(self) -> None:
        """Stop, then serve again on the same port with the same ConfigMaps."""
        self.stop()
        self.start()

    # --- what tests change ----------------------------------------------------------------------

    def put_configmap(
        self, namespace: str, name: str, data: Mapping[str, str], *, labels: Mapping[str, str] | None = None
    ) -> str:
        """Create or replace a ConfigMap unconditionally (as `kubectl apply` would); its new version."""
        with self._cond:
            existing = self._objects.get((namespace, name))
            metadata = dict(existing["metadata"]) if existing else {"name": name, "namespace": namespace}
            if labels is not None:
                metadata["labels"] = dict(labels)
            return self._store(namespace, name, {"metadata": metadata, "data": dict(data)})

    def configmap(self, namespace: str, name: str) -> dict[str, Any]:
        """The stored object."""
        with self._cond:
            return json.loads(json.dumps(self._objects[(namespace, name)]))

    def forget_history(self) -> None:
        """Compact: a watch from any version before the current one is answered 410 Gone."""
        with self._cond:
            self._history.clear()
            self._oldest = self._rv

    def replace_unseen(self, namespace: str, name: str, data: Mapping[str, str]) -> str:
        """Change a ConfigMap, then compact and drop every watch before any of them sends the change:
        a watcher must come back with a version now too old (410) and read the ConfigMap again."""
        with self._cond:
            version = self.put_configmap(namespace, name, data)
            self.forget_history()
            self.drop_watches(clean=True)
            return version

    @property
    def abrupt_drop_count(self) -> int:
        """How many times the watches were cut off mid-stream (or the server stopped)."""
        with self._cond:
            return self._abrupt_drops

    def drop_watches(self, *, clean: bool = False) -> None:
        """End every open watch: cut off mid-stream (as an API server restart or a load balancer
        would), or `clean`: the stream's proper end, as when the watch's timeout runs out."""
        with self._cond:
            self._drops += 1
            if not clean:
                self._abrupt_drops += 1
            self._cond.notify_all()

    def wait_watches(self, count: int, timeout_s: float = 5.0) -> None:
        """Wait until `count` watches were opened in all (AssertionError after `timeout_s`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.watches_opened >= count, timeout_s):
                raise AssertionError(f"only {self.watches_opened} watches opened, wanted {count}")

    # --- the API --------------------------------------------------------------------------------

    def _store(self, namespace: str, name: str, body: Mapping[str, Any]) -> str:
        """Store `body` as the ConfigMap's next version; call with the condition held."""
        self._rv += 1
        existing = self._objects.get((namespace, name))
        metadata = {
            **{k: v for k, v in (body.get("metadata") or {}).items() if k in ("labels", "annotations")},
            "name": name,
            "namespace": namespace,
            "uid": existing["metadata"]["uid"] if existing else f"uid-{namespace}-{name}",
            "resourceVersion": str(self._rv),
            "creationTimestamp": "2026-01-01T00:00:00Z",
        }
        obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}
        for key in ("data", "binaryData"):
            if body.get(key):
                obj[key] = dict(body[key])
        self._objects[(namespace, name)] = obj
        self._history.append((self._rv, "MODIFIED" if existing else "ADDED", obj))
        self._cond.notify_all()
        return str(self._rv)

    def get(self, namespace: str, name: str) -> tuple[int, dict[str, Any]]:
        with self._cond:
            obj = self._objects.get((namespace, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'configmaps "{name}" not found')
            return 200, obj

    def put(self, namespace: str, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._cond:
            self.puts += 1
            obj = self._objects.get((namespace, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'configmaps "{name}" not found')
            wanted = (body.get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != obj["metadata"]["resourceVersion"]:
                self.conflicts += 1
                return 409, _status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on configmaps "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            self._store(namespace, name, body)
            return 200, self._objects[(namespace, name)]

    def watch_events(
        self, namespace: str, name: str, since: int, timeout_s: float
    ) -> Iterator[dict[str, Any]]:
        """The events after `since`, then each new one until the timeout, a drop or a stop."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self.watches_opened += 1
            self._cond.notify_all()
            drops = self._drops
            if since < self._oldest:
                self.gone_answered += 1
                yield {
                    "type": "ERROR",
                    "object": _status(410, "Expired", f"too old resource version: {since}"),
                }
                return
        sent = since
        while True:
            with self._cond:
                pending = [
                    (rv, kind, obj)
                    for rv, kind, obj in self._history
                    if rv > sent
                    and obj["metadata"]["namespace"] == namespace
                    and obj["metadata"]["name"] == name
                ]
                if not pending:
                    if self._drops != drops or time.monotonic() >= deadline:
                        return
                    self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
                    if self._drops != drops:
                        return
                    continue
            for rv, kind, obj in pending:
                sent = rv
                yield {"type": kind, "object": obj}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _route(self) -> tuple[str, str | None, dict[str, list[str]]]:
        parsed = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parsed.query)
        if not parsed.path.startswith(_PREFIX):
            return "", None, query
        parts = parsed.path[len(_PREFIX) :].split("/")
        if len(parts) == 2 and parts[1] == "configmaps":
            return parts[0], None, query
        if len(parts) == 3 and parts[1] == "configmaps":
            return parts[0], parts[2], query
        return "", None, query

    def _answer(self, code: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        namespace, name, query = self._route()
        if not namespace:
            self._answer(404, _status(404, "NotFound", "the fake serves configmaps only"))
            return
        if name is not None:
            self._answer(*self.fake.get(namespace, name))
            return
        # The API server parses booleans as Go's strconv.ParseBool does; clients before 37 send "True".
        if query.get("watch", [""])[0] not in ("1", "t", "T", "TRUE", "true", "True"):
            self._answer(400, _status(400, "BadRequest", "the fake lists only with watch"))
            return
        selector = query.get("fieldSelector", [""])[0]
        if not selector.startswith("metadata.name="):
            self._answer(400, _status(400, "BadRequest", "the fake watches one configmap by fieldSelector"))
            return
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout_s = float(query.get("timeoutSeconds", ["60"])[0])
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        # Chunked, as the API server streams a watch: the client reads each event as its chunk ends.
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        drops = self.fake.abrupt_drop_count
        with contextlib.suppress(OSError):
            for event in self.fake.watch_events(namespace, selector.split("=", 1)[1], since, timeout_s):
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            if self.fake.abrupt_drop_count == drops:  # a clean end of the stream
                self.wfile.write(b"0\r\n\r\n")
            # Dropped: the connection just closes mid-stream, as when a server goes away.

    def do_PUT(self) -> None:
        namespace, name, _query = self._route()
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if not namespace or name is None:
            self._answer(404, _status(404, "NotFound", "the fake serves configmaps only"))
            return
        self._answer(*self.fake.put(namespace, name, body))


def write_kubeconfig(path: Path, server_url: str, namespace: str = "default") -> Path:
    """A kubeconfig whose current context is the fake API server (token auth, plain HTTP)."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server_url}}],
                "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
                ],
                "current-context": "fake",
            }
        )
    )
    return path


@contextlib.contextmanager
def fake_kube(tmp_path: Path, monkeypatch: Any) -> Iterator[FakeKube]:
    """A started fake API server, with KUBECONFIG pointing at it and no in-cluster credentials."""
    fake = FakeKube()
    fake.start()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", fake.url)))
    try:
        yield fake
    finally:
        fake.stop()
