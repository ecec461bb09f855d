"""The one typed settings object of a shard daemon, read from flags and `SHARDD_*` environment.

Flags win over the environment, which wins over the defaults; the defaults run locally.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from shardrouter.core.settings_source import env_names, settings_values
from shardrouter.core.shardmap_watch import configmap_spec_problems
from shardrouter.shardd.idempotency.placement import CLAIM_PLACEMENTS

ENV_PREFIX = "SHARDD_"


@dataclass(frozen=True, kw_only=True)
class ShardSettings:
    """Everything a shard daemon is configured with."""

    #: This shard's id, as in the shard map.
    shard_id: str = "shard-0"
    #: libpq connection string of the shard's own database.
    dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    #: gRPC listen address (host:port).
    listen: str = "127.0.0.1:50061"
    #: Port of the Prometheus /metrics endpoint (0 disables it).
    metrics_port: int = 9465
    #: Shard map file; needed to route credits to other shards. Empty: a single-shard system.
    shard_map: str = ""
    #: Seconds between checks of the shard map file (followed without a restart, as the router does).
    shard_map_reload_s: float = 1.0
    #: The shard map's ConfigMap, watched through the Kubernetes API (`NAMESPACE/NAME[:KEY]`, key
    #: `shard-map.yaml` by default): a move's new map arrives at once instead of when the kubelet
    #: refreshes the mounted file (60-90 s later). Needs shard_map, which stays the start-up map and
    #: the fallback; only a higher version replaces the map in force. Needs get and watch on that
    #: ConfigMap. Empty: follow the file alone.
    shard_map_configmap: str = ""
    #: gRPC worker threads. Keep more than `max_in_flight + max_waiting`: the spare threads answer shed
    #: calls at once instead of letting them queue behind busy ones.
    workers: int = 64
    #: Serving processes of this daemon, all on the one `listen` port (SO_REUSEPORT; the kernel spreads
    #: connections among them). A Python process uses about one core: more processes use more cores.
    #: The first one also runs the background work (relay, partition keeper) and serves /metrics on
    #: metrics_port; process i serves its own /metrics on metrics_port + i - 1.
    processes: int = 1
    #: Set by a multi-process daemon for each of its serving processes (1..processes); leave at 0.
    process_index: int = 0
    #: Calls open at once (running or queued for a thread), and the HTTP/2 streams one client
    #: connection may open; past it grpc answers RESOURCE_EXHAUSTED. Admission sheds long before.
    max_calls: int = 1024
    #: Database connections kept open even when idle.
    pool_min: int = 2
    #: Most database connections (what the database serves at once for this daemon).
    pool_max: int = 16
    #: Longest wait for a free connection (s); then UNAVAILABLE with RetryInfo.
    pool_timeout_s: float = 2.0
    #: Longest wait (s) of a schema migration, or of a partition's creation at start, for a lock
    #: another session holds; past it the start fails (nothing applied) instead of queueing a lock
    #: that stalls the shard's traffic, and is retried by the next start.
    migration_lock_timeout_s: float = 5.0
    #: RetryInfo delay after a transient database failure (ms).
    transient_retry_ms: int = 250
    #: Run a claimed key's handler transaction in psycopg's pipeline mode: a new-key Deposit in 1
    #: round trip (the claim, the Deposit, the record and the COMMIT in one pipeline; other handlers
    #: 2), not 5. Off only to debug statement by statement.
    db_pipeline: bool = True
    #: Where a UUIDv7 key's claim goes: `adaptive` sends it with the handler's first statements
    #: (one round trip less per new key) while few recent claims found their key taken, and on its
    #: own first when many did; `first` always on its own (a handler then never starts for a
    #: duplicate: for handlers that act outside their transaction before their first statement);
    #: `ahead` always with the handler.
    claim_placement: str = "adaptive"
    #: Idempotency keys expire after this many days.
    retention_days: int = 30
    #: Keys dated this far in the future are still accepted.
    max_clock_skew_s: int = 300
    #: How long a duplicate in this process waits for its twin's claim (ms); the claim itself never
    #: waits (it only tries the key's advisory lock).
    claim_lock_timeout_ms: int = 50
    #: Lock wait allowed to handlers on hot account rows (ms).
    handler_lock_timeout_ms: int = 2000
    #: RetryInfo delay for an in-flight duplicate (ms).
    in_flight_retry_ms: int = 100
    #: Longest a duplicate that asked to wait (`idempotency-wait-ms`, HTTP `Prefer: wait=N`) waits for
    #: its original in flight (ms); a longer ask is capped to it. 0: never wait (answer in flight).
    max_duplicate_wait_ms: int = 10_000
    #: A duplicate waiting for its original (it asked to) ends the original's database session once
    #: that session has waited this long (ms) on its own daemon in the middle of the call (the daemon
    #: stalled: stopped, starved, a long pause), which rolls the original back, and runs the call
    #: itself; what makes a hedged write escape a stalled daemon. 0: never (wait for the original).
    stalled_claim_ms: int = 0
    #: Accept only UUIDv7 idempotency keys (INVALID_ARGUMENT for any other UUID or an opaque key).
    #: A UUIDv7 dates itself, so a retry after its record was dropped is refused as expired; any
    #: other key is dated by its first receipt, and such a late retry looks like a new operation.
    require_uuidv7: bool = False
    #: Outbox relay worker threads delivering cross-shard credits (0: no relay).
    relay_workers: int = 2
    #: Outbox rows a relay worker takes at once.
    relay_batch: int = 32
    #: Age after which an undeliverable credit is voided and dead-lettered (s).
    relay_max_age_s: int = 6 * 3600
    #: Deadline of one delivery call to another shard (s).
    relay_call_timeout_s: float = 5.0
    #: Dead letters may be replayed by hand for this long; retention must outlast it.
    dead_letter_replay_days: int = 7
    #: Admission (shardd/admission.py): calls in flight (running, or waiting briefly for one of the
    #: pool_max connections) before the shard counts as saturated; past it a caller holding its fair
    #: share (max_in_flight / callers in flight) is shed at once.
    max_in_flight: int = 32
    #: Calls admitted beyond saturation for callers under their fair share; past max_in_flight +
    #: max_waiting every call is shed.
    max_waiting: int = 16
    #: Completed keys kept in memory for replays without a database read (0: none).
    replay_cache_entries: int = 10_000
    #: Most memory those kept keys' stored responses may use (MiB).
    replay_cache_mb: int = 16
    #: Largest request accepted (bytes).
    max_message_bytes: int = 64 * 1024
    #: Largest request metadata accepted (bytes).
    max_metadata_bytes: int = 16 * 1024
    #: mTLS: the daemon's server certificate (PEM file); with tls_key. Empty: no TLS.
    tls_cert: str = ""
    #: mTLS: the server certificate's private key (PEM file).
    tls_key: str = ""
    #: mTLS: the CA that signs callers' client certificates (PEM file); callers must present one.
    tls_ca: str = ""
    #: Client certificate identities (a SPIFFE ID, else the common name) allowed to speak for a caller
    #: via `x-caller-id`.
    trusted_proxies: tuple[str, ...] = ("router",)
    #: Dev mode believes `x-caller-id` without TLS. Never in production.
    dev_mode: bool = False
    #: Authorization policy file (JSON, gRFC A43 plus an account match; README, "Authorization"):
    #: who may call which method on which accounts. Followed without a restart; a bad new file is
    #: refused and the last good policy stays. Required to serve outside dev mode; in dev mode without
    #: one every call is allowed.
    authz_policy_file: str = ""
    #: Seconds between checks of the authorization policy file.
    authz_policy_reload_s: float = 1.0
    #: Seconds to finish in-flight calls on SIGTERM.
    shutdown_grace_s: float = 10.0
    #: Oldest a client's connection may get (s, +-10% jitter): then GOAWAY and the client reconnects,
    #: so a router's connections spread again over a shard's daemons after one was replaced (behind
    #: a Kubernetes Service a reconnect lands on any ready pod). 0 keeps connections forever.
    max_connection_age_s: float = 300.0
    #: Seconds a connection past its age still has for the calls running on it.
    max_connection_age_grace_s: float = 30.0
    #: With tracing on, also a span per SQL statement (psycopg instrumentation); the transaction span
    #: is always there. Off saves most of tracing's cost on a busy shard (`python -m bench.tracing_overhead`).
    trace_statements: bool = True
    #: Log format: "json" or "text".
    log_format: str = "json"
    #: Log level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"
    #: One INFO line per guarded call (logger shardd.calls: key, outcome, code, duration). Off by
    #: default: the outcome metrics carry the rates, and the line costs about 6 % of a busy shard's
    #: CPU; failed calls are logged (WARNING) either way. On to follow single keys in the logs.
    log_calls: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid shardd settings: " + "; ".join(problems))

    @property
    def retention(self) -> timedelta:
        """Key retention window."""
        return timedelta(days=self.retention_days)

    @property
    def tls_enabled(self) -> bool:
        """Whether mTLS is configured."""
        return bool(self.tls_cert)

    def serving_problems(self) -> list[str]:
        """What keeps these settings from serving calls (the other commands need no policy)."""
        if not self.dev_mode and not self.authz_policy_file:
            return [
                "authz_policy_file (SHARDD_AUTHZ_POLICY_FILE, --authz-policy-file) is required outside "
                "dev mode: without an authorization policy every caller could call every method on "
                "every account"
            ]
        return []

    def problems(self) -> list[str]:
        """Every reason these settings are unusable."""
        checks = [
            (self.workers < 1 or self.max_calls < 1, "workers and max_calls must be at least 1"),
            (
                not 1 <= self.processes <= 64 or not 0 <= self.process_index <= self.processes,
                "processes must be between 1 and 64, process_index between 0 and processes",
            ),
            (not 1 <= self.pool_min <= self.pool_max, "pool sizes must satisfy 1 <= pool_min <= pool_max"),
            (
                self.max_connection_age_s < 0 or self.max_connection_age_grace_s < 0,
                "max_connection_age_s and max_connection_age_grace_s must not be negative",
            ),
            (self.shard_map_reload_s <= 0, "shard_map_reload_s must be positive"),
            (
                not 0 < self.migration_lock_timeout_s <= 600,
                "migration_lock_timeout_s must be positive and at most 600",
            ),
            (
                bool(self.shard_map_configmap) and not self.shard_map,
                "shard_map_configmap needs shard_map: the file is the start-up map and the fallback",
            ),
            (
                not 0 < self.authz_policy_reload_s <= 60,
                "authz_policy_reload_s must be positive and at most 60",
            ),
            (
                self.max_in_flight < 1 or self.max_waiting < 0,
                "max_in_flight must be at least 1 and max_waiting at least 0",
            ),
            (
                self.replay_cache_entries < 0 or self.replay_cache_mb < 0,
                "replay_cache_entries and replay_cache_mb must not be negative",
            ),
            (self.transient_retry_ms < 1, "transient_retry_ms must be at least 1"),
            (
                self.claim_placement not in CLAIM_PLACEMENTS,
                f"claim_placement must be one of {', '.join(CLAIM_PLACEMENTS)}",
            ),
            (
                not 0 <= self.max_duplicate_wait_ms <= 600_000,
                "max_duplicate_wait_ms must be between 0 and 600000",
            ),
            (
                not 0 <= self.stalled_claim_ms <= 600_000,
                "stalled_claim_ms must be between 0 (never) and 600000",
            ),
            (self.retention_days < 1, "retention_days must be at least 1"),
            (
                bool(self.tls_cert) != bool(self.tls_key) or bool(self.tls_ca and not self.tls_cert),
                "tls_cert and tls_key go together, and tls_ca needs them",
            ),
            (self.log_format not in ("json", "text"), "log_format must be json or text"),
        ]
        out = [message for broken, message in checks if broken]
        out += configmap_spec_problems(self.shard_map_configmap)
        # The source document's late-replay failure: a key that expires before its slowest retry
        # path (relay redelivery, then a manual dead-letter replay) lets that retry apply twice.
        slowest = timedelta(seconds=self.relay_max_age_s) + timedelta(days=self.dead_letter_replay_days)
        if self.retention < slowest * 2:
            out.append(
                f"retention_days={self.retention_days} must be at least twice the slowest retry path "
                f"(relay_max_age_s + dead_letter_replay_days = {slowest}), or a late replay could apply twice"
            )
        return out


def parse_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ShardSettings:
    """Settings from `--flag value` arguments and `SHARDD_*` variables."""
    return ShardSettings(
        **settings_values(ShardSettings, prefix=ENV_PREFIX, prog="shardd", argv=argv, env=env)
    )


ENV_NAMES = env_names(ShardSettings, ENV_PREFIX)


__all__ = [
    "ENV_NAMES",
    "ENV_PREFIX",
    "ShardSettings",
    "parse_settings",
]
