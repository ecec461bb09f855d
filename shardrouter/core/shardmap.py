"""The shard map: which shard owns an account, by hash slots.

An account's slot is `crc32(utf-8 account id) % slots` (16384 by default); each shard owns inclusive
slot ranges, and together the ranges must cover every slot exactly once. Moving a range to another
shard is a map change, not a rehash of every account. The file is YAML or JSON:

    version: 7
    slots: 16384
    shards:
      - id: shard-0
        addresses: [127.0.0.1:50061, 127.0.0.1:50071]
        slot_ranges: [[0, 8191]]
      - id: shard-1
        address: 127.0.0.1:50062
        slot_ranges: [[8192, 16383]]

A shard may own no slots (`slot_ranges: []`): one just added, waiting for a move to give it a range,
or one whose ranges all moved away. A shard may be served by several daemons over its one database (`addresses`, or one `address`, a
Kubernetes Service say): a call may go to any of them, and the claim protocol decides between them.
`version` (a non-negative integer, 0 when absent) orders the maps: a process that follows the file
takes a new map only with a higher version, so a stale copy of the file can never turn ownership
back (see `ShardMapFile`).
"""

from __future__ import annotations

import bisect
import fcntl
import os
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEFAULT_SLOTS = 16384
_SHARD_ID = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
def is_shard_id(text: str) -> bool:
    """Whether `text` has the form of a shard id (a lower-case DNS label such as shard-0)."""
    return _SHARD_ID.fullmatch(text) is not None


#: Shard ids no shard may take: the router's metrics label a call answered before any shard was
#: chosen `shard="none"` (the router's `metrics.NO_SHARD`), which a shard of that name would blur.
RESERVED_SHARD_IDS = frozenset({"none"})


class ShardMapError(ValueError):
    """A shard map file that cannot be used, with the file and the problem in the message."""


@dataclass(frozen=True)
class Shard:
    """One shard: its id and the gRPC addresses of its daemons (one or more, all equivalent)."""

    id: str
    addresses: tuple[str, ...]

    @property
    def address(self) -> str:
        """The first address (where a single-daemon shard is served)."""
        return self.addresses[0]


def account_hash(account_id: str) -> int:
    """The CRC-32 of an account id's UTF-8 bytes: its slot for any slot count, and the `account_hash`
    column every row of the account carries in a shard's database (the same value as the database's
    own `account_hash()`)."""
    return zlib.crc32(account_id.encode())


@dataclass(frozen=True)
class ShardMap:
    """Slot ranges to shards; look-ups are a binary search over the ranges' starts."""

    slots: int
    shards: tuple[Shard, ...]
    # Sorted, non-overlapping (start, end, shard index) covering 0..slots-1.
    ranges: tuple[tuple[int, int, int], ...]
    #: Orders the maps of one deployment: a follower takes only a higher version (0: unversioned).
    version: int = 0

    def slot_of(self, account_id: str) -> int:
        """The hash slot of an account id."""
        return account_hash(account_id) % self.slots

    def shard_for(self, account_id: str) -> Shard:
        """The shard that owns an account."""
        slot = self.slot_of(account_id)
        i = bisect.bisect_right(self._starts, slot) - 1
        return self.shards[self.ranges[i][2]]

    def owner_of_slot(self, slot: int) -> Shard:
        """The shard that owns a slot."""
        i = bisect.bisect_right(self._starts, slot) - 1
        return self.shards[self.ranges[i][2]]

    def range_of_slot(self, slot: int) -> tuple[int, int, Shard]:
        """The map range a slot is in: its first and last slot, and the shard that owns it."""
        start, end, index = self.ranges[bisect.bisect_right(self._starts, slot) - 1]
        return start, end, self.shards[index]

    def addresses(self) -> frozenset[str]:
        """Every daemon address of every shard."""
        return frozenset(a for shard in self.shards for a in shard.addresses)

    def shard_by_id(self, shard_id: str) -> Shard | None:
        """The shard with this id, if the map has one."""
        return next((s for s in self.shards if s.id == shard_id), None)

    @property
    def _starts(self) -> list[int]:
        return [r[0] for r in self.ranges]


def even_shard_map(
    addresses: Mapping[str, str | Sequence[str]], slots: int = DEFAULT_SLOTS, *, version: int = 0
) -> ShardMap:
    """A map that splits the slots evenly over the given shards, in order; a shard's value is its
    address or the list of its daemons' addresses."""
    items = list(addresses.items())
    raw = {
        "version": version,
        "slots": slots,
        "shards": [
            {
                "id": shard_id,
                **({"address": where} if isinstance(where, str) else {"addresses": list(where)}),
                "slot_ranges": [[i * slots // len(items), (i + 1) * slots // len(items) - 1]],
            }
            for i, (shard_id, where) in enumerate(items)
        ],
    }
    return parse_shard_map(raw, source="<generated>")


def shard_map_document(shard_map: ShardMap) -> dict[str, Any]:
    """The map as the plain document `parse_shard_map` reads (for writing a file)."""
    return {
        "version": shard_map.version,
        "slots": shard_map.slots,
        "shards": [
            {
                "id": shard.id,
                **(
                    {"address": shard.address}
                    if len(shard.addresses) == 1
                    else {"addresses": list(shard.addresses)}
                ),
                "slot_ranges": [[s, e] for s, e, idx in shard_map.ranges if idx == i],
            }
            for i, shard in enumerate(shard_map.shards)
        ],
    }


def write_shard_map(path: str | Path, shard_map: ShardMap) -> None:
    """Write the map to its file atomically: a reader sees the old file or the new, never half.

    The new file is written and flushed beside the old one, then renamed over it, and the folder
    flushed, so after a crash the file holds one whole map.
    """
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    text = yaml.safe_dump(shard_map_document(shard_map), sort_keys=False)
    with temporary.open("w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, target)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


#: How a writer makes the next map from the one in force (None: that one says enough already);
#: what every store of the map, a file or a ConfigMap, publishes by compare-and-swap.
ShardMapChange = Callable[[ShardMap], ShardMap | None]


def update_shard_map(path: str | Path, change: ShardMapChange) -> ShardMap:
    """Read the map, let `change` make the next one (None: no change), write it; the map in force.

    Writers of one file (a move's commit, a shard being added) take turns on an exclusive lock of
    a file beside it, so neither can write a map made from one the other has just replaced.
    """
    target = Path(path)
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        current = load_shard_map(target)
        new = change(current)
        if new is None:
            return current
        write_shard_map(target, new)
        return new


def load_shard_map(path: str | Path) -> ShardMap:
    """Read and check a shard map file; ShardMapError names the file and the problem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ShardMapError(f"shard map {source}: cannot read: {exc.strerror or exc}") from exc
    try:
        raw = yaml.safe_load(text)  # YAML is a superset of JSON, so one parser reads both
    except yaml.YAMLError as exc:
        raise ShardMapError(f"shard map {source}: not valid YAML or JSON: {exc}") from exc
    return parse_shard_map(raw, source=source)


def parse_shard_map(raw: object, *, source: str) -> ShardMap:
    """Check a parsed shard map document and build the map."""

    def fail(problem: str) -> ShardMapError:
        return ShardMapError(f"shard map {source}: {problem}")

    if not isinstance(raw, dict):
        raise fail("top level must be a mapping with 'shards' (and optionally 'slots')")
    version = raw.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise fail("'version' must be a non-negative integer")
    slots = raw.get("slots", DEFAULT_SLOTS)
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= 1 << 20:
        raise fail("'slots' must be an integer between 1 and 1048576")
    entries = raw.get("shards")
    if not isinstance(entries, list) or not entries:
        raise fail("'shards' must be a non-empty list")
    shards: list[Shard] = []
    ranges: list[tuple[int, int, int]] = []
    for index, entry in enumerate(entries):
        shard, its_ranges = _shard_entry(entry, f"shards[{index}]", slots, [s.id for s in shards], fail)
        shards.append(shard)
        ranges += [(first, last, index) for first, last in its_ranges]
    owners: dict[str, str] = {}
    for shard in shards:
        for address in shard.addresses:
            if address in owners:
                raise fail(f"address {address} is given to both {owners[address]} and {shard.id}")
            owners[address] = shard.id
    ranges.sort()
    _check_every_slot_owned_once(ranges, slots, shards, fail)
    return ShardMap(slots=slots, shards=tuple(shards), ranges=tuple(ranges), version=version)


def _shard_entry(
    entry: object, where: str, slots: int, taken_ids: list[str], fail: Callable[[str], ShardMapError]
) -> tuple[Shard, list[tuple[int, int]]]:
    """One entry of `shards`: the shard and its slot ranges, each checked on its own (and its id
    against the ids of the entries before it)."""
    if not isinstance(entry, dict):
        raise fail(f"{where} must be a mapping with id, address (or addresses), slot_ranges")
    shard_id = entry.get("id")
    if not isinstance(shard_id, str) or not is_shard_id(shard_id):
        raise fail(f"{where}.id must be a lower-case DNS label such as shard-0")
    if shard_id in RESERVED_SHARD_IDS:
        raise fail(f"{where}.id {shard_id!r} is reserved (the router's metrics use it for no shard)")
    if shard_id in taken_ids:
        raise fail(f"{where}.id {shard_id!r} appears twice")
    addresses = _addresses(entry, where, fail)
    shard_ranges = entry.get("slot_ranges")
    # Empty: a shard that owns nothing yet (just added) or any more (moved out), still reachable.
    if not isinstance(shard_ranges, list):
        raise fail(f"{where}.slot_ranges must be a list of [first, last] pairs (empty: owns no slot)")
    for pair in shard_ranges:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
            or not 0 <= pair[0] <= pair[1] < slots
        ):
            raise fail(
                f"{where}.slot_ranges entry {pair!r} must be [first, last] with 0 <= first <= last < {slots}"
            )
    return Shard(id=shard_id, addresses=addresses), [(pair[0], pair[1]) for pair in shard_ranges]


def _check_every_slot_owned_once(
    ranges: list[tuple[int, int, int]], slots: int, shards: list[Shard], fail: Callable[[str], ShardMapError]
) -> None:
    """The sorted (first, last, shard index) ranges cover 0..slots-1 without a gap or an overlap."""
    expected = 0
    for start, end, index in ranges:
        if start < expected:
            raise fail(f"slot {start} is owned twice (again by {shards[index].id})")
        if start > expected:
            raise fail(f"slots {expected}..{start - 1} are owned by no shard")
        expected = end + 1
    if expected != slots:
        raise fail(f"slots {expected}..{slots - 1} are owned by no shard")


def _addresses(entry: dict[str, Any], where: str, fail: Callable[[str], ShardMapError]) -> tuple[str, ...]:
    one, several = entry.get("address"), entry.get("addresses")
    if (one is None) == (several is None):
        raise fail(f"{where} needs 'address' (host:port) or 'addresses' (a list of them), not both")
    if one is not None:
        if not isinstance(one, str) or ":" not in one:
            raise fail(f"{where}.address must be host:port")
        return (one,)
    if not isinstance(several, list) or not several:
        raise fail(f"{where}.addresses must be a non-empty list of host:port")
    for address in several:
        if not isinstance(address, str) or ":" not in address:
            raise fail(f"{where}.addresses entry {address!r} must be host:port")
    if len(set(several)) != len(several):
        raise fail(f"{where}.addresses lists an address twice")
    return tuple(several)


__all__ = [
    "DEFAULT_SLOTS",
    "RESERVED_SHARD_IDS",
    "Shard",
    "ShardMap",
    "ShardMapChange",
    "ShardMapError",
    "account_hash",
    "even_shard_map",
    "is_shard_id",
    "load_shard_map",
    "parse_shard_map",
    "shard_map_document",
    "update_shard_map",
    "write_shard_map",
]
