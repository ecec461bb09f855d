"""The generated OpenAPI 3.1 document and the self-contained documentation page."""

from __future__ import annotations

import json
import re

from openapi_spec_validator import validate

from shardrouter.core.errors import Reason
from shardrouter.core.rpcs import RPCS
from shardrouter.router.http.json_mapping import COMPACT_TRANSFER_ROUTE
from shardrouter.router.http.openapi import OPENAPI_PAGE, openapi_document, openapi_json, openapi_page
from shardrouter.router.http.problems import HTTP_ONLY_CODES

DOC = openapi_document()
HTTP_RPCS = [d for d in RPCS if d.http is not None]


def _resolve(item):
    while "$ref" in item:
        node = DOC
        for part in item["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        item = node
    return item


def _operations():
    for path, item in DOC["paths"].items():
        for verb, operation in item.items():
            yield path, verb, operation


def test_the_document_is_valid_openapi_3_1():
    assert DOC["openapi"].startswith("3.1")
    validate(DOC)
    validate(json.loads(openapi_json()))


def test_every_http_route_and_the_compact_form_appear_and_nothing_else():
    assert HTTP_RPCS
    expected = {(d.http.path, d.http.verb.lower()) for d in HTTP_RPCS}  # type: ignore[union-attr]
    expected.add((COMPACT_TRANSFER_ROUTE.path, COMPACT_TRANSFER_ROUTE.verb.lower()))
    assert {(path, verb) for path, verb, _ in _operations()} == expected
    assert all(d.service != "shardrouter.internal.v1.ShardLedgerService" for d in HTTP_RPCS)
    operation_ids = [op["operationId"] for _, _, op in _operations()]
    assert len(operation_ids) == len(set(operation_ids))
    for declaration in HTTP_RPCS:
        route = declaration.http
        operation = DOC["paths"][route.path][route.verb.lower()]
        assert operation["x-grpc-method"] == declaration.full_name
        path_params = [p["name"] for p in operation.get("parameters", []) if p.get("in") == "path"]
        assert path_params == list(route.path_fields)


def test_keyed_operations_take_the_idempotency_key_and_answer_201():
    for path, verb, operation in _operations():
        declaration = next(d for d in RPCS if d.full_name == operation["x-grpc-method"])
        parameters = [_resolve(p) for p in operation.get("parameters", [])]
        headers = [p for p in parameters if p["in"] == "header" and p["name"] == "Idempotency-Key"]
        responses = operation["responses"]
        if declaration.keyed:
            assert headers and headers[0]["required"], (path, verb)
            assert set(responses) >= {"201", "400", "409", "422", "429", "503"}
            assert "Idempotent-Replayed" in responses["201"]["headers"]
            assert "200" not in responses
        else:
            assert not headers
            assert set(responses) >= {"200", "400", "404", "429", "503"}
            assert "409" not in responses
        for status in ("400", "409", "422", "429", "503"):
            if status in responses:
                response = _resolve(responses[status])
                assert list(response["content"]) == ["application/problem+json"]
        for status in ("409", "429", "503"):
            if status in responses:
                assert "Retry-After" in _resolve(responses[status])["headers"]


def test_a_created_transfer_has_a_location_and_a_deposit_does_not():
    transfer = DOC["paths"]["/v1/transfers"]["post"]["responses"]["201"]
    deposit = DOC["paths"]["/v1/deposits"]["post"]["responses"]["201"]
    assert "Location" in transfer["headers"]
    assert "Location" not in deposit["headers"]


def test_schemas_follow_the_proto3_json_mapping():
    schemas = DOC["components"]["schemas"]
    money = schemas["Money"]["properties"]
    assert money["amountMinor"]["type"] == "string"
    assert money["amountMinor"]["format"] == "int64"
    assert money["currency"] == {"type": "string"}
    transfer = schemas["Transfer"]["properties"]
    assert transfer["createdAt"]["type"] == "string"
    assert transfer["createdAt"]["format"] == "date-time"
    assert transfer["state"] == {"$ref": "#/components/schemas/TransferState"}
    assert transfer["deliveryAttempts"] == {
        "type": "array",
        "items": {"$ref": "#/components/schemas/DeliveryAttempt"},
    }
    assert transfer["sourceAccountId"] == {"type": "string"}  # responses always write strings
    assert schemas["TransferState"]["enum"][0] == "TRANSFER_STATE_UNSPECIFIED"
    request = schemas["TransferRequest"]["properties"]
    assert request["sourceAccountId"]["type"] == ["string", "integer"]
    assert set(request) == {"sourceAccountId", "destinationAccountId", "amount", "reference"}
    compact = schemas["CompactTransfer"]
    assert compact["required"] == ["src", "dst", "amount"]
    assert compact["properties"]["amount"]["type"] == "integer"
    assert compact["additionalProperties"] is False


def test_every_ref_resolves():
    raw = openapi_json().decode()
    refs = set(re.findall(r'"\$ref":"([^"]+)"', raw))
    assert refs
    for ref in refs:
        assert _resolve({"$ref": ref}), ref


def test_problem_schema_lists_every_reason():
    problem = DOC["components"]["schemas"]["Problem"]
    reasons = {v for k, v in vars(Reason).items() if k.isupper() and isinstance(v, str)}
    assert set(problem["properties"]["reason"]["enum"]) == reasons | set(HTTP_ONLY_CODES)  # 408, 413, 415, ...
    assert {"type", "title", "status", "detail", "retry_after_ms", "field_violations"} <= set(
        problem["properties"]
    )


def test_openapi_json_is_deterministic():
    assert openapi_json() == openapi_json()
    assert json.loads(openapi_json()) == DOC


def test_the_page_is_self_contained_and_reads_openapi_json_relatively():
    page = openapi_page()
    assert page is OPENAPI_PAGE
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", page, re.IGNORECASE)
    assert not re.search(r"""(src|href)\s*=\s*["']?//""", page, re.IGNORECASE)
    assert "<link" not in page.lower()
    assert "<script src" not in page.lower()
    assert "@import" not in page
    assert 'fetch("openapi.json"' in page
    # The renderer writes text nodes, never markup taken from the document.
    assert "innerHTML" not in page
    for needle in ("parameters", "requestBody", "responses", "operationId"):
        assert needle in page


_FAKE_DOM = r"""
const doc = JSON.parse(require("fs").readFileSync(0, "utf8"));
const script = process.argv[2];
function node(tag) {
  return { tag, children: [], textContent: "", className: "", id: "",
           appendChild(c) { this.children.push(c); return c; } };
}
const byId = {};
global.document = {
  createElement: node,
  getElementById(id) { return byId[id] || (byId[id] = node("div")); },
};
let requested = null;
global.fetch = (url) => { requested = url; return Promise.resolve({ ok: true, json: () => Promise.resolve(doc) }); };
eval(require("fs").readFileSync(script, "utf8"));
function text(n) { return [n.textContent].concat(n.children.map(text)).join(" "); }
setTimeout(() => {
  console.log(JSON.stringify({ requested, error: byId.error ? byId.error.textContent : "",
                               title: byId.title.textContent, operations: text(byId.operations) }));
}, 50);
"""


def test_the_page_renders_every_operation(tmp_path):
    import shutil
    import subprocess

    import pytest

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = re.search(r"<script>(.*)</script>", OPENAPI_PAGE, re.DOTALL)
    assert script is not None
    (tmp_path / "page.js").write_text(script.group(1))
    (tmp_path / "dom.js").write_text(_FAKE_DOM)
    result = subprocess.run(
        [node, str(tmp_path / "dom.js"), str(tmp_path / "page.js")],
        input=openapi_json(),
        capture_output=True,
        timeout=60,
        check=True,
    )
    shown = json.loads(result.stdout)
    assert shown["requested"] == "openapi.json"
    assert shown["error"] == ""
    assert shown["title"].startswith("shard-router")
    for path, _verb, operation in _operations():
        assert path in shown["operations"]
        assert operation["operationId"] in shown["operations"]
    for words in (
        "Idempotency-Key",
        "Retry-After",
        "application/problem+json",
        "sourceAccountId",
        "201",
        "409",
    ):
        assert words in shown["operations"]
