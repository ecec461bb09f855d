"""Several serving processes of one shard daemon on one port (`shardd serve --processes N`).

A Python process serves with about one core, whatever its thread count. This parent process
prepares the database once, then starts N `shardd serve` processes that each bind the same port with
SO_REUSEPORT; the kernel spreads incoming connections among them, so callers with several connections
(the router keeps `ROUTER_SHARD_CONNECTIONS` to each shard) use every process. The claim protocol is
already safe across processes: the database decides every key. The parent restarts a process that
dies, forwards SIGTERM/SIGINT to all of them and waits for their graceful stop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from shardrouter.core import grpcserver
from shardrouter.shardd.settings import ShardSettings

log = logging.getLogger(__name__)

__all__ = ["PARENT_PID_ENV", "ServingProcesses", "port_is_free", "stop_with_parent"]

#: The parent's pid, in each serving process's environment: the process checks its parent against
#: it, so one started just as its parent died (already handed to init) still sees the parent gone.
PARENT_PID_ENV = "SHARD_ROUTER_SERVING_PARENT_PID"

#: A process that dies sooner than this after its start is restarted only after a pause, so a
#: process that cannot start (a bad certificate, say) is not restarted in a tight loop.
_QUICK_DEATH_S = 5.0
_RESTART_PAUSE_S = 2.0


def port_is_free(listen: str) -> bool:
    """Whether nothing (with or without SO_REUSEPORT) listens on `listen` now.

    The serving processes share their port; this check keeps them from sharing it with a stranger.
    """
    host, port = grpcserver.listen_host(listen), listen.rpartition(":")[2]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


class ServingProcesses:
    """The N serving processes of one daemon, started with the parent's own command line."""

    def __init__(self, settings: ShardSettings, argv: Sequence[str]) -> None:
        self._settings = settings
        self._argv = list(argv)
        self._processes: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
        self._stopping = threading.Event()

    def start(self) -> None:
        """Start every serving process."""
        for index in range(1, self._settings.processes + 1):
            self._start(index)

    def supervise(self, stop: threading.Event) -> None:
        """Restart processes that die until `stop` is set."""
        while not stop.wait(0.2):
            for index, (process, started) in list(self._processes.items()):
                code = process.poll()
                if code is None:
                    continue
                quick = time.monotonic() - started < _QUICK_DEATH_S
                log.warning(
                    "serving process %d (pid %d) ended with %s; starting it again%s",
                    index,
                    process.pid,
                    code,
                    f" in {_RESTART_PAUSE_S:g} s" if quick else "",
                )
                if quick and stop.wait(_RESTART_PAUSE_S):
                    return
                self._start(index)

    def stop(self, grace_s: float) -> int:
        """SIGTERM every process, wait for them to finish their calls; the worst exit status."""
        for process, _ in self._processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        worst = 0
        deadline = time.monotonic() + grace_s + 5
        for process, _ in self._processes.values():
            try:
                code = process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("serving process %d did not stop in time; killing it", process.pid)
                process.kill()
                code = process.wait()
            worst = worst or (code if code > 0 else 0)
        return worst

    def pids(self) -> list[int]:
        """The process ids of the serving processes now."""
        return [process.pid for process, _ in self._processes.values()]

    def _start(self, index: int) -> None:
        # Flags win over the environment and a later flag over an earlier one: appended, these make
        # the child one serving process of the group, never another parent.
        args = [
            *self._argv,
            "--processes",
            str(self._settings.processes),
            "--process-index",
            str(index),
        ]
        process = subprocess.Popen(
            [sys.executable, "-m", "shardrouter.shardd.cli", *args],
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
        )
        self._processes[index] = (process, time.monotonic())
        log.info("started serving process %d of %d (pid %d)", index, self._settings.processes, process.pid)


def stop_with_parent(stop: threading.Event, poll_s: float = 0.5) -> threading.Thread:
    """In a serving process: set `stop` (a graceful stop) once the parent is gone.

    A parent killed with SIGKILL cannot forward a SIGTERM; its serving processes would live on,
    holding the port, with nobody to restart or stop them. The parent is the one the environment
    names (`PARENT_PID_ENV`), else the one at this call: a process re-parented before it got here
    (its parent killed while starting it) would otherwise take init for its parent and never stop.
    """
    named = os.environ.get(PARENT_PID_ENV, "")
    parent = int(named) if named.isdigit() else os.getppid()

    def watch() -> None:
        while not stop.wait(poll_s):
            if os.getppid() != parent:
                log.warning("the parent process %d is gone; stopping", parent)
                stop.set()
                return

    watcher = threading.Thread(target=watch, name="parent-watch", daemon=True)
    watcher.start()
    return watcher
