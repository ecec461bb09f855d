"""Metrics plumbing shared by every process: OpenTelemetry instruments, exposed for Prometheus scraping.

Each process (each shard daemon, even two in one test process) owns a `MetricsPipeline`: an SDK
`MeterProvider` whose only built-in reader is a `PrometheusMetricReader` writing into the
pipeline's own `prometheus_client.CollectorRegistry`; `start_metrics_server()` serves that registry
at /metrics. Nothing here touches the global meter provider, so pipelines never mix their series.

The reader runs with target_info and the instrument-scope labels off, so what Prometheus scrapes is
exactly the instruments: a counter named `router_requests` is `router_requests_total`, a histogram
`router_request_duration_seconds` keeps its name (its unit "s" maps to the suffix it already has).

Each process's own instruments live with it: the router's in `router/metrics.py`, the shard
daemon's in `shardd/observability.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from threading import Thread
from typing import TYPE_CHECKING

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from prometheus_client import CollectorRegistry, start_http_server

from shardrouter.core.grpcserver import ListenError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


log = logging.getLogger(__name__)

@dataclass(eq=False)
class MetricsPipeline:
    """A `MeterProvider` read by Prometheus into `registry`; build one with `new_metrics_pipeline()`."""

    provider: MeterProvider
    reader: MetricReader
    registry: CollectorRegistry
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _shut_down: bool = field(default=False, repr=False)

    def meter(self, name: str) -> Meter:
        """The meter instruments of the component `name` are created from."""
        return self.provider.get_meter(name)

    def shutdown(self) -> None:
        """Shut the provider down; its reader leaves `registry` (idempotent)."""
        with self._lock:
            # The SDK logs a warning on a second shutdown; a daemon may reach this from two paths.
            if self._shut_down:
                return
            self._shut_down = True
        self.provider.shutdown()


def new_metrics_pipeline(
    registry: CollectorRegistry | None = None, *, readers: Sequence[MetricReader] = ()
) -> MetricsPipeline:
    """A fresh provider exposing its instruments in `registry` (default: a new, private one).

    `readers` see the same instruments too (an OTLP `PeriodicExportingMetricReader`, or an
    `InMemoryMetricReader` in tests).
    """
    registry = registry if registry is not None else CollectorRegistry()
    # No target_info and no otel_scope_* labels: the series keep the exact names and label sets
    # the alert rules use; Prometheus's own job/pod labels already say which target it is.
    reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=registry)
    # A pull reader has nothing to flush at exit, and an atexit hook would keep every provider
    # (one per test daemon) alive until the interpreter ends.
    provider = MeterProvider(metric_readers=[reader, *readers], shutdown_on_exit=False)
    return MetricsPipeline(provider, reader, registry)


@dataclass
class MetricsServer:
    """A running Prometheus /metrics HTTP endpoint."""

    host: str
    port: int
    _server: WSGIServer
    _thread: Thread

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int, registry: CollectorRegistry, *, host: str = "0.0.0.0") -> MetricsServer:  # noqa: S104
    """Serve `registry` at http://host:port/metrics in a daemon thread (port 0: pick a free one).

    The default host is every interface (a Prometheus in the cluster scrapes the pod); local runs
    and tests pass 127.0.0.1. grpcserver.ListenError, naming the address, if it cannot be bound.
    """
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # the port in use, or the host not this machine's: say which
        raise ListenError(f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}") from exc
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)


__all__ = [
    "MetricsPipeline",
    "MetricsServer",
    "new_metrics_pipeline",
    "start_metrics_server",
]
