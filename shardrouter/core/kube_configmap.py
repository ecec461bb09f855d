"""One Kubernetes ConfigMap, read, replaced by compare-and-swap, and watched: the shard map's home on
Kubernetes (the `shard-map` ConfigMap), for the processes that follow it and the moves that publish it.

Built on the official `kubernetes` client rather than `lightkube`: it is the one the Kubernetes project
keeps, it loads every form of credentials a cluster hands out (the pod's service account with its
token refresh, any kubeconfig with exec plugins or client certificates). Releases before 37 carry no
type hints (37 cannot be installed beside the tracing UI: see pyproject.toml), so mypy sees it as
untyped and the few calls made here are kept to plain values. Its only cost is its size, paid once
per image. Only its configuration loading and its raw HTTP calls are used (`_preload_content=False`):
the objects are read and written as plain JSON, so one ConfigMap's few fields need none of its
generated models, and a watch is read line by line so that `interrupt` can end it from another thread.

Every request has a bounded connect and read timeout; a watch ends on the server's side after
`watch_timeout_s` and the reader is told so by the stream ending, so no call here can hang for ever.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client as kube_client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

#: Connect timeout of every request (s).
CONNECT_TIMEOUT_S = 5.0
#: Read timeout of a read or a replace (s).
REQUEST_TIMEOUT_S = 10.0
#: How long the API server keeps one watch open (s) before the reader opens the next one.
WATCH_TIMEOUT_S = 240
#: A watch's read timeout beyond `watch_timeout_s`: a stream silent that long is dead (half-open).
WATCH_READ_SLACK_S = 30.0

_HTTP_CONFLICT = 409
_HTTP_GONE = 410
_HTTP_NOT_FOUND = 404


class ConfigMapError(Exception):
    """The ConfigMap could not be read, written or watched (API unreachable, refused, bad answer)."""


class ConfigMapNotFound(ConfigMapError):
    """There is no such ConfigMap."""


class ConfigMapConflict(ConfigMapError):
    """A replace found another resourceVersion than the one it was made from (HTTP 409): read again."""


class ConfigMapGone(ConfigMapError):
    """A watch asked for a resourceVersion the API server no longer keeps (HTTP 410): read again."""


@dataclass(frozen=True)
class ConfigMap:
    """One read of a ConfigMap: its string data, its resourceVersion and the whole object as sent."""

    data: dict[str, str]
    resource_version: str
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)


@dataclass(frozen=True)
class ConfigMapEvent:
    """One watch event: ADDED, MODIFIED, DELETED or BOOKMARK (a BOOKMARK only moves the version on)."""

    type: str
    config_map: ConfigMap


def load_configuration(kubeconfig: str | None = None) -> kube_client.Configuration:
    """The API server and credentials: the pod's service account when in a cluster, else `kubeconfig`,
    else the `KUBECONFIG` variable (read now, not when the library was imported), else ~/.kube/config.

    ConfigMapError when none of them can be used.
    """
    configuration = kube_client.Configuration()
    if kubeconfig is None:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
            return configuration
        except kube_config.ConfigException:
            pass  # not in a pod with a service account: a kubeconfig it is
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    try:
        kube_config.load_kube_config(
            config_file=path, client_configuration=configuration
        )
    except (kube_config.ConfigException, OSError, ValueError) as exc:
        raise ConfigMapError(
            f"no Kubernetes credentials: not in a cluster, and kubeconfig {path} cannot be used: {exc}"
        ) from exc
    return configuration


class KubeConfigMaps:
    """ConfigMaps of one API server: `read`, `replace` (conditional) and `watch` one at a time.

    Safe to share between threads for `read` and `replace`; `watch` remembers its open stream so
    that `interrupt` (from any thread) can end it.
    """

    def __init__(
        self,
        configuration: kube_client.Configuration | None = None,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self._api_client = kube_client.ApiClient(configuration or load_configuration())
        self._api = kube_client.CoreV1Api(self._api_client)
        self._timeout = (CONNECT_TIMEOUT_S, request_timeout_s)
        self._watch_timeout_s = watch_timeout_s
        self._lock = threading.Lock()
        self._stream: urllib3.BaseHTTPResponse | None = None
        self._interrupted = False

    def get(self, namespace: str, name: str) -> ConfigMap:
        """The ConfigMap as it is now."""
        response = self._call(
            f"read configmap {namespace}/{name}",
            lambda: self._api.read_namespaced_config_map(
                name, namespace, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return _config_map(_json(response, f"configmap {namespace}/{name}"))

    def read(self, namespace: str, name: str) -> tuple[dict[str, str], str]:
        """The ConfigMap's data and resourceVersion."""
        found = self.get(namespace, name)
        return found.data, found.resource_version

    def replace(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        resource_version: str,
        *,
        base: ConfigMap | None = None,
    ) -> ConfigMap:
        """Replace the ConfigMap's data if its resourceVersion is still `resource_version`, else
        ConfigMapConflict. The rest of the object (labels, annotations, binaryData) is taken from
        `base` (the read this replace is made from), so a replace changes nothing but the data."""
        document: dict[str, Any] = dict(base.raw) if base is not None else {}
        metadata = dict(document.get("metadata") or {})
        metadata.update({"name": name, "namespace": namespace, "resourceVersion": resource_version})
        # Server-kept bookkeeping is not ours to send back.
        metadata.pop("managedFields", None)
        document.update(apiVersion="v1", kind="ConfigMap", metadata=metadata, data=dict(data))
        # Sent as the plain document: the client serializes a dict as it is, so a field its models
        # do not know (a newer API server's) survives the round trip.
        body = document
        response = self._call(
            f"replace configmap {namespace}/{name}",
            lambda: self._api.replace_namespaced_config_map(
                name, namespace, body, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return _config_map(_json(response, f"configmap {namespace}/{name}"))

    def watch(self, namespace: str, name: str, resource_version: str) -> Iterator[ConfigMapEvent]:
        """The changes of one ConfigMap after `resource_version`, until the server ends the watch
        (after `watch_timeout_s`), the stream breaks (ConfigMapError), the version is too old
        (ConfigMapGone), or `interrupt` is called (the iterator just ends)."""
        what = f"watch configmap {namespace}/{name}"
        stream: urllib3.BaseHTTPResponse = self._call(
            what,
            lambda: self._api.list_namespaced_config_map(
                namespace,
                field_selector=f"metadata.name={name}",
                resource_version=resource_version,
                watch=True,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                _preload_content=False,
                _request_timeout=(CONNECT_TIMEOUT_S, self._watch_timeout_s + WATCH_READ_SLACK_S),
            ),
        )
        with self._lock:
            if self._interrupted:
                stream.shutdown()
                stream.release_conn()
                return
            self._stream = stream
        try:
            for line in iter_resp_lines(stream):
                if not line.strip():
                    continue
                event = _event(line, what)
                if event is not None:
                    yield event
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            with self._lock:
                if self._interrupted:
                    return
            raise ConfigMapError(f"{what}: stream broke: {exc}") from exc
        finally:
            with self._lock:
                self._stream = None
            stream.release_conn()

    def interrupt(self) -> None:
        """End the watch that is open (from any thread), and every later one at its start: its
        iterator stops at once. For a client being closed: sticky, so a watch opened just after the
        interrupt cannot slip past it and hold its thread until the server's timeout."""
        with self._lock:
            self._interrupted = True
            stream = self._stream
        if stream is not None:
            try:
                # shutdown, not close: it wakes a read blocked in another thread.
                stream.shutdown()
            except Exception:
                log.debug("closing the configmap watch stream failed", exc_info=True)

    def close(self) -> None:
        """Close the connection pool."""
        self.interrupt()
        self._api_client.close()

    def _call(self, what: str, request: Any) -> Any:
        try:
            return request()
        except ApiException as exc:
            raise _api_error(what, exc.status, exc.reason, exc.body) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ConfigMapError(f"{what}: API server unreachable: {exc}") from exc


def _api_error(what: str, status: int | None, reason: str | None, body: object) -> ConfigMapError:
    message = _status_message(body) or reason or "no reason given"
    if status == _HTTP_CONFLICT:
        return ConfigMapConflict(f"{what}: changed meanwhile (409): {message}")
    if status == _HTTP_GONE:
        return ConfigMapGone(f"{what}: resourceVersion too old (410): {message}")
    if status == _HTTP_NOT_FOUND:
        return ConfigMapNotFound(f"{what}: not found (404): {message}")
    return ConfigMapError(f"{what}: HTTP {status}: {message}")


def _status_message(body: object) -> str | None:
    """The message of a Kubernetes Status body, if it is one."""
    if not isinstance(body, str | bytes):
        return None
    try:
        status = json.loads(body)
    except ValueError:
        return None
    message = status.get("message") if isinstance(status, dict) else None
    return message if isinstance(message, str) else None


def _json(response: urllib3.BaseHTTPResponse, what: str) -> dict[str, Any]:
    try:
        document = json.loads(response.data)
    except ValueError as exc:
        raise ConfigMapError(f"{what}: the API server's answer is not JSON: {exc}") from exc
    finally:
        response.release_conn()
    if not isinstance(document, dict):
        raise ConfigMapError(f"{what}: the API server's answer is not an object")
    return document


def _config_map(document: Mapping[str, Any]) -> ConfigMap:
    metadata = document.get("metadata")
    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    data = document.get("data") or {}
    if not isinstance(version, str) or not isinstance(data, dict):
        raise ConfigMapError("the API server sent a ConfigMap without resourceVersion or with bad data")
    return ConfigMap(data={str(k): str(v) for k, v in data.items()}, resource_version=version, raw=document)


def _event(line: str, what: str) -> ConfigMapEvent | None:
    """One line of a watch stream as an event (None: a type we do not follow)."""
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise ConfigMapError(f"{what}: a watch event is not JSON: {exc}") from exc
    kind = event.get("type") if isinstance(event, dict) else None
    obj = event.get("object") if isinstance(event, dict) else None
    if not isinstance(obj, dict):
        raise ConfigMapError(f"{what}: a watch event without an object")
    if kind == "ERROR":
        # The API server reports an expired version inside the stream, as a Status object.
        raise _api_error(what, obj.get("code"), obj.get("reason"), json.dumps(obj))
    if kind == "BOOKMARK":
        metadata = obj.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        if not isinstance(version, str):
            return None
        return ConfigMapEvent("BOOKMARK", ConfigMap(data={}, resource_version=version, raw=obj))
    if kind in ("ADDED", "MODIFIED", "DELETED"):
        return ConfigMapEvent(kind, _config_map(obj))
    log.debug("ignoring watch event of type %r", kind)
    return None


__all__ = [
    "CONNECT_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "WATCH_TIMEOUT_S",
    "ConfigMap",
    "ConfigMapConflict",
    "ConfigMapError",
    "ConfigMapEvent",
    "ConfigMapGone",
    "ConfigMapNotFound",
    "KubeConfigMaps",
    "load_configuration",
]
