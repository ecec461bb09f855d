"""A shard map file followed without a restart, by the router and the shard daemons alike.

The file is polled in a daemon thread and the map swapped in as a whole when its content changes, so
readers (`current`) never see half a change and never wait on the file. A bad file never replaces a
good map, and neither does an older one: a map with a version takes over only from a lower version
(`shardrouter.core.shardmap`), so a stale ConfigMap replica or a bad rollback cannot turn ownership back.

Between polls, a process about to act on ownership (a shard refusing an account, the router told the
account moved) calls `recheck`, which reads the file at once but at most every few milliseconds, so a
move's commit reaches it without waiting for the next poll, and a flood of such calls reads it once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shardrouter.core.lifecycle import Poller
from shardrouter.core.shardmap import ShardMap, ShardMapError, load_shard_map

log = logging.getLogger(__name__)

MapListener = Callable[[ShardMap, ShardMap], None]

#: Least time between two `recheck` reads of the file (s): a burst of refusals reads it once.
RECHECK_INTERVAL_S = 0.02


class ShardMapFile(Poller):
    """The current shard map, reloaded from its file without a restart.

    Each check re-opens the file by path and hashes its bytes, so a Kubernetes ConfigMap update (an
    atomic swap of the `..data` symlink, which leaves the old inode intact) is seen as surely as an
    in-place rewrite, and a rewrite that keeps size and mtime is not missed either. The file is a
    few hundred bytes; reading it once a second costs nothing.

    `on_change` is called on the polling thread; a listener that touches event-loop objects must hop
    onto the loop (`loop.call_soon_threadsafe`), as the router's does.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        interval_s: float = 1.0,
        on_change: MapListener | None = None,
    ) -> None:
        super().__init__(interval_s, "shard-map-reload")
        self._path = Path(path)
        self._on_change = on_change
        self._lock = threading.Lock()
        # Raises ShardMapError: at start-up a bad file is fatal, there is no last good map.
        self._map = load_shard_map(self._path)
        self._seen_hash = self._content_hash()
        # Serialises `recheck`: a caller arriving while another's read runs waits for its result.
        self._recheck_lock = threading.Lock()
        self._last_recheck = float("-inf")
        #: Maps refused for an older version (or a changed one that kept its version): a stale copy
        #: of the map was offered (exported as a metric).
        self.refused_total = 0

    @property
    def path(self) -> Path:
        """The shard map file."""
        return self._path

    @property
    def current(self) -> ShardMap:
        """The map in force (replaced as a whole, so a reader never sees half of a change)."""
        return self._map

    @property
    def version(self) -> int:
        """The version of the map in force."""
        return self._map.version

    def check(self) -> bool:
        """Reload if the file's content changed; True when a new map took effect."""
        with self._lock:
            digest = self._content_hash()
            if digest == self._seen_hash:
                return False
            # Remember what was tried, so a bad file is reported once, not once per poll.
            self._seen_hash = digest
            try:
                new = load_shard_map(self._path)
            except ShardMapError as exc:
                log.warning(
                    "shard map reload failed, keeping the last good map: %s",
                    exc,
                    extra={"path": str(self._path)},
                )
                return False
            if self._refused(new, str(self._path)):
                return False
            old, self._map = self._map, new
        self._announce(old, new, str(self._path))
        return True

    def offer(self, new: ShardMap, source: str) -> bool:
        """Take a map from another source than the file (a watched ConfigMap), under the file's rule:
        only a higher version replaces the map in force. True when it took effect.

        The file stays the fallback: whichever of the two shows a newer map first wins, and neither
        can turn the other back.
        """
        with self._lock:
            if new == self._map or self._refused(new, source):
                return False
            old, self._map = self._map, new
        self._announce(old, new, source)
        return True

    def _refused(self, new: ShardMap, source: str) -> bool:
        """Whether `new` may not replace the map in force (logged and counted); call with the lock held."""
        refusal = _refusal(self._map, new)
        if refusal is None:
            return False
        self.refused_total += 1
        log.warning(
            "shard map reload refused, keeping version %d: %s",
            self._map.version,
            refusal,
            extra={"path": source},
        )
        return True

    def _announce(self, old: ShardMap, new: ShardMap, source: str) -> None:
        log.info(
            "shard map reloaded: version %d, %d shards",
            new.version,
            len(new.shards),
            extra={
                "path": source,
                "shards": ",".join(f"{s.id}={'|'.join(s.addresses)}" for s in new.shards),
            },
        )
        if self._on_change is not None:
            try:
                self._on_change(old, new)
            except Exception:  # a failing listener must not stop the reloads
                log.exception("shard map change listener failed")

    def recheck(self, min_interval_s: float = RECHECK_INTERVAL_S) -> ShardMap:
        """Check the file now, unless a recheck ran less than `min_interval_s` ago; the map in force.

        For a decision that a newer map may change (is the account still ours, who owns it now):
        the poll may be up to `interval_s` behind the file. Unchanged content costs one read and a
        hash (microseconds); a changed file is parsed once, by whichever caller comes first.
        """
        with self._recheck_lock:
            now = time.monotonic()
            if now - self._last_recheck >= min_interval_s:
                self._last_recheck = now
                self.check()
        return self._map

    def _content_hash(self) -> bytes | None:
        try:
            return hashlib.sha256(self._path.read_bytes()).digest()
        except OSError:
            return None  # gone for a moment (mid-swap) or unreadable: load_shard_map says why



def _refusal(current: ShardMap, new: ShardMap) -> str | None:
    """Why `new` may not replace `current` (None: it may). Unversioned maps (0) replace each other."""
    if current.version == 0 and new.version == 0:
        return None
    if new.version < current.version:
        return f"the file's version {new.version} is older than the map in force"
    if new.version == current.version and new != current:
        return f"the file changed but kept version {new.version}; a new map needs a higher version"
    return None


__all__ = ["RECHECK_INTERVAL_S", "MapListener", "ShardMapFile"]
