"""What this shard's database says about who owns slot ranges, cached for every call to read.

A move's commit records its fact (`slot_ownership`, migration 14: this range belongs to that shard
as of map version V) in the old owner's database, in the commit's own transaction, and in the new
owner's, in the transaction that lowers its fence; both notify `OWNERSHIP_CHANNEL`. Fences
(`slot_fences`) say which ranges take no writes here now. `DatabaseOwnership` keeps both in memory
and reads them again:

- every `interval_s` (a poller), so a daemon that hears no notification still learns in a second;
- when notified (the outbox relay's listener hears the channel);
- before a call is refused as another shard's (`refresh`, at most every few milliseconds for the
  whole daemon), since the cache may be a moment behind a hand-over;
- when a write meets a fence (`shardd.db`'s `on_slot_fenced`).

`ShardLocator` (the handlers' and the interceptor's view of ownership) combines these facts with the
followed shard map (`core.ownership.owner_of_slot`, facts winning from the map's own version on),
so the new owner takes the range the moment it is handed over, whatever map file it has, and a
stale map can never hand a range back here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from shardrouter.core.errors import Reason, Unavailable
from shardrouter.core.lifecycle import Poller
from shardrouter.core.ownership import (
    LearnedOwners,
    RangeOwner,
    SlotOwner,
    disagrees,
    owner_of_slot,
    relevant,
)
from shardrouter.core.shardmap import ShardMap
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.core.tracing import untraced
from shardrouter.shardd.fences import SlotFence

log = logging.getLogger(__name__)

#: The channel a move's commit and hand-over notify (both shards' databases).
OWNERSHIP_CHANNEL = "shardrouter_ownership"
#: RetryInfo delay of an ACCOUNT_MOVED or SLOT_RANGE_MOVING refusal: the router redirects at once
#: (or waits out the cut-over); a direct caller retries after it.
ACCOUNT_MOVED_RETRY_MS = 500
#: Least time between two on-demand reads (s): a burst of misrouted calls reads the tables once.
REFRESH_INTERVAL_S = 0.02

# A fence is incoming when no move out of this shard raised it (its journal is on the old owner).
_READ = (
    "SELECT 'owner', move_id, slots, first_slot, last_slot, owner_shard_id, map_version FROM slot_ownership"
    " UNION ALL"
    " SELECT CASE WHEN EXISTS (SELECT 1 FROM slot_moves m WHERE m.move_id = f.move_id)"
    " THEN 'fence' ELSE 'incoming' END, move_id, slots, first_slot, last_slot, NULL, NULL FROM slot_fences f"
)

Connect = Callable[[], Any]  # a context manager giving a psycopg connection (Database.connection)


def record_owner(conn: psycopg.Connection[Any], move_id: str, fact: RangeOwner) -> None:
    """Record a move's fact here (inside the caller's transaction) and notify the shard's daemons
    (delivered at its commit). Recording it again changes nothing."""
    conn.execute(
        "INSERT INTO slot_ownership (move_id, slots, first_slot, last_slot, owner_shard_id, map_version)"
        " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (move_id) DO NOTHING",
        (move_id, fact.slots, fact.first_slot, fact.last_slot, fact.shard_id, fact.map_version),
    )
    conn.execute("SELECT pg_notify(%s, %s)", (OWNERSHIP_CHANNEL, move_id))


def recorded_owners(conn: psycopg.Connection[Any]) -> list[RangeOwner]:
    """Every fact recorded in this database, oldest version first."""
    rows = conn.execute(
        "SELECT slots, first_slot, last_slot, owner_shard_id, map_version FROM slot_ownership"
        " ORDER BY map_version, move_id"
    ).fetchall()
    return [RangeOwner(int(r[0]), int(r[1]), int(r[2]), str(r[3]), int(r[4])) for r in rows]


class DatabaseOwnership(Poller):
    """The facts and fences of this shard's database, read again on a timer and on demand."""

    def __init__(self, connect: Connect, *, interval_s: float = 1.0) -> None:
        super().__init__(interval_s, "ownership-refresh")
        self._connect = connect
        self.facts: tuple[RangeOwner, ...] = ()
        self.fences: tuple[SlotFence, ...] = ()
        self._incoming: frozenset[str] = frozenset()  # move ids of the fences of moves into this shard
        #: Called after a read that changed the facts or fences (the locator recomputes then).
        self.on_change: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._last_read = float("-inf")
        self.reads = 0

    def check(self) -> bool:
        """Read both tables now; True if anything changed. A failed read keeps the last good view."""
        with self._lock:
            self._last_read = time.monotonic()
            try:
                with untraced(), self._connect() as conn:  # a poll: a span every second is noise
                    rows = conn.execute(_READ).fetchall()
            except Exception as exc:  # the database is away: the last view stands, the map decides
                log.warning("could not read slot ownership from the database: %s", exc)
                return False
            self.reads += 1
            facts = tuple(
                RangeOwner(int(r[2]), int(r[3]), int(r[4]), str(r[5]), int(r[6]))
                for r in rows
                if r[0] == "owner"
            )
            fences = tuple(
                SlotFence(str(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows if r[0] != "owner"
            )
            incoming = frozenset(str(r[1]) for r in rows if r[0] == "incoming")
            changed = (facts, fences, incoming) != (self.facts, self.fences, self._incoming)
            self.facts, self.fences, self._incoming = facts, fences, incoming
        if changed and self.on_change is not None:
            self.on_change()
        return changed

    def refresh(self, min_interval_s: float = REFRESH_INTERVAL_S) -> None:
        """Read again unless a read started less than `min_interval_s` ago; a caller arriving while
        another's read runs waits for it and takes its result."""
        with self._refresh_lock:
            if time.monotonic() - self._last_read >= min_interval_s:
                self.check()

    def fenced(self, slot: int, slots: int, *, incoming: bool = False) -> SlotFence | None:
        """The fence of this shard covering the slot, if any (with `incoming`, only one raised by a
        move into this shard, not yet handed over)."""
        return next(
            (
                f
                for f in self.fences
                if f.slots == slots
                and f.first_slot <= slot <= f.last_slot
                and (not incoming or f.move_id in self._incoming)
            ),
            None,
        )


class ShardLocator:
    """Which shard owns an account, as seen from one shard.

    The followed shard map says it, overruled for a range by a newer fact: one this shard's database
    recorded (`DatabaseOwnership`; from the map's own version on) or one another shard told this
    shard's relay (`learned`; only when newer than the map). Without a map the shard owns everything.
    """

    def __init__(
        self,
        own_shard_id: str,
        shard_maps: ShardMapFile | None = None,
        ownership: DatabaseOwnership | None = None,
    ) -> None:
        self.own_shard_id = own_shard_id
        self._maps = shard_maps
        self._ownership = ownership
        #: Facts other shards named when they refused a credit (`ACCOUNT_MOVED`).
        self.learned = LearnedOwners()
        # The database's facts that can overrule the map in force, for the map and facts they were
        # picked from: recomputed only when either changes.
        self._relevant: tuple[int, tuple[RangeOwner, ...], tuple[RangeOwner, ...]] = (-1, (), ())

    @property
    def shard_map(self) -> ShardMap | None:
        """The followed map in force (None without one)."""
        return None if self._maps is None else self._maps.current

    @property
    def maps_refused(self) -> int:
        """How many maps the follower refused as older than the one in force."""
        return 0 if self._maps is None else self._maps.refused_total

    def owner(self, account_id: str) -> SlotOwner | None:
        """The account's owner as this shard decides it now (None without a shard map: this shard)."""
        if self._maps is None:
            return None
        shard_map = self._maps.current
        slot = shard_map.slot_of(account_id)
        recorded = self._recorded(shard_map)
        learned = self.learned.snapshot
        owner = owner_of_slot(shard_map, slot, recorded, at_least=True)
        if learned:
            told = owner_of_slot(shard_map, slot, learned, at_least=False)
            if not told.from_map and (owner.from_map or told.map_version > owner.map_version):
                owner = told
        return owner

    def shard_of(self, account_id: str) -> str:
        """The owning shard's id (this shard when no shard map is configured)."""
        if self._maps is None:
            return self.own_shard_id
        shard_map = self._maps.current
        if not self._recorded(shard_map) and not self.learned.snapshot:
            return shard_map.shard_for(account_id).id  # every call while the map says it all
        owner = self.owner(account_id)
        return self.own_shard_id if owner is None else owner.shard_id

    def refresh(self) -> None:
        """Look again at the map file and the database's facts (each rate-limited for the daemon)."""
        if self._maps is not None:
            self._maps.recheck()
        if self._ownership is not None:
            self._ownership.refresh()

    def owner_now(self, account_id: str) -> str:
        """The owning shard's id after looking again (`refresh`): for a decision the cached view
        may have got wrong."""
        if self._maps is None:
            return self.own_shard_id
        self.refresh()
        return self.shard_of(account_id)

    def require_local(self, account_id: str) -> None:
        """Refuse an account that another shard owns: UNAVAILABLE, reason ACCOUNT_MOVED, naming the
        owner, the range and the version (the router sends the call there at once), or reason
        SLOT_RANGE_MOVING while a move into or out of this shard holds the range fenced.

        The cached view may be a moment behind a move's hand-over, which made this shard the owner
        and sent the router here: before refusing, it looks again (`refresh`).
        """
        if self.shard_of(account_id) == self.own_shard_id:
            return
        self.refresh()
        owner = self.owner(account_id)
        if owner is None or owner.shard_id == self.own_shard_id:
            return
        raise self._refusal(account_id, owner)

    def fenced_refusal(self, account_id: str) -> Unavailable:
        """The answer to a call that met this shard's fence on the account's slot: ACCOUNT_MOVED once
        the database (looked at again) or the map names another owner, else SLOT_RANGE_MOVING."""
        self.refresh()
        owner = self.owner(account_id)
        if owner is None or owner.shard_id == self.own_shard_id:
            return slot_moving(account_id)
        return self._refusal(account_id, owner)

    def overrides(self) -> int:
        """How many ranges this shard's database gives another owner than the map in force does (its
        map is behind the databases)."""
        if self._maps is None:
            return 0
        shard_map = self._maps.current
        return sum(1 for fact in self._recorded(shard_map) if disagrees(fact, shard_map))

    def _recorded(self, shard_map: ShardMap) -> tuple[RangeOwner, ...]:
        facts = self._ownership.facts if self._ownership is not None else ()
        version, picked_from, picked = self._relevant
        if version != shard_map.version or picked_from is not facts:
            picked = relevant(facts, shard_map, at_least=True)
            self._relevant = (shard_map.version, facts, picked)
        return picked

    def _refusal(self, account_id: str, owner: SlotOwner) -> Unavailable:
        slot = self._maps.current.slot_of(account_id) if self._maps is not None else 0
        if (
            owner.from_map
            and self._ownership is not None
            and self._ownership.fenced(slot, owner.range.slots, incoming=True)
        ):
            # The map names another owner, no recorded fact does, and a move into this shard holds
            # the range fenced: the router came here because the old owner said the move committed,
            # and the hand-over is a moment away. SLOT_RANGE_MOVING makes it wait and send again
            # (naming the map's owner would end the call).
            return slot_moving(account_id)
        return Unavailable(
            f"account {account_id} belongs to {owner.shard_id}, not to {self.own_shard_id} (slots "
            f"{owner.range.first_slot}-{owner.range.last_slot}, shard map version {owner.map_version}): "
            "nothing was applied; the caller's shard map is out of date, retry with the same idempotency "
            "key through the router",
            reason=Reason.ACCOUNT_MOVED,
            retry_after_ms=ACCOUNT_MOVED_RETRY_MS,
            metadata=owner.range.metadata(),
        )


def slot_moving(account_id: str) -> Unavailable:
    """The answer to a call on an account whose slot is fenced here (moving, or moved away)."""
    return Unavailable(
        f"account {account_id} is in a slot range that is moving, or has moved, to another shard; "
        "nothing was applied, retry (with the same idempotency key) and the owner will answer",
        reason=Reason.SLOT_RANGE_MOVING,
        retry_after_ms=ACCOUNT_MOVED_RETRY_MS,
        metadata={"account_id": account_id},
    )


__all__ = [
    "ACCOUNT_MOVED_RETRY_MS",
    "OWNERSHIP_CHANNEL",
    "REFRESH_INTERVAL_S",
    "DatabaseOwnership",
    "ShardLocator",
    "record_owner",
    "recorded_owners",
    "slot_moving",
]
