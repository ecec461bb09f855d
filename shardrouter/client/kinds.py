"""The caller library's operation kinds: one per keyed RPC of the public API, read from its declaration.

An operation kind is the snake_case name of a keyed method of `shardrouter.v1.TransferService`
("Transfer" -> "transfer"). Its method path and its request and response types come from the method's
declaration in the proto (`shardrouter.core.rpcs`), so a keyed RPC declared there is an operation kind
of this library with no edit here: `TransferClient.create_operation(kind, arguments)` stores it,
`send_with_retries` sends it, and the `shard-router` command has a subcommand for it.

An operation's arguments are flat `name -> str | int` pairs naming the request's scalar fields by their
dotted path ("account_id", "amount.amount_minor"). The kinds that `TransferClient` has typed helpers
for keep the shorter names their operations have always been stored with ("source", "amount_minor";
`ARGUMENT_NAMES`), so operations stored by earlier versions still resume.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from shardrouter.core.rpcs import (
    INTEGER_FIELD_TYPES,
    PUBLIC_SERVICE,
    RPCS,
    RpcDeclaration,
    RpcDeclarationError,
)

__all__ = [
    "ARGUMENT_NAMES",
    "KINDS",
    "OPERATION_TYPES",
    "Argument",
    "OperationKind",
    "OperationType",
    "kind_name",
    "operation_type",
    "operation_types",
    "scalar_field_paths",
]

#: What an operation's argument may be: a string or an integer field of the request.
Argument = str | int
#: An operation kind's name, one of `KINDS` ("transfer", "deposit", ...).
OperationKind = str

#: The argument names of the kinds with typed helpers, as operations have always stored them:
#: argument name -> request field path. A request field not named here is its own path.
ARGUMENT_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "transfer": MappingProxyType(
            {
                "source": "source_account_id",
                "destination": "destination_account_id",
                "amount_minor": "amount.amount_minor",
                "currency": "amount.currency",
                "reference": "reference",
            }
        ),
        "deposit": MappingProxyType(
            {
                "account": "account_id",
                "amount_minor": "amount.amount_minor",
                "currency": "amount.currency",
                "reference": "reference",
            }
        ),
    }
)

_STRING = frozenset({FieldDescriptor.TYPE_STRING})
_INTEGER = INTEGER_FIELD_TYPES | {FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM}
_MAX_DEPTH = 4  # message fields nested deeper than this (or recursive ones) are not arguments


def kind_name(method_name: str) -> OperationKind:
    """The operation kind of a method: its name in snake_case ("Transfer" -> "transfer")."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", method_name).lower()


def scalar_field_paths(message: Descriptor) -> dict[str, FieldDescriptor]:
    """The singular string and integer fields of `message` (and of its message fields), by dotted path."""
    return dict(_paths(message, "", 0))


def _paths(message: Descriptor, prefix: str, depth: int) -> Iterator[tuple[str, FieldDescriptor]]:
    for field in message.fields:
        if field.is_repeated:
            continue
        path = prefix + field.name
        if field.type in _STRING or field.type in _INTEGER:
            yield path, field
        elif field.message_type is not None and depth < _MAX_DEPTH:
            yield from _paths(field.message_type, path + ".", depth + 1)


@dataclass(frozen=True, slots=True)
class OperationType:
    """One operation kind: the keyed RPC it sends and the request field each argument name sets."""

    kind: OperationKind
    declaration: RpcDeclaration
    #: argument name -> (request field path, its field descriptor)
    arguments: Mapping[str, tuple[str, FieldDescriptor]]

    @property
    def method(self) -> str:
        """The gRPC method path, "/shardrouter.v1.TransferService/Transfer"."""
        return self.declaration.full_name


def _operation_type(declaration: RpcDeclaration, names: Mapping[str, str]) -> OperationType:
    kind = kind_name(declaration.name)
    request: Descriptor = cast(Descriptor, declaration.request_type.DESCRIPTOR)
    fields = scalar_field_paths(request)
    unknown = sorted(path for path in names.values() if path not in fields)
    if unknown:
        raise RpcDeclarationError(
            f"operation kind {kind!r}: ARGUMENT_NAMES names {', '.join(unknown)}, which "
            f"{request.full_name} has no string or integer field for"
        )
    named = set(names.values())
    arguments = {name: (path, fields[path]) for name, path in names.items()}
    arguments.update({path: (path, field) for path, field in fields.items() if path not in named})
    return OperationType(kind, declaration, MappingProxyType(arguments))


def operation_types(
    declarations: Iterable[RpcDeclaration],
    *,
    service: str = PUBLIC_SERVICE,
    argument_names: Mapping[str, Mapping[str, str]] = ARGUMENT_NAMES,
) -> Mapping[OperationKind, OperationType]:
    """The operation kinds of `service`'s keyed RPCs among `declarations`, in declaration order.

    RpcDeclarationError if `argument_names` renames the arguments of a kind that is not declared (a
    renamed or removed RPC) or names a field its request does not have.
    """
    keyed = [d for d in declarations if d.service == service and d.keyed]
    stale = sorted(set(argument_names) - {kind_name(d.name) for d in keyed})
    if stale:
        raise RpcDeclarationError(
            f"ARGUMENT_NAMES has {', '.join(stale)}, which no keyed RPC of {service} is"
        )
    types = (_operation_type(d, argument_names.get(kind_name(d.name), {})) for d in keyed)
    return MappingProxyType({t.kind: t for t in types})


#: Every operation kind, by name: the keyed RPCs of the public API.
OPERATION_TYPES: Mapping[OperationKind, OperationType] = operation_types(RPCS)
KINDS: tuple[OperationKind, ...] = tuple(OPERATION_TYPES)


def operation_type(kind: str) -> OperationType:
    """The operation kind named `kind`; ValueError (listing the kinds) if there is none."""
    found = OPERATION_TYPES.get(kind)
    if found is None:
        raise ValueError(f"unknown operation kind {kind!r}; expected one of {', '.join(KINDS)}")
    return found
