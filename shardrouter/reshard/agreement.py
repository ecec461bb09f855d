"""Whether the routers and shard daemons follow the map a move published: read from their /metrics.

Each process exports the version of the map it follows (`router_shard_map_version`,
`shardd_shard_map_version`). After a move, `shard-router reshard --agreement URL ...` reads them
until every process reports the published version (or a later one) or the wait runs out, and says
which processes lag. It is a report: the databases already decide ownership, so a lagging process
costs a redirect per call, not a wrong answer. On Kubernetes the same check is a PromQL query and
the `ShardMapVersionSkew` alert (deploy README).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

VERSION_METRICS = ("router_shard_map_version", "shardd_shard_map_version")


@dataclass(frozen=True)
class Agreement:
    """Each endpoint's reported map version (None: unreachable, or no such metric), against `version`."""

    version: int
    reported: dict[str, int | None]

    @property
    def lagging(self) -> dict[str, int | None]:
        """The endpoints not yet at `version`."""
        return {url: v for url, v in self.reported.items() if v is None or v < self.version}

    def summary(self) -> str:
        """One line for a person."""
        if not self.lagging:
            return f"every process ({len(self.reported)}) follows shard map version {self.version} or later"
        behind = ", ".join(f"{url} {'unreachable' if v is None else f'at {v}'}" for url, v in self.lagging.items())
        return (
            f"{len(self.lagging)} of {len(self.reported)} processes do not follow shard map version "
            f"{self.version} yet: {behind} (the databases decide ownership meanwhile; calls they route "
            "to the old owner are redirected)"
        )


def reported_version(url: str, timeout_s: float = 2.0) -> int | None:
    """The map version one process's /metrics reports (None if it cannot be read)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (operator-given URL)
            text = reply.read().decode()
    except (OSError, urllib.error.URLError, ValueError):
        return None
    for family in text_string_to_metric_families(text):
        if family.name in VERSION_METRICS:
            for sample in family.samples:
                return int(sample.value)
    return None


def wait_for_agreement(
    urls: Sequence[str],
    version: int,
    *,
    timeout_s: float = 30.0,
    poll_s: float = 0.5,
    read: Callable[[str], int | None] = reported_version,
) -> Agreement:
    """Read every endpoint until all report `version` or later, or `timeout_s` ran out; the last look."""
    deadline = time.monotonic() + timeout_s
    while True:
        agreement = Agreement(version, {url: read(url) for url in urls})
        if not agreement.lagging or time.monotonic() >= deadline:
            return agreement
        time.sleep(poll_s)


__all__ = ["VERSION_METRICS", "Agreement", "reported_version", "wait_for_agreement"]
