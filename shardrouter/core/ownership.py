"""Who owns a slot range when a process's shard map is not the newest word on it.

The shard map is the fast, shared way to learn owners; the shards' databases are the authority. A
move records its change in both shards' databases (`slot_ownership`: this range belongs to that
shard as of map version V) before any map says so, and a shard that refuses a call for an account
it does not own names the range, its owner and the version (`ACCOUNT_MOVED`). Each such fact is a
`RangeOwner`. A process that holds facts newer than its map decides by `owner_of_slot`:

- a shard daemon, with the facts its own database recorded: a fact at least as new as the map
  wins (`at_least`), since the database is the authority and a map of the same version that
  disagrees was made without this move;
- the router and the outbox relay, with facts shards told them (`LearnedOwners`): only a fact
  strictly newer than the map wins, so two shards whose maps share a version but disagree cannot
  send a call back and forth.

`with_owner` rebuilds a map from facts: a move publishes its change that way, and
`shard-router reshard show-map` rebuilds the map every process should follow.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc

from shardrouter.core.channels import our_error_info
from shardrouter.core.errors import Reason
from shardrouter.core.shardmap import ShardMap
from shardrouter.core.wire import MetadataEntry

#: The ErrorInfo metadata keys of an ACCOUNT_MOVED refusal that name the range's owner.
OWNER_KEY, VERSION_KEY, RANGE_KEY, SLOTS_KEY = "owner_shard_id", "map_version", "slot_range", "slots"
#: Most facts a router or relay keeps beyond its map (the oldest go first): bounded memory whatever
#: the shards say.
MAX_LEARNED = 4096


@dataclass(frozen=True)
class RangeOwner:
    """A fact about one slot range: `shard_id` owns slots `first_slot`..`last_slot` (of `slots`) as of
    map version `map_version`."""

    slots: int
    first_slot: int
    last_slot: int
    shard_id: str
    map_version: int

    def covers(self, slot: int, slots: int) -> bool:
        """Whether the fact is about this slot (of a map with `slots` slots)."""
        return self.slots == slots and self.first_slot <= slot <= self.last_slot

    def overlaps(self, other: RangeOwner) -> bool:
        """Whether the two facts share a slot."""
        return (
            self.slots == other.slots
            and self.first_slot <= other.last_slot
            and other.first_slot <= self.last_slot
        )

    def metadata(self) -> dict[str, str]:
        """The fact as ErrorInfo metadata (an ACCOUNT_MOVED refusal carries it)."""
        return {
            OWNER_KEY: self.shard_id,
            VERSION_KEY: str(self.map_version),
            RANGE_KEY: f"{self.first_slot}-{self.last_slot}",
            SLOTS_KEY: str(self.slots),
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> RangeOwner | None:
        """The fact a refusal's metadata names, or None when it names none (or a malformed one)."""
        owner = metadata.get(OWNER_KEY, "")
        version, slots = _number(metadata.get(VERSION_KEY)), _number(metadata.get(SLOTS_KEY))
        first, _, last = metadata.get(RANGE_KEY, "").partition("-")
        first_slot, last_slot = _number(first), _number(last)
        if not owner or version is None or slots is None or first_slot is None or last_slot is None:
            return None
        if not 0 <= first_slot <= last_slot < slots:
            return None
        return cls(slots, first_slot, last_slot, owner, version)


@dataclass(frozen=True)
class SlotOwner:
    """The owner of one slot as a process decides it: the shard, the version its word is from, and
    the range that word is about (a map range, or a fact's)."""

    shard_id: str
    map_version: int
    range: RangeOwner
    #: True when the map decided (no fact newer than it covers the slot).
    from_map: bool


def moved_to(code: grpc.StatusCode, trailers: Iterable[MetadataEntry]) -> RangeOwner | None:
    """The fact a shard's ACCOUNT_MOVED refusal names (None for any other answer, or one naming
    no range: a shard older than these facts)."""
    if code is not grpc.StatusCode.UNAVAILABLE:
        return None
    info = our_error_info(trailers)
    if info is None or info.reason != Reason.ACCOUNT_MOVED:
        return None
    return RangeOwner.from_metadata(info.metadata)


def map_owner(shard_map: ShardMap, slot: int) -> RangeOwner:
    """The map's word on a slot: its owner and the whole map range the slot is in."""
    start, end, shard = shard_map.range_of_slot(slot)
    return RangeOwner(shard_map.slots, start, end, shard.id, shard_map.version)


def owner_of_slot(
    shard_map: ShardMap, slot: int, facts: Iterable[RangeOwner], *, at_least: bool
) -> SlotOwner:
    """The slot's owner: the newest fact covering it if that is newer than the map (or, with
    `at_least`, as new), else the map's."""
    best: RangeOwner | None = None
    for fact in facts:
        if not fact.covers(slot, shard_map.slots):
            continue
        newer = fact.map_version >= shard_map.version if at_least else fact.map_version > shard_map.version
        if newer and (best is None or fact.map_version > best.map_version):
            best = fact
    if best is not None:
        return SlotOwner(best.shard_id, best.map_version, best, from_map=False)
    word = map_owner(shard_map, slot)
    return SlotOwner(word.shard_id, word.map_version, word, from_map=True)


def relevant(facts: Iterable[RangeOwner], shard_map: ShardMap, *, at_least: bool) -> tuple[RangeOwner, ...]:
    """The facts that can overrule `shard_map` (the rest are older than it)."""
    return tuple(
        f
        for f in facts
        if f.slots == shard_map.slots
        and (f.map_version >= shard_map.version if at_least else f.map_version > shard_map.version)
    )


def disagrees(fact: RangeOwner, shard_map: ShardMap) -> bool:
    """Whether the map gives any slot of the fact's range to another shard than the fact does."""
    return any(
        shard_map.shards[index].id != fact.shard_id
        for start, end, index in shard_map.ranges
        if start <= fact.last_slot and end >= fact.first_slot
    )


def with_owner(shard_map: ShardMap, fact: RangeOwner, *, version: int) -> ShardMap:
    """The map with the fact's range given to its shard (which the map must list), at `version`."""
    target = next((i for i, s in enumerate(shard_map.shards) if s.id == fact.shard_id), None)
    if target is None:
        raise ValueError(f"the shard map has no shard {fact.shard_id!r}")
    ranges: list[tuple[int, int, int]] = []
    for start, end, index in shard_map.ranges:
        if end < fact.first_slot or start > fact.last_slot:
            ranges.append((start, end, index))
            continue
        if start < fact.first_slot:
            ranges.append((start, fact.first_slot - 1, index))
        if end > fact.last_slot:
            ranges.append((fact.last_slot + 1, end, index))
    ranges.append((fact.first_slot, fact.last_slot, target))
    return ShardMap(
        slots=shard_map.slots, shards=shard_map.shards, ranges=tuple(_merged(sorted(ranges))), version=version
    )


def with_facts(shard_map: ShardMap, facts: Iterable[RangeOwner]) -> ShardMap:
    """The map every process should follow: `shard_map` with every fact at least as new as it
    applied, oldest first, at the newest version among them (unchanged if none applies)."""
    applying = sorted(
        (f for f in relevant(facts, shard_map, at_least=True) if disagrees(f, shard_map)),
        key=lambda f: f.map_version,
    )
    current = shard_map
    for fact in applying:
        current = with_owner(current, fact, version=max(current.version, fact.map_version))
    return current


class LearnedOwners:
    """Facts a router or relay heard from shards (ACCOUNT_MOVED), kept while its map is older.

    Thread-safe; `snapshot` is lock-free for the hot path (a tuple swapped as a whole). A fact
    replaces the facts it overlaps that are older; facts the map has caught up with are dropped by
    `forget_upto` (call it when a new map takes effect).
    """

    def __init__(self, limit: int = MAX_LEARNED) -> None:
        self._lock = threading.Lock()
        self._facts: tuple[RangeOwner, ...] = ()
        self._limit = limit

    @property
    def snapshot(self) -> tuple[RangeOwner, ...]:
        """The facts known now."""
        return self._facts

    def learn(self, fact: RangeOwner, map_version: int) -> bool:
        """Keep a fact newer than the map in force (`map_version`); True if it was new here."""
        if fact.map_version <= map_version:
            return False
        with self._lock:
            if any(f.overlaps(fact) and f.map_version >= fact.map_version for f in self._facts):
                return False
            kept = [f for f in self._facts if not f.overlaps(fact)]
            kept.append(fact)
            if len(kept) > self._limit:
                kept.sort(key=lambda f: f.map_version)
                kept = kept[len(kept) - self._limit :]
            self._facts = tuple(kept)
        return True

    def forget_upto(self, map_version: int) -> None:
        """Drop the facts a map of `map_version` already says (or overrules)."""
        with self._lock:
            self._facts = tuple(f for f in self._facts if f.map_version > map_version)


def _number(text: str | None) -> int | None:
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def _merged(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent ranges of one shard as one."""
    out: list[tuple[int, int, int]] = []
    for start, end, index in ranges:
        if out and out[-1][2] == index and out[-1][1] + 1 == start:
            out[-1] = (out[-1][0], end, index)
        else:
            out.append((start, end, index))
    return out


__all__ = [
    "MAX_LEARNED",
    "OWNER_KEY",
    "RANGE_KEY",
    "SLOTS_KEY",
    "VERSION_KEY",
    "LearnedOwners",
    "RangeOwner",
    "SlotOwner",
    "disagrees",
    "map_owner",
    "moved_to",
    "owner_of_slot",
    "relevant",
    "with_facts",
    "with_owner",
]
