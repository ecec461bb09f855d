"""The one typed settings object of the router, read from flags and `ROUTER_*` environment.

Flags win over the environment, which wins over the defaults; the defaults run locally. Same
approach as `shardd.settings`, so operators learn one convention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardrouter.core.settings_source import env_names, settings_values
from shardrouter.core.shardmap_watch import configmap_spec_problems

ENV_PREFIX = "ROUTER_"
MAX_FORWARD_RETRIES = 5


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    """Everything the router is configured with."""

    #: gRPC listen address (host:port).
    listen: str = "127.0.0.1:50051"
    #: Port of the Prometheus /metrics endpoint (0 disables it).
    metrics_port: int = 9464
    #: Shard map file (YAML or JSON, see `shardrouter.core.shardmap`); reloaded when it changes.
    shard_map: str = "shard-map.yaml"
    #: Seconds between checks of the shard map file.
    reload_interval_s: float = 1.0
    #: The shard map's ConfigMap, watched through the Kubernetes API (`NAMESPACE/NAME[:KEY]`, key
    #: `shard-map.yaml` by default): a move's new map arrives at once instead of when the kubelet
    #: refreshes the mounted file (60-90 s later). The file stays the start-up map and the fallback;
    #: only a higher version replaces the map in force. Needs get and watch on that ConfigMap.
    #: Empty: follow the file alone.
    shard_map_configmap: str = ""
    #: Calls forwarded at once (asyncio: no thread each), and the HTTP/2 streams one client connection
    #: may open. Past it grpc answers RESOURCE_EXHAUSTED; below it a client's parallel calls on one
    #: channel are never refused (a small stream cap made grpc reset streams with REFUSED_STREAM).
    max_calls: int = 1024
    #: Dev mode passes a caller-sent `x-caller-id` through without TLS. Never in production.
    dev_mode: bool = False
    #: The router's own server certificate (PEM file); with tls_key. Empty: no TLS.
    tls_cert: str = ""
    #: The server certificate's private key (PEM file).
    tls_key: str = ""
    #: CA of callers' client certificates (PEM file): callers need one (mTLS), and the verified
    #: certificate's common name becomes the forwarded `x-caller-id`.
    tls_ca: str = ""
    #: TLS towards the shards: the router's client certificate (PEM file), its identity to the shards,
    #: which trust it to speak for callers.
    shard_tls_cert: str = ""
    #: The client certificate's private key (PEM file).
    shard_tls_key: str = ""
    #: The CA that signs the shards' server certificates (PEM file).
    shard_tls_ca: str = ""
    #: Largest request accepted (bytes).
    max_message_bytes: int = 64 * 1024
    #: Largest request metadata accepted (bytes).
    max_metadata_bytes: int = 16 * 1024
    #: Upper bound of the deadline given to a shard when the caller set none, or a longer one (s).
    #: Above the 30 s that GetTransfer may wait, so a legitimate long poll is never cut short.
    max_deadline_s: float = 60.0
    #: Connections (channels) to each shard address, used in turn (passing over one still in
    #: reconnect backoff while another is connected); more than one spreads a shard's calls over
    #: its serving processes (`SHARDD_PROCESSES`, which share one port).
    shard_connections: int = 4
    #: Extra rounds for a keyed call or a read whose shard could not be reached, after each of the
    #: shard's daemons was tried once (a mutating call without a key gets no extra rounds).
    forward_retries: int = 2
    #: Longest a call may be held (s) while a shard refuses its account's slot range as moving
    #: (SLOT_RANGE_MOVING: a move is cutting over): the router re-reads the shard map and resends every
    #: few tens of ms, so the call lands once the move commits (at the new owner) or is called off;
    #: past it, or near the call's deadline, the shard's retryable answer is passed on. 0: at once.
    move_wait_s: float = 2.0
    #: Hedged forwarding, off at 0: a keyed call or a read that a shard's daemon has not answered
    #: after this many ms is also sent to the shard's next daemon (the key keeps it applied once; the
    #: second attempt waits for a twin in flight and replays it); the first answer is the caller's.
    #: Set it near the calls' p95, for shards served by two or more daemons.
    hedge_after_ms: int = 0
    #: Most hedges, in percent of the calls that could be hedged (a token bucket, as gRPC's retry
    #: throttling): a shard slow for every call cannot multiply the router's load.
    hedge_budget_percent: float = 10.0
    #: Seconds to finish in-flight calls on SIGTERM.
    shutdown_grace_s: float = 10.0
    #: Oldest a caller's connection may get (s, grpc adds +-10% jitter): then the router sends GOAWAY
    #: and the caller reconnects, so long-lived callers spread over new router pods after a scale-up
    #: or rollout. 0 keeps connections forever.
    max_connection_age_s: float = 300.0
    #: Seconds a connection past its age still has for the calls running on it.
    max_connection_age_grace_s: float = 30.0
    #: HTTP/JSON front listen address (host:port), served beside gRPC by the same process with the
    #: same forwarding; empty: no HTTP front. It serves TLS with the gRPC server's certificate and
    #: caller CA (tls_cert, tls_key, tls_ca), so callers prove who they are the same way on both.
    http_listen: str = ""
    #: Largest HTTP request body accepted (bytes); a larger one is answered 413 unread.
    http_max_body_bytes: int = 64 * 1024
    #: Longest an HTTP request's headers, and then its body, may each take to arrive (s); also how
    #: long a new connection may stay silent. A slow sender is answered 408 and disconnected, so it
    #: cannot hold a connection and a task for ever (slowloris).
    http_body_timeout_s: float = 10.0
    #: Deadline of a call made over HTTP (s), as a gRPC caller's deadline would be (capped by
    #: max_deadline_s).
    http_deadline_s: float = 30.0
    #: Seconds an idle HTTP keep-alive connection is kept open.
    http_keep_alive_s: float = 15.0
    #: Most HTTP connections open at once; past it new requests are answered 503.
    http_max_connections: int = 2048
    #: Log format: "json" or "text".
    log_format: str = "json"
    #: Log level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid router settings: " + "; ".join(problems))

    @property
    def tls_enabled(self) -> bool:
        """Whether the router serves TLS."""
        return bool(self.tls_cert)

    @property
    def verifies_callers(self) -> bool:
        """Whether callers must present a client certificate (mTLS), so their identity is known."""
        return bool(self.tls_cert and self.tls_ca)

    @property
    def shard_tls_enabled(self) -> bool:
        """Whether the router speaks TLS to the shards."""
        return bool(self.shard_tls_cert or self.shard_tls_ca)

    def problems(self) -> list[str]:
        """Every reason these settings are unusable."""
        checks = [
            (":" not in self.listen, "listen must be host:port"),
            (not self.shard_map, "shard_map must name the shard map file"),
            (self.reload_interval_s <= 0, "reload_interval_s must be positive"),
            (self.max_calls < 1, "max_calls must be at least 1"),
            (not 1 <= self.shard_connections <= 64, "shard_connections must be between 1 and 64"),
            (
                bool(self.tls_cert) != bool(self.tls_key) or (self.tls_ca and not self.tls_cert),
                "tls_cert and tls_key go together, and tls_ca needs them",
            ),
            (
                bool(self.shard_tls_cert) != bool(self.shard_tls_key),
                "shard_tls_cert and shard_tls_key go together",
            ),
            (
                self.max_message_bytes < 1024 or self.max_metadata_bytes < 1024,
                "max_message_bytes and max_metadata_bytes must be at least 1024",
            ),
            (self.max_deadline_s <= 0, "max_deadline_s must be positive"),
            (
                not 0 <= self.forward_retries <= MAX_FORWARD_RETRIES,
                f"forward_retries must be between 0 and {MAX_FORWARD_RETRIES}",
            ),
            (
                not 0 <= self.hedge_after_ms <= self.max_deadline_s * 1000,
                "hedge_after_ms must be between 0 (off) and max_deadline_s",
            ),
            (
                not 0 <= self.hedge_budget_percent <= 100,
                "hedge_budget_percent must be between 0 and 100",
            ),
            (
                not 0 <= self.move_wait_s <= self.max_deadline_s,
                "move_wait_s must be between 0 and max_deadline_s",
            ),
            (self.shutdown_grace_s < 0, "shutdown_grace_s must not be negative"),
            (
                self.max_connection_age_s < 0 or self.max_connection_age_grace_s < 0,
                "max_connection_age_s and max_connection_age_grace_s must not be negative",
            ),
            (
                self.http_listen and ":" not in self.http_listen,
                "http_listen must be host:port (or empty: no HTTP front)",
            ),
            (
                self.http_listen and self.http_listen == self.listen and not self.listen.endswith(":0"),
                "http_listen must differ from listen",
            ),
            (self.http_max_body_bytes < 1024, "http_max_body_bytes must be at least 1024"),
            (
                self.http_body_timeout_s <= 0 or self.http_keep_alive_s <= 0,
                "http_body_timeout_s and http_keep_alive_s must be positive",
            ),
            (self.http_deadline_s <= 0, "http_deadline_s must be positive"),
            (self.http_max_connections < 1, "http_max_connections must be at least 1"),
            (self.log_format not in ("json", "text"), "log_format must be json or text"),
        ]
        return [message for broken, message in checks if broken] + configmap_spec_problems(
            self.shard_map_configmap
        )


def parse_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RouterSettings:
    """Settings from `--flag value` arguments and `ROUTER_*` variables."""
    return RouterSettings(
        **settings_values(RouterSettings, prefix=ENV_PREFIX, prog="router", argv=argv, env=env)
    )


ENV_NAMES = env_names(RouterSettings, ENV_PREFIX)


__all__ = [
    "ENV_NAMES",
    "ENV_PREFIX",
    "MAX_FORWARD_RETRIES",
    "RouterSettings",
    "parse_settings",
]
