"""The mapping between an `Operation`'s arguments and the protobuf messages of its RPC.

The request and response types are the ones the operation kind's RPC declares (its method's input
and output descriptors, `shardrouter.client.kinds`); each argument sets the request field its name
maps to. The request is rebuilt from the stored arguments on every attempt; protobuf's deterministic
serialisation of the same fields gives the same bytes, so the shard's request hash matches and a
resend replays instead of being refused as IDEMPOTENCY_KEY_REUSED.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shardrouter.client.kinds import Argument, OperationKind, operation_type
from shardrouter.core.errors import InvalidArgument
from shardrouter.core.validation import validate_deposit, validate_transfer

__all__ = [
    "LOCAL_VALIDATORS",
    "InvalidOperation",
    "build_request",
    "decode_response_bytes",
    "deposit_arguments",
    "message_to_dict",
    "transfer_arguments",
    "validate",
]

#: The state-free checks this library runs before it stores an operation, by RPC name: the shard's
#: own (`shardrouter.core.validation`), so an operation that can never succeed is refused before it
#: is stored. A kind without one is checked by the shard alone.
LOCAL_VALIDATORS: Mapping[str, Callable[[Any], None]] = MappingProxyType(
    {"Transfer": validate_transfer, "Deposit": validate_deposit}
)


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


def build_request(kind: OperationKind, arguments: Mapping[str, Argument]) -> Message:
    """The request message of an operation kind's RPC, with each argument in its field.

    An argument left out leaves its field unset; a name the request has no field for, or a value
    that is not of its field's type, is an InvalidOperation.
    """
    op_type = operation_type(kind)
    request = op_type.declaration.request_type()
    unknown = sorted(set(arguments) - set(op_type.arguments))
    if unknown:
        raise InvalidOperation(
            f"{kind} has no argument {', '.join(unknown)}; its arguments are {', '.join(op_type.arguments)}"
        )
    for name, value in arguments.items():
        path, field = op_type.arguments[name]
        *parents, leaf = path.split(".")
        target = request
        for parent in parents:
            target = getattr(target, parent)
        try:
            setattr(target, leaf, _field_value(field, value))
        except (TypeError, ValueError) as exc:
            raise InvalidOperation(f"{kind} argument {name}: {exc}", ((path, str(exc)),)) from exc
    return request


def _field_value(field: FieldDescriptor, value: Argument) -> Argument | bool:
    if field.type == FieldDescriptor.TYPE_STRING:
        return str(value)
    if isinstance(value, str) and not value.lstrip("-").isdigit():
        raise ValueError(f"{value!r} is not an integer")
    if field.type == FieldDescriptor.TYPE_BOOL:
        return bool(int(value))
    return int(value)


def validate(kind: OperationKind, arguments: Mapping[str, Argument]) -> None:
    """Raise InvalidOperation if the shard would answer INVALID_ARGUMENT to these arguments.

    Runs the kind's local validator (`LOCAL_VALIDATORS`) if it has one.
    """
    request = build_request(kind, arguments)
    check = LOCAL_VALIDATORS.get(operation_type(kind).declaration.name)
    if check is None:
        return
    try:
        check(request)
    except InvalidArgument as exc:
        raise InvalidOperation(
            exc.message, tuple((v.field, v.description) for v in exc.field_violations)
        ) from exc


def decode_response_bytes(kind: OperationKind, raw: bytes) -> Message:
    """The response message of an operation kind's RPC, from its wire bytes."""
    return operation_type(kind).declaration.response_type.FromString(raw)


def message_to_dict(message: Message | None) -> dict[str, Any] | None:
    """A JSON-ready dict of a protobuf message (proto3 JSON mapping, field names as in the .proto)."""
    if message is None:
        return None
    return MessageToDict(message, preserving_proto_field_name=True)
