"""Each RPC is declared once, in the proto, and every part reads that one declaration."""

from __future__ import annotations

import itertools

import pytest
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import ServiceDescriptor

from shardrouter.client.kinds import OPERATION_TYPES, operation_types
from shardrouter.client.service_config import service_config
from shardrouter.core.rpcs import (
    INTERNAL_SERVICE,
    PUBLIC_SERVICE,
    RPCS,
    RPCS_BY_PATH,
    HttpRoute,
    RpcDeclaration,
    RpcDeclarationError,
    declarations_of,
)
from shardrouter.internal.v1 import ledger_pb2
from shardrouter.router.routing import ROUTED_METHODS
from shardrouter.shardd import server
from shardrouter.v1 import options_pb2, transfer_pb2

_files = itertools.count()


def _service(*methods: tuple[str, options_pb2.CallRule | None, str | None]) -> ServiceDescriptor:
    """A service in a new proto file: one request type (a string `account`, an int `count`) and
    methods given as (name, call rule or None, HTTP GET path or None)."""
    n = next(_files)
    package = f"rpcs_test_{n}"
    proto = descriptor_pb2.FileDescriptorProto(
        name=f"rpcs_test_{n}.proto",
        package=package,
        syntax="proto3",
        dependency=["shardrouter/v1/options.proto", "google/api/annotations.proto"],
    )
    request = proto.message_type.add(name="Request")
    request.field.add(name="account", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING)
    request.field.add(name="count", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64)
    service = proto.service.add(name="Service")
    for name, rule, get_path in methods:
        method = service.method.add(
            name=name, input_type=f".{package}.Request", output_type=f".{package}.Request"
        )
        if rule is not None:
            method.options.Extensions[options_pb2.call].CopyFrom(rule)
        if get_path is not None:
            method.options.Extensions[annotations_pb2.http].get = get_path
    pool = descriptor_pool.Default()
    pool.Add(proto)
    return pool.FindServiceByName(f"{package}.Service")


def test_every_served_method_is_declared_with_a_routing_field() -> None:
    served = [
        transfer_pb2.DESCRIPTOR.services_by_name["TransferService"],
        ledger_pb2.DESCRIPTOR.services_by_name["ShardLedgerService"],
    ]
    assert {d.full_name for d in RPCS} == {f"/{s.full_name}/{m.name}" for s in served for m in s.methods}
    for declaration in RPCS:
        field = declaration.request_type.DESCRIPTOR.fields_by_name[declaration.routing_field]
        assert field.type == field.TYPE_STRING


def test_the_declarations_say_what_each_rpc_is() -> None:
    keyed = {d.name: (d.routing_field, d.scope_prefix) for d in RPCS if d.keyed}
    assert keyed == {
        "Transfer": ("source_account_id", f"/{PUBLIC_SERVICE}/Transfer"),
        "Deposit": ("account_id", f"/{PUBLIC_SERVICE}/Deposit"),
        # The credit and its void fence each other: one scope.
        "CreditTransfer": ("destination_account_id", "transfer_in"),
        "VoidCredit": ("destination_account_id", "transfer_in"),
        "RefundTransfer": ("source_account_id", f"/{INTERNAL_SERVICE}/RefundTransfer"),
    }
    routes = {d.name: d.http for d in RPCS if d.http is not None}
    assert routes == {
        "Transfer": HttpRoute("POST", "/v1/transfers", "*"),
        "Deposit": HttpRoute("POST", "/v1/deposits", "*"),
        "GetTransfer": HttpRoute("GET", "/v1/accounts/{source_account_id}/transfers/{transfer_id}", ""),
        "GetBalance": HttpRoute("GET", "/v1/accounts/{account_id}/balance", ""),
    }
    assert routes["GetTransfer"].path_fields == ("source_account_id", "transfer_id")


def test_router_shard_and_client_read_the_same_declarations() -> None:
    assert tuple(d for d in RPCS if d.service == PUBLIC_SERVICE) == ROUTED_METHODS
    guarded = server.mutating_methods()
    assert [(m.full_name, m.scope_prefix, m.routing_field) for m in guarded] == [
        (d.full_name, d.scope_prefix, d.routing_field) for d in RPCS if d.keyed
    ]
    keyed_public = [d.full_name for d in RPCS if d.keyed and d.service == PUBLIC_SERVICE]
    assert [t.method for t in OPERATION_TYPES.values()] == keyed_public
    for op_type in OPERATION_TYPES.values():
        assert RPCS_BY_PATH[op_type.method] is op_type.declaration


@pytest.mark.parametrize(
    ("rule", "get_path", "problem"),
    [
        (None, None, "has no (shardrouter.v1.call) option"),
        (options_pb2.CallRule(keyed=True), None, "routing_field is empty"),
        (
            options_pb2.CallRule(keyed=True, routing_field="acount"),
            None,
            "'acount' is not a singular string field",
        ),
        (
            options_pb2.CallRule(keyed=True, routing_field="count"),
            None,
            "'count' is not a singular string field",
        ),
        (options_pb2.CallRule(routing_field="account", scope="shared"), None, "only for keyed methods"),
        (
            options_pb2.CallRule(routing_field="account"),
            "/v1/things/{thing_id}",
            "{thing_id} is not a string field",
        ),
    ],
    ids=[
        "no-rule",
        "keyed-without-routing-field",
        "unknown-field",
        "not-a-string",
        "scope-on-a-read",
        "http-path",
    ],
)
def test_a_badly_declared_rpc_is_refused_naming_the_method(
    rule: options_pb2.CallRule | None, get_path: str | None, problem: str
) -> None:
    service = _service(("Good", options_pb2.CallRule(routing_field="account"), None), ("Bad", rule, get_path))
    with pytest.raises(RpcDeclarationError) as refused:
        declarations_of([service])
    assert f"{service.full_name}.Bad" in str(refused.value)
    assert problem in str(refused.value)


def test_a_well_declared_rpc_is_read() -> None:
    rule = options_pb2.CallRule(routing_field="account", keyed=True, scope="together")
    (declaration,) = declarations_of([_service(("Move", rule, "/v1/{account}"))])
    assert declaration.keyed
    assert declaration.scope_prefix == "together"
    assert declaration.http == HttpRoute("GET", "/v1/{account}", "")
    assert declaration.request_type.DESCRIPTOR.name == "Request"


def test_a_keyed_rpc_without_a_request_validator_stops_the_shard() -> None:
    (declaration,) = declarations_of(
        [_service(("Unvalidated", options_pb2.CallRule(routing_field="account", keyed=True), None))]
    )
    assert isinstance(declaration, RpcDeclaration)
    with pytest.raises(RpcDeclarationError, match="Unvalidated is keyed but has no request validator"):
        server._guarded_method(declaration, None)


def test_a_new_keyed_rpc_is_a_new_operation_kind_with_a_retrying_service_config() -> None:
    """What the caller library derives from a declaration, for an RPC it has never heard of."""
    service = _service(
        ("WithdrawAll", options_pb2.CallRule(routing_field="account", keyed=True), None),
        ("Peek", options_pb2.CallRule(routing_field="account"), None),
    )
    declarations = declarations_of([service])
    kinds = operation_types(declarations, service=service.full_name, argument_names={})
    assert list(kinds) == ["withdraw_all"]
    withdraw = kinds["withdraw_all"]
    assert withdraw.method == f"/{service.full_name}/WithdrawAll"
    assert {name: path for name, (path, _) in withdraw.arguments.items()} == {
        "account": "account",
        "count": "count",
    }
    config = service_config(declarations, service=service.full_name)
    by_method = {n["method"]: entry for entry in config["methodConfig"] for n in entry["name"]}
    assert by_method["WithdrawAll"]["retryPolicy"]["retryableStatusCodes"] == ["ABORTED", "UNAVAILABLE"]
    assert "retryPolicy" not in by_method["Peek"] and by_method["Peek"]["waitForReady"] is True


def test_argument_names_of_an_undeclared_kind_or_field_are_refused() -> None:
    service = _service(("Withdraw", options_pb2.CallRule(routing_field="account", keyed=True), None))
    declarations = declarations_of([service])
    with pytest.raises(RpcDeclarationError, match="ARGUMENT_NAMES has refund, which no keyed RPC"):
        operation_types(declarations, service=service.full_name, argument_names={"refund": {}})
    with pytest.raises(
        RpcDeclarationError, match=r"names amount\.currency, which .* has no string or integer"
    ):
        operation_types(
            declarations,
            service=service.full_name,
            argument_names={"withdraw": {"currency": "amount.currency"}},
        )
