"""What a composition root holds on to: things that run until they are stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Protocol

__all__ = ["Poller", "Stoppable", "stop_all"]

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    """A background part of a process (a thread, a poller, an HTTP endpoint) that `stop()` ends."""

    def stop(self) -> None:
        """End it and wait until it has ended."""
        ...


def stop_all(parts: Iterable[Stoppable]) -> None:
    """Stop `parts` in reverse order of their start: a part never outlives what it uses."""
    for part in reversed(list(parts)):
        part.stop()


class Poller:
    """A daemon thread that calls `check()` every `interval_s` until `stop()`: the loop the followed
    files (the shard map, the authorization policy) share. `check` raising is logged and the polling
    goes on: what a follower holds stays in force."""

    def __init__(self, interval_s: float, thread_name: str) -> None:
        self._interval_s = interval_s
        self._thread_name = thread_name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """One look; True when something changed."""
        raise NotImplementedError

    def start(self) -> None:
        """Poll in a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._interval_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception:
                log.exception("%s: check failed; what is in force stays", self._thread_name)
