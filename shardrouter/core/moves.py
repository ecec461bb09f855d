"""The phases of a slot range's move, in order: the one list the move (`reshard`) and the shard
daemon's move metrics (`shardd.observability`) both read.

A move's journal row names its phase by the value (`"caught_up"`); the daemon's rank gauge is a
phase's place in this order (0 planned .. 7 done, 8 aborted). The move sits above the daemon in the
layers, so the list lives here, below both.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """A move's phases, in order; `aborted` ends a move that never committed."""

    PLANNED = "planned"
    PREPARED = "prepared"
    COPIED = "copied"
    CAUGHT_UP = "caught_up"
    FENCED = "fenced"
    VERIFIED = "verified"
    COMMITTED = "committed"
    DONE = "done"
    ABORTED = "aborted"

    @property
    def rank(self) -> int:
        """Its place in the order of phases."""
        return list(Phase).index(self)


#: A move in one of these phases holds nothing any more.
FINISHED_PHASES = frozenset({Phase.DONE, Phase.ABORTED})
#: A move in one of these phases still holds objects or a fence.
ACTIVE_PHASES = frozenset(p for p in Phase if p not in FINISHED_PHASES)


__all__ = [
    "ACTIVE_PHASES",
    "FINISHED_PHASES",
    "Phase",
]
