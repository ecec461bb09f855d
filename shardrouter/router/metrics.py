"""The router's metrics: `router_requests_total{method,code,shard,protocol}`,
`router_request_duration_seconds{method,code,shard,protocol}`, `router_redirects_total{reason,shard}`,
`router_tls_handshake_failures_total{protocol,reason}` (the HTTP front's), and the shard map in force:
`router_shard_map_version` and `router_shard_map_refused_total`.

Built on the pipeline every process shares (`core.metrics`), exposed at the router's /metrics.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc
from opentelemetry.metrics import CallbackOptions, Observation
from prometheus_client import CollectorRegistry

from shardrouter.core.metrics import new_metrics_pipeline

if TYPE_CHECKING:
    from shardrouter.core.shardmap_file import ShardMapFile

#: The router's latency buckets (seconds): prometheus_client's defaults, which the router's
#: histogram had before it became an OpenTelemetry instrument (the SDK's own defaults are for ms).
ROUTER_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


#: The `shard` label of a call the router answered before it chose a shard (a request whose routing
#: account it cannot read, or a failure of its own before the shard map was consulted). A fixed
#: value: the label only ever holds ids from the router's own shard map, or this.
NO_SHARD = "none"

#: The `protocol` label: the call came over gRPC, or through the HTTP/JSON front.
GRPC = "grpc"
HTTP = "http"
#: The `method` label of a call that names no method the router serves (gRPC's UNIMPLEMENTED, an
#: HTTP request on no declared route): one fixed value, never the path a caller sent, so the series
#: stay bounded.
UNKNOWN_METHOD = "unknown"

_Labels = dict[str, str]


class CallRecord:
    """One call the router is timing, for `RouterMetrics`.

    `shard` is the id of the shard the call was last forwarded to (the forwarder sets it, from its
    own shard map, each time it picks a shard), `NO_SHARD` until it picks one; `protocol` how the
    call came (`GRPC`, `HTTP`). `finish(code)` counts
    the call once, with its duration and that shard. Calling the record (`record(code)`) notes a
    final code for `RouterMetrics.timed()`, which finishes it on the way out.
    """

    __slots__ = ("_code", "_metrics", "method", "protocol", "shard", "started")

    def __init__(self, metrics: RouterMetrics, method: str, protocol: str = GRPC) -> None:
        self._metrics = metrics
        self.method = method
        self.protocol = protocol
        self.shard = NO_SHARD
        self._code: grpc.StatusCode | None = None
        self.started = time.perf_counter()

    def __call__(self, code: grpc.StatusCode) -> None:
        """Note `code` as the call's final code (the last one noted wins)."""
        self._code = code

    def finish(self, code: grpc.StatusCode | None = None) -> None:
        """Count the call as answered with `code` (default: the one noted, else UNKNOWN)."""
        if code is None:
            code = self._code if self._code is not None else grpc.StatusCode.UNKNOWN
        self._metrics.observe(
            self.method, code, time.perf_counter() - self.started, shard=self.shard, protocol=self.protocol
        )


class RouterMetrics:
    """The router's request counter and latency: `router_requests_total{method,code,shard,protocol}`
    and `router_request_duration_seconds{method,code,shard,protocol}`, and its redirects:
    `router_redirects_total{reason,shard}`.

    `method` is the short method name ("Transfer"), `code` the gRPC status name the router
    answered ("OK", "ABORTED", "UNAVAILABLE", ...), `shard` the id of the shard the call was
    forwarded to (the last one, for a call sent on to another shard; the one that could not be
    reached, for the router's own SHARD_UNAVAILABLE; `NO_SHARD`, "none", for a call answered before a
    shard was chosen), `reason` the shard's refusal that sent a call on to another shard
    (ACCOUNT_MOVED, SLOT_RANGE_MOVING) and there `shard` the shard that refused it, `protocol`
    "grpc" or "http" (the HTTP/JSON front), so the two fronts' traffic and errors are told apart.

    The label values come from the method declarations, grpc's status codes and the router's shard
    map, never from what a caller sent, so the series stay few: shards x methods x codes x 2. Each label
    set is built once and kept (the OpenTelemetry API has no bound instruments): a call looks its
    labels up by shard, method and code, and allocates none.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.pipeline = new_metrics_pipeline(registry)
        self.registry = self.pipeline.registry
        meter = self._meter = self.pipeline.meter(__name__)
        self.requests = meter.create_counter(
            "router_requests",
            unit="{call}",
            description="Calls the router answered, by method, gRPC status code, shard and protocol.",
        )
        self.duration = meter.create_histogram(
            "router_request_duration_seconds",
            unit="s",
            description="Time the router took to answer a call, forwarding included, by shard.",
            explicit_bucket_boundaries_advisory=ROUTER_DURATION_BUCKETS,
        )
        self.redirects = meter.create_counter(
            "router_redirects",
            unit="{redirect}",
            description="Calls sent on to another shard after the shard tried said the account moved.",
        )
        self.hedges = meter.create_counter(
            "router_hedges",
            unit="{hedge}",
            description="Second attempts of slow calls at another daemon of the shard (result=sent), and those whose answer the caller got (result=won).",
        )
        self.tls_handshake_failures = meter.create_counter(
            "router_tls_handshake_failures",
            unit="{handshake}",
            description=(
                "TLS handshakes the HTTP front refused or lost, by reason (no_certificate, "
                "untrusted_certificate, not_tls, client_refused, timeout, connection_lost, other). "
                "Only protocol=http: gRPC's handshakes run inside grpc-core, which reports none to Python."
            ),
        )
        #: (protocol, shard id) -> method path -> code -> the label set of a call (filled on first use).
        self._call_labels: dict[tuple[str, str], dict[str, dict[grpc.StatusCode, _Labels]]] = {}
        #: shard id -> reason -> the label set of a redirect.
        self._redirect_labels: dict[str, dict[str, _Labels]] = {}

    def follow_shard_map(self, shard_maps: ShardMapFile) -> None:
        """Export the map in force: `router_shard_map_version` and `router_shard_map_refused_total`
        (maps refused as older than it, from the file or the ConfigMap), both read at each scrape."""

        def version(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(shard_maps.version)]

        def refused(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(shard_maps.refused_total)]

        self._meter.create_observable_gauge(
            "router_shard_map_version",
            callbacks=[version],
            unit="{version}",
            description="Version of the shard map in force.",
        )
        # A counter read from the follower: it only grows, so Prometheus may rate() it.
        self._meter.create_observable_counter(
            "router_shard_map_refused",
            callbacks=[refused],
            unit="{map}",
            description="Shard maps refused for a version older than (or equal to, changed) the map in force.",
        )

    def redirected(self, reason: str, shard: str = NO_SHARD) -> None:
        """Count one redirect of a call to the account's new owner; `shard` refused it."""
        try:
            labels = self._redirect_labels[shard][reason]
        except KeyError:
            labels = self._redirect_labels.setdefault(shard, {}).setdefault(
                reason, {"reason": reason, "shard": shard}
            )
        self.redirects.add(1, labels)

    def hedged(self, shard: str, *, won: bool) -> None:
        """Count a hedge sent to `shard`'s next daemon, or (`won`) one whose answer was the caller's."""
        self.hedges.add(1, {"result": "won" if won else "sent", "shard": shard})

    def tls_handshake_failed(self, reason: str, protocol: str = HTTP) -> None:
        """Count one failed TLS handshake on `protocol`'s front, for `reason` (a bounded set)."""
        self.tls_handshake_failures.add(1, {"protocol": protocol, "reason": reason})

    def call_labels(
        self, method: str, code: grpc.StatusCode, shard: str = NO_SHARD, protocol: str = GRPC
    ) -> Mapping[str, str]:
        """The label set of a call of `method` (its path or short name) answered `code`, forwarded to
        `shard`, received over `protocol`: built on first use, then the same object every time."""
        try:
            return self._call_labels[protocol, shard][method][code]
        except KeyError:
            by_code = self._call_labels.setdefault((protocol, shard), {}).setdefault(method, {})
            return by_code.setdefault(
                code,
                {
                    "method": method.rsplit("/", 1)[-1],
                    "code": code.name,
                    "shard": shard,
                    "protocol": protocol,
                },
            )

    def observe(
        self,
        method: str,
        code: grpc.StatusCode,
        seconds: float | None = None,
        *,
        shard: str = NO_SHARD,
        protocol: str = GRPC,
    ) -> None:
        """Count one answered call (and its duration, if given) under `shard` and `protocol`."""
        labels = self.call_labels(method, code, shard, protocol)
        self.requests.add(1, labels)
        if seconds is not None:
            self.duration.record(seconds, labels)

    def start(self, method: str, protocol: str = GRPC) -> CallRecord:
        """Start timing a call of `method`; the caller sets its `shard` and calls `finish(code)` once."""
        return CallRecord(self, method, protocol)

    @contextmanager
    def timed(self, method: str) -> Iterator[CallRecord]:
        """Time a call; call the yielded record with the final code (UNKNOWN if never called), and
        set its `shard` once the call is forwarded."""
        record = CallRecord(self, method)
        try:
            yield record
        finally:
            record.finish()

    def shutdown(self) -> None:
        """Stop the instruments' provider and leave the registry (idempotent)."""
        self.pipeline.shutdown()


__all__ = [
    "GRPC",
    "HTTP",
    "NO_SHARD",
    "ROUTER_DURATION_BUCKETS",
    "UNKNOWN_METHOD",
    "CallRecord",
    "RouterMetrics",
]
