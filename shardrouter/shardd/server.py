"""Assembles a shard daemon: database, migrations, partitions, interceptors, servicers, relay."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import grpc
import psycopg
from grpc_health.v1 import health
from opentelemetry import trace

from shardrouter.core import grpcserver, tls, tracing
from shardrouter.core.interceptors import ServerInterceptorBase
from shardrouter.core.lifecycle import Stoppable, stop_all
from shardrouter.core.metrics import start_metrics_server
from shardrouter.core.rpcs import INTERNAL_SERVICE, PUBLIC_SERVICE, RPCS, RpcDeclaration, RpcDeclarationError
from shardrouter.core.shardmap import ShardMap, ShardMapError
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.core.shardmap_watch import watch_shard_map_configmap
from shardrouter.internal.v1 import ledger_pb2_grpc
from shardrouter.shardd import migrations, partitions
from shardrouter.shardd.admission import Admission, AdmissionLimits
from shardrouter.shardd.authorization import AuthorizationInterceptor, AuthzObserver, PolicyFile
from shardrouter.shardd.authorization_policy import AuthzPolicyError
from shardrouter.shardd.db import Database
from shardrouter.shardd.idempotency import IdempotencyConfig, IdempotencyInterceptor, MutatingMethod
from shardrouter.shardd.idempotency.outcomes import OutcomeListener
from shardrouter.shardd.idempotency.process_keys import CompletedKeys
from shardrouter.shardd.idempotency.waiting import KeyWaits
from shardrouter.shardd.identity import IdentityPolicy
from shardrouter.shardd.interceptor_chain import build_interceptors
from shardrouter.shardd.ledger.service import (
    REQUEST_VALIDATORS,
    ShardLedgerServicer,
    ShardLocator,
    TransferServicer,
)
from shardrouter.shardd.listener import ShardListener
from shardrouter.shardd.observability import ShardMetrics, ShardStateCollector
from shardrouter.shardd.ownership import DatabaseOwnership
from shardrouter.shardd.partition_keeper import PartitionKeeper
from shardrouter.shardd.settings import ShardSettings
from shardrouter.shardd.transfer_waits import TRANSFER_CHANNEL, TransferWaits
from shardrouter.v1 import transfer_pb2_grpc

log = logging.getLogger(__name__)

# Partitions exist this many months past the current one, so an insert never lacks one.
MONTHS_AHEAD = 2


def mutating_methods(locator: ShardLocator | None = None) -> list[MutatingMethod]:
    """Every keyed method of the shard (as the proto declares them), guarded by the idempotency interceptor.

    Each is checked first by its request validator (`REQUEST_VALIDATORS`, beside the handlers). With
    a `locator`, it also refuses, before any claim, an account that another shard owns (`owned_here`).
    """
    return [_guarded_method(d, locator) for d in RPCS if d.keyed]


def _guarded_method(declaration: RpcDeclaration, locator: ShardLocator | None) -> MutatingMethod:
    validate = REQUEST_VALIDATORS.get(declaration.name)
    if validate is None:
        raise RpcDeclarationError(
            f"rpc {declaration.service}.{declaration.name} is keyed but has no request validator in "
            "shardrouter.shardd.ledger.service.REQUEST_VALIDATORS"
        )
    if locator is not None:
        validate = owned_here(validate, declaration.routing_field, locator)
    return MutatingMethod(
        declaration.full_name,
        validate,
        scope_name=declaration.scope_name,
        routing_field=declaration.routing_field,
    )


def owned_here(
    validate: Callable[[Any], None], routing_field: str, locator: ShardLocator
) -> Callable[[Any], None]:
    """`validate`, then refuse (UNAVAILABLE, ACCOUNT_MOVED) a request whose account another shard owns.

    The interceptor runs it before the key is looked up or claimed, so the refusal names the owner
    and costs no database work. Left to the handler, a call on an account moved out would first
    meet the moved slot's fence at the claim (SLOT_RANGE_MOVING, which names no owner: a router whose
    map is older than this daemon's could not follow it), or replay a record that moved with it.
    Like a validation failure, it is answered and never stored. An empty account (a VoidCredit from
    an older relay) is left to the handler and the fences.
    """

    def check(request: Any) -> None:
        validate(request)
        account_id = str(getattr(request, routing_field))
        if account_id:
            locator.require_local(account_id)

    return check


def idempotency_config(settings: ShardSettings) -> IdempotencyConfig:
    """The interceptor's configuration from the daemon's settings."""
    return IdempotencyConfig(
        retention=settings.retention,
        max_clock_skew=timedelta(seconds=settings.max_clock_skew_s),
        claim_lock_timeout_ms=settings.claim_lock_timeout_ms,
        handler_lock_timeout_ms=settings.handler_lock_timeout_ms,
        in_flight_retry_ms=settings.in_flight_retry_ms,
        require_uuidv7=settings.require_uuidv7,
        max_duplicate_wait_ms=settings.max_duplicate_wait_ms,
        stalled_claim_ms=settings.stalled_claim_ms,
        claim_placement=settings.claim_placement,
    )


def prepare_database(
    dsn: str, retention: timedelta, *, lock_timeout_s: float = migrations.DEFAULT_LOCK_TIMEOUT_S
) -> None:
    """Apply migrations and create every partition a live key could need, waiting at most
    `lock_timeout_s` for any lock (`migrations.MigrationLockTimeout`, or psycopg's LockNotAvailable
    from a partition's creation)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrations.apply_migrations(conn, lock_timeout_s=lock_timeout_s)
        conn.execute(
            "SELECT set_config('lock_timeout', %s, false)", (f"{max(1, round(lock_timeout_s * 1000))}ms",)
        )
        partitions.ensure_partitions(
            conn,
            now=datetime.now(UTC),
            retention=retention,
            months_ahead=MONTHS_AHEAD,
        )


def _prepare(settings: ShardSettings, database: Database) -> None:
    """Schema and partitions ready, the pool open; on failure the pool is closed again."""
    try:
        prepare_database(settings.dsn, settings.retention, lock_timeout_s=settings.migration_lock_timeout_s)
        database.open()
    except BaseException:
        database.close()
        raise


@dataclass
class ShardDaemon:
    """A running shard daemon (what `start_shard` returns)."""

    settings: ShardSettings
    server: grpc.Server
    port: int
    database: Database
    health: health.HealthServicer
    #: The followed shard map (None when the daemon runs without one).
    shard_maps: ShardMapFile | None
    #: The followed authorization policy (None: dev mode without one, every call allowed).
    policies: PolicyFile | None = None
    #: What runs beside the server, in start order (stopped in reverse).
    background: list[Stoppable] = field(default_factory=list)
    #: The daemon's metrics (None when metrics_port is 0) and the port /metrics is served on.
    metrics: ShardMetrics | None = None
    metrics_port: int = 0
    #: The `GetTransfer` calls waiting for transfers, woken by the relay (and its listener).
    transfer_waits: TransferWaits = field(default_factory=TransferWaits)
    #: Who owns an account as this daemon decides it: its map, overruled by its database's facts.
    locator: ShardLocator | None = None
    #: The database's ownership facts and fences, read again on a timer and on demand.
    ownership: DatabaseOwnership | None = None
    #: The duplicates waiting for their key's original, and the wait requests this process answers.
    key_waits: KeyWaits | None = None

    @property
    def shard_map(self) -> ShardMap | None:
        """The shard map in force."""
        return self.shard_maps.current if self.shard_maps is not None else None

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: health NOT_SERVING, drain calls, stop the background parts, close the pool."""
        grpcserver.graceful_stop(
            self.server, self.health, self.settings.shutdown_grace_s if grace_s is None else grace_s
        )
        stop_all(self.background)
        if self.metrics is not None:
            self.metrics.shutdown()  # its registry stops exposing the instruments
        self.database.close()


def admission_from(settings: ShardSettings) -> Admission:
    """The daemon's admission limits, as its settings give them."""
    return Admission(
        AdmissionLimits(
            max_in_flight=settings.max_in_flight,
            max_waiting=settings.max_waiting,
            retry_after_ms=settings.in_flight_retry_ms,
        ),
        frozenset(settings.trusted_proxies),
        dev_mode=settings.dev_mode,
    )


def follow_shard_map(settings: ShardSettings) -> ShardMapFile | None:
    """The daemon's shard map follower (not yet polling), or None when it runs without a map.

    Ownership is decided by the map in force at each call, so from a new version on this shard refuses
    the accounts it no longer owns (retryable UNAVAILABLE, ACCOUNT_MOVED), after reading the file once
    more (`ShardLocator.require_local`).
    """
    if not settings.shard_map:
        return None
    shard_maps = ShardMapFile(settings.shard_map, interval_s=settings.shard_map_reload_s)
    if shard_maps.current.shard_by_id(settings.shard_id) is None:
        raise ShardMapError(f"shard map {settings.shard_map} has no shard {settings.shard_id!r}")
    return shard_maps


def identity_from(settings: ShardSettings) -> IdentityPolicy:
    """Whom the daemon believes a caller is (the key scope's and the authorization's caller)."""
    return IdentityPolicy(dev_mode=settings.dev_mode, trusted_proxies=frozenset(settings.trusted_proxies))


def follow_policy(settings: ShardSettings, observer: AuthzObserver | None = None) -> PolicyFile | None:
    """The daemon's authorization policy follower (not yet polling), or None in dev mode without a file.

    Outside dev mode a policy file is required (`ShardSettings.serving_problems`); a missing or bad
    file stops the start with AuthzPolicyError, naming the setting or the bad place in the file.
    """
    problems = settings.serving_problems()
    if problems:
        raise AuthzPolicyError("invalid shardd settings: " + "; ".join(problems))
    if not settings.authz_policy_file:
        log.warning(
            "dev mode without an authorization policy (authz_policy_file): every caller may call every "
            "method on every account"
        )
        return None
    return PolicyFile(
        settings.authz_policy_file, interval_s=settings.authz_policy_reload_s, observer=observer
    )


def authorization_from(
    settings: ShardSettings, policies: PolicyFile | None, observer: AuthzObserver | None = None
) -> AuthorizationInterceptor | None:
    """The interceptor enforcing the followed policy (None without one: nothing to enforce)."""
    if policies is None:
        return None
    return AuthorizationInterceptor(lambda: policies.current, identity_from(settings), observer)


def new_database(
    settings: ShardSettings, *, tracer_provider: trace.TracerProvider | None = None, traced: bool = False
) -> Database:
    """The daemon's connection pool (not yet open), as its settings give it."""
    return Database(
        settings.dsn,
        min_size=settings.pool_min,
        max_size=settings.pool_max,
        acquire_timeout_s=settings.pool_timeout_s,
        transient_retry_ms=settings.transient_retry_ms,
        pipeline=settings.db_pipeline,
        tracer_provider=tracer_provider,
        traced=traced and settings.trace_statements,
    )


def new_idempotency_interceptor(
    settings: ShardSettings,
    database: Database,
    locator: ShardLocator,
    admission: Admission,
    *,
    listeners: Sequence[OutcomeListener],
    tracer: trace.Tracer | None,
) -> IdempotencyInterceptor:
    """The interceptor guarding every keyed RPC, with this daemon's limits and memory."""
    return IdempotencyInterceptor(
        database=database,
        methods=mutating_methods(locator),
        config=idempotency_config(settings),
        identity=identity_from(settings),
        listeners=listeners,
        tracer=tracer,
        shard_id=settings.shard_id,
        admission=admission,
        completed=CompletedKeys(
            max_entries=settings.replay_cache_entries, max_bytes=settings.replay_cache_mb * 1024 * 1024
        ),
    )


def new_grpc_server(settings: ShardSettings, interceptors: Sequence[ServerInterceptorBase]) -> grpc.Server:
    """The daemon's thread-pool gRPC server (no services yet), with its settings' limits."""
    return grpcserver.new_server(
        workers=settings.workers,
        max_calls=settings.max_calls,
        interceptors=list(interceptors),
        options=grpcserver.server_options(
            max_message_bytes=settings.max_message_bytes,
            max_metadata_bytes=settings.max_metadata_bytes,
            max_streams=settings.max_calls,
            share_port=settings.processes > 1,
            max_connection_age_s=settings.max_connection_age_s,
            max_connection_age_grace_s=settings.max_connection_age_grace_s,
        ),
    )


def listen_when_ready(
    settings: ShardSettings,
    server: grpc.Server,
    database: Database,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind and start `server`, migrate the schema and open the pool; the bound port.

    A lone process listens first (health answers NOT_SERVING while the schema is prepared, so a
    probe sees it alive); one of several processes on a shared port listens only once it can serve,
    since the kernel hands it connections as soon as it listens (its parent migrated the schema).
    """
    if settings.processes > 1:
        _prepare(settings, database)
        port = grpcserver.bind(server, settings.listen, credentials)
        server.start()
        return port
    port = grpcserver.bind(server, settings.listen, credentials)
    server.start()
    try:
        _prepare(settings, database)
    except BaseException:  # database unreachable, or SIGTERM during a migration: leave nothing running
        server.stop(0)
        raise
    return port


def _start(part: _Startable, into: list[Stoppable]) -> None:
    part.start()
    into.append(part)


def start_background(daemon: ShardDaemon, *, metrics_host: str | None = None) -> None:
    """Start what runs beside the server: map poll, partition keeper, state collector, /metrics, relay.

    In a multi-process daemon only the first serving process runs the background work; the claim
    protocol needs none of it to be safe across processes.
    """
    settings, background = daemon.settings, daemon.background
    runs_background = settings.process_index <= 1
    if daemon.policies is not None:  # every serving process enforces, so every one follows the file
        _start(daemon.policies, background)
    if daemon.shard_maps is not None:
        _start(daemon.shard_maps, background)
        # Every serving process decides ownership, so every one follows the ConfigMap too (started
        # by the call; the mounted file stays the fallback).
        watch = watch_shard_map_configmap(settings.shard_map_configmap, daemon.shard_maps)
        if watch is not None:
            background.append(watch)
    if daemon.ownership is not None:  # every serving process decides ownership, so every one reads it
        daemon.ownership.check()  # before the first call: a stale map must not decide it
        _start(daemon.ownership, background)
    if runs_background:
        # Keeps months ahead partitioned while the daemon runs, whether or not the retention CronJob does.
        _start(
            PartitionKeeper(settings.dsn, retention=settings.retention, months_ahead=MONTHS_AHEAD), background
        )
    if daemon.metrics is not None and runs_background:
        _start(
            ShardStateCollector(daemon.database, retention=settings.retention, metrics=daemon.metrics),
            background,
        )
    if daemon.metrics is not None:
        host = metrics_host if metrics_host is not None else grpcserver.listen_host(settings.listen)
        metrics_port = settings.metrics_port + max(0, settings.process_index - 1)
        metrics_server = start_metrics_server(metrics_port, daemon.metrics.registry, host=host)
        background.append(metrics_server)
        daemon.metrics_port = metrics_server.port
    # Every serving process listens: its waiters hear other daemons' commits, and its flights hear
    # the duplicates that wait for them.
    listener = ShardListener(settings.dsn)
    listener.subscribe(TRANSFER_CHANNEL, daemon.transfer_waits.notify_payload)
    listener.on_connection(daemon.transfer_waits.set_listening)
    if daemon.key_waits is not None:
        daemon.key_waits.subscribe(listener)
    relay = None
    if daemon.shard_maps is not None and settings.relay_workers > 0 and runs_background:
        from shardrouter.shardd.relay import OutboxRelay

        maps = daemon.shard_maps
        relay = OutboxRelay(
            settings,
            daemon.database,
            lambda: maps.current,
            daemon.transfer_waits,
            locator=daemon.locator,
            ownership=daemon.ownership,
            listener=listener,
        )
    _start(listener, background)
    if relay is not None:
        _start(relay, background)


def start_shard(
    settings: ShardSettings,
    *,
    listeners: Sequence[OutcomeListener] = (),
    tracer_provider: trace.TracerProvider | None = None,
    metrics_host: str | None = None,
) -> ShardDaemon:
    """Migrate, then serve; health turns SERVING only when the schema is ready.

    Tracing: spans go to `tracer_provider` when given (tests), else to the global provider that
    `tracing.configure_tracing` installed; with neither, the tracing interceptor is left out.
    Metrics: with `settings.metrics_port > 0`, /metrics is served on `metrics_host` (default: the
    host of `settings.listen`, so a loopback daemon exposes its metrics on loopback only).
    """
    metrics = ShardMetrics() if settings.metrics_port > 0 else None
    policies = follow_policy(settings, metrics)
    shard_maps = follow_shard_map(settings)
    traced = tracing.tracing_active(tracer_provider)
    database = new_database(settings, tracer_provider=tracer_provider, traced=traced)
    ownership = DatabaseOwnership(database.connection) if shard_maps is not None else None
    locator = ShardLocator(settings.shard_id, shard_maps, ownership)
    if shard_maps is not None:
        database.on_slot_fenced = locator.refresh
    admission = admission_from(settings)
    guard = new_idempotency_interceptor(
        settings,
        database,
        locator,
        admission,
        listeners=[*listeners, *([metrics.observe] if metrics else [])],
        tracer=tracing.get_tracer(tracer_provider) if traced else None,
    )
    server = new_grpc_server(
        settings,
        build_interceptors(
            idempotency=guard,
            admission=admission,
            tracing=tracing.server_interceptor(tracer_provider) if traced else None,
            authorization=authorization_from(settings, policies, metrics),
        ),
    )
    transfer_waits = TransferWaits()
    transfer_pb2_grpc.add_TransferServiceServicer_to_server(
        TransferServicer(database, locator, transfer_waits), server
    )
    ledger_pb2_grpc.add_ShardLedgerServiceServicer_to_server(ShardLedgerServicer(locator), server)
    health_servicer = grpcserver.add_health_and_reflection(server, [PUBLIC_SERVICE, INTERNAL_SERVICE])
    credentials = (
        tls.server_credentials(settings.tls_cert, settings.tls_key, settings.tls_ca)
        if settings.tls_enabled
        else None
    )
    port = listen_when_ready(settings, server, database, credentials)
    daemon = ShardDaemon(
        settings,
        server,
        port,
        database,
        health_servicer,
        shard_maps,
        policies,
        metrics=metrics,
        transfer_waits=transfer_waits,
        locator=locator,
        ownership=ownership,
        key_waits=guard.key_waits,
    )
    if metrics is not None:
        metrics.follow_ownership(locator)
        metrics.follow_key_waits(guard.key_waits)
    start_background(daemon, metrics_host=metrics_host)
    grpcserver.mark_serving(health_servicer, [PUBLIC_SERVICE, INTERNAL_SERVICE])
    _warn_about(settings)
    _log_serving(settings, port)
    return daemon


def _warn_about(settings: ShardSettings) -> None:
    if settings.workers <= settings.max_in_flight + settings.max_waiting:
        log.warning(
            "workers (%d) do not exceed max_in_flight + max_waiting (%d): calls past the admission limits "
            "queue for a thread instead of being answered at once",
            settings.workers,
            settings.max_in_flight + settings.max_waiting,
        )
    if not settings.tls_enabled and not settings.dev_mode:
        log.warning("no TLS and not in dev mode: every call will be refused as unauthenticated")


def _log_serving(settings: ShardSettings, port: int) -> None:
    if settings.process_index:
        log.info(
            "shard %s serving on port %d (process %d of %d)",
            settings.shard_id,
            port,
            settings.process_index,
            settings.processes,
        )
    else:
        log.info("shard %s serving on port %d", settings.shard_id, port)


class _Startable(Stoppable, Protocol):
    def start(self) -> None: ...


__all__ = [
    "INTERNAL_SERVICE",
    "MONTHS_AHEAD",
    "PUBLIC_SERVICE",
    "ShardDaemon",
    "admission_from",
    "authorization_from",
    "follow_policy",
    "follow_shard_map",
    "idempotency_config",
    "identity_from",
    "listen_when_ready",
    "mutating_methods",
    "new_database",
    "new_grpc_server",
    "new_idempotency_interceptor",
    "owned_here",
    "prepare_database",
    "start_background",
    "start_shard",
]
