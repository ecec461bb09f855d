"""The shard map's ConfigMap, watched: a move's new map reaches the router and the shard daemons within
a moment, not after the kubelet refreshes the mounted file (60-90 s later).

`ConfigMapMapWatch` reads the ConfigMap, then watches it, and hands every map it sees to a callback:
in production `ShardMapFile.offer`, which applies the version rule (only a higher version replaces the
map in force), so the mounted file and the watch can race freely and neither turns the other back.
The file stays the fallback: with the API server unreachable the watch logs, backs off (bounded) and
tries again, while the file keeps being followed.

A ConfigMap is named `NAMESPACE/NAME[:KEY]` (`parse_configmap_spec`); the key defaults to
`shard-map.yaml`, the key of deploy/k8s/base/shard-map.yaml.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import yaml

from shardrouter.core.shardmap import ShardMap, ShardMapError, parse_shard_map

if TYPE_CHECKING:
    from shardrouter.core.kube_configmap import ConfigMap, KubeConfigMaps
    from shardrouter.core.shardmap_file import ShardMapFile

log = logging.getLogger(__name__)

#: The ConfigMap key holding the map unless the spec names another.
DEFAULT_KEY = "shard-map.yaml"
#: First and longest wait between two failed attempts (s); doubled after each failure.
BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 10.0
#: A watch that ends sooner than this (s) without an event is followed by a backoff.
QUICK_END_S = 1.0

# A namespace is a DNS label; a ConfigMap's name a DNS subdomain; a key what ConfigMap keys allow.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_SPEC_FORM = "NAMESPACE/NAME[:KEY], e.g. shard-router/shard-map or shard-router/shard-map:shard-map.yaml"


@dataclass(frozen=True)
class ConfigMapSpec:
    """Which ConfigMap, and which of its keys, holds the shard map."""

    namespace: str
    name: str
    key: str = DEFAULT_KEY

    @property
    def where(self) -> str:
        """The ConfigMap for messages and as the map's source: configmap:NAMESPACE/NAME[:KEY]."""
        suffix = "" if self.key == DEFAULT_KEY else f":{self.key}"
        return f"configmap:{self.namespace}/{self.name}{suffix}"

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.key}"


def parse_configmap_spec(spec: str) -> ConfigMapSpec:
    """`NAMESPACE/NAME[:KEY]` as a ConfigMapSpec; ValueError saying what is wrong and the form expected."""
    text = spec.strip()
    if not text:
        raise ValueError(f"the shard map ConfigMap is empty; expected {_SPEC_FORM}")
    location, colon, key = text.partition(":")
    namespace, slash, name = location.partition("/")
    if not slash or not namespace or not name:
        raise ValueError(f"shard map ConfigMap {spec!r}: expected {_SPEC_FORM}")
    if len(namespace) > 63 or _DNS_LABEL.fullmatch(namespace) is None:
        raise ValueError(
            f"shard map ConfigMap {spec!r}: namespace {namespace!r} is not a lower-case DNS label"
        )
    if len(name) > 253 or _DNS_SUBDOMAIN.fullmatch(name) is None:
        raise ValueError(f"shard map ConfigMap {spec!r}: name {name!r} is not a lower-case DNS subdomain")
    if colon and (len(key) > 253 or _KEY.fullmatch(key) is None):
        raise ValueError(
            f"shard map ConfigMap {spec!r}: key {key!r} must be letters, digits, '-', '_' or '.'"
        )
    return ConfigMapSpec(namespace, name, key if colon else DEFAULT_KEY)


def shard_map_from_configmap(data: dict[str, str], spec: ConfigMapSpec) -> ShardMap:
    """The map under the spec's key of a ConfigMap's data (ShardMapError if missing or bad)."""
    text = data.get(spec.key)
    if text is None:
        raise ShardMapError(f"shard map {spec.where}: the ConfigMap has no key {spec.key!r}")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ShardMapError(f"shard map {spec.where}: not valid YAML or JSON: {exc}") from exc
    return parse_shard_map(raw, source=spec.where)


class ConfigMapMapWatch:
    """A daemon thread that follows one ConfigMap and hands every good map in it to `on_map`.

    Read, then watch from the version read; a watch the server ends is opened again from the last
    version seen; a version the server no longer keeps (410) means read again. Any other failure is
    logged and retried after a backoff that doubles up to `backoff_max_s` and resets once a read or
    an event succeeds. A bad document is logged (once per resourceVersion) and skipped: the map in
    force stays.

    `on_map` runs on this thread; it must not block for long.
    """

    def __init__(
        self,
        spec: ConfigMapSpec,
        on_map: Callable[[ShardMap], object],
        *,
        client: KubeConfigMaps | None = None,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        if client is None:
            # Loads the credentials now, so a process configured to watch without any fails at start.
            from shardrouter.core.kube_configmap import KubeConfigMaps

            client = KubeConfigMaps()
        self.spec = spec
        self._on_map = on_map
        self._client = client
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Set once a read of the ConfigMap succeeded (its map handed over, or found bad).
        self.synced = threading.Event()
        #: Reads, watch events with a map, and failures: for logs and tests.
        self.maps_seen = 0
        self.failures = 0

    def start(self) -> None:
        """Follow the ConfigMap in a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="shard-map-configmap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop following: the open watch is interrupted, the thread joined (bounded)."""
        self._stop.set()
        self._client.interrupt()
        if self._thread is not None:
            self._thread.join(5)
        self._client.close()

    def _run(self) -> None:
        from shardrouter.core.kube_configmap import ConfigMapError, ConfigMapGone

        backoff = self._backoff_initial_s
        version: str | None = None  # None: read before watching
        while not self._stop.is_set():
            try:
                if version is None:
                    found = self._client.get(self.spec.namespace, self.spec.name)
                    self._hand(found)
                    self.synced.set()
                    version = found.resource_version
                    backoff = self._backoff_initial_s
                opened, events = time.monotonic(), 0
                for event in self._client.watch(self.spec.namespace, self.spec.name, version):
                    if self._stop.is_set():
                        return
                    events += 1
                    version = event.config_map.resource_version
                    backoff = self._backoff_initial_s
                    if event.type in ("ADDED", "MODIFIED"):
                        self._hand(event.config_map)
                    elif event.type == "DELETED":
                        log.warning(
                            "shard map ConfigMap deleted; keeping the map in force",
                            extra={"path": self.spec.where},
                        )
                # The server ended the watch (its timeout): watch again from `version`, at once unless
                # it ended straight away with nothing, which a server that refuses to keep watches
                # open would repeat in a tight loop.
                if events == 0 and time.monotonic() - opened < QUICK_END_S:
                    if self._stop.wait(backoff):
                        return
                    backoff = min(backoff * 2, self._backoff_max_s)
            except ConfigMapGone:
                log.info(
                    "shard map ConfigMap watch expired; reading it again", extra={"path": self.spec.where}
                )
                version = None
            except Exception as exc:
                if self._stop.is_set():
                    return
                self.failures += 1
                level = logging.WARNING if isinstance(exc, ConfigMapError) else logging.ERROR
                log.log(
                    level,
                    "shard map ConfigMap not followed, retrying in %.1f s: %s",
                    backoff,
                    exc,
                    extra={"path": self.spec.where},
                    exc_info=not isinstance(exc, ConfigMapError),
                )
                # Read again after a failure: events may have been missed while the stream was down.
                version = None
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self._backoff_max_s)

    def _hand(self, found: ConfigMap) -> None:
        try:
            shard_map = shard_map_from_configmap(found.data, self.spec)
        except ShardMapError as exc:
            if found.resource_version != self._bad_version:
                self._bad_version = found.resource_version
                log.warning(
                    "shard map ConfigMap is not usable, keeping the map in force: %s",
                    exc,
                    extra={"path": self.spec.where},
                )
            return
        self.maps_seen += 1
        try:
            self._on_map(shard_map)
        except Exception:  # a failing callback must not stop the watch
            log.exception("shard map ConfigMap callback failed", extra={"path": self.spec.where})

    _bad_version: str | None = None


def watch_shard_map_configmap(spec: str, shard_maps: ShardMapFile) -> ConfigMapMapWatch | None:
    """Start following the ConfigMap `spec` names (`NAMESPACE/NAME[:KEY]`) into `shard_maps` (via
    `offer`, so only a higher version takes over); None when `spec` is empty (no ConfigMap).

    ValueError for a bad spec, ConfigMapError when there are no Kubernetes credentials to use.
    """
    if not spec.strip():
        return None
    parsed = parse_configmap_spec(spec)
    source = parsed.where

    def offer(shard_map: ShardMap) -> None:
        shard_maps.offer(shard_map, source)

    watch = ConfigMapMapWatch(parsed, offer)
    watch.start()
    return watch



def configmap_spec_problems(spec: str) -> list[str]:
    """A settings check of `--shard-map-configmap`: what is wrong with `spec` (empty: not set, fine)."""
    if not spec:
        return []
    try:
        parse_configmap_spec(spec)
    except ValueError as exc:
        return [f"shard_map_configmap: {exc}"]
    return []


__all__ = [
    "BACKOFF_INITIAL_S",
    "BACKOFF_MAX_S",
    "DEFAULT_KEY",
    "ConfigMapMapWatch",
    "ConfigMapSpec",
    "configmap_spec_problems",
    "parse_configmap_spec",
    "shard_map_from_configmap",
    "watch_shard_map_configmap",
]
