"""The caller library follows the RPC declarations: its operation kinds, their requests and responses,
its service config (and the shipped copy of it) and its command's subcommands are made from them."""

from __future__ import annotations

import argparse
import json
from importlib import resources

import pytest

from shardrouter.client import Operation, cli
from shardrouter.client.kinds import ARGUMENT_NAMES, KINDS, OPERATION_TYPES, kind_name
from shardrouter.client.service_config import (
    READ_TIMEOUT_S,
    SERVICE_CONFIG_RESOURCE,
    load_service_config,
    retryable_codes,
)
from shardrouter.client.wire import (
    LOCAL_VALIDATORS,
    InvalidOperation,
    build_request,
    decode_response_bytes,
    deposit_arguments,
    transfer_arguments,
    validate,
)
from shardrouter.core.rpcs import PUBLIC_SERVICE, RPCS
from shardrouter.core.validation import MAX_WAIT_MS
from shardrouter.v1 import transfer_pb2

PUBLIC = [d for d in RPCS if d.service == PUBLIC_SERVICE]
KEYED_PUBLIC = [d for d in PUBLIC if d.keyed]


def test_the_kinds_are_the_keyed_rpcs_of_the_public_api() -> None:
    assert tuple(kind_name(d.name) for d in KEYED_PUBLIC) == KINDS
    assert {"transfer", "deposit"} <= set(KINDS)
    assert kind_name("RefundTransfer") == "refund_transfer" and kind_name("GetHTTPRoute") == "get_http_route"
    with pytest.raises(ValueError, match="unknown operation kind 'get_balance'"):
        Operation.new("get_balance", {"account_id": "alice"})


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_builds_its_rpcs_request_and_decodes_its_response(kind: str) -> None:
    declaration = OPERATION_TYPES[kind].declaration
    routing = next(
        n for n, (path, _) in OPERATION_TYPES[kind].arguments.items() if path == declaration.routing_field
    )
    request = build_request(kind, {routing: "alice"})
    assert type(request) is declaration.request_type
    assert getattr(request, declaration.routing_field) == "alice"
    response = declaration.response_type()
    assert type(decode_response_bytes(kind, response.SerializeToString())) is declaration.response_type


def test_stored_arguments_make_the_same_bytes_as_before() -> None:
    """Operations stored by earlier versions resend byte for byte the request they first sent."""
    money = transfer_pb2.Money(amount_minor=2500, currency="EUR")
    transfer = transfer_pb2.TransferRequest(
        source_account_id="ivy", destination_account_id="jon", amount=money, reference="invoice 7"
    )
    deposit = transfer_pb2.DepositRequest(account_id="ivy", amount=money, reference="")
    built = build_request("transfer", transfer_arguments("ivy", "jon", 2500, "EUR", "invoice 7"))
    assert built.SerializeToString(deterministic=True) == transfer.SerializeToString(deterministic=True)
    built = build_request("deposit", deposit_arguments("ivy", 2500, "EUR"))
    assert built.SerializeToString(deterministic=True) == deposit.SerializeToString(deterministic=True)
    assert set(ARGUMENT_NAMES) <= set(KINDS)


def test_arguments_the_request_cannot_take_are_invalid_operations() -> None:
    with pytest.raises(InvalidOperation, match="transfer has no argument amount, colour"):
        build_request("transfer", {"amount": 5, "colour": "red"})
    with pytest.raises(InvalidOperation, match="deposit argument amount_minor: 'ten' is not an integer"):
        build_request("deposit", {"account": "ivy", "amount_minor": "ten", "currency": "EUR"})
    with pytest.raises(InvalidOperation, match="amount is required") as refused:
        validate("deposit", {"account": "ivy"})
    assert ("amount", "is required") in refused.value.field_violations
    assert set(LOCAL_VALIDATORS) <= {d.name for d in KEYED_PUBLIC}


def test_the_service_config_retries_what_each_declaration_allows() -> None:
    config = json.loads(load_service_config())
    by_method = {
        (n["service"], n["method"]): entry for entry in config["methodConfig"] for n in entry["name"]
    }
    assert set(by_method) == {(d.service, d.name) for d in PUBLIC}
    for declaration in PUBLIC:
        entry = by_method[(declaration.service, declaration.name)]
        codes = entry.get("retryPolicy", {}).get("retryableStatusCodes", [])
        assert codes == list(retryable_codes(declaration))
        if declaration.keyed:
            assert codes == ["ABORTED", "UNAVAILABLE"] and entry["retryPolicy"]["maxAttempts"] == 5
        else:
            assert codes == [] and entry["waitForReady"] is True
    # GetTransfer may wait up to MAX_WAIT_MS on the server: its deadline covers that wait.
    assert by_method[(PUBLIC_SERVICE, "GetTransfer")]["timeout"] == f"{READ_TIMEOUT_S + MAX_WAIT_MS // 1000}s"
    assert by_method[(PUBLIC_SERVICE, "GetBalance")]["timeout"] == f"{READ_TIMEOUT_S}s"


def test_the_shipped_service_config_file_is_fresh() -> None:
    shipped = (
        resources.files("shardrouter.client").joinpath(SERVICE_CONFIG_RESOURCE).read_text(encoding="utf-8")
    )
    assert shipped == load_service_config(), (
        f"shardrouter/client/{SERVICE_CONFIG_RESOURCE} is stale: run .venv/bin/python scripts/generate_service_config.py"
    )


def test_the_command_has_a_subcommand_for_every_kind() -> None:
    assert [kind for kind, _ in cli.OPERATION_COMMANDS.values()] == list(KINDS)
    parser = cli.build_parser({})
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(cli.OPERATION_COMMANDS) <= set(subcommands)


def test_a_derived_subcommand_takes_one_flag_per_request_field(capsys: pytest.CaptureFixture[str]) -> None:
    """What a keyed RPC without hand-written flags gets (shown on deposit, whose fields are known)."""
    command = cli._derived_command(OPERATION_TYPES["deposit"])
    parser = argparse.ArgumentParser()
    command.add_flags(parser)
    ns = parser.parse_args(["--account", "ivy", "--amount-minor", "250", "--currency", "EUR"])
    arguments = command.arguments(ns)
    assert arguments == {"account": "ivy", "amount_minor": 250, "currency": "EUR"}
    assert build_request("deposit", arguments) == build_request(
        "deposit", deposit_arguments("ivy", 250, "EUR", "")
    )
    assert command.describe(arguments) == "account=ivy, amount_minor=250, currency=EUR"
    with pytest.raises(SystemExit):
        parser.parse_args(["--amount-minor", "250"])
    assert "the following arguments are required: --account" in capsys.readouterr().err
