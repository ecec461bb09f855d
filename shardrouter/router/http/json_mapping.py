"""HTTP/JSON to request messages and response messages to JSON, per each RPC's `google.api.http` route.

The HTTP front serves the routes declared on the RPCs (`shardrouter.core.rpcs`), so a request message
is built from a route's path variables, its query (routes without a body) and its JSON body with the
proto3 JSON mapping (`google.protobuf.json_format`), and the response message is written back as JSON:

* `request_from_http(declaration, path_params, body, query)`: body `"*"` means the whole JSON object
  is the request; path variables set their fields (a body holding the same field with another value is
  refused); fields may be spelled as in the proto (`source_account_id`) or in lowerCamelCase
  (`sourceAccountId`), not both. Account ids (string fields named `*account_id`) are accepted as JSON
  strings or integers. Unknown fields, floats in integer fields, malformed JSON and duplicate object
  keys are refused. Every refusal is a `JsonRequestError` whose `to_error()` is the `InvalidArgument`
  (reason INVALID_REQUEST, HTTP 400) naming the field.
* `compact_transfer_request(body)`: the source document's `POST /transfers` form,
  `{"src": 8842, "dst": 1190, "amount": 2500}` (src/dst integers or strings, amount an integer of
  minor units, optional `currency` and `reference`). Without `currency` the request's
  `amount.currency` is left empty and `currency_from_accounts` is set: the caller of this function
  must fill it from the accounts' currency (read with GetBalance of the source account) *before*
  sending the request, so that the request, and hence its idempotency hash, is the same on every retry.
* `message_to_json_bytes(message)`: deterministic JSON (lowerCamelCase names, every field printed,
  int64 as strings, keys sorted, compact separators, UTF-8): the same message always gives the same
  bytes, so a replayed outcome is answered byte for byte as the first time.
* `created_location(declaration, response)`: the `Location` of what a POST created, from the GET
  route that returns the same message (Transfer -> `/v1/accounts/{source_account_id}/transfers/{id}`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from shardrouter.core.errors import FieldViolation, InvalidArgument, Reason
from shardrouter.core.rpcs import INTEGER_FIELD_TYPES, PUBLIC_SERVICE, RPCS, HttpRoute, RpcDeclaration, rpc
from shardrouter.v1 import transfer_pb2

__all__ = [
    "COMPACT_TRANSFER_FIELDS",
    "COMPACT_TRANSFER_ROUTE",
    "CompactTransfer",
    "DuplicateField",
    "JsonRequestError",
    "MalformedJson",
    "PathBodyConflict",
    "UnexpectedInput",
    "UnknownField",
    "WrongType",
    "compact_transfer_request",
    "created_location",
    "created_resource_route",
    "message_to_json_bytes",
    "request_from_http",
    "response_json_from_wire",
]

#: The source document's compact transfer: served beside the declared route, for the Transfer RPC.
COMPACT_TRANSFER_ROUTE = HttpRoute("POST", "/transfers", "*")
COMPACT_TRANSFER_FIELDS = ("src", "dst", "amount", "currency", "reference")

_FAILED_FIELD = re.compile(r"Failed to parse (\w+) field")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class JsonRequestError(ValueError):
    """The HTTP request does not make a valid request message; `message` says why, for a person."""

    kind: ClassVar[str] = "invalid request"

    def __init__(self, problem: str, field: str = "") -> None:
        self.problem = problem
        self.field = field
        self.message = f"{self.kind}: {problem}"
        super().__init__(self.message)

    def to_error(self) -> InvalidArgument:
        """The refusal as our error type: INVALID_ARGUMENT / INVALID_REQUEST (HTTP 400), field named."""
        return InvalidArgument(
            self.message,
            reason=Reason.INVALID_REQUEST,
            field_violations=[FieldViolation(self.field or "body", self.problem)],
        )


class MalformedJson(JsonRequestError):
    """The body is not JSON (or not UTF-8, or not an object where one is needed)."""

    kind = "malformed JSON body"


class UnknownField(JsonRequestError):
    """A field the request message does not have."""

    kind = "unknown field"


class DuplicateField(JsonRequestError):
    """The same field twice: a repeated object key, or both its proto and its lowerCamelCase name."""

    kind = "duplicate field"


class WrongType(JsonRequestError):
    """A field's JSON value has the wrong type or is out of range."""

    kind = "wrong type"


class PathBodyConflict(JsonRequestError):
    """A path variable and the body name different values for one field."""

    kind = "path and body disagree"


class UnexpectedInput(JsonRequestError):
    """A body on a route without one, or query parameters where the route takes none."""

    kind = "unexpected input"


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateField(f"the JSON object has the key {key!r} twice", key)
        result[key] = value
    return result


def _refuse_constant(name: str) -> Any:
    raise MalformedJson(f"{name} is not JSON")


def _load_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MalformedJson(f"the body is not UTF-8 (byte {error.start})") from None
    if not text.strip():
        raise MalformedJson("the body is empty; send a JSON object")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise MalformedJson(f"{error.msg} at line {error.lineno} column {error.colno}") from None


def _load_object(body: bytes) -> dict[str, Any]:
    value = _load_json(body)
    if not isinstance(value, dict):
        raise MalformedJson(f"the body is a JSON {_json_type(value)}; send a JSON object")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _descriptor(message_type: type[Message] | Message) -> Descriptor:
    descriptor: Any = message_type.DESCRIPTOR  # the upb and pure-Python descriptor types differ in stubs
    return descriptor  # type: ignore[no-any-return]


def _message_of(field: FieldDescriptor) -> Descriptor:
    message = field.message_type
    if message is None:
        raise TypeError(f"{field.full_name} is not a message field")
    return message


def _is_account_field(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_STRING and field.name.endswith("account_id")


def _is_plain_message(field: FieldDescriptor) -> bool:
    """A message field written as a JSON object of its fields (not a map, not a well-known type)."""
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        return False
    message = _message_of(field)
    return not message.GetOptions().map_entry and not message.full_name.startswith("google.protobuf.")


def _account_id(value: Any, where: str) -> Any:
    """An account id given as a JSON integer, as the string the request holds."""
    if isinstance(value, bool | float):
        raise WrongType(
            f"{where} is a JSON {_json_type(value)}; an account id is a string or an integer", where
        )
    if isinstance(value, int):
        return str(value)
    return value


def _normalise(obj: dict[str, Any], message: Descriptor, prefix: str) -> dict[str, Any]:
    """`obj` keyed by proto field names, checked for unknown and doubled fields, account ids as strings."""
    by_json_name = {f.json_name: f for f in message.fields}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        field = message.fields_by_name.get(key) or by_json_name.get(key)
        where = prefix + key
        if field is None:
            known = ", ".join(f.name for f in message.fields)
            raise UnknownField(f"{message.name} has no field {where!r} (its fields: {known})", where)
        if field.name in out:
            raise DuplicateField(
                f"{prefix}{field.name} is given twice (as {field.name!r} and {field.json_name!r})",
                prefix + field.name,
            )
        where = prefix + field.name
        out[field.name] = None if value is None else _check_value(field, value, where)
    return out


def _check_value(field: FieldDescriptor, value: Any, where: str) -> Any:
    if field.is_repeated and not (
        field.type == FieldDescriptor.TYPE_MESSAGE and _message_of(field).GetOptions().map_entry
    ):
        if not isinstance(value, list):
            raise WrongType(f"{where} is a JSON {_json_type(value)}; expected an array", where)
        return [_check_single(field, item, f"{where}[{i}]") for i, item in enumerate(value)]
    return _check_single(field, value, where)


def _check_single(field: FieldDescriptor, value: Any, where: str) -> Any:
    if _is_plain_message(field):
        if not isinstance(value, dict):
            raise WrongType(f"{where} is a JSON {_json_type(value)}; expected an object", where)
        return _normalise(value, _message_of(field), where + ".")
    if _is_account_field(field):
        return _account_id(value, where)
    if field.type in INTEGER_FIELD_TYPES and isinstance(value, float):
        raise WrongType(f"{where} is a fractional JSON number ({value!r}); expected an integer", where)
    return value


def _parse(values: dict[str, Any], declaration: RpcDeclaration) -> Message:
    message = declaration.request_type()
    try:
        json_format.ParseDict(values, message, ignore_unknown_fields=False)
    except json_format.ParseError as error:
        text = str(error).split("\n", 1)[0]
        field = ".".join(_FAILED_FIELD.findall(text))
        detail = text.rsplit(" field: ", 1)[-1].split(" at ", 1)[0].rstrip(".")
        raise WrongType(f"{field or 'the body'}: {detail}", field) from None
    return message


def _query_values(
    query: Iterable[tuple[str, str]] | Mapping[str, str] | None,
) -> list[tuple[str, str]]:
    if query is None:
        return []
    if isinstance(query, Mapping):
        return list(query.items())
    return list(query)


def request_from_http(
    declaration: RpcDeclaration,
    path_params: Mapping[str, str],
    body: bytes | None = None,
    query: Iterable[tuple[str, str]] | Mapping[str, str] | None = None,
) -> Message:
    """The request message of `declaration` from an HTTP request on its route.

    `path_params` are the route's `{variables}` (Starlette: `request.path_params`); `body` the raw
    body (None or empty for no body); `query` the query parameters as (name, value) pairs (Starlette:
    `request.query_params.multi_items()`), which set the remaining fields of a route without a body.
    Raises a `JsonRequestError` subclass.
    """
    route = declaration.http
    if route is None:
        raise ValueError(f"{declaration.full_name} has no HTTP route")
    request = _descriptor(declaration.request_type)
    pairs = _query_values(query)
    values: dict[str, Any]
    if route.body == "*":
        values = _normalise(_load_object(body or b""), request, "")
        if pairs:
            raise UnexpectedInput(
                f"{route.verb} {route.path} takes its fields in the JSON body, not as query parameters "
                f"({pairs[0][0]!r})",
                pairs[0][0],
            )
    elif route.body:
        field = request.fields_by_name[route.body]
        values = {route.body: _check_value(field, _load_json(body or b""), route.body)} if body else {}
        values.update(_query_object(pairs, request, route))
    else:
        if body and body.strip():
            raise UnexpectedInput(f"{route.verb} {route.path} takes no body", "body")
        values = _query_object(pairs, request, route)
    for name in route.path_fields:
        if name not in path_params:
            raise ValueError(f"path variable {{{name}}} of {route.path} was not given")
        from_path = path_params[name]
        in_body = values.get(name)
        if in_body is not None and in_body != from_path:
            raise PathBodyConflict(
                f"the path says {name} is {from_path!r} but the body says {in_body!r}", name
            )
        values[name] = from_path
    return _parse(values, declaration)


def _query_object(pairs: list[tuple[str, str]], request: Descriptor, route: HttpRoute) -> dict[str, Any]:
    by_json_name = {f.json_name: f for f in request.fields}
    values: dict[str, Any] = {}
    for key, value in pairs:
        field = request.fields_by_name.get(key) or by_json_name.get(key)
        if field is None or field.name in route.path_fields or field.name == route.body:
            known = ", ".join(
                f.name for f in request.fields if f.name not in route.path_fields and f.name != route.body
            )
            raise UnknownField(
                f"{route.verb} {route.path} has no query parameter {key!r} (its query parameters: "
                f"{known or 'none'})",
                key,
            )
        if field.type == FieldDescriptor.TYPE_MESSAGE or field.is_repeated:
            raise UnexpectedInput(f"{key} cannot be given as a query parameter", key)
        if field.name in values:
            raise DuplicateField(f"the query parameter {key!r} is given twice", key)
        values[field.name] = value
    return values


@dataclass(frozen=True, slots=True)
class CompactTransfer:
    """A compact transfer read into the Transfer RPC's request.

    When `currency_from_accounts` is set, `request.amount.currency` is empty: the caller fills it with
    the accounts' currency (GetBalance of the source account) before sending, then the shard checks
    that the destination has the same currency.
    """

    request: transfer_pb2.TransferRequest
    currency_from_accounts: bool

    #: The RPC the compact form is a spelling of.
    declaration: ClassVar[RpcDeclaration] = rpc(PUBLIC_SERVICE, "Transfer")


def compact_transfer_request(body: bytes) -> CompactTransfer:
    """`{"src": 8842, "dst": 1190, "amount": 2500, "currency"?: "EUR", "reference"?: "..."}` as a request."""
    obj = _load_object(body)
    for key in obj:
        if key not in COMPACT_TRANSFER_FIELDS:
            raise UnknownField(
                f"a compact transfer has no field {key!r} (its fields: {', '.join(COMPACT_TRANSFER_FIELDS)})",
                key,
            )
    for key in ("src", "dst", "amount"):
        if obj.get(key) is None:
            raise WrongType(f"{key} is required", key)
    amount = obj["amount"]
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise WrongType(
            f"amount is a JSON {_json_type(amount)}; expected an integer count of minor units (2500 for 25.00)",
            "amount",
        )
    if not _INT64_MIN <= amount <= _INT64_MAX:
        raise WrongType("amount does not fit in 64 bits", "amount")
    currency, reference = obj.get("currency"), obj.get("reference")
    for key, value in (("currency", currency), ("reference", reference)):
        if value is not None and not isinstance(value, str):
            raise WrongType(f"{key} is a JSON {_json_type(value)}; expected a string", key)
    src, dst = _account_id(obj["src"], "src"), _account_id(obj["dst"], "dst")
    for key, value in (("src", src), ("dst", dst)):
        if not isinstance(value, str):
            raise WrongType(
                f"{key} is a JSON {_json_type(value)}; an account id is a string or an integer", key
            )
    request = transfer_pb2.TransferRequest(
        source_account_id=src,
        destination_account_id=dst,
        amount=transfer_pb2.Money(amount_minor=amount, currency=currency or ""),
        reference=reference or "",
    )
    return CompactTransfer(request, currency_from_accounts=not currency)


def message_to_json_bytes(message: Message) -> bytes:
    """`message` as deterministic proto3 JSON: lowerCamelCase, all fields, sorted keys, compact, UTF-8."""
    values = json_format.MessageToDict(message, always_print_fields_with_no_presence=True)
    return json.dumps(values, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def response_json_from_wire(declaration: RpcDeclaration, data: bytes) -> bytes:
    """The JSON body for a response message received serialised (as the router forwards it)."""
    return message_to_json_bytes(declaration.response_type.FromString(data))


def created_resource_route(declaration: RpcDeclaration) -> tuple[str, RpcDeclaration] | None:
    """Which response field of `declaration` is a created resource, and the GET RPC that returns it.

    The GET route is the one whose response has a message field of the same type as a field of this
    response, with every path variable a field of that message (TransferResponse.transfer is the
    Transfer that GetTransfer returns, found by source_account_id and transfer_id). None if no route
    returns anything this call answers with.
    """
    for field in _descriptor(declaration.response_type).fields:
        if field.type != FieldDescriptor.TYPE_MESSAGE or field.is_repeated:
            continue
        created = _message_of(field)
        for other in RPCS:
            route = other.http
            if other is declaration or route is None or route.verb != "GET":
                continue
            returns = {
                _message_of(f).full_name
                for f in _descriptor(other.response_type).fields
                if f.type == FieldDescriptor.TYPE_MESSAGE
            }
            if created.full_name in returns and all(
                name in created.fields_by_name for name in route.path_fields
            ):
                return field.name, other
    return None


def created_location(declaration: RpcDeclaration, response: Message) -> str | None:
    """The path of what `declaration` created, for `Location` (see `created_resource_route`), or None.

    None too when the response lacks the resource or a path value is empty.
    """
    found = created_resource_route(declaration)
    if found is None or not response.HasField(found[0]):
        return None
    field, getter = found
    route = getter.http
    assert route is not None
    created: Message = getattr(response, field)
    path = route.path
    for name in route.path_fields:
        value = str(getattr(created, name))
        if not value:
            return None
        path = path.replace("{" + name + "}", quote(value, safe=""), 1)
    return path
