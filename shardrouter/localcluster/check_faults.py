"""`shard-router check --local-cluster`: the checker against a local cluster of its own, with faults
on a schedule: a shard daemon (each in turn) or the router SIGKILLed every N seconds and started
again, while the workload runs. The cluster is started in a temporary directory and deleted after.

It lives here, not in `shardrouter.check`, because it starts and kills the local cluster's processes;
the checker below it only drives a router and reads databases.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from shardrouter.check import cli as check_cli
from shardrouter.localcluster.cluster import Daemon, LocalCluster
from shardrouter.localcluster.postgres import free_port

#: How long a killed process stays down before it is started again (s).
DOWN_S = 0.5


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--local-cluster", action="store_true")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--kill-shard-daemon-every", type=float, default=0.0, metavar="S")
    p.add_argument("--kill-router-every", type=float, default=0.0, metavar="S")
    return p


class Faults:
    """Kills processes of `cluster` on a schedule, each started again `DOWN_S` later, until `stop`."""

    def __init__(self, cluster: LocalCluster, every_s: float, targets: list[Daemon]) -> None:
        self._cluster, self._every_s, self._targets = cluster, every_s, targets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="check-faults", daemon=True)
        self.kills: list[str] = []
        self.failed = ""

    def start(self) -> None:
        """Begin the schedule (nothing if no interval or no target)."""
        if self._every_s > 0 and self._targets:
            self._thread.start()

    def stop(self) -> None:
        """End the schedule; a killed process is started again first."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for daemon in itertools.cycle(self._targets):
            if self._stop.wait(self._every_s) or daemon.proc is None:
                return
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait()
            self.kills.append(daemon.name)
            time.sleep(DOWN_S)
            try:
                daemon.start()
            except (RuntimeError, TimeoutError) as exc:  # the run's proofs will show what it cost
                self.failed = f"{daemon.name} did not start again: {exc}"
                return


def main(argv: Sequence[str]) -> int:
    """Start a cluster, run the check with the faults asked for, report the kills; the check's exit code."""
    ours, rest = _parser().parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        return check_cli.main(["--help"])
    data_dir = Path(tempfile.mkdtemp(prefix="shard-router-check-")) / "cluster"
    cluster = LocalCluster(data_dir=data_dir, shards=ours.shards, router_port=free_port(), http_port=0)
    print(f"starting a local cluster of {ours.shards} shards in {data_dir} ...", flush=True)
    cluster.start()
    faults: list[Faults] = []
    try:
        faults = [
            Faults(cluster, ours.kill_shard_daemon_every, list(cluster.shard_daemons)),
            Faults(cluster, ours.kill_router_every, [cluster.router] if cluster.router else []),
        ]
        for f in faults:
            f.start()
        target = ["--target", f"127.0.0.1:{cluster.router_port}", "--databases", str(cluster.databases_path)]
        history = [] if "--history" in rest else ["--history", str(Path.cwd() / "check-local.jsonl")]
        code = check_cli.main([*target, *history, *rest], before_proof=lambda: _stop(faults))
    finally:
        _stop(faults)
        cluster.stop()
        with contextlib.suppress(OSError):
            cluster.wipe()
        shutil.rmtree(data_dir.parent, ignore_errors=True)
    return code


def _stop(faults: list[Faults]) -> str:
    """Stop every schedule; what they did, in one line."""
    for f in faults:
        f.stop()
    kills = [name for f in faults for name in f.kills]
    failed = "; ".join(f.failed for f in faults if f.failed)
    return (
        f"faults: {len(kills)} SIGKILL(s)"
        + (f": {', '.join(kills)}" if kills else "")
        + (f"; {failed}" if failed else "")
    )


__all__ = ["Faults", "main"]
