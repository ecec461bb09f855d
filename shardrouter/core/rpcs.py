"""What each RPC is, read once from the proto declarations: the one registry every part uses.

Each method of a served service declares itself on the method, in the proto: its `CallRule`
(`shardrouter.v1.call`: routing field, keyed or not, key scope; see `proto/shardrouter/v1/options.proto`)
and, for the public API, its `google.api.http` route. This module reads those options from the
generated descriptors and checks them when it is imported, so a daemon with an RPC declared badly does
not start: a method without a rule, a routing field the request does not have (or that is not a
string), a scope on a read, an HTTP path variable that is no request field.

Readers: the router (which field routes a call), the shard daemon (which methods the idempotency
interceptor guards, their scopes, the ownership check before a claim, which records move with an
account), the caller library (the method path of an operation kind), the outbox relay and the HTTP
front (its routes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from google.api import annotations_pb2, http_pb2
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from shardrouter.internal.v1 import ledger_pb2
from shardrouter.v1 import options_pb2, transfer_pb2

# The generated .pyi types extensions as plain field descriptors; these are the extension handles.
_CALL_RULE: Any = options_pb2.call
_HTTP_RULE: Any = annotations_pb2.http

__all__ = [
    "INTEGER_FIELD_TYPES",
    "INTERNAL_SERVICE",
    "PUBLIC_SERVICE",
    "RPCS",
    "RPCS_BY_PATH",
    "HttpRoute",
    "RpcDeclaration",
    "RpcDeclarationError",
    "declarations_of",
    "rpc",
]

#: The protobuf field types that carry an integer (JSON and command-line flags read them as numbers).
INTEGER_FIELD_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED32,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64,
    }
)

PUBLIC_SERVICE = transfer_pb2.DESCRIPTOR.services_by_name["TransferService"].full_name
INTERNAL_SERVICE = ledger_pb2.DESCRIPTOR.services_by_name["ShardLedgerService"].full_name


class RpcDeclarationError(ValueError):
    """A method's declaration in the proto is missing or inconsistent."""


@dataclass(frozen=True, slots=True)
class HttpRoute:
    """A method's `google.api.http` route: verb, path template, and which part of the request is the body."""

    verb: str  # "GET", "POST", ...
    path: str  # "/v1/accounts/{account_id}/balance"
    body: str  # "*" (the whole request), a field name, or "" (no body)

    @property
    def path_fields(self) -> tuple[str, ...]:
        """The request fields named by the path's `{variables}`, in order."""
        fields: list[str] = []
        rest = self.path
        while "{" in rest:
            start = rest.index("{")
            end = rest.find("}", start)
            if end < 0:
                raise RpcDeclarationError(f"HTTP path {self.path!r} has an unclosed '{{'")
            fields.append(rest[start + 1 : end].split("=", 1)[0])
            rest = rest[end + 1 :]
        return tuple(fields)


@dataclass(frozen=True, slots=True)
class RpcDeclaration:
    """One RPC as its proto declares it."""

    service: str  # "shardrouter.v1.TransferService"
    name: str  # "Transfer"
    request_type: type[Message]
    response_type: type[Message]
    #: The request field (a string) naming the account whose shard owns the call.
    routing_field: str
    #: Whether the call needs an idempotency key and has its outcome stored and replayed.
    keyed: bool
    #: The key scope shared with other methods ("": the method's own full name).
    scope_name: str
    #: The HTTP route, for methods the HTTP front serves.
    http: HttpRoute | None

    @property
    def full_name(self) -> str:
        """The gRPC method path, "/shardrouter.v1.TransferService/Transfer"."""
        return f"/{self.service}/{self.name}"

    @property
    def scope_prefix(self) -> str:
        """The key scope's method part: the declared scope, else the full method name."""
        return self.scope_name or self.full_name


def _http_route(rule: http_pb2.HttpRule) -> HttpRoute | None:
    verb = rule.WhichOneof("pattern")
    if verb is None:
        return None
    if verb == "custom":
        return HttpRoute(rule.custom.kind.upper(), rule.custom.path, rule.body)
    return HttpRoute(verb.upper(), str(getattr(rule, verb)), rule.body)


def _string_field(request: Descriptor, name: str) -> FieldDescriptor | None:
    field = request.fields_by_name.get(name)
    if field is None or field.type != FieldDescriptor.TYPE_STRING or field.is_repeated:
        return None
    return field


def _declaration(method: MethodDescriptor) -> RpcDeclaration:
    where = f"rpc {method.full_name}"
    options = method.GetOptions()
    if not options.HasExtension(_CALL_RULE):
        raise RpcDeclarationError(f"{where} has no (shardrouter.v1.call) option: declare its routing field")
    rule: options_pb2.CallRule = options.Extensions[_CALL_RULE]
    request = method.input_type
    if not rule.routing_field:
        raise RpcDeclarationError(f"{where}: (shardrouter.v1.call).routing_field is empty")
    if _string_field(request, rule.routing_field) is None:
        raise RpcDeclarationError(
            f"{where}: routing_field {rule.routing_field!r} is not a singular string field of "
            f"{request.full_name}"
        )
    if rule.scope and not rule.keyed:
        raise RpcDeclarationError(f"{where}: a scope ({rule.scope!r}) is only for keyed methods")
    http = _http_route(options.Extensions[_HTTP_RULE]) if options.HasExtension(_HTTP_RULE) else None
    if http is not None:
        for name in http.path_fields:
            if _string_field(request, name) is None:
                raise RpcDeclarationError(
                    f"{where}: HTTP path variable {{{name}}} is not a string field of {request.full_name}"
                )
        if http.body not in ("", "*") and http.body not in request.fields_by_name:
            raise RpcDeclarationError(
                f"{where}: HTTP body {http.body!r} is not a field of {request.full_name}"
            )
    return RpcDeclaration(
        service=method.containing_service.full_name,
        name=method.name,
        request_type=message_factory.GetMessageClass(request),
        response_type=message_factory.GetMessageClass(method.output_type),
        routing_field=rule.routing_field,
        keyed=rule.keyed,
        scope_name=rule.scope,
        http=http,
    )


def declarations_of(services: Iterable[ServiceDescriptor]) -> tuple[RpcDeclaration, ...]:
    """Every method of `services`, read and checked; RpcDeclarationError names the first bad one."""
    return tuple(_declaration(m) for service in services for m in service.methods)


#: Every RPC that shard-router serves: the public API, then the shard-to-shard API.
RPCS: tuple[RpcDeclaration, ...] = declarations_of(
    (
        transfer_pb2.DESCRIPTOR.services_by_name["TransferService"],
        ledger_pb2.DESCRIPTOR.services_by_name["ShardLedgerService"],
    )
)
RPCS_BY_PATH: Mapping[str, RpcDeclaration] = MappingProxyType({d.full_name: d for d in RPCS})


def rpc(service: str, name: str) -> RpcDeclaration:
    """The declaration of `service`'s method `name` (KeyError if there is none)."""
    return RPCS_BY_PATH[f"/{service}/{name}"]
