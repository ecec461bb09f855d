"""The daemon process's one `LISTEN` connection to its shard's database, shared by whoever needs it.

The daemons of a shard tell each other about commits through PostgreSQL's `NOTIFY`: a queued credit
(the relay's workers), a transfer's new state (`GetTransfer` waiters), a move's ownership facts,
a duplicate asking for, and being told of, its key's original's end (`idempotency.waiting`). Each
part subscribes a handler to its channel before `start`; one thread per process sits in `LISTEN` on
its own connection, outside the pool, for the process's life, and calls the handlers in the order
the notifications arrive. After losing its connection it connects again (backing off up to 5 s) and
tells the subscribers of both events (`on_connection`), so that they poll meanwhile and look again
once it is back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg

log = logging.getLogger(__name__)

#: Longest pause before the listener connects again after losing its connection (s).
_RETRY_MAX_S = 5.0
#: How often the listening thread looks at its stop flag (s): a daemon's stop waits for it (a wake-up
#: that sends nothing to the server costs tens of microseconds).
_POLL_S = 0.1

Handler = Callable[[str], None]


class ShardListener:
    """One thread `LISTEN`ing on the subscribed channels of the shard's database."""

    def __init__(self, dsn: str, *, name: str = "shard-listen") -> None:
        self._dsn = dsn
        self._name = name
        self._handlers: dict[str, list[Handler]] = {}
        self._connection_handlers: list[Callable[[bool], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, channel: str, handler: Handler) -> None:
        """Call `handler(payload)` for each notification on `channel` (before `start`).

        `channel` is one of our constant channel names (an SQL identifier, written into `LISTEN`)."""
        assert self._thread is None, "subscribe before the listener starts"
        assert channel.isidentifier(), channel
        self._handlers.setdefault(channel, []).append(handler)

    def on_connection(self, handler: Callable[[bool], None]) -> None:
        """Call `handler(True)` each time `LISTEN` starts, `handler(False)` when it stops (before `start`)."""
        assert self._thread is None, "subscribe before the listener starts"
        self._connection_handlers.append(handler)

    @property
    def channels(self) -> frozenset[str]:
        """The channels subscribed to."""
        return frozenset(self._handlers)

    def start(self) -> None:
        """Start listening (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and wait for the thread (it looks at its stop flag ten times a second)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_POLL_S * 4 + 5)

    def _run(self) -> None:
        pause = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, connect_timeout=5) as conn:
                    for channel in self._handlers:
                        conn.execute(f"LISTEN {channel}")
                    self._connected(True)
                    pause = 0.1
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=_POLL_S, stop_after=1):
                            self._dispatch(note.channel, note.payload)
            except psycopg.Error as exc:
                self._connected(False)
                log.warning("shard listener lost its connection (%s); polling until it is back", exc)
                self._stop.wait(pause)
                pause = min(pause * 2, _RETRY_MAX_S)
        self._connected(False)

    def _dispatch(self, channel: str, payload: str) -> None:
        for handler in self._handlers.get(channel, ()):
            try:
                handler(payload)
            except Exception:  # one subscriber's bug must not deafen the others
                log.exception("handler of %s notifications failed", channel)

    def _connected(self, connected: bool) -> None:
        for handler in self._connection_handlers:
            try:
                handler(connected)
            except Exception:
                log.exception("listener connection handler failed")


__all__ = ["ShardListener"]
