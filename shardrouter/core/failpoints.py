"""Named failpoints: places in the code where a test can stop a process, to kill it exactly there.

The code marks a place with `reached("name")`. A process whose environment arms that name stops
there; any other process passes straight through (the environment is read once, at import, so an
unarmed point costs a dictionary look-up of an empty dictionary).

    SHARD_ROUTER_FAILPOINTS="NAME=ACTION[,NAME=ACTION...]"

NAME is a point's name (letters, digits, `.`, `_`, `-`); ACTION is what the process does there:

- `pause`: write one line to standard error, `failpoint NAME: paused (pid PID)`, and block until
  the process is killed. A test waits for that line, then sends SIGKILL: the kill lands at the
  point, not some milliseconds later, wherever the process got to meanwhile.

Spaces around names, actions and commas are ignored; an empty value arms nothing. A malformed
value, an unknown action or a name given twice is refused when the module is imported (with
`FailpointError`), so a mistyped arming never lets a test run past the point it meant to stop at.

The pause blocks the thread that reached the point; the process's other threads go on, and any of
them that reaches an armed point pauses there too (a daemon's other calls). The announced pid is the
process's own: a shard daemon serving with several processes (`shardd/processes.py`) is one of its
serving processes, which a test kills by that pid (its parent starts it again, armed again).

The points are named `<part>.<where>`:

- `shard-router reshard`: one after each phase it journals (`reshard.planned`, `reshard.prepared`,
  ..., `reshard.committed`), `reshard.start_checked` (checked, start lock held, nothing journaled)
  and `reshard.published` (handed over and the map written, not yet cleaned up); see
  `shardrouter/reshard/move.py`.
- `shard-router reconcile --repair`: `reconcile.repaired`, one repair committed, the next not begun
  (`shardrouter/reconcile/repair.py`).
- the shard daemon, every guarded (keyed) call (`shardrouter/shardd/idempotency/steps.py`):
  `shardd.claimed_before_commit`, the key claimed and the handler's writes sent in its open
  transaction, nothing committed; `shardd.committed_before_answer`, the record committed with the
  writes, the answer not yet sent.
- the shard daemon's relay (`shardrouter/shardd/relay.py`): `shardd.relay_delivered_before_marked`,
  the destination answered a credit OK, the outbox row not yet marked delivered (its transaction
  open); `shardd.relay_dead_lettered_before_refund`, a pass's dead letters committed, their refunds
  not yet sent.
- the shard daemon's `RefundTransfer` (`shardrouter/shardd/ledger/service.py`):
  `shardd.refund_applied_before_marked`, the refund's entry, balance and transfer state written in
  the call's open transaction, the dead letter not yet marked refunded.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from enum import Enum

#: The environment variable that arms failpoints.
ENV = "SHARD_ROUTER_FAILPOINTS"
_NAME = re.compile(r"[A-Za-z0-9._-]+")


class FailpointError(ValueError):
    """The failpoint environment variable is malformed."""


class Action(Enum):
    """What an armed failpoint does."""

    #: Announce the point on standard error and block until killed.
    PAUSE = "pause"


def parse(spec: str) -> dict[str, Action]:
    """Armed points of a `SHARD_ROUTER_FAILPOINTS` value: name -> action."""
    armed: dict[str, Action] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        name, sep, action = (part.strip() for part in item.partition("="))
        if not sep or not _NAME.fullmatch(name):
            raise FailpointError(f"{ENV}: {item.strip()!r} is not NAME=ACTION")
        try:
            armed_action = Action(action)
        except ValueError:
            known = ", ".join(a.value for a in Action)
            raise FailpointError(f"{ENV}: {name}: unknown action {action!r} (known: {known})") from None
        if name in armed:
            raise FailpointError(f"{ENV}: {name} is armed twice")
        armed[name] = armed_action
    return armed


_ARMED: Mapping[str, Action] = parse(os.environ.get(ENV, ""))


def armed() -> Mapping[str, Action]:
    """The points this process's environment armed (read once, at import)."""
    return _ARMED


def reached(name: str) -> None:
    """The process is at the point `name`: go on, unless the environment armed it."""
    if not _ARMED:
        return
    action = _ARMED.get(name)
    if action is Action.PAUSE:
        _pause(name)


def _pause(name: str) -> None:
    sys.stdout.flush()  # what the process printed before the point is out before the announcement
    sys.stderr.write(f"failpoint {name}: paused (pid {os.getpid()})\n")
    sys.stderr.flush()
    while True:
        time.sleep(3600)


__all__ = ["ENV", "Action", "FailpointError", "armed", "parse", "reached"]
