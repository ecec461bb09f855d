"""Where a guarded call's claim goes: first, on its own, or ahead of the handler's statements.

A claim sent with the handler's first statements (`store.ClaimAhead`) saves a new key its own round
trip, but a duplicate then pays more than a claim sent first would have cost it: the handler starts,
the database fails the pipeline and rolls it back, and a Sync ends it, where a claim sent first
answers a duplicate in one statement. Measured on the bench (2 vCPUs, a Deposit, shard and database
CPU together): about 145 µs saved per new key, about 470 µs lost per duplicate. So the claim goes
ahead while few of this process's recent claims found their key taken, and first when many did (a
retry storm after an outage, a queue redelivering a batch), and back again when they stop.
"""

from __future__ import annotations

#: Above this share of duplicates among recent claims, claims go first (the break-even is near 24 %).
AHEAD_BELOW_DUPLICATE_SHARE = 0.2
#: Each claim's weight in the moving share: the last few dozen claims decide.
_WEIGHT = 1 / 32


#: The placements a daemon can be set to: `adaptive` (by the share below), or always `first` or
#: always `ahead`.
CLAIM_PLACEMENTS = ("adaptive", "first", "ahead")


class ClaimPlacement:
    """The share of this process's recent claims that found their key taken, and what it decides.

    Read and updated by every call's thread without a lock: a lost update only nudges an estimate.
    """

    __slots__ = ("duplicate_share", "mode")

    def __init__(self, mode: str = "adaptive") -> None:
        if mode not in CLAIM_PLACEMENTS:
            raise ValueError(f"claim placement must be one of {', '.join(CLAIM_PLACEMENTS)}, not {mode!r}")
        self.mode = mode
        self.duplicate_share = 0.0

    def ahead(self) -> bool:
        """Whether the next claim goes with the handler's first statements."""
        if self.mode == "adaptive":
            return self.duplicate_share < AHEAD_BELOW_DUPLICATE_SHARE
        return self.mode == "ahead"

    def note(self, *, duplicate: bool) -> None:
        """A claim's outcome: the key taken (a completed record, or in flight), or claimed."""
        self.duplicate_share += _WEIGHT * ((1.0 if duplicate else 0.0) - self.duplicate_share)


__all__ = ["AHEAD_BELOW_DUPLICATE_SHARE", "CLAIM_PLACEMENTS", "ClaimPlacement"]
