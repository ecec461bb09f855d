"""The outbox relay: delivers cross-shard credits at least once; the destination makes them exactly-once.

Workers lock due outbox rows with `FOR UPDATE SKIP LOCKED` (oldest first, in batches), send each
credit to the destination shard's `CreditTransfer` with the credit's own idempotency key, and mark the
row delivered only after the destination answered OK. A redelivery after a crash replays the stored
outcome at the destination, so the credit applies once. Idle workers are woken by the commit that
queues a credit (the process's `listener.ShardListener`, in `LISTEN shardrouter_outbox`; migration 11
notifies) and look every `_IDLE_S` anyway, for postponed credits and for a notification lost while
the listener was down.

Callers waiting in `GetTransfer` are woken when a transfer leaves PENDING (`transfer_waits`): the
transaction that marks a transfer completed also sends `pg_notify` on `TRANSFER_CHANNEL`, and so does
the relay once a refund it sent is confirmed; right after, it signals this process's waiters. The
process's listener hears `TRANSFER_CHANNEL` and signals them when another daemon of the shard made
the change (a relay built without the process's listener runs one of its own that does).

A credit that fails for good (unknown or closed account, currency mismatch) or that is older than
`relay_max_age_s` goes to `dead_letters` and is compensated by `RefundTransfer` on this shard, keyed
by the transfer's refund key. Before giving up on age, the relay fences the credit with `VoidCredit`
under the credit's key, which the destination also records as a fact of the transfer, so a slow
credit can never land after the refund, whichever relay sends it; a void refused because the credit
already landed leaves the row to the next delivery, which learns it was delivered.

Tracing: the polls run untraced, so an idle relay leaves no spans. A poll that finds work runs it
in one job span, `outbox.deliver` or `outbox.refund`, whose children are the job's statements and,
through the `traceparent` it sends, the destination shard's spans of the calls it makes.

Channels: those of every client of the shards (`core.channels`, shared with the router): the same
options (keepalive, reconnect backoff), the same rule for a daemon that was not reached (tried at
the shard's next daemon), and the same certificate rotation.

TLS: the relay's client certificate is the shard's own (`tls_cert`, `tls_key`, `tls_ca`) and follows
its rotation as the router's does (`core.channels.CertificateRotation`): polled at most once a
second, when a call is about to be made; after a renewal new calls go out on new channels that
present the new certificate, calls in flight finish on the old ones, and a half-written set is
skipped (the last good certificate stays in use).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
from opentelemetry import trace

from shardrouter.core import failpoints, rpcs, tls, tracing
from shardrouter.core.callers import CALLER_METADATA
from shardrouter.core.channels import (
    CERT_POLL_S,
    CertificateRotation,
    channel_options,
    new_channel,
    retire_after_s,
    unreached,
)
from shardrouter.core.errors import ShardRouterError
from shardrouter.core.keys import KEY_METADATA
from shardrouter.core.ownership import RangeOwner, moved_to
from shardrouter.core.shardmap import ShardMap
from shardrouter.internal.v1 import ledger_pb2
from shardrouter.shardd.db import Database, mapped_database_errors
from shardrouter.shardd.ledger import store
from shardrouter.shardd.ledger.service import refund_key
from shardrouter.shardd.listener import ShardListener
from shardrouter.shardd.ownership import OWNERSHIP_CHANNEL, DatabaseOwnership, ShardLocator
from shardrouter.shardd.settings import ShardSettings
from shardrouter.shardd.transfer_waits import TRANSFER_CHANNEL, TransferWaits, notify_in_transaction

log = logging.getLogger(__name__)

_PERMANENT = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
}
#: How long an idle worker waits before looking again without being woken (s): the fallback for a
#: lost notification, and what makes postponed credits (backoff) due again.
_IDLE_S = 1.0
#: The channel a commit that queues a credit notifies (migration 11).
OUTBOX_CHANNEL = "shardrouter_outbox"
#: The relay's failpoints (core/failpoints.py): a credit delivered and answered OK, not yet marked
#: delivered; a dead letter committed, its refund not yet sent.
DELIVERED_BEFORE_MARKED = "shardd.relay_delivered_before_marked"
DEAD_LETTERED_BEFORE_REFUND = "shardd.relay_dead_lettered_before_refund"
_MAX_BACKOFF_S = 60.0
#: How often, at most, the client certificate files are checked for a rotation (s).
_CERT_POLL_S = CERT_POLL_S


@dataclass(frozen=True)
class RelayStats:
    """What one pass of the relay did."""

    delivered: int = 0
    postponed: int = 0
    dead_lettered: int = 0
    refunded: int = 0


class ShardClients:
    """One channel per daemon of the peer shards (`core.channels` options), reused by every worker.

    With TLS the channels are replaced when the client certificate is renewed; the replaced ones are
    closed once every call that may still run on them has reached its deadline.
    """

    def __init__(
        self,
        settings: ShardSettings,
        shard_map: Callable[[], ShardMap],
        on_moved: Callable[[RangeOwner], object] | None = None,
    ) -> None:
        self._settings = settings
        self._map = shard_map  # the map in force, read at every call (it is followed without restart)
        #: Told the range, owner and version a shard named when it refused a credit as not its own.
        self._on_moved = on_moved
        self._channels: dict[str, grpc.Channel] = {}  # by daemon address
        self._turns = itertools.count()
        self._lock = threading.Lock()
        self._options = channel_options(max_message_bytes=settings.max_message_bytes)
        # Start-up: an unreadable certificate file is an error here, as for the server's.
        self._rotation = CertificateRotation(
            tls.ClientCertificateFiles(settings.tls_cert, settings.tls_key, settings.tls_ca)
            if settings.tls_enabled
            else None,
            _CERT_POLL_S,
        )
        # Channels replaced by a rotation, each with the time after which no call can still run on it.
        self._retired: list[tuple[float, grpc.Channel]] = []

    def call(
        self, shard_id: str, method: str, payload: bytes, key: str | uuid.UUID, timeout_s: float
    ) -> tuple[grpc.StatusCode, str]:
        """Send raw request bytes to a shard's internal method (by name, as the proto declares it); the
        status and message it answered.

        A shard served by several daemons is tried at each of them in turn until one is reached
        (`core.channels.unreached`; the same key everywhere: the shard applies it once).
        """
        shard = self._map().shard_by_id(shard_id)
        if shard is None:
            raise LookupError(f"shard {shard_id} is not in the shard map")
        metadata = tuple(
            tracing.inject_trace_context(
                [(KEY_METADATA, str(key)), (CALLER_METADATA, f"relay:{self._settings.shard_id}")]
            )
        )  # with a current job span, the callee's spans join its trace
        path = rpcs.rpc(rpcs.INTERNAL_SERVICE, method).full_name
        first = next(self._turns)
        answer: tuple[grpc.StatusCode, str] = (grpc.StatusCode.UNAVAILABLE, "no address")
        for i in range(len(shard.addresses)):
            address = shard.addresses[(first + i) % len(shard.addresses)]
            rpc = self._channel(address).unary_unary(path, None, None)
            try:
                rpc(payload, timeout=timeout_s, metadata=metadata)
            except grpc.RpcError as err:
                call: grpc.Call = err  # type: ignore[assignment]  # a failed call is both
                answer = call.code(), call.details() or ""
                trailers = call.trailing_metadata() or ()
                if unreached(answer[0], trailers):
                    continue
                fact = moved_to(answer[0], trailers)
                if fact is not None and self._on_moved is not None:
                    self._on_moved(fact)  # the next attempt goes to the owner it names
                return answer
            return grpc.StatusCode.OK, ""
        return answer

    def owner_of(self, account_id: str) -> str:
        """The id of the shard that owns an account in the map in force."""
        return self._map().shard_for(account_id).id

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            for channel in [*self._channels.values(), *(channel for _, channel in self._retired)]:
                channel.close()
            self._channels.clear()
            self._retired.clear()

    def _follow_rotation(self) -> None:
        """On a renewed client certificate, retire the channels (call with the lock held)."""
        now = time.monotonic()
        for _, channel in [r for r in self._retired if r[0] <= now]:
            channel.close()
        self._retired = [r for r in self._retired if r[0] > now]
        if self._rotation.renewed() is None:  # not due, unchanged, or half-written: keep the channels
            return
        # A call may still be running on a retired channel until its deadline: close it only after.
        closes_at = now + retire_after_s(self._settings.relay_call_timeout_s)
        self._retired += [(closes_at, channel) for channel in self._channels.values()]
        log.info("client certificate rotated: new channels to %d shard(s)", len(self._channels))
        self._channels.clear()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            self._follow_rotation()
            channel = self._channels.get(address)
            if channel is None:
                channel = new_channel(address, self._rotation.credentials, self._options)
                self._channels[address] = channel
            return channel


class OutboxRelay:
    """Background workers draining this shard's outbox."""

    def __init__(
        self,
        settings: ShardSettings,
        database: Database,
        shard_map: Callable[[], ShardMap],
        waits: TransferWaits | None = None,
        locator: ShardLocator | None = None,
        ownership: DatabaseOwnership | None = None,
        listener: ShardListener | None = None,
    ) -> None:
        self._settings = settings
        self._db = database
        #: This process's `GetTransfer` waiters, signalled after each committed state change.
        self._waits = waits if waits is not None else TransferWaits()
        #: Who owns a credit's account: the map, overruled by newer facts (this shard's database, and
        #: what the shards it sends to answer).
        self._locator = locator
        #: Read again when a move's commit or hand-over notifies this shard's database.
        self._ownership = ownership
        self._clients = ShardClients(
            settings, shard_map, on_moved=None if locator is None else self._learn
        )
        self._tracer_provider = database.tracer_provider
        self._stop = threading.Event()
        #: Set when a commit queued a credit (or on stop): idle workers look at once.
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        #: The process's listener (its owner starts and stops it), or one of the relay's own that
        #: also wakes this process's `GetTransfer` waiters.
        self._own_listener: ShardListener | None = None
        if listener is None:
            listener = self._own_listener = ShardListener(settings.dsn, name="relay-listen")
            listener.subscribe(TRANSFER_CHANNEL, self._waits.notify_payload)
            listener.on_connection(self._waits.set_listening)
        self._subscribe(listener)

    def start(self) -> None:
        """Start the worker threads (and the relay's own listener, if it has one)."""
        if self._own_listener is not None:
            self._own_listener.start()
        for i in range(self._settings.relay_workers):
            thread = threading.Thread(target=self._work, name=f"relay-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the workers after their current batch."""
        self._stop.set()
        self._wake.set()
        if self._own_listener is not None:
            self._own_listener.stop()
        for thread in self._threads:
            thread.join(timeout=self._settings.relay_call_timeout_s * 2 + 5)
        self._clients.close()

    def run_once(self) -> RelayStats:
        """Deliver one batch of due credits, then retry refunds still owed."""
        stats = self._deliver_batch()
        if stats.dead_lettered:
            # Dead letters committed, their refunds not yet sent: the next pass (of whichever daemon)
            # must find them owed (crash tests stop here).
            failpoints.reached(DEAD_LETTERED_BEFORE_REFUND)
        refunded = self.refund_owed()
        return RelayStats(stats.delivered, stats.postponed, stats.dead_lettered, refunded)

    def refund_owed(self, transfer_id: uuid.UUID | None = None) -> int:
        """Send RefundTransfer for dead letters not yet refunded (or for one, even if refunded)."""
        # Polled after every batch: looking costs no span, only refunding does.
        with tracing.untraced(), mapped_database_errors(250), self._db.connection() as conn:
            with conn.transaction():
                if transfer_id is None:
                    letters = store.list_dead_letters(conn, unrefunded_only=True, unfenced_only=True)
                else:
                    one = store.read_dead_letter(conn, transfer_id)
                    letters = [one] if one else []
        if not letters:
            return 0
        with self._job_span("outbox.refund", [letter.transfer_id for letter in letters]) as span:
            done = self._refund(letters)
            span.set_attribute("outbox.refunded", done)
        return done

    def _refund(self, letters: list[store.DeadLetterRow]) -> int:
        done = 0
        refunded: list[uuid.UUID] = []
        for letter in letters:
            request = ledger_pb2.RefundTransferRequest(
                transfer_id=str(letter.transfer_id),
                reason=letter.reason,
                source_account_id=letter.source_account_id,
            )
            code, message = self._clients.call(
                self._settings.shard_id,
                "RefundTransfer",
                request.SerializeToString(deterministic=True),
                letter.refund_key,
                self._settings.relay_call_timeout_s,
            )
            if code is grpc.StatusCode.OK:
                done += 1
                refunded.append(letter.transfer_id)
            else:
                log.warning("refund of %s not confirmed: %s %s", letter.transfer_id, code.name, message)
        self._announce_refunds(refunded)
        return done

    def _announce_refunds(self, transfer_ids: list[uuid.UUID]) -> None:
        """Wake the waiters of refunded transfers: each refund committed in whichever daemon answered
        RefundTransfer, so the notification goes out after the fact, in a transaction of its own."""
        if not transfer_ids:
            return
        try:
            with tracing.untraced(), mapped_database_errors(250), self._db.connection() as conn:
                with conn.transaction():
                    notify_in_transaction(conn, transfer_ids)
        except ShardRouterError as exc:  # the waiters of other daemons poll instead
            log.info("refunds not announced to other daemons: %s", exc)
        self._waits.notify(transfer_ids)

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                stats = self.run_once()
            except (ShardRouterError, LookupError) as exc:
                log.warning("relay pass failed: %s", exc)
                stats = RelayStats()
            except Exception:
                log.exception("relay pass crashed")
                stats = RelayStats()
            if stats.delivered + stats.postponed + stats.dead_lettered == 0:
                # Cleared before the next pass: a wake-up after this point is seen by that pass or
                # wakes the next wait.
                self._wake.wait(_IDLE_S)
                self._wake.clear()

    def _subscribe(self, listener: ShardListener) -> None:
        """Wake the workers whenever a commit queued a credit or a move changed ownership here, and
        when `LISTEN` starts (anything queued while nobody listened is due then). While the listener
        is down the workers still poll every `_IDLE_S`."""
        listener.subscribe(OUTBOX_CHANNEL, lambda _: self._wake.set())
        listener.subscribe(OWNERSHIP_CHANNEL, self._ownership_changed)
        listener.on_connection(lambda connected: self._wake.set() if connected else None)

    def _ownership_changed(self, _: str) -> None:
        if self._ownership is not None:
            self._ownership.check()  # a move committed or handed over here
        self._wake.set()  # credits held back by the move are due now

    def _job_span(
        self, name: str, transfer_ids: list[uuid.UUID]
    ) -> contextlib.AbstractContextManager[trace.Span]:
        """One span for one job of this relay, naming the transfers it handles."""
        return tracing.background_job_span(
            name,
            tracer_provider=self._tracer_provider,
            attributes={
                "shard.id": self._settings.shard_id,
                "outbox.batch_size": len(transfer_ids),
                "outbox.transfer_ids": [str(t) for t in transfer_ids],
            },
        )

    def _deliver_batch(self) -> RelayStats:
        completed: list[uuid.UUID] = []
        # Outermost, so that the job span (entered only once the claim found rows) covers the commit.
        with contextlib.ExitStack() as job:
            with mapped_database_errors(250), self._db.connection() as conn, conn.transaction():
                with tracing.untraced():  # the poll: an idle relay leaves no span
                    rows = store.claim_due_outbox(conn, self._settings.relay_batch)
                if not rows:
                    return RelayStats()
                span = job.enter_context(self._job_span("outbox.deliver", [r.transfer_id for r in rows]))
                delivered, postponed, dead = self._deliver(conn, rows, completed)
                notify_in_transaction(conn, completed)  # heard by the other daemons after the commit
                span.set_attributes(
                    {
                        "outbox.delivered": delivered,
                        "outbox.postponed": postponed,
                        "outbox.dead_lettered": dead,
                    }
                )
        self._waits.notify(completed)  # committed: this process's waiters read COMPLETED now
        return RelayStats(delivered, postponed, dead)

    def _deliver(
        self, conn: store.Connection, rows: list[store.OutboxRow], completed: list[uuid.UUID]
    ) -> tuple[int, int, int]:
        """Send each claimed credit and record its outcome in the claiming transaction; the
        transfers it marks completed are appended to `completed`."""
        delivered = postponed = dead = 0
        for row in rows:
            if self._stop.is_set():
                break
            code, message = self._clients.call(
                self._destination_of(row),
                "CreditTransfer",
                row.payload,
                row.idempotency_key,
                self._settings.relay_call_timeout_s,
            )
            store.record_attempt(conn, row.transfer_id, code.name, message)
            if code is grpc.StatusCode.OK:
                # Delivered, not yet marked in the outbox (the claiming transaction is open): after a
                # crash here the credit is sent again, and the destination's key makes that harmless
                # (crash tests stop here).
                failpoints.reached(DELIVERED_BEFORE_MARKED)
                store.mark_delivered(conn, row.id)
                if store.set_transfer_state(conn, row.transfer_id, expected="pending", new="completed"):
                    completed.append(row.transfer_id)
                delivered += 1
            elif code in _PERMANENT:
                self._dead_letter(conn, row, f"{code.name}: {message}")
                dead += 1
            elif self._too_old(row) and self._fence(row):
                self._dead_letter(
                    conn, row, f"undelivered after {self._settings.relay_max_age_s} s: {code.name}"
                )
                dead += 1
            else:
                store.postpone(conn, row.id, _backoff(row.attempts), f"{code.name}: {message}")
                postponed += 1
        return delivered, postponed, dead

    def _destination_of(self, row: store.OutboxRow) -> str:
        """The shard that owns the credit's account now: the one named when the transfer was made,
        unless its slot has moved since (then the map in force names the new owner)."""
        account = ledger_pb2.CreditTransferRequest.FromString(row.payload).destination_account_id
        if not account:
            return row.destination_shard_id
        return self._locator.shard_of(account) if self._locator else self._clients.owner_of(account)

    def _learn(self, fact: RangeOwner) -> None:
        if self._locator is None:
            return
        shard_map = self._locator.shard_map
        if shard_map is not None and self._locator.learned.learn(fact, shard_map.version):
            log.info(
                "relay: slots %d-%d belong to %s as of map version %d (the map here is version %d)",
                fact.first_slot,
                fact.last_slot,
                fact.shard_id,
                fact.map_version,
                shard_map.version,
            )

    def _too_old(self, row: store.OutboxRow) -> bool:
        return (datetime.now(UTC) - row.created_at).total_seconds() > self._settings.relay_max_age_s

    def _fence(self, row: store.OutboxRow) -> bool:
        """Void the credit at the destination; True only if it can no longer apply."""
        credit = ledger_pb2.CreditTransferRequest.FromString(row.payload)
        request = ledger_pb2.VoidCreditRequest(
            transfer_id=str(row.transfer_id),
            reason="relay gave up",
            destination_account_id=credit.destination_account_id,
        )
        code, message = self._clients.call(
            self._destination_of(row),
            "VoidCredit",
            request.SerializeToString(deterministic=True),
            row.idempotency_key,
            self._settings.relay_call_timeout_s,
        )
        if code is not grpc.StatusCode.OK:
            log.info("credit %s not voided (%s %s); keep delivering", row.transfer_id, code.name, message)
        return code is grpc.StatusCode.OK

    def _dead_letter(self, conn: store.Connection, row: store.OutboxRow, reason: str) -> None:
        log.warning("credit of transfer %s dead-lettered: %s", row.transfer_id, reason)
        store.dead_letter(conn, row=row, reason=reason, refund_key=str(refund_key(row.transfer_id)))


def _backoff(attempts: int) -> float:
    delay: float = min(_MAX_BACKOFF_S, 0.2 * 2.0 ** min(attempts, 10))
    return delay * random.uniform(0.5, 1.5)


__all__ = [
    "DEAD_LETTERED_BEFORE_REFUND",
    "DELIVERED_BEFORE_MARKED",
    "OUTBOX_CHANNEL",
    "OutboxRelay",
    "RelayStats",
    "ShardClients",
]
