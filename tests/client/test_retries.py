"""send_with_retries against a scripted in-test gRPC server: what is retried, when, with which key."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardrouter.client import (
    ErrorDetails,
    OperationState,
    RetryPolicy,
    SqliteOperationStore,
    TransferClient,
    Verdict,
    classify,
    load_service_config,
)
from shardrouter.client.retry import backoff_s
from shardrouter.core.errors import Reason
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.client.fakes import FIXED_TRANSFER_ID, fail, ok, scripted_server, sleep_then

U = grpc.StatusCode


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteOperationStore]:
    with SqliteOperationStore(tmp_path / "ops.db") as s:
        yield s


def _client(address: str, store: SqliteOperationStore, **kwargs: object) -> TransferClient:
    return TransferClient(address, store=store, **kwargs)  # type: ignore[arg-type]


def test_aborted_with_retry_info_waits_the_delay_and_resends_the_same_key(
    store: SqliteOperationStore,
) -> None:
    with scripted_server(
        fail(U.ABORTED, "in flight", reason=Reason.IDEMPOTENCY_KEY_IN_FLIGHT, retry_ms=50), ok(True)
    ) as (
        address,
        service,
    ):
        with _client(address, store, caller_id="billing") as client:
            op = client.create_transfer("alice", "bob", 2500, "EUR", reference="r1")
            result = client.send_with_retries(op, base_backoff_s=0.0, max_backoff_s=0.0)
    assert len(service.calls) == 2
    assert service.calls[1].at - service.calls[0].at >= 0.050
    assert service.keys == [op.idempotency_key, op.idempotency_key]
    assert [c.metadata.get("x-caller-id") for c in service.calls] == ["billing", "billing"]
    assert service.calls[0].request == service.calls[1].request
    assert result.ok and result.replayed and result.attempts == 2
    assert result.state is OperationState.SUCCEEDED
    assert isinstance(result.response, transfer_pb2.TransferResponse)
    assert result.response.transfer.transfer_id == FIXED_TRANSFER_ID
    stored = store.get(op.id)
    assert stored is not None
    assert [(a.code, a.reason, a.replayed) for a in stored.attempts] == [
        ("ABORTED", Reason.IDEMPOTENCY_KEY_IN_FLIGHT, False),
        ("OK", None, True),
    ]
    assert stored.outcome is not None and stored.outcome.response_b64


def test_aborted_without_retry_info_falls_back_to_the_pushback_trailer(store: SqliteOperationStore) -> None:
    with scripted_server(fail(U.ABORTED, pushback_ms=120), ok()) as (address, service):
        with _client(address, store) as client:
            op = client.create_deposit("alice", 100, "EUR")
            result = client.send_with_retries(op, base_backoff_s=0.0, max_backoff_s=0.0)
    assert result.ok and len(service.calls) == 2
    assert service.calls[1].at - service.calls[0].at >= 0.120
    assert "x-caller-id" not in service.calls[0].metadata


def test_unavailable_then_ok(store: SqliteOperationStore) -> None:
    with scripted_server(fail(U.UNAVAILABLE, "db down"), ok()) as (address, service):
        with _client(address, store) as client:
            result = client.transfer("alice", "bob", 1, "EUR")
    assert result.ok and not result.replayed
    assert [a.code for a in result.operation.attempts] == ["UNAVAILABLE", "OK"]
    assert len(set(service.keys)) == 1


def test_attempt_deadline_exceeded_then_ok(store: SqliteOperationStore) -> None:
    with scripted_server(sleep_then(0.6, ok()), ok(True)) as (address, service):
        with _client(address, store) as client:
            op = client.create_transfer("alice", "bob", 1, "EUR")
            started = time.monotonic()
            result = client.send_with_retries(op, attempt_timeout_s=0.2, base_backoff_s=0.0)
            elapsed = time.monotonic() - started
    assert result.ok and result.replayed
    assert [a.code for a in result.operation.attempts] == ["DEADLINE_EXCEEDED", "OK"]
    assert elapsed < 0.55  # the first attempt was cut at its own deadline, not the server's pace
    assert len(set(service.keys)) == 1


def test_failed_precondition_is_final_after_exactly_one_attempt(store: SqliteOperationStore) -> None:
    with scripted_server(
        fail(U.FAILED_PRECONDITION, "insufficient funds", reason=Reason.INSUFFICIENT_FUNDS), ok()
    ) as (
        address,
        service,
    ):
        with _client(address, store) as client:
            result = client.transfer("alice", "bob", 1, "EUR")
    assert len(service.calls) == 1
    assert result.state is OperationState.FAILED and result.attempts == 1
    assert result.reason == Reason.INSUFFICIENT_FUNDS
    assert result.error is not None and result.error.domain == "shardrouter.v1"
    stored = store.get(result.operation.id)
    assert stored is not None and stored.outcome is not None
    assert stored.outcome.reason == Reason.INSUFFICIENT_FUNDS and stored.outcome.response_b64 is None


@pytest.mark.parametrize("code", [U.INVALID_ARGUMENT, U.NOT_FOUND, U.PERMISSION_DENIED, U.UNIMPLEMENTED])
def test_other_refusals_are_not_retried(store: SqliteOperationStore, code: grpc.StatusCode) -> None:
    with scripted_server(fail(code), ok()) as (address, service):
        with _client(address, store) as client:
            result = client.transfer("alice", "bob", 1, "EUR")
    assert len(service.calls) == 1 and result.state is OperationState.FAILED


def test_expired_key_needs_reconciliation(store: SqliteOperationStore) -> None:
    with scripted_server(
        fail(U.FAILED_PRECONDITION, "too old", reason=Reason.IDEMPOTENCY_KEY_EXPIRED), ok()
    ) as (
        address,
        service,
    ):
        with _client(address, store) as client:
            result = client.transfer("alice", "bob", 1, "EUR")
    assert len(service.calls) == 1
    assert result.state is OperationState.NEEDS_RECONCILIATION
    assert store.list_pending() == []


def test_internal_stops_but_stays_pending_for_resume(store: SqliteOperationStore) -> None:
    with scripted_server(fail(U.INTERNAL, "bug"), ok()) as (address, service):
        with _client(address, store) as client:
            result = client.transfer("alice", "bob", 1, "EUR")
            assert len(service.calls) == 1 and result.state is OperationState.PENDING
            assert not result.budget_exhausted
            resumed = client.resume_pending()
    assert [r.ok for r in resumed] == [True]
    assert service.keys == [result.operation.idempotency_key] * 2


def test_resource_exhausted_is_retried_only_with_a_server_delay(store: SqliteOperationStore) -> None:
    with scripted_server(fail(U.RESOURCE_EXHAUSTED, "slow down", retry_ms=20), ok()) as (address, service):
        with _client(address, store) as client:
            assert client.transfer("alice", "bob", 1, "EUR").ok
    assert len(service.calls) == 2
    with scripted_server(fail(U.RESOURCE_EXHAUSTED, "too big"), ok()) as (address, service):
        with _client(address, store) as client:
            assert client.transfer("alice", "bob", 1, "EUR").state is OperationState.FAILED
    assert len(service.calls) == 1


def test_budget_exhausted_leaves_the_operation_pending_with_every_attempt_recorded(
    store: SqliteOperationStore,
) -> None:
    with scripted_server(fail(U.UNAVAILABLE, "down")) as (address, service):
        with _client(address, store) as client:
            op = client.create_transfer("alice", "bob", 1, "EUR")
            started = time.monotonic()
            result = client.send_with_retries(
                op, budget_s=0.4, attempt_timeout_s=0.1, base_backoff_s=0.02, max_backoff_s=0.05
            )
            elapsed = time.monotonic() - started
    assert result.budget_exhausted and result.state is OperationState.PENDING
    assert result.code is U.UNAVAILABLE
    assert elapsed < 0.6
    stored = store.get(op.id)
    assert stored is not None and stored.state is OperationState.PENDING
    assert len(stored.attempts) == len(service.calls) == result.attempts >= 3
    assert all(a.code == "UNAVAILABLE" for a in stored.attempts)
    assert set(service.keys) == {op.idempotency_key}
    assert store.list_pending() == [stored]


def test_resume_after_restart_uses_the_stored_key_and_caller(tmp_path: Path) -> None:
    path = tmp_path / "ops.db"
    with scripted_server(fail(U.UNKNOWN, "proxy died mid-call"), ok(True)) as (address, service):
        with SqliteOperationStore(path) as first, _client(address, first, caller_id="billing") as client:
            op = client.create_transfer("alice", "bob", 1, "EUR")
            assert client.send_with_retries(op).state is OperationState.PENDING
        # A new process: new store object, and a client configured with another caller id.
        with SqliteOperationStore(path) as second, _client(address, second, caller_id="other") as client:
            results = client.resume_pending()
            assert [r.replayed for r in results] == [True]
            assert second.list_pending() == []
    assert set(service.keys) == {op.idempotency_key}
    assert {c.metadata["x-caller-id"] for c in service.calls} == {"billing"}


def test_sending_an_unstored_operation_is_refused(store: SqliteOperationStore, tmp_path: Path) -> None:
    with SqliteOperationStore(tmp_path / "other.db") as other:
        with scripted_server(ok()) as (address, service):
            with _client(address, other) as elsewhere, _client(address, store) as client:
                op = elsewhere.create_transfer("alice", "bob", 1, "EUR")
                with pytest.raises(KeyError, match="not in the store"):
                    client.send_with_retries(op)
    assert service.calls == []


def test_reserved_metadata_is_refused(store: SqliteOperationStore) -> None:
    with pytest.raises(ValueError, match="idempotency-key"):
        TransferClient("127.0.0.1:1", store=store, metadata=[("idempotency-key", "x")])


def test_classification_table() -> None:
    none = ErrorDetails()
    expired = ErrorDetails(reason=Reason.IDEMPOTENCY_KEY_EXPIRED)
    assert classify(U.OK, none, None) is Verdict.SUCCEEDED
    assert classify(U.UNAVAILABLE, none, None) is Verdict.RETRY
    assert classify(U.DEADLINE_EXCEEDED, none, None) is Verdict.RETRY
    assert classify(U.ABORTED, none, None) is Verdict.RETRY
    assert classify(U.RESOURCE_EXHAUSTED, none, 0.1) is Verdict.RETRY
    assert classify(U.RESOURCE_EXHAUSTED, none, None) is Verdict.FAILED
    assert classify(U.FAILED_PRECONDITION, expired, None) is Verdict.NEEDS_RECONCILIATION
    assert classify(U.FAILED_PRECONDITION, none, None) is Verdict.FAILED
    assert classify(U.INVALID_ARGUMENT, none, None) is Verdict.FAILED
    assert classify(U.UNKNOWN, none, None) is Verdict.STOP_PENDING


def test_backoff_is_full_jitter_and_capped() -> None:
    policy = RetryPolicy(base_backoff_s=0.05, max_backoff_s=2.0)
    rng = random.Random(7)
    samples = {n: [backoff_s(n, policy, rng) for _ in range(300)] for n in (1, 3, 10)}
    assert all(0 <= s <= 0.05 for s in samples[1])
    assert all(0 <= s <= 0.2 for s in samples[3]) and max(samples[3]) > 0.1
    assert all(0 <= s <= 2.0 for s in samples[10]) and max(samples[10]) > 1.5
    assert min(samples[10]) < 0.3  # full jitter: the whole range, not just near the cap


def test_service_config_is_valid_and_lists_safe_retry_codes() -> None:
    config = json.loads(load_service_config())
    mutating = next(m for m in config["methodConfig"] if "retryPolicy" in m)
    assert {n["method"] for n in mutating["name"]} == {"Transfer", "Deposit"}
    assert {n["service"] for n in mutating["name"]} == {"shardrouter.v1.TransferService"}
    policy = mutating["retryPolicy"]
    assert policy["maxAttempts"] == 5
    assert {"ABORTED", "UNAVAILABLE"} <= set(policy["retryableStatusCodes"])
    reads = [m for m in config["methodConfig"] if "retryPolicy" not in m]
    assert all(m["waitForReady"] is True and m["timeout"] for m in reads)


def test_a_bare_stub_with_the_service_config_retries_aborted() -> None:
    script = (fail(U.ABORTED, "in flight", retry_ms=30, pushback_ms=30), ok(True))
    request = transfer_pb2.TransferRequest(
        source_account_id="alice",
        destination_account_id="bob",
        amount=transfer_pb2.Money(amount_minor=1, currency="EUR"),
    )
    metadata = (("idempotency-key", "01920000-0000-7000-8000-000000000000"),)
    with scripted_server(*script) as (address, service):
        options = [("grpc.service_config", load_service_config()), ("grpc.enable_retries", 1)]
        with grpc.insecure_channel(address, options=options) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            reply, call = stub.Transfer.with_call(request, metadata=metadata, timeout=5)
    assert reply.transfer.transfer_id == FIXED_TRANSFER_ID
    assert len(service.calls) == 2
    assert service.keys == [metadata[0][1]] * 2
    assert dict(call.trailing_metadata())["idempotency-replayed"] == "true"
    # Without the service config, the same script is not retried: the config is what makes it work.
    with scripted_server(*script) as (address, service):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as raised:
                transfer_pb2_grpc.TransferServiceStub(channel).Transfer(request, metadata=metadata, timeout=5)
    assert raised.value.code() is U.ABORTED and len(service.calls) == 1
