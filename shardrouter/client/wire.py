"""The mapping between an `Operation`'s arguments and the generated protobuf messages.

The request is rebuilt from the stored arguments on every attempt; protobuf's deterministic
serialisation of the same fields gives the same bytes, so the shard's request hash matches and a
resend replays instead of being refused as IDEMPOTENCY_KEY_REUSED.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shardrouter.client.operation import Argument, Operation, OperationKind
from shardrouter.core.errors import InvalidArgument
from shardrouter.core.validation import validate_deposit, validate_transfer
from shardrouter.v1 import transfer_pb2

__all__ = [
    "InvalidOperation",
    "build_request",
    "decode_response",
    "decode_response_bytes",
    "deposit_arguments",
    "message_to_dict",
    "transfer_arguments",
    "validate",
]

MutatingRequest = transfer_pb2.TransferRequest | transfer_pb2.DepositRequest
MutatingResponse = transfer_pb2.TransferResponse | transfer_pb2.DepositResponse


class InvalidOperation(ValueError):
    """The arguments can never make a valid request (checked locally, before anything is stored)."""

    def __init__(self, message: str, field_violations: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.field_violations = field_violations


def transfer_arguments(
    source: str, destination: str, amount_minor: int, currency: str, reference: str = ""
) -> dict[str, Argument]:
    """The `arguments` of a transfer operation."""
    return {
        "source": source,
        "destination": destination,
        "amount_minor": amount_minor,
        "currency": currency,
        "reference": reference,
    }


def deposit_arguments(
    account: str, amount_minor: int, currency: str, reference: str = ""
) -> dict[str, Argument]:
    """The `arguments` of a deposit operation."""
    return {"account": account, "amount_minor": amount_minor, "currency": currency, "reference": reference}


def build_request(kind: OperationKind, arguments: Mapping[str, Argument]) -> MutatingRequest:
    """The request message for an operation's arguments."""
    try:
        money = transfer_pb2.Money(
            amount_minor=int(arguments["amount_minor"]), currency=str(arguments["currency"])
        )
        reference = str(arguments.get("reference", ""))
        if kind == "transfer":
            return transfer_pb2.TransferRequest(
                source_account_id=str(arguments["source"]),
                destination_account_id=str(arguments["destination"]),
                amount=money,
                reference=reference,
            )
        return transfer_pb2.DepositRequest(
            account_id=str(arguments["account"]), amount=money, reference=reference
        )
    except (KeyError, ValueError) as exc:
        raise InvalidOperation(f"incomplete {kind} arguments: {exc}") from exc


def validate(kind: OperationKind, arguments: Mapping[str, Argument]) -> None:
    """Raise InvalidOperation if the shard would answer INVALID_ARGUMENT to these arguments."""
    request = build_request(kind, arguments)
    try:
        if isinstance(request, transfer_pb2.TransferRequest):
            validate_transfer(request)
        else:
            validate_deposit(request)
    except InvalidArgument as exc:
        raise InvalidOperation(
            exc.message, tuple((v.field, v.description) for v in exc.field_violations)
        ) from exc


def decode_response(operation: Operation) -> MutatingResponse | None:
    """The response message recorded as the operation's last outcome, if it succeeded."""
    if operation.outcome is None or operation.outcome.response_b64 is None:
        return None
    return decode_response_bytes(operation.kind, base64.b64decode(operation.outcome.response_b64))


def decode_response_bytes(kind: OperationKind, raw: bytes) -> MutatingResponse:
    """The response message of an operation kind, from its wire bytes."""
    if kind == "transfer":
        return transfer_pb2.TransferResponse.FromString(raw)
    return transfer_pb2.DepositResponse.FromString(raw)


def message_to_dict(message: Message | None) -> dict[str, Any] | None:
    """A JSON-ready dict of a protobuf message (proto3 JSON mapping, field names as in the .proto)."""
    if message is None:
        return None
    return MessageToDict(message, preserving_proto_field_name=True)
