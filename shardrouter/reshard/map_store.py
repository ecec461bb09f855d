"""Where the shard map that routers and shard daemons follow is published: a file or a ConfigMap.

A move records its commit in the shards' databases first (they are the authority on who owns a
range); publishing the map is how every process learns it fast. Both stores publish by
compare-and-swap, so two writers (two moves, a move and `dev add-shard`) never write a map made
from one the other has just replaced:

- a file (the local cluster's, or any path): an exclusive lock beside it (`update_shard_map`);
- a Kubernetes ConfigMap (`configmap:NAMESPACE/NAME`, key `shard-map.yaml` unless `:KEY` follows):
  a replace conditional on the `resourceVersion` read (`configmap_store.py`).

A store never lowers the version: `change` gets the published map and returns the next one, or None
when the published one already says enough (a newer map, or this change already made).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from shardrouter.core.shardmap import ShardMap, ShardMapChange, load_shard_map, update_shard_map

#: How a map store is named on the command line when it is a ConfigMap.
CONFIGMAP_PREFIX = "configmap:"

class MapStore(Protocol):
    """The published shard map: read it, or replace it by compare-and-swap."""

    @property
    def where(self) -> str:
        """The store, for messages (a path, or configmap:NAMESPACE/NAME)."""
        ...

    def load(self) -> ShardMap:
        """The published map (ShardMapError if there is none or it is bad)."""
        ...

    def publish(self, change: ShardMapChange) -> ShardMap:
        """Read the published map, let `change` make the next one (None: no change), write it if
        nobody wrote meanwhile (else read again and repeat); the map published afterwards."""
        ...


class FileMapStore:
    """A shard map file, replaced atomically under a lock beside it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def where(self) -> str:
        """The file's path."""
        return str(self.path)

    def load(self) -> ShardMap:
        """The map in the file."""
        return load_shard_map(self.path)

    def publish(self, change: ShardMapChange) -> ShardMap:
        """Replace the file under its lock (`update_shard_map`)."""
        return update_shard_map(self.path, change)


def map_store_from(spec: str | Path) -> MapStore:
    """The store a `--map` argument names: `configmap:NAMESPACE/NAME[:KEY]`, else a file path."""
    text = str(spec)
    if text.startswith(CONFIGMAP_PREFIX):
        # Imported here: only a move that publishes to Kubernetes needs the Kubernetes client.
        from shardrouter.reshard.configmap_store import ConfigMapStore

        return ConfigMapStore.from_spec(text[len(CONFIGMAP_PREFIX) :])
    return FileMapStore(Path(text))


__all__ = ["CONFIGMAP_PREFIX", "FileMapStore", "MapStore", "map_store_from"]
