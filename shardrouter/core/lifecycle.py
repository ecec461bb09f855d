"""What a composition root holds on to: things that run until they are stopped."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["Stoppable", "stop_all"]


class Stoppable(Protocol):
    """A background part of a process (a thread, a poller, an HTTP endpoint) that `stop()` ends."""

    def stop(self) -> None:
        """End it and wait until it has ended."""
        ...


def stop_all(parts: Iterable[Stoppable]) -> None:
    """Stop `parts` in reverse order of their start: a part never outlives what it uses."""
    for part in reversed(list(parts)):
        part.stop()
