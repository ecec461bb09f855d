"""What a move is: a slot range, the shard that owns it, the shard it goes to, and its phases
(`core.moves`, shared with the shard daemon's move metrics)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from shardrouter.core.moves import ACTIVE_PHASES, Phase
from shardrouter.core.ownership import RangeOwner
from shardrouter.core.shardmap import ShardMap


class MoveError(RuntimeError):
    """A move that cannot start or go on; the message says why and what to do."""


_RANGE = re.compile(r"(\d+)-(\d+)|(\d+)")


@dataclass(frozen=True)
class MovePlan:
    """One move of slots `first_slot`..`last_slot` (of `slots`) from `source` to `target`."""

    move_id: str
    slots: int
    first_slot: int
    last_slot: int
    source: str
    target: str

    @property
    def object_name(self) -> str:
        """The stem of the PostgreSQL objects the move creates (an identifier, under 63 bytes)."""
        return "shardrouter_move_" + re.sub(r"[^a-z0-9]", "_", self.move_id.lower())[:40]

    def row_filter(self, column: str = "account_hash") -> str:
        """SQL that is true for the rows of the moving slots (the publication's row filter)."""
        return f"({column} % {self.slots} BETWEEN {self.first_slot} AND {self.last_slot})"

    def ownership(self, map_version: int) -> RangeOwner:
        """The fact the move's commit records: the range belongs to the target as of `map_version`."""
        return RangeOwner(self.slots, self.first_slot, self.last_slot, self.target, map_version)


def parse_slot_range(text: str, slots: int) -> tuple[int, int]:
    """`LO-HI` or one slot `N`, checked against the map's slot count."""
    match = _RANGE.fullmatch(text.strip())
    if match is None:
        raise MoveError(f"--slots {text!r}: give a range FIRST-LAST of slot numbers, e.g. 0-1023")
    first, last = (int(match[1]), int(match[2])) if match[1] else (int(match[3]), int(match[3]))
    if not 0 <= first <= last < slots:
        raise MoveError(f"--slots {text!r}: need 0 <= FIRST <= LAST < {slots} (the map's slot count)")
    return first, last


def plan_move(shard_map: ShardMap, first_slot: int, last_slot: int, target: str) -> MovePlan:
    """A move of the range to `target`: one shard must own all of it today, and not be the target."""
    if shard_map.shard_by_id(target) is None:
        known = ", ".join(s.id for s in shard_map.shards)
        raise MoveError(f"shard {target!r} is not in the shard map (it has {known}); add it to the map first")
    owners = {
        shard_map.shards[index].id
        for start, end, index in shard_map.ranges
        if start <= last_slot and end >= first_slot
    }
    if len(owners) != 1:
        raise MoveError(
            f"slots {first_slot}-{last_slot} are owned by {', '.join(sorted(owners))}: "
            "move a range one shard owns, one move per owner"
        )
    (source,) = owners
    if source == target:
        raise MoveError(f"slots {first_slot}-{last_slot} already belong to {target}")
    return MovePlan(
        move_id=f"m{uuid.uuid4().hex[:12]}",
        slots=shard_map.slots,
        first_slot=first_slot,
        last_slot=last_slot,
        source=source,
        target=target,
    )


def owns_range(shard_map: ShardMap, shard_id: str, first_slot: int, last_slot: int) -> bool:
    """Whether one shard owns every slot of the range in this map."""
    return all(
        shard_map.shards[index].id == shard_id
        for start, end, index in shard_map.ranges
        if start <= last_slot and end >= first_slot
    )


__all__ = [
    "ACTIVE_PHASES",
    "MoveError",
    "MovePlan",
    "Phase",
    "owns_range",
    "parse_slot_range",
    "plan_move",
]
