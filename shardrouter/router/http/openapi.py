"""The OpenAPI 3.1 description of the HTTP/JSON front, generated from the RPC declarations.

Every RPC with a `google.api.http` route (`shardrouter.core.rpcs.RPCS`) is one operation; its request
and response schemas come from the message descriptors with the proto3 JSON mapping (lowerCamelCase
names, 64-bit integers as decimal strings, enums by name, Timestamp as an RFC 3339 string). Keyed
operations take the `Idempotency-Key` header (and `Prefer: wait=N`, `prefer`), answer 201 (with
`Location` where a GET route returns what they created) and mark replays with
`Idempotent-Replayed: true`; failures are problem+json
(`shardrouter.router.http.problems`). The source document's compact `POST /transfers` is added beside
the declared routes (`shardrouter.router.http.json_mapping.COMPACT_TRANSFER_ROUTE`).

`openapi_json()` is the document as bytes to serve at `openapi.json`; `OPENAPI_PAGE` is a
self-contained HTML page (no external asset) that fetches `openapi.json` from beside itself and lists
each operation with its parameters, body and responses.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

from shardrouter.core.errors import Reason
from shardrouter.core.keys import MAX_KEY_LENGTH
from shardrouter.core.rpcs import RPCS, HttpRoute, RpcDeclaration
from shardrouter.core.wire_names import (
    IDEMPOTENCY_KEY_HEADER,
    LOCATION_HEADER,
    REPLAYED_HEADER,
    REPLAYED_VALUE,
    RETRY_AFTER_HEADER,
)
from shardrouter.router.http.json_mapping import (
    COMPACT_TRANSFER_ROUTE,
    CompactTransfer,
    created_resource_route,
)
from shardrouter.router.http.prefer import PREFER_HEADER, PREFERENCE_APPLIED_HEADER
from shardrouter.router.http.problems import HTTP_ONLY_CODES, PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_PREFIX

__all__ = ["OPENAPI_PAGE", "OPENAPI_VERSION", "openapi_document", "openapi_json", "openapi_page"]

OPENAPI_VERSION = "3.1.0"
_SCHEMAS = "#/components/schemas/"
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {
        "type": "string",
        "format": "date-time",
        "description": "RFC 3339 time in UTC, for example 2026-01-31T12:00:00.123Z",
    },
    "google.protobuf.Duration": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?s$"},
}
_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_SFIXED64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_FIXED64,
}
_UINT32 = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32}
_INT32 = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32}
_FLOATS = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}


def _descriptor(message_type: type[Message]) -> Descriptor:
    descriptor: Any = message_type.DESCRIPTOR  # the upb and pure-Python descriptor types differ in stubs
    return descriptor  # type: ignore[no-any-return]


class _Schemas:
    """The component schemas reached from the operations, named by short proto name."""

    def __init__(self) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        self._full_names: dict[str, str] = {}

    def _name(self, full_name: str, short: str) -> str:
        owner = self._full_names.setdefault(short, full_name)
        return short if owner == full_name else full_name.replace(".", "_")

    def ref(self, descriptor: Descriptor | EnumDescriptor, *, request: bool = False) -> dict[str, Any]:
        """A `$ref` to the schema of a message or enum, adding it (and what it uses) when new."""
        if descriptor.full_name in _WELL_KNOWN:
            return dict(_WELL_KNOWN[descriptor.full_name])
        name = self._name(descriptor.full_name, descriptor.name)
        if name not in self.schemas:
            if isinstance(descriptor, EnumDescriptor):
                self.schemas[name] = {
                    "type": "string",
                    "enum": [v.name for v in descriptor.values],
                    "description": f"Enum {descriptor.full_name}, by value name.",
                }
            else:
                self.schemas[name] = {}  # placeholder against recursion
                self.schemas[name] = self._message(descriptor, request=request)
        return {"$ref": _SCHEMAS + name}

    def _message(self, message: Descriptor, *, request: bool) -> dict[str, Any]:
        # Only the request message itself takes account ids as integers; what it nests is shared.
        properties = {field.json_name: self._field(field, request=request) for field in message.fields}
        return {
            "type": "object",
            "description": f"Message {message.full_name} (proto3 JSON mapping).",
            "properties": properties,
        }

    def _field(self, field: FieldDescriptor, *, request: bool) -> dict[str, Any]:
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            value = message.fields_by_name["value"]
            return {"type": "object", "additionalProperties": self._single(value, request=request)}
        single = self._single(field, request=request)
        if field.is_repeated:
            return {"type": "array", "items": single}
        return single

    def _single(self, field: FieldDescriptor, *, request: bool) -> dict[str, Any]:
        kind = field.type
        if field.message_type is not None:
            return self.ref(field.message_type)
        if field.enum_type is not None:
            return self.ref(field.enum_type)
        if kind in _INT64:
            return {
                "type": "string",
                "format": "uint64"
                if kind in {FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64}
                else "int64",
                "pattern": "^-?[0-9]+$",
                "description": "64-bit integer as a decimal string (requests may also send a JSON integer).",
            }
        if kind in _UINT32:
            return {"type": "integer", "format": "int64", "minimum": 0, "maximum": 2**32 - 1}
        if kind in _INT32:
            return {"type": "integer", "format": "int32"}
        if kind in _FLOATS:
            return {"type": "number"}
        if kind == FieldDescriptor.TYPE_BOOL:
            return {"type": "boolean"}
        if kind == FieldDescriptor.TYPE_BYTES:
            return {"type": "string", "contentEncoding": "base64"}
        if request and field.name.endswith("account_id"):
            return {
                "type": ["string", "integer"],
                "description": "Account id; a JSON integer is read as its decimal string.",
            }
        return {"type": "string"}


def _problem_schema() -> dict[str, Any]:
    # The reasons of the gRPC ErrorInfo and those only the HTTP front answers (408, 413, 415, ...).
    reasons = sorted(
        {v for k, v in vars(Reason).items() if k.isupper() and isinstance(v, str)} | set(HTTP_ONLY_CODES)
    )
    return {
        "type": "object",
        "description": "RFC 9457 problem details; `reason` is the gRPC ErrorInfo reason.",
        "required": ["type", "title", "status"],
        "properties": {
            "type": {
                "type": "string",
                "description": (
                    f"{PROBLEM_TYPE_PREFIX}<reason in kebab case> for every reason, the HTTP-only "
                    "refusals' included; about:blank only for an answer without a known reason"
                ),
            },
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "reason": {"type": "string", "enum": reasons},
            "retry_after_ms": {"type": "integer", "minimum": 0},
            "field_violations": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["field", "description"],
                    "properties": {"field": {"type": "string"}, "description": {"type": "string"}},
                },
            },
        },
    }


def _compact_transfer_schema() -> dict[str, Any]:
    account = "Account id (a JSON integer is read as its decimal string)."
    return {
        "type": "object",
        "description": (
            "The compact transfer of the source document. Without `currency` the source account's "
            "currency is used."
        ),
        "required": ["src", "dst", "amount"],
        "additionalProperties": False,
        "properties": {
            "src": {"type": ["string", "integer"], "description": "Account to debit. " + account},
            "dst": {"type": ["string", "integer"], "description": "Account to credit. " + account},
            "amount": {
                "type": "integer",
                "minimum": 1,
                "description": "Amount in minor units (2500 for 25.00).",
            },
            "currency": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "ISO 4217 code."},
            "reference": {"type": "string", "maxLength": 140},
        },
    }


def _problem_response(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {PROBLEM_CONTENT_TYPE: {"schema": {"$ref": _SCHEMAS + "Problem"}}},
    }
    if retry_after:
        response["headers"] = {RETRY_AFTER_HEADER: {"$ref": f"#/components/headers/{RETRY_AFTER_HEADER}"}}
    return response


_ERROR_RESPONSES: dict[str, dict[str, Any]] = {
    "400": _problem_response("Malformed request, or a missing or malformed Idempotency-Key."),
    "404": _problem_response("The account or transfer does not exist."),
    "409": _problem_response(
        "A request with this Idempotency-Key is still in progress: send it again after Retry-After "
        f"(or send `{PREFER_HEADER}: wait=N` to wait for its outcome instead; this answer then comes only "
        "once the wait granted ran out).",
        retry_after=True,
    ),
    "422": _problem_response(
        "Refused: the key was used for a different request or has expired, or the accounts' state refuses "
        "it (insufficient funds, closed account, currency mismatch, balance limit). Retrying does not help."
    ),
    "429": _problem_response("Too many requests: retry after Retry-After.", retry_after=True),
    "503": _problem_response(
        "Temporarily unavailable: retry (same key) after Retry-After.", retry_after=True
    ),
    "504": _problem_response("The deadline ran out; nothing was applied."),
    "default": _problem_response("Any other failure."),
}
# A duplicate that asked to wait and ran out of its wait says what it was granted.
_ERROR_RESPONSES["409"]["headers"][PREFERENCE_APPLIED_HEADER] = {
    "$ref": f"#/components/headers/{PREFERENCE_APPLIED_HEADER}"
}


def _parameters(declaration: RpcDeclaration, route: HttpRoute, schemas: _Schemas) -> list[dict[str, Any]]:
    """Path fields, then (for a route without a body) the request's scalar fields as query
    parameters, then the key header of a keyed call."""
    request = _descriptor(declaration.request_type)
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in route.path_fields
    ]
    if not route.body:
        parameters += [
            {
                "name": field.json_name,
                "in": "query",
                "required": False,
                "schema": schemas._single(field, request=True),
            }
            for field in request.fields
            if field.name not in route.path_fields and field.message_type is None and not field.is_repeated
        ]
    if declaration.keyed:
        parameters.append({"$ref": f"#/components/parameters/{IDEMPOTENCY_KEY_HEADER}"})
        parameters.append({"$ref": f"#/components/parameters/{PREFER_HEADER}"})
    return parameters


def _request_body(
    declaration: RpcDeclaration, route: HttpRoute, schemas: _Schemas, *, compact: bool
) -> dict[str, Any] | None:
    """The request body's schema: the compact transfer, the whole request, or one of its fields."""
    if not route.body:
        return None
    request = _descriptor(declaration.request_type)
    if compact:
        schema: dict[str, Any] = {"$ref": _SCHEMAS + "CompactTransfer"}
    elif route.body == "*":
        schema = schemas.ref(request, request=True)
    else:
        schema = schemas._field(request.fields_by_name[route.body], request=True)
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _responses(declaration: RpcDeclaration, schemas: _Schemas) -> dict[str, Any]:
    """201 (keyed: with the replay marker and, for a created resource, its Location) or 200, then
    the problem answers that can occur (409 and 422 only for keyed calls)."""
    success: dict[str, Any] = {
        "description": "Applied." if declaration.keyed else "OK.",
        "content": {"application/json": {"schema": schemas.ref(_descriptor(declaration.response_type))}},
    }
    if declaration.keyed:
        headers: dict[str, Any] = {
            REPLAYED_HEADER: {
                "description": (
                    f"`{REPLAYED_VALUE}` when this is the stored answer of an earlier request with the same key."
                ),
                "schema": {"type": "string", "enum": [REPLAYED_VALUE]},
            },
            PREFERENCE_APPLIED_HEADER: {"$ref": f"#/components/headers/{PREFERENCE_APPLIED_HEADER}"},
        }
        if created_resource_route(declaration) is not None:
            headers[LOCATION_HEADER] = {
                "description": "Path of the created resource.",
                "schema": {"type": "string"},
            }
        success["headers"] = headers
    responses: dict[str, Any] = {"201" if declaration.keyed else "200": success}
    for status in ("400", "404", "409", "422", "429", "503", "504", "default"):
        if status in ("409", "422") and not declaration.keyed:
            continue
        responses[status] = {"$ref": f"#/components/responses/Problem{status.capitalize()}"}
    return responses


def _operation(
    declaration: RpcDeclaration, route: HttpRoute, schemas: _Schemas, *, compact: bool = False
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": declaration.name + ("Compact" if compact else ""),
        "tags": [declaration.service],
        "summary": f"{declaration.name}{' (compact form)' if compact else ''}",
        "description": (
            f"gRPC method {declaration.full_name}; routed by `{declaration.routing_field}`."
            + (
                f" Mutating and idempotent: send an {IDEMPOTENCY_KEY_HEADER}, the same on every retry; a retry "
                "of a completed request answers the stored status and body with "
                f"`{REPLAYED_HEADER}: {REPLAYED_VALUE}`."
                if declaration.keyed
                else " Read-only."
            )
        ),
        "x-grpc-method": declaration.full_name,
    }
    parameters = _parameters(declaration, route, schemas)
    if parameters:
        operation["parameters"] = parameters
    body = _request_body(declaration, route, schemas, compact=compact)
    if body is not None:
        operation["requestBody"] = body
    operation["responses"] = _responses(declaration, schemas)
    return operation


def _header_parameters() -> dict[str, Any]:
    """The request headers keyed operations take: the key, and the wait preference."""
    return {
        IDEMPOTENCY_KEY_HEADER: {
            "name": IDEMPOTENCY_KEY_HEADER,
            "in": "header",
            "required": True,
            "description": (
                f"1-{MAX_KEY_LENGTH} visible ASCII characters, quoted (structured-field string) "
                "or bare; a UUIDv7 is recommended. Generate it once per operation, store it, and "
                "send it unchanged on every retry."
            ),
            "schema": {"type": "string", "minLength": 1, "maxLength": 2 * MAX_KEY_LENGTH + 2},
        },
        PREFER_HEADER: {
            "name": PREFER_HEADER,
            "in": "header",
            "required": False,
            "description": (
                "RFC 7240 preferences; the one read is `wait=N` (whole seconds). When an earlier "
                "request with the same Idempotency-Key is still in progress, wait up to N seconds "
                "(capped at the server's maximum, and within the request's deadline) for its "
                "outcome and answer it (replayed, with Idempotent-Replayed: true), or run the "
                "request if that attempt ended without an outcome, instead of 409 at once. Past "
                "the wait, 409 as without it. A wait value that is not a whole number of seconds "
                "is refused with 400; other preferences are ignored."
            ),
            "schema": {"type": "string", "examples": ["wait=5"]},
        },
    }


def _response_headers() -> dict[str, Any]:
    """The response headers answers refer to."""
    return {
        RETRY_AFTER_HEADER: {
            "description": "Seconds to wait before sending the same request again.",
            "schema": {"type": "integer", "minimum": 1},
        },
        PREFERENCE_APPLIED_HEADER: {
            "description": (
                f"`wait=M` when the request's `{PREFER_HEADER}: wait=N` was honoured: M is the "
                "longest wait granted, N capped at the server's maximum (the deadline bounds it "
                "further). On every answer to such a request, including 409."
            ),
            "schema": {"type": "string", "examples": ["wait=5"]},
        },
    }


def openapi_document(title: str = "shard-router", version: str = "v1") -> dict[str, Any]:
    """The OpenAPI 3.1 document of every RPC with an HTTP route, plus the compact `POST /transfers`."""
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    for declaration in RPCS:
        if declaration.http is None:
            continue
        route = declaration.http
        paths.setdefault(route.path, {})[route.verb.lower()] = _operation(declaration, route, schemas)
    compact = CompactTransfer.declaration
    paths.setdefault(COMPACT_TRANSFER_ROUTE.path, {})[COMPACT_TRANSFER_ROUTE.verb.lower()] = _operation(
        compact, COMPACT_TRANSFER_ROUTE, schemas, compact=True
    )
    components_schemas = dict(sorted(schemas.schemas.items()))
    components_schemas["Problem"] = _problem_schema()
    components_schemas["CompactTransfer"] = _compact_transfer_schema()
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": title,
            "version": version,
            "description": (
                "HTTP/JSON front of shard-router, one semantics with its gRPC API: the same RPCs, routes "
                "from their google.api.http declarations, bodies in the proto3 JSON mapping (fields in "
                "lowerCamelCase or as in the proto, unknown fields refused). Mutating calls take an "
                "Idempotency-Key header (IETF draft): 201 on first apply, the stored answer replayed with "
                "Idempotent-Replayed: true, 409 + Retry-After while in flight (or, with Prefer: wait=N, "
                "the in-flight request's outcome once it has one, and Preference-Applied), 422 on reuse "
                "with a different request, 400 when missing or malformed. Errors are problem+json "
                "carrying the gRPC ErrorInfo reason."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": components_schemas,
            "parameters": _header_parameters(),
            "headers": _response_headers(),
            "responses": {
                f"Problem{status.capitalize()}": response for status, response in _ERROR_RESPONSES.items()
            },
        },
    }


def openapi_json() -> bytes:
    """The OpenAPI document as compact, deterministic JSON bytes (serve as `openapi.json`)."""
    return json.dumps(openapi_document(), separators=(",", ":"), sort_keys=True).encode()


def openapi_page() -> str:
    """The documentation page: self-contained HTML that renders `openapi.json` from beside it."""
    return OPENAPI_PAGE


OPENAPI_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>shard-router HTTP API</title>
<style>
body { font: 15px/1.5 system-ui, sans-serif; margin: 0 auto; max-width: 60rem; padding: 1rem 2rem; color: #1d2330; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.15rem; margin: 0; } h3 { font-size: 1rem; margin: 1rem 0 .3rem; }
section.op { border: 1px solid #d4d8e0; border-radius: 6px; margin: 1.2rem 0; padding: .8rem 1rem; }
.verb { display: inline-block; min-width: 4rem; font-weight: 700; text-transform: uppercase; }
.verb.post { color: #1a7f37; } .verb.get { color: #0b5cad; }
code, pre { font-family: ui-monospace, monospace; font-size: .9em; }
pre { background: #f4f6f9; padding: .6rem; overflow-x: auto; }
table { border-collapse: collapse; width: 100%; } td, th { text-align: left; padding: .2rem .5rem; border-bottom: 1px solid #eceff3; vertical-align: top; }
.muted { color: #5b6475; } #error { color: #b3261e; }
</style>
</head>
<body>
<h1 id="title">shard-router HTTP API</h1>
<p id="description" class="muted">Loading openapi.json&hellip;</p>
<p id="error"></p>
<div id="operations"></div>
<script>
"use strict";
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function resolve(doc, item) {
  let seen = 0;
  while (item && item.$ref && seen++ < 20) {
    item = item.$ref.replace(/^#\\//, "").split("/").reduce((o, k) => (o ? o[k] : undefined), doc);
  }
  return item || {};
}
function typeName(doc, schema) {
  if (!schema) return "";
  if (schema.$ref) return schema.$ref.split("/").pop();
  if (schema.type === "array") return typeName(doc, schema.items) + "[]";
  const t = Array.isArray(schema.type) ? schema.type.join(" | ") : (schema.type || "");
  return schema.format ? t + " (" + schema.format + ")" : t;
}
function table(headers, rows) {
  const t = el("table"), head = el("tr");
  headers.forEach((h) => head.appendChild(el("th", h)));
  t.appendChild(head);
  rows.forEach((r) => { const tr = el("tr"); r.forEach((c) => tr.appendChild(el("td", c))); t.appendChild(tr); });
  return t;
}
function schemaTable(doc, schema) {
  const s = resolve(doc, schema), required = s.required || [];
  const rows = Object.entries(s.properties || {}).map(([name, p]) => {
    const r = resolve(doc, p);
    const enumText = r.enum ? " one of: " + r.enum.join(", ") : "";
    return [name + (required.includes(name) ? " *" : ""), typeName(doc, p), ((p.description || r.description || "") + enumText).trim()];
  });
  return rows.length ? table(["field", "type", "description"], rows) : el("p", typeName(doc, schema), "muted");
}
function renderOperation(doc, path, verb, op) {
  const box = el("section", null, "op");
  const h = el("h2");
  h.appendChild(el("span", verb, "verb " + verb));
  h.appendChild(el("code", path));
  box.appendChild(h);
  box.appendChild(el("p", (op.summary || "") + (op.operationId ? " [" + op.operationId + "]" : ""), "muted"));
  if (op.description) box.appendChild(el("p", op.description));
  const params = (op.parameters || []).map((p) => resolve(doc, p));
  if (params.length) {
    box.appendChild(el("h3", "Parameters"));
    box.appendChild(table(["name", "in", "type", "description"], params.map((p) => [
      p.name + (p.required ? " *" : ""), p.in, typeName(doc, p.schema), p.description || ""])));
  }
  if (op.requestBody) {
    box.appendChild(el("h3", "Body"));
    Object.entries(op.requestBody.content || {}).forEach(([type, media]) => {
      box.appendChild(el("p", type + ": " + typeName(doc, media.schema), "muted"));
      box.appendChild(schemaTable(doc, media.schema));
    });
  }
  box.appendChild(el("h3", "Responses"));
  box.appendChild(table(["status", "description", "body", "headers"], Object.entries(op.responses || {}).map(([status, r]) => {
    const resp = resolve(doc, r);
    const bodies = Object.entries(resp.content || {}).map(([t, m]) => t + ": " + typeName(doc, m.schema)).join("; ");
    return [status, resp.description || "", bodies, Object.keys(resp.headers || {}).join(", ")];
  })));
  return box;
}
function render(doc) {
  document.getElementById("title").textContent = (doc.info && doc.info.title || "API") + " " + (doc.info && doc.info.version || "");
  document.getElementById("description").textContent = doc.info && doc.info.description || "";
  const list = document.getElementById("operations");
  Object.entries(doc.paths || {}).forEach(([path, item]) => {
    ["get", "put", "post", "delete", "patch"].forEach((verb) => {
      if (item[verb]) list.appendChild(renderOperation(doc, path, verb, item[verb]));
    });
  });
  const schemas = (doc.components && doc.components.schemas) || {};
  const names = Object.keys(schemas);
  if (names.length) {
    list.appendChild(el("h2", "Schemas"));
    names.forEach((name) => {
      const box = el("section", null, "op");
      box.id = "schema-" + name;
      box.appendChild(el("h3", name));
      if (schemas[name].description) box.appendChild(el("p", schemas[name].description, "muted"));
      box.appendChild(schemaTable(doc, schemas[name]));
      list.appendChild(box);
    });
  }
}
fetch("openapi.json", { headers: { "Accept": "application/json" } })
  .then((r) => { if (!r.ok) throw new Error("openapi.json: HTTP " + r.status); return r.json(); })
  .then(render)
  .catch((e) => { document.getElementById("error").textContent = String(e); });
</script>
</body>
</html>
"""
