"""The gRPC-to-HTTP table: every reason has a row, the draft's statuses, Retry-After, problem+json."""

from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import status_pb2
from grpc_status import rpc_status

from shardrouter.core import errors
from shardrouter.core.errors import FieldViolation, Reason
from shardrouter.core.wire import DETAILS_TRAILER
from shardrouter.router.http.idempotency_header import IdempotencyKeyHeaderError, parse_idempotency_key
from shardrouter.router.http.problems import (
    CODE_ROWS,
    PROBLEM_TYPE_PREFIX,
    REASON_ROWS,
    http_status_for,
    problem_for,
    problem_from_error,
    problem_from_status,
    problem_from_trailers,
    retry_after_seconds,
)

ALL_REASONS = sorted(v for k, v in vars(Reason).items() if k.isupper() and isinstance(v, str))


def test_every_reason_has_an_explicit_row():
    assert ALL_REASONS
    assert set(ALL_REASONS) == set(REASON_ROWS)


def test_every_grpc_code_has_a_row():
    assert set(CODE_ROWS) == set(grpc.StatusCode)


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        (Reason.IDEMPOTENCY_KEY_IN_FLIGHT, 409),
        (Reason.IDEMPOTENCY_KEY_REUSED, 422),
        (Reason.IDEMPOTENCY_KEY_EXPIRED, 422),
        (Reason.IDEMPOTENCY_KEY_MISSING, 400),
        (Reason.IDEMPOTENCY_KEY_INVALID, 400),
        (Reason.IDEMPOTENCY_KEY_FROM_FUTURE, 400),
        (Reason.INVALID_REQUEST, 400),
        (Reason.INSUFFICIENT_FUNDS, 422),
        (Reason.ACCOUNT_CLOSED, 422),
        (Reason.CURRENCY_MISMATCH, 422),
        (Reason.BALANCE_LIMIT_EXCEEDED, 422),
        (Reason.ACCOUNT_NOT_FOUND, 404),
        (Reason.TRANSFER_NOT_FOUND, 404),
        (Reason.RATE_LIMITED, 429),
        (Reason.SHARD_SATURATED, 503),
        (Reason.SLOT_RANGE_MOVING, 503),
        (Reason.DATABASE_UNAVAILABLE, 503),
        (Reason.DEADLINE_EXCEEDED, 504),
        (Reason.UNAUTHENTICATED, 401),
        (Reason.INTERNAL, 500),
    ],
)
def test_the_drafts_and_the_designs_statuses(reason, status):
    assert http_status_for(REASON_ROWS[reason].code, reason) == status


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.FAILED_PRECONDITION, 422),
        (grpc.StatusCode.ABORTED, 409),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.UNIMPLEMENTED, 501),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
        (grpc.StatusCode.DATA_LOSS, 500),
    ],
)
def test_codes_without_a_reason(code, status):
    assert http_status_for(code) == status
    assert http_status_for(code.value[0]) == status  # the numeric code of a google.rpc.Status
    assert problem_for(code, "x").body["type"] == "about:blank"


def test_a_reason_counts_only_with_its_own_code():
    # ShardRouterError defaults its reason to INTERNAL whatever its code.
    assert http_status_for(grpc.StatusCode.NOT_FOUND, Reason.INTERNAL) == 404
    assert http_status_for(grpc.StatusCode.INVALID_ARGUMENT, Reason.INSUFFICIENT_FUNDS) == 400
    assert http_status_for(grpc.StatusCode.FAILED_PRECONDITION, "SOMETHING_NEW") == 422
    assert problem_for(grpc.StatusCode.FAILED_PRECONDITION, "x", reason="SOMETHING_NEW").body == {
        "type": "about:blank",
        "title": "Unprocessable Content",
        "status": 422,
        "detail": "x",
        "reason": "SOMETHING_NEW",
    }


def test_every_error_type_raised_with_each_of_its_reasons_maps_through_its_row():
    by_code = {
        cls.code: cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.ShardRouterError)
    }
    for reason, row in REASON_ROWS.items():
        problem = problem_from_error(by_code[row.code]("m", reason=reason))
        assert problem.status == row.http_status
        assert problem.body["reason"] == reason
        assert problem.body["type"] == PROBLEM_TYPE_PREFIX + reason.lower().replace("_", "-")
        assert problem.body["title"] == row.title


def test_in_flight_is_409_with_retry_after_rounded_up():
    problem = problem_from_error(
        errors.Aborted("key in flight", reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT, retry_after_ms=1200)
    )
    assert problem.status == 409
    assert dict(problem.headers) == {"Retry-After": "2"}
    assert problem.body == {
        "type": PROBLEM_TYPE_PREFIX + "idempotency-key-in-flight",
        "title": "A request with this Idempotency-Key is in progress",
        "status": 409,
        "detail": "key in flight",
        "reason": "IDEMPOTENCY_KEY_IN_FLIGHT",
        "retry_after_ms": 1200,
    }
    assert problem.content_type == "application/problem+json"


@pytest.mark.parametrize(
    ("ms", "seconds"), [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (2000, 2), (60_500, 61)]
)
def test_retry_after_whole_seconds_rounded_up_at_least_one(ms, seconds):
    assert retry_after_seconds(ms) == seconds


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.ResourceExhausted("slow down", reason=Reason.RATE_LIMITED), 429),
        (errors.Unavailable("shed", reason=Reason.SHARD_SATURATED), 503),
        (errors.Aborted("busy", reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT), 409),
    ],
)
def test_retryable_answers_always_carry_retry_after(error, status):
    problem = problem_from_error(error)
    assert problem.status == status
    assert dict(problem.headers) == {"Retry-After": "1"}
    assert problem.body["retry_after_ms"] == 1000


def test_refusals_that_a_retry_cannot_change_carry_no_retry_after():
    for error in (
        errors.FailedPrecondition("no", reason=Reason.INSUFFICIENT_FUNDS),
        errors.FailedPrecondition("no", reason=Reason.IDEMPOTENCY_KEY_REUSED),
        errors.NotFound("no", reason=Reason.ACCOUNT_NOT_FOUND),
        errors.InvalidArgument("no", reason=Reason.INVALID_REQUEST),
    ):
        problem = problem_from_error(error)
        assert problem.headers == ()
        assert "retry_after_ms" not in problem.body


def test_field_violations_are_listed():
    problem = problem_from_error(
        errors.InvalidArgument(
            "bad transfer",
            reason=Reason.INVALID_REQUEST,
            field_violations=[
                FieldViolation("amount.currency", "not ISO 4217"),
                FieldViolation("reference", "long"),
            ],
        )
    )
    assert problem.status == 400
    assert problem.body["field_violations"] == [
        {"field": "amount.currency", "description": "not ISO 4217"},
        {"field": "reference", "description": "long"},
    ]


def test_decoded_from_the_wire_as_the_router_sees_it():
    error = errors.Unavailable("moving", reason=Reason.SLOT_RANGE_MOVING, retry_after_ms=250)
    status = rpc_status.to_status(errors.to_status_proto(error))
    trailers = status.trailing_metadata
    assert any(key == DETAILS_TRAILER for key, _ in trailers)
    problem = problem_from_trailers(status.code, status.details, trailers)
    assert problem.status == 503
    assert dict(problem.headers) == {"Retry-After": "1"}
    assert problem.body["retry_after_ms"] == 250
    assert problem.body["reason"] == Reason.SLOT_RANGE_MOVING
    assert problem.body["detail"] == "moving"
    raw = dict(trailers)[DETAILS_TRAILER]
    assert problem_from_status(status.code, status.details, raw) == problem


def test_no_or_broken_details_leave_code_and_message():
    for details in (None, b"\xff\xff not a status", status_pb2.Status()):
        problem = problem_from_status(grpc.StatusCode.NOT_FOUND, "gone", details)
        assert problem.status == 404
        assert problem.body == {"type": "about:blank", "title": "Not Found", "status": 404, "detail": "gone"}
    assert problem_from_trailers(grpc.StatusCode.INTERNAL, "x", None).status == 500


def test_header_refusals_are_400_with_their_reason():
    for header, reason in ((None, Reason.IDEMPOTENCY_KEY_MISSING), ('"abc', Reason.IDEMPOTENCY_KEY_INVALID)):
        with pytest.raises(IdempotencyKeyHeaderError) as caught:
            parse_idempotency_key(header)
        problem = problem_from_error(caught.value.to_error())
        assert problem.status == 400
        assert problem.body["reason"] == reason
        assert problem.body["field_violations"][0]["field"] == "Idempotency-Key"


def test_body_bytes_are_compact_sorted_json():
    problem = problem_from_error(errors.FailedPrecondition("caf\u00e9", reason=Reason.INSUFFICIENT_FUNDS))
    raw = problem.body_bytes()
    assert b": " not in raw
    assert b", " not in raw
    assert json.loads(raw) == dict(problem.body)
    assert list(json.loads(raw)) == sorted(problem.body)
