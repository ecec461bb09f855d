"""SIGTERM and SIGINT: how a daemon learns it must stop, for threaded and asyncio processes alike.

Install the handlers before anything starts, so a signal during start-up is a clean stop too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How often a main thread waiting for a signal wakes to run a handler that is pending (s).
_WAKE_S = 0.2


class StopDuringStartUp(KeyboardInterrupt):
    """SIGTERM or SIGINT before the daemon serves. A KeyboardInterrupt, so that psycopg cancels the
    statement it is waiting for (a long migration) and the transaction rolls back."""


def _announce(signum: int) -> None:
    log.info("received %s, shutting down", signal.Signals(signum).name)


class TerminationSignals:
    """SIGTERM and SIGINT, caught from construction on: `stop` is set; while `starting`, the main
    thread is interrupted too (StopDuringStartUp), so a migration waiting on the database is cancelled.
    """

    def __init__(self, *, starting: bool = True) -> None:
        self.stop = threading.Event()
        self.starting = starting
        for signum in _SIGNALS:
            signal.signal(signum, self._received)

    def wait(self) -> None:
        """Block the main thread until a signal arrives. It wakes every `_WAKE_S`: a signal the
        kernel delivers to another thread (grpc's, psycopg's pool's) only marks Python's handler as
        pending, and a main thread blocked in a lock without a timeout would never run it."""
        while not self.stop.wait(_WAKE_S):
            pass

    def _received(self, signum: int, _frame: object) -> None:
        _announce(signum)
        self.stop.set()
        if self.starting:
            raise StopDuringStartUp


def aio_termination_event() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT, received on the running loop.

    The handlers stay installed while the daemon drains: a second signal must not kill it half way.
    """
    loop = asyncio.get_running_loop()
    received = asyncio.Event()

    def on_signal(signum: signal.Signals) -> None:
        _announce(signum)
        received.set()

    for signum in _SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    return received


__all__ = ["StopDuringStartUp", "TerminationSignals", "aio_termination_event"]
