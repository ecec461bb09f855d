"""HTTP/JSON <-> messages: requests per each route, the compact transfer, deterministic response JSON."""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st

from shardrouter.core.errors import Reason
from shardrouter.core.rpcs import RPCS
from shardrouter.router.http.json_mapping import (
    COMPACT_TRANSFER_ROUTE,
    CompactTransfer,
    DuplicateField,
    JsonRequestError,
    MalformedJson,
    PathBodyConflict,
    UnexpectedInput,
    UnknownField,
    WrongType,
    compact_transfer_request,
    created_location,
    message_to_json_bytes,
    request_from_http,
    response_json_from_wire,
)
from shardrouter.router.http.problems import problem_from_error
from shardrouter.v1 import transfer_pb2

HTTP = {d.name: d for d in RPCS if d.http is not None}
TRANSFER, DEPOSIT, GET_TRANSFER, GET_BALANCE = (
    HTTP[n] for n in ("Transfer", "Deposit", "GetTransfer", "GetBalance")
)


def body(value: object) -> bytes:
    return json.dumps(value).encode()


def test_every_http_route_builds_its_request():
    assert set(HTTP) == {"Transfer", "Deposit", "GetTransfer", "GetBalance"}
    for declaration in HTTP.values():
        route = declaration.http
        assert route is not None
        params = {name: f"v-{name}" for name in route.path_fields}
        message = request_from_http(declaration, params, b"{}" if route.body == "*" else None)
        assert isinstance(message, declaration.request_type)
        for name, value in params.items():
            assert getattr(message, name) == value


def test_transfer_body_in_either_spelling_with_account_ids_as_numbers():
    expected = transfer_pb2.TransferRequest(
        source_account_id="8842",
        destination_account_id="1190",
        amount=transfer_pb2.Money(amount_minor=2500, currency="EUR"),
        reference="invoice 7",
    )
    camel = {
        "sourceAccountId": 8842,
        "destinationAccountId": "1190",
        "amount": {"amountMinor": "2500", "currency": "EUR"},
        "reference": "invoice 7",
    }
    snake = {
        "source_account_id": "8842",
        "destination_account_id": 1190,
        "amount": {"amount_minor": 2500, "currency": "EUR"},
        "reference": "invoice 7",
    }
    assert request_from_http(TRANSFER, {}, body(camel)) == expected
    assert request_from_http(TRANSFER, {}, body(snake)) == expected


def test_null_means_the_default():
    assert request_from_http(
        DEPOSIT, {}, b'{"accountId":"a","reference":null}'
    ) == transfer_pb2.DepositRequest(account_id="a")


def test_path_variables_set_their_fields_and_must_agree_with_the_body():
    params = {"source_account_id": "acc-1", "transfer_id": "t-1"}
    message = request_from_http(GET_TRANSFER, params, None, [("waitForCompletionMs", "500")])
    assert message == transfer_pb2.GetTransferRequest(
        source_account_id="acc-1", transfer_id="t-1", wait_for_completion_ms=500
    )
    assert request_from_http(GET_BALANCE, {"account_id": "42"}) == transfer_pb2.GetBalanceRequest(
        account_id="42"
    )


def test_a_path_variable_contradicting_the_body_is_refused():
    from shardrouter.core.rpcs import HttpRoute, RpcDeclaration

    # No declared route has a path variable and a body today; the rule is checked on one that would.
    route = HttpRoute("POST", "/v1/accounts/{account_id}/deposits", "*")
    declaration = RpcDeclaration(
        DEPOSIT.service, "Deposit", DEPOSIT.request_type, DEPOSIT.response_type, "account_id", True, "", route
    )
    assert request_from_http(declaration, {"account_id": "42"}, b'{"accountId": 42}').account_id == "42"
    assert request_from_http(declaration, {"account_id": "42"}, b"{}").account_id == "42"
    with pytest.raises(PathBodyConflict) as caught:
        request_from_http(declaration, {"account_id": "42"}, b'{"account_id": "43"}')
    assert caught.value.field == "account_id"
    assert "'42'" in caught.value.message and "'43'" in caught.value.message


@pytest.mark.parametrize(
    ("raw", "error", "field", "words"),
    [
        (b"", MalformedJson, "", "empty"),
        (b"{", MalformedJson, "", "line 1 column 2"),
        (b"[1]", MalformedJson, "", "JSON array"),
        (b'"x"', MalformedJson, "", "JSON string"),
        (b"\xff{}", MalformedJson, "", "not UTF-8"),
        (b'{"reference": NaN}', MalformedJson, "", "NaN"),
        (b'{"reference":"a","reference":"b"}', DuplicateField, "reference", "twice"),
        (b'{"reference":"a","reference":"a"}', DuplicateField, "reference", "twice"),
        (b'{"sourceAccountId":"a","source_account_id":"a"}', DuplicateField, "source_account_id", "twice"),
        (b'{"src": 1}', UnknownField, "src", "has no field 'src'"),
        (b'{"amount": {"cents": 1}}', UnknownField, "amount.cents", "Money has no field"),
        (b'{"amount": 5}', WrongType, "amount", "expected an object"),
        (b'{"amount": {"amountMinor": 25.5}}', WrongType, "amount.amount_minor", "fractional"),
        (b'{"amount": {"amountMinor": 25.0}}', WrongType, "amount.amount_minor", "fractional"),
        (b'{"amount": {"amountMinor": "x"}}', WrongType, "amount.amount_minor", "invalid literal"),
        (b'{"amount": {"amountMinor": true}}', WrongType, "amount.amount_minor", "Bool"),
        (
            b'{"amount": {"amountMinor": "99999999999999999999"}}',
            WrongType,
            "amount.amount_minor",
            "out of range",
        ),
        (b'{"reference": 5}', WrongType, "reference", "expected string"),
        (b'{"sourceAccountId": 1.5}', WrongType, "source_account_id", "string or an integer"),
        (b'{"sourceAccountId": true}', WrongType, "source_account_id", "string or an integer"),
        (b'{"sourceAccountId": ["a"]}', WrongType, "source_account_id", "expected string"),
    ],
)
def test_refusals_name_the_problem_and_field(raw, error, field, words):
    with pytest.raises(error) as caught:
        request_from_http(TRANSFER, {}, raw)
    assert caught.value.field == field
    assert words in caught.value.message


def test_input_a_route_does_not_take_is_refused():
    with pytest.raises(UnexpectedInput):
        request_from_http(TRANSFER, {}, b"{}", [("reference", "x")])
    with pytest.raises(UnexpectedInput):
        request_from_http(GET_BALANCE, {"account_id": "a"}, b'{"accountId": "a"}')
    assert request_from_http(GET_BALANCE, {"account_id": "a"}, b"") == transfer_pb2.GetBalanceRequest(
        account_id="a"
    )
    with pytest.raises(UnknownField) as caught:
        request_from_http(GET_BALANCE, {"account_id": "a"}, None, {"account_id": "b"})
    assert "none" in caught.value.message
    with pytest.raises(UnknownField):
        request_from_http(GET_TRANSFER, {"source_account_id": "a", "transfer_id": "t"}, None, [("wait", "1")])
    with pytest.raises(DuplicateField):
        request_from_http(
            GET_TRANSFER,
            {"source_account_id": "a", "transfer_id": "t"},
            None,
            [("wait_for_completion_ms", "1"), ("waitForCompletionMs", "2")],
        )
    with pytest.raises(WrongType):
        request_from_http(
            GET_TRANSFER,
            {"source_account_id": "a", "transfer_id": "t"},
            None,
            [("wait_for_completion_ms", "-1")],
        )


def test_refusals_become_400_invalid_request():
    with pytest.raises(JsonRequestError) as caught:
        request_from_http(TRANSFER, {}, b'{"amount": {"cents": 1}}')
    error = caught.value.to_error()
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == Reason.INVALID_REQUEST
    problem = problem_from_error(error)
    assert problem.status == 400
    assert problem.body["field_violations"][0]["field"] == "amount.cents"


@given(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5) | st.none(), max_size=5))
def test_any_json_object_is_a_request_or_a_refusal(obj):
    try:
        message = request_from_http(TRANSFER, {}, body(obj))
    except JsonRequestError as error:
        assert error.message
    else:
        assert isinstance(message, transfer_pb2.TransferRequest)


# The compact form of the source document: POST /transfers {"src":8842,"dst":1190,"amount":2500}.


def test_compact_transfer_without_currency_asks_for_the_accounts_currency():
    assert COMPACT_TRANSFER_ROUTE.verb == "POST"
    assert COMPACT_TRANSFER_ROUTE.path == "/transfers"
    compact = compact_transfer_request(b'{"src":8842,"dst":1190,"amount":2500}')
    assert compact == CompactTransfer(
        transfer_pb2.TransferRequest(
            source_account_id="8842",
            destination_account_id="1190",
            amount=transfer_pb2.Money(amount_minor=2500),
        ),
        currency_from_accounts=True,
    )
    assert compact.declaration is TRANSFER


def test_compact_transfer_with_currency_and_reference():
    compact = compact_transfer_request(
        body({"src": "a-1", "dst": "b-2", "amount": 1, "currency": "EUR", "reference": "r"})
    )
    assert not compact.currency_from_accounts
    assert compact.request == transfer_pb2.TransferRequest(
        source_account_id="a-1",
        destination_account_id="b-2",
        amount=transfer_pb2.Money(amount_minor=1, currency="EUR"),
        reference="r",
    )
    assert compact_transfer_request(
        body({"src": 1, "dst": 2, "amount": 3, "currency": None})
    ).currency_from_accounts


@pytest.mark.parametrize(
    ("obj", "error", "field"),
    [
        ({"src": 1, "dst": 2}, WrongType, "amount"),
        ({"dst": 2, "amount": 3}, WrongType, "src"),
        ({"src": 1, "amount": 3}, WrongType, "dst"),
        ({"src": 1, "dst": 2, "amount": 25.5}, WrongType, "amount"),
        ({"src": 1, "dst": 2, "amount": 25.0}, WrongType, "amount"),
        ({"src": 1, "dst": 2, "amount": "2500"}, WrongType, "amount"),
        ({"src": 1, "dst": 2, "amount": True}, WrongType, "amount"),
        ({"src": 1, "dst": 2, "amount": 1 << 63}, WrongType, "amount"),
        ({"src": 1.5, "dst": 2, "amount": 3}, WrongType, "src"),
        ({"src": 1, "dst": [2], "amount": 3}, WrongType, "dst"),
        ({"src": 1, "dst": 2, "amount": 3, "currency": 978}, WrongType, "currency"),
        ({"src": 1, "dst": 2, "amount": 3, "reference": {}}, WrongType, "reference"),
        ({"src": 1, "dst": 2, "amount": 3, "memo": "x"}, UnknownField, "memo"),
        ({"sourceAccountId": "a"}, UnknownField, "sourceAccountId"),
    ],
)
def test_compact_transfer_refusals(obj, error, field):
    with pytest.raises(error) as caught:
        compact_transfer_request(body(obj))
    assert caught.value.field == field


def test_compact_transfer_malformed_json():
    with pytest.raises(MalformedJson):
        compact_transfer_request(b"src=1")
    with pytest.raises(DuplicateField):
        compact_transfer_request(b'{"src":1,"src":2,"dst":3,"amount":4}')


# Responses: deterministic JSON, so a replay is byte for byte the first answer.


def _transfer_response() -> transfer_pb2.TransferResponse:
    response = transfer_pb2.TransferResponse(
        transfer=transfer_pb2.Transfer(
            transfer_id="0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b",
            source_account_id="8842",
            destination_account_id="1190",
            amount=transfer_pb2.Money(amount_minor=2500, currency="EUR"),
            state=transfer_pb2.TRANSFER_STATE_PENDING,
            reference="caf\u00e9",
        )
    )
    response.transfer.created_at.FromMilliseconds(1_700_000_000_123)
    return response


def test_response_json_golden_bytes():
    assert message_to_json_bytes(_transfer_response()) == (
        b'{"transfer":{"amount":{"amountMinor":"2500","currency":"EUR"},'
        b'"createdAt":"2023-11-14T22:13:20.123Z","deliveryAttempts":[],"destinationAccountId":"1190",'
        b'"reference":"caf\xc3\xa9","sourceAccountId":"8842","state":"TRANSFER_STATE_PENDING",'
        b'"transferId":"0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"}}'
    )


def test_response_from_the_wire_is_the_same_json():
    response = _transfer_response()
    assert response_json_from_wire(TRANSFER, response.SerializeToString()) == message_to_json_bytes(response)
    empty = transfer_pb2.GetBalanceResponse()
    assert message_to_json_bytes(empty) == b'{"accountId":"","state":"ACCOUNT_STATE_UNSPECIFIED"}'


@given(
    st.text(max_size=20),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.sampled_from(list(transfer_pb2.TransferState.values())),
    st.integers(min_value=0, max_value=253402300799),
    st.integers(min_value=0, max_value=999_999_999),
)
def test_response_json_is_deterministic_and_round_trips(text, amount, state, seconds, nanos):
    response = transfer_pb2.TransferResponse(
        transfer=transfer_pb2.Transfer(
            transfer_id=text, reference=text, amount=transfer_pb2.Money(amount_minor=amount), state=state
        )
    )
    response.transfer.updated_at.seconds = seconds
    response.transfer.updated_at.nanos = nanos
    first = message_to_json_bytes(response)
    again = transfer_pb2.TransferResponse.FromString(response.SerializeToString())
    assert message_to_json_bytes(again) == first
    parsed = json_format.Parse(first, transfer_pb2.TransferResponse())
    assert parsed == response
    assert message_to_json_bytes(parsed) == first


def test_location_of_a_created_transfer_is_its_get_route():
    response = _transfer_response()
    response.transfer.source_account_id = "a/b c"
    assert created_location(TRANSFER, response) == (
        "/v1/accounts/a%2Fb%20c/transfers/0192d1a8-7c1e-7b3a-9f2e-3c4d5e6f7a8b"
    )
    assert created_location(TRANSFER, transfer_pb2.TransferResponse()) is None
    assert created_location(DEPOSIT, transfer_pb2.DepositResponse(entry_id="e")) is None
