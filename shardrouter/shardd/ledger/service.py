"""The RPC handlers of a shard: public `TransferService` and internal `ShardLedgerService`.

Mutating handlers run inside the transaction the idempotency interceptor opened
(`current_transaction()`); they raise domain errors and never call `context.abort`. Business
failures (`NotFound`, `FailedPrecondition`) become the stored outcome of the key. An account another
shard owns is refused before anything is applied (`UNAVAILABLE`, reason `ACCOUNT_MOVED`), never stored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from shardrouter.core import failpoints
from shardrouter.core.errors import (
    Aborted,
    FailedPrecondition,
    FieldViolation,
    Internal,
    NotFound,
    Reason,
)
from shardrouter.core.keys import derived_key, new_key
from shardrouter.core.validation import (
    account_problems,
    is_uuid,
    money_problems,
    raise_if_any,
    validate_deposit,
    validate_get_balance,
    validate_get_transfer,
    validate_transfer,
)
from shardrouter.internal.v1 import ledger_pb2, ledger_pb2_grpc
from shardrouter.shardd.db import Database, current_transaction
from shardrouter.shardd.ledger import store
from shardrouter.shardd.ledger.store import AccountRow, TransferRow
from shardrouter.shardd.ownership import ACCOUNT_MOVED_RETRY_MS, ShardLocator, slot_moving
from shardrouter.shardd.transfer_waits import TransferWaits
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

MAX_BALANCE = 10**17
#: A failpoint (core/failpoints.py): a refund's writes made in its open transaction, the transfer not
#: yet marked refunded.
REFUND_APPLIED_BEFORE_MARKED = "shardd.refund_applied_before_marked"
_TRANSFER_STATES = {
    "pending": transfer_pb2.TRANSFER_STATE_PENDING,
    "completed": transfer_pb2.TRANSFER_STATE_COMPLETED,
    "refunded": transfer_pb2.TRANSFER_STATE_REFUNDED,
}
#: How often a waiting `GetTransfer` reads the transfer again without being woken (s): the fallback
#: for a lost wake-up, while a listener in this process hears the shard's state changes.
_POLL_INTERVAL_S = 0.25
#: The same step while nothing in this process hears them (no relay here, or its listener is down).
_UNHEARD_POLL_INTERVAL_S = 0.05


def credit_key(transfer_id: uuid.UUID) -> uuid.UUID:
    """The idempotency key of a transfer's cross-shard credit (and of its void)."""
    return derived_key(transfer_id, "credit")


def refund_key(transfer_id: uuid.UUID) -> uuid.UUID:
    """The idempotency key of a transfer's refund."""
    return derived_key(transfer_id, "refund")


def credit_payload(
    transfer_id: uuid.UUID,
    *,
    source_shard_id: str,
    source_account_id: str,
    destination_account_id: str,
    amount: transfer_pb2.Money,
) -> bytes:
    """The outbox payload of a transfer's cross-shard credit: the `CreditTransfer` request the relay
    sends, serialized deterministically (every resend of it is the same bytes)."""
    credit = ledger_pb2.CreditTransferRequest(
        transfer_id=str(transfer_id),
        source_shard_id=source_shard_id,
        source_account_id=source_account_id,
        destination_account_id=destination_account_id,
        amount=amount,
    )
    return credit.SerializeToString(deterministic=True)


class TransferServicer(transfer_pb2_grpc.TransferServiceServicer):
    """Public API of one shard."""

    def __init__(self, database: Database, locator: ShardLocator, waits: TransferWaits | None = None) -> None:
        self._db = database
        self._locator = locator
        #: Where `GetTransfer` waits to be woken by a state change (the relay signals it).
        self._waits = waits if waits is not None else TransferWaits()

    def Transfer(
        self, request: transfer_pb2.TransferRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.TransferResponse:
        """Debit the source; credit the destination here, or queue the credit for its shard."""
        call = current_transaction()
        conn = call.conn
        src, dst = request.source_account_id, request.destination_account_id
        self._locator.require_local(src)
        dst_shard = self._locator.shard_of(dst)
        local = dst_shard == self._locator.own_shard_id
        accounts = store.lock_accounts(conn, [src, dst] if local else [src])
        if local and dst not in accounts:
            # Missing here may mean moved away, with this daemon's map a poll behind the move.
            dst_shard = self._locator.owner_now(dst)
            local = dst_shard == self._locator.own_shard_id
            if local and store.slot_fenced(conn, dst):
                raise slot_moving(dst)  # routed by the source: the caller waits, not redirected
        source = _usable_account(accounts.get(src), src, request.amount.currency)
        if source.balance < request.amount.amount_minor:
            raise FailedPrecondition(
                f"insufficient funds: account {src} holds {source.balance} and the transfer needs "
                f"{request.amount.amount_minor} {request.amount.currency} (minor units)",
                reason=Reason.INSUFFICIENT_FUNDS,
                metadata={"account_id": src},
            )
        if local:
            destination = _usable_account(accounts.get(dst), dst, request.amount.currency)
            _check_limit(destination, request.amount.amount_minor)
        now = datetime.now(UTC)
        transfer = TransferRow(
            id=new_key(),
            source_account_id=src,
            destination_account_id=dst,
            destination_shard_id=dst_shard,
            amount_minor=request.amount.amount_minor,
            currency=request.amount.currency,
            reference=request.reference,
            state="completed" if local else "pending",
            created_at=now,
            updated_at=now,
        )
        store.insert_transfer(conn, transfer)
        store.add_to_balance(conn, src, -transfer.amount_minor)
        store.insert_entry(
            conn,
            account_id=src,
            amount_minor=-transfer.amount_minor,
            kind="transfer_out",
            idempotency_key=call.key,
            entry_id=new_key(),
            transfer_id=transfer.id,
            reference=request.reference,
        )
        if local:
            store.add_to_balance(conn, dst, transfer.amount_minor)
            store.insert_entry(
                conn,
                account_id=dst,
                amount_minor=transfer.amount_minor,
                kind="transfer_in",
                idempotency_key=call.key,
                entry_id=new_key(),
                transfer_id=transfer.id,
                reference=request.reference,
            )
        else:
            store.insert_outbox(
                conn,
                transfer_id=transfer.id,
                destination_shard_id=dst_shard,
                key=str(credit_key(transfer.id)),
                payload=credit_payload(
                    transfer.id,
                    source_shard_id=self._locator.own_shard_id,
                    source_account_id=src,
                    destination_account_id=dst,
                    amount=request.amount,
                ),
            )
        return transfer_pb2.TransferResponse(transfer=_transfer_message(transfer, []))

    def Deposit(
        self, request: transfer_pb2.DepositRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.DepositResponse:
        """Credit an account from outside, opening it on its first deposit."""
        call = current_transaction()
        account_id, amount = request.account_id, request.amount
        self._locator.require_local(account_id)
        entry_id = new_key()
        balance = store.deposit(
            call.conn,
            account_id=account_id,
            currency=amount.currency,
            amount_minor=amount.amount_minor,
            max_balance=MAX_BALANCE,
            idempotency_key=call.key,
            entry_id=entry_id,
            reference=request.reference,
            noting_answer=call.answers_in_database,
        )
        if call.answers_in_database:
            # The claim, this statement, the record and the COMMIT go in one round trip, and the
            # account's row is locked for the database's work alone. A deposit that wrote nothing
            # noted no answer: the interceptor runs this again, answers fetched, and below says why.
            return call.answered_in_database(transfer_pb2.DepositResponse)
        if balance is None:  # nothing written: say why (the account's row is locked, so this holds)
            found = store.read_account(call.conn, account_id)
            account = (
                _usable_account(found, account_id, amount.currency)
                if found is not None
                else AccountRow(account_id, amount.currency, 0, "open")  # a first deposit past the limit
            )
            _check_limit(account, amount.amount_minor)
            raise Internal(f"the deposit to {account_id} was applied nowhere, for no known reason")
        return transfer_pb2.DepositResponse(
            entry_id=str(entry_id),
            balance=transfer_pb2.Money(amount_minor=balance, currency=amount.currency),
        )

    def GetBalance(
        self, request: transfer_pb2.GetBalanceRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.GetBalanceResponse:
        """An account's balance and state."""

        validate_get_balance(request)
        self._locator.require_local(request.account_id)
        with self._db.read() as conn:
            account = store.read_account(conn, request.account_id)
            # A fenced range is moving or has moved: what is here may no longer be the truth.
            if store.slot_fenced(conn, request.account_id):
                raise self._locator.fenced_refusal(request.account_id)
        if account is None:
            raise _account_not_found(request.account_id)
        return transfer_pb2.GetBalanceResponse(
            account_id=account.id,
            balance=transfer_pb2.Money(amount_minor=account.balance, currency=account.currency),
            state=transfer_pb2.ACCOUNT_STATE_OPEN
            if account.state == "open"
            else transfer_pb2.ACCOUNT_STATE_CLOSED,
        )

    def GetTransfer(
        self, request: transfer_pb2.GetTransferRequest, context: grpc.ServicerContext
    ) -> transfer_pb2.GetTransferResponse:
        """A transfer with its delivery history, optionally waiting for it to leave PENDING.

        While it waits it reads the transfer again when woken (`TransferWaits`: the relay of any
        daemon of the shard committed a state change of it), when the call ends, and otherwise every
        `_POLL_INTERVAL_S` (`_UNHEARD_POLL_INTERVAL_S` while no listener in this process hears the
        shard's state changes). A wake-up between a read and the wait that follows is not lost.
        """

        validate_get_transfer(request)
        self._locator.require_local(request.source_account_id)
        transfer_id = uuid.UUID(request.transfer_id)
        wait_s = request.wait_for_completion_ms / 1000
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = min(wait_s, max(0.0, remaining - 0.05))
        give_up = time.monotonic() + wait_s
        with self._waits.watch(transfer_id) as watch:
            if wait_s > 0:
                context.add_callback(watch.interrupt)  # a cancelled call stops waiting at once
            while True:
                watch.before_read()
                transfer, attempts = self._read_transfer(request, transfer_id)
                if transfer.state != "pending" or time.monotonic() >= give_up or not context.is_active():
                    return transfer_pb2.GetTransferResponse(transfer=_transfer_message(transfer, attempts))
                step = _POLL_INTERVAL_S if self._waits.listening else _UNHEARD_POLL_INTERVAL_S
                watch.wait(min(step, give_up - time.monotonic()))

    def _read_transfer(
        self, request: transfer_pb2.GetTransferRequest, transfer_id: uuid.UUID
    ) -> tuple[TransferRow, list[store.AttemptRow]]:
        """The transfer and its delivery attempts; NOT_FOUND unless it is from the request's account."""
        with self._db.read() as conn:
            transfer = store.read_transfer(conn, transfer_id)
            attempts = store.attempts_of(conn, transfer_id) if transfer else []
            if store.slot_fenced(conn, request.source_account_id):
                raise self._locator.fenced_refusal(request.source_account_id)
        if transfer is None or transfer.source_account_id != request.source_account_id:
            raise NotFound(
                f"no transfer {request.transfer_id} from account {request.source_account_id} on this shard",
                reason=Reason.TRANSFER_NOT_FOUND,
            )
        return transfer, attempts


class ShardLedgerServicer(ledger_pb2_grpc.ShardLedgerServiceServicer):
    """Internal API: the credit leg of cross-shard transfers, its fence, and refunds."""

    def __init__(self, locator: ShardLocator) -> None:
        self._locator = locator

    def CreditTransfer(
        self, request: ledger_pb2.CreditTransferRequest, context: grpc.ServicerContext
    ) -> ledger_pb2.CreditTransferResponse:
        """Credit the destination account of a transfer debited on another shard."""
        call = current_transaction()
        dst, amount = request.destination_account_id, request.amount
        transfer_id = uuid.UUID(request.transfer_id)
        # Retryable, not a stored NOT_FOUND: the relay's map and this shard's may disagree during a
        # move, and a permanent refusal would dead-letter and refund a credit its new owner can take.
        self._locator.require_local(dst)
        account = _usable_account(store.lock_accounts(call.conn, [dst]).get(dst), dst, amount.currency)
        existing = store.entry_of_transfer(call.conn, transfer_id, "transfer_in")
        if existing is not None:  # belt and braces: a second key for the same credit applies nothing
            return ledger_pb2.CreditTransferResponse(entry_id=str(existing))
        if store.credit_voided(call.conn, transfer_id):  # voided under another caller's key scope
            raise FailedPrecondition(
                f"the credit of transfer {transfer_id} was voided here: its source refunds it",
                reason=Reason.CREDIT_VOIDED,
                metadata={"transfer_id": str(transfer_id)},
            )
        _check_limit(account, amount.amount_minor)
        store.add_to_balance(call.conn, dst, amount.amount_minor)
        entry_id = new_key()
        store.insert_entry(
            call.conn,
            account_id=dst,
            amount_minor=amount.amount_minor,
            kind="transfer_in",
            idempotency_key=call.key,
            entry_id=entry_id,
            transfer_id=transfer_id,
        )
        return ledger_pb2.CreditTransferResponse(entry_id=str(entry_id))

    def VoidCredit(
        self, request: ledger_pb2.VoidCreditRequest, context: grpc.ServicerContext
    ) -> ledger_pb2.VoidCreditResponse:
        """Fence a credit the relay gives up on, so that it can never apply here.

        Claiming the credit's key fences a late CreditTransfer under the same (scope, key): the
        interceptor stores this outcome. A key is unique per caller, though, and after the source's
        slot moved, its new owner's relay calls under another caller than the old relay, whose call
        may still be running. So the void is also a fact of the transfer (`voided_credits`, moved
        with the account), which CreditTransfer checks whoever sends it; and it looks for the credit
        itself first. Both lock the destination account's row before they look, so one always sees
        the other. Finding the credit applied, the void is refused (ABORTED, never stored) and the
        relay's next delivery answers with the credit's entry: delivered, not refunded.
        """
        call = current_transaction()
        transfer_id = uuid.UUID(request.transfer_id)
        account = request.destination_account_id
        if account:  # empty from older relays: the key alone fences
            # A fenced slot takes no write here: refused before the row lock, which would hold up
            # a move's apply worker on the row for nothing.
            if store.slot_fenced(call.conn, account):
                raise self._locator.fenced_refusal(account)
            store.lock_accounts(call.conn, [account])
        if store.entry_of_transfer(call.conn, transfer_id, "transfer_in") is not None:
            raise Aborted(
                f"the credit of transfer {transfer_id} is already applied on this shard; deliver it "
                "again (CreditTransfer answers with its entry) instead of voiding it",
                reason=Reason.CREDIT_ALREADY_APPLIED,
                metadata={"transfer_id": str(transfer_id)},
                retry_after_ms=100,
            )
        if account:
            store.void_credit(call.conn, transfer_id, account, request.reason[:140])
        return ledger_pb2.VoidCreditResponse(transfer_id=request.transfer_id)

    def RefundTransfer(
        self, request: ledger_pb2.RefundTransferRequest, context: grpc.ServicerContext
    ) -> ledger_pb2.RefundTransferResponse:
        """Give a pending transfer's debit back to its source account, once."""
        call = current_transaction()
        transfer_id = uuid.UUID(request.transfer_id)
        # A fenced slot takes no write here: refused before the transfer's row lock (see VoidCredit).
        source = request.source_account_id  # empty from older relays: the fence refuses the write
        if source and store.slot_fenced(call.conn, source):
            raise self._locator.fenced_refusal(source)
        transfer = store.read_transfer(call.conn, transfer_id, lock=True)
        if transfer is None:
            raise NotFound(f"no transfer {transfer_id} on this shard", reason=Reason.TRANSFER_NOT_FOUND)
        existing = store.entry_of_transfer(call.conn, transfer_id, "refund")
        if existing is not None:
            return ledger_pb2.RefundTransferResponse(entry_id=str(existing))
        if transfer.state != "pending":
            raise FailedPrecondition(
                f"transfer {transfer_id} is {transfer.state}; only a pending transfer can be refunded",
                reason=Reason.INVALID_REQUEST,
            )
        store.lock_accounts(call.conn, [transfer.source_account_id])
        store.add_to_balance(call.conn, transfer.source_account_id, transfer.amount_minor)
        entry_id = new_key()
        store.insert_entry(
            call.conn,
            account_id=transfer.source_account_id,
            amount_minor=transfer.amount_minor,
            kind="refund",
            idempotency_key=call.key,
            entry_id=entry_id,
            transfer_id=transfer_id,
            reference=request.reason[:140],
        )
        store.set_transfer_state(call.conn, transfer_id, expected="pending", new="refunded")
        # The refund applied in the call's open transaction, its dead letter not yet marked refunded:
        # both commit together or neither does (crash tests stop here).
        failpoints.reached(REFUND_APPLIED_BEFORE_MARKED)
        store.mark_refunded(call.conn, transfer_id)
        return ledger_pb2.RefundTransferResponse(entry_id=str(entry_id))


def validate_credit(request: ledger_pb2.CreditTransferRequest) -> None:
    """State-free checks of a credit (the relay built it, but the shard trusts nothing)."""
    problems = money_problems("amount", request.amount, request.HasField("amount"))
    for name in ("source_account_id", "destination_account_id"):
        problems += account_problems(name, getattr(request, name))
    if request.source_account_id and request.source_account_id == request.destination_account_id:
        problems.append(FieldViolation("destination_account_id", "must differ from source_account_id"))
    problems += _transfer_id_problems(request.transfer_id)
    raise_if_any("CreditTransfer", problems)


def validate_transfer_id_only(
    request: ledger_pb2.VoidCreditRequest | ledger_pb2.RefundTransferRequest,
) -> None:
    """The request must name a transfer by its UUID; its reason is short printable text."""
    problems = _transfer_id_problems(request.transfer_id)
    # VoidCredit's destination, RefundTransfer's source; empty from older relays.
    field = (
        "destination_account_id" if isinstance(request, ledger_pb2.VoidCreditRequest) else "source_account_id"
    )
    account = str(getattr(request, field))
    if account:
        problems += account_problems(field, account)
    if len(request.reason) > 500 or any(not ch.isprintable() for ch in request.reason):
        problems.append(FieldViolation("reason", "must be at most 500 printable characters"))
    raise_if_any(type(request).__name__.removesuffix("Request"), problems)


def _transfer_id_problems(transfer_id: str) -> list[FieldViolation]:
    return [] if is_uuid(transfer_id) else [FieldViolation("transfer_id", "must be a UUID in canonical form")]


def _usable_account(account: AccountRow | None, account_id: str, currency: str) -> AccountRow:
    if account is None:
        raise _account_not_found(account_id)
    if account.state != "open":
        raise FailedPrecondition(
            f"account {account_id} is closed",
            reason=Reason.ACCOUNT_CLOSED,
            metadata={"account_id": account_id},
        )
    if account.currency != currency:
        raise FailedPrecondition(
            f"account {account_id} holds {account.currency}, not {currency}",
            reason=Reason.CURRENCY_MISMATCH,
            metadata={"account_id": account_id, "account_currency": account.currency},
        )
    return account


def _check_limit(account: AccountRow, credit: int) -> None:
    if account.balance + credit > MAX_BALANCE:
        raise FailedPrecondition(
            f"account {account.id} would exceed the balance limit of {MAX_BALANCE} minor units",
            reason=Reason.BALANCE_LIMIT_EXCEEDED,
            metadata={"account_id": account.id},
        )


def _account_not_found(account_id: str) -> NotFound:
    return NotFound(
        f"account {account_id} does not exist",
        reason=Reason.ACCOUNT_NOT_FOUND,
        metadata={"account_id": account_id},
    )


def _timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(moment)
    return ts


def _transfer_message(transfer: TransferRow, attempts: list[store.AttemptRow]) -> transfer_pb2.Transfer:
    return transfer_pb2.Transfer(
        transfer_id=str(transfer.id),
        source_account_id=transfer.source_account_id,
        destination_account_id=transfer.destination_account_id,
        amount=transfer_pb2.Money(amount_minor=transfer.amount_minor, currency=transfer.currency),
        state=_TRANSFER_STATES[transfer.state],
        reference=transfer.reference,
        created_at=_timestamp(transfer.created_at),
        updated_at=_timestamp(transfer.updated_at),
        delivery_attempts=[
            transfer_pb2.DeliveryAttempt(
                attempted_at=_timestamp(a.attempted_at), status_code=a.status_code, message=a.message
            )
            for a in attempts
        ],
    )


__all__ = [
    "ACCOUNT_MOVED_RETRY_MS",
    "MAX_BALANCE",
    "REFUND_APPLIED_BEFORE_MARKED",
    "REQUEST_VALIDATORS",
    "ShardLedgerServicer",
    "ShardLocator",
    "TransferServicer",
    "credit_key",
    "credit_payload",
    "refund_key",
    "validate_credit",
    "validate_transfer_id_only",
]


#: The state-free check of each keyed RPC's request, by method name, run by the idempotency
#: interceptor before the key is claimed (a refusal there is answered and never stored). Which RPCs
#: are keyed is declared in the proto; the shard refuses to start if one has no validator here.
REQUEST_VALIDATORS: Mapping[str, Callable[[Any], None]] = MappingProxyType(
    {
        "Transfer": validate_transfer,
        "Deposit": validate_deposit,
        "CreditTransfer": validate_credit,
        "VoidCredit": validate_transfer_id_only,
        "RefundTransfer": validate_transfer_id_only,
    }
)
