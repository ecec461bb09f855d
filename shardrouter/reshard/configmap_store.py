"""The shard map published in a Kubernetes ConfigMap (`configmap:NAMESPACE/NAME[:KEY]`), by
compare-and-swap on its resourceVersion: the `MapStore` a move uses on Kubernetes.

`publish` reads the ConfigMap, lets `change` make the next map from the one published, and replaces
the ConfigMap only if nobody replaced it meanwhile (409 otherwise: read again, call `change` again).
Two moves publishing at once therefore both land, one after the other, each made from the map the
other published; neither is lost. Only the map's key is written: the ConfigMap's other keys, labels
and annotations stay as they were. Routers and shard daemons watching the ConfigMap
(`core.shardmap_watch`) see the new map within a moment.
"""

from __future__ import annotations

import logging

import yaml

from shardrouter.core.kube_configmap import ConfigMapConflict, ConfigMapError, KubeConfigMaps
from shardrouter.core.shardmap import ShardMap, ShardMapChange, ShardMapError, shard_map_document
from shardrouter.core.shardmap_watch import ConfigMapSpec, parse_configmap_spec, shard_map_from_configmap

log = logging.getLogger(__name__)

#: Replaces tried before `publish` gives up: each 409 means another writer landed a map meanwhile,
#: so this many in a row is a storm of writers, not bad luck.
MAX_ATTEMPTS = 20


class MapPublishError(ShardMapError):
    """The map could not be published (the ConfigMap kept changing under every attempt)."""


class ConfigMapStore:
    """A shard map in one key of a ConfigMap, replaced conditionally on its resourceVersion."""

    def __init__(
        self, spec: ConfigMapSpec, client: KubeConfigMaps | None = None, *, max_attempts: int = MAX_ATTEMPTS
    ) -> None:
        self.spec = spec
        # Loads the credentials now: a move with none fails before it starts, not at its commit.
        self._client = client if client is not None else KubeConfigMaps()
        self._max_attempts = max_attempts

    @classmethod
    def from_spec(cls, spec: str) -> ConfigMapStore:
        """The store `NAMESPACE/NAME[:KEY]` names; ShardMapError (a ValueError) for a bad spec or
        without Kubernetes credentials, the error a move's callers already report."""
        try:
            parsed = parse_configmap_spec(spec)
        except ValueError as exc:
            raise ShardMapError(str(exc)) from exc
        try:
            return cls(parsed)
        except ConfigMapError as exc:
            raise ShardMapError(f"shard map {parsed.where}: {exc}") from exc

    @property
    def where(self) -> str:
        """configmap:NAMESPACE/NAME[:KEY]."""
        return self.spec.where

    def load(self) -> ShardMap:
        """The published map (ShardMapError if the ConfigMap or its key is missing or bad)."""
        try:
            found = self._client.get(self.spec.namespace, self.spec.name)
        except ConfigMapError as exc:
            raise ShardMapError(f"shard map {self.where}: {exc}") from exc
        return shard_map_from_configmap(found.data, self.spec)

    def publish(self, change: ShardMapChange) -> ShardMap:
        """Read, `change`, replace if unchanged meanwhile, else again (at most `max_attempts` times);
        the map published afterwards. MapPublishError when every attempt met another writer,
        ShardMapError for any other failure (a replace that timed out may still have landed: the next
        `publish` calls `change` on it, which then answers None)."""
        for attempt in range(1, self._max_attempts + 1):
            try:
                found = self._client.get(self.spec.namespace, self.spec.name)
            except ConfigMapError as exc:
                raise ShardMapError(f"shard map {self.where}: {exc}") from exc
            current = shard_map_from_configmap(found.data, self.spec)
            new = change(current)
            if new is None:
                return current
            text = yaml.safe_dump(shard_map_document(new), sort_keys=False)
            try:
                self._client.replace(
                    self.spec.namespace,
                    self.spec.name,
                    {**found.data, self.spec.key: text},
                    found.resource_version,
                    base=found,
                )
            except ConfigMapConflict:
                log.info(
                    "shard map ConfigMap changed while publishing (attempt %d of %d); reading it again",
                    attempt,
                    self._max_attempts,
                    extra={"path": self.where},
                )
                continue
            except ConfigMapError as exc:  # refused (RBAC), unreachable: the error moves report
                raise ShardMapError(f"shard map {self.where}: not published: {exc}") from exc
            return new
        raise MapPublishError(
            f"shard map {self.where}: not published: the ConfigMap changed under each of "
            f"{self._max_attempts} attempts (another writer keeps replacing it)"
        )


__all__ = ["MAX_ATTEMPTS", "ConfigMapStore", "MapPublishError"]
