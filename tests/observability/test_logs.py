"""Logs: one JSON line per guarded call, with the key, the outcome and the span's ids; no secrets.

In process (a traced shard) for the trace and span ids; as a real `shardd serve` process for what the
log file must never hold: the DSN's password, request bodies and stored responses.
"""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from shardrouter.core.logs import JsonFormatter
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc
from tests.helpers import key_metadata, money
from tests.observability.traced import Traced
from tests.processes import shardd_process, wait_serving


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter("shardd-test"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_each_guarded_call_logs_its_key_outcome_and_span(traced: Traced) -> None:
    handler = _Lines()
    calls = logging.getLogger("shardd.calls")
    calls.addHandler(handler)
    calls.setLevel(logging.INFO)
    try:
        md = key_metadata(caller="billing")
        key = md[0][1]
        request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5), reference="r1")
        traced.stub.Deposit(request, metadata=md)
        traced.stub.Deposit(request, metadata=md)
        with pytest.raises(grpc.RpcError):
            traced.stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(6)), metadata=md)
    finally:
        calls.removeHandler(handler)
    entries = [json.loads(line) for line in handler.lines]
    mine = [e for e in entries if e.get("key") == key]
    assert [e["outcome"] for e in mine] == ["new", "replay", "key_reused"]
    assert [e["code"] for e in mine] == ["OK", "OK", "FAILED_PRECONDITION"]
    spans = sorted(
        traced.wait_for(lambda: traced.spans("idempotency", {"idempotency.key": key}), 3),
        key=lambda s: s.start_time or 0,
    )
    for entry, span in zip(mine, spans, strict=True):
        assert entry["trace_id"] == format(span.context.trace_id, "032x")
        assert entry["span_id"] == format(span.context.span_id, "016x")
        assert entry["scope"] == "/shardrouter.v1.TransferService/Deposit|billing"
        assert entry["duration_ms"] >= 0
        assert entry["level"] == "info"


def test_the_log_file_holds_no_password_no_request_body_and_no_stored_response(postgres, tmp_path) -> None:
    name = "logs_hygiene"
    postgres.create_database(name)
    password = "pw-3f9c1a7e"  # a marker, not a secret: trust auth ignores it
    dsn = postgres.dsn_for(name).replace("postgres@", f"postgres:{password}@")
    shard = shardd_process(tmp_path, shard_id="shard-logs", dsn=dsn, extra_env={"SHARDD_LOG_CALLS": "true"})
    shard.start()
    try:
        wait_serving(shard.address, 30, shard)
        body_marker = "body-7d2e9b41"
        with grpc.insecure_channel(shard.address) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            md = key_metadata(caller="billing")
            request = transfer_pb2.DepositRequest(account_id="alice", amount=money(5), reference=body_marker)
            first = stub.Deposit(request, metadata=md)
            stub.Deposit(request, metadata=md)  # replay of the stored response
            with pytest.raises(grpc.RpcError) as refused:  # a stored business refusal
                stub.Transfer(
                    transfer_pb2.TransferRequest(
                        source_account_id="alice",
                        destination_account_id="bob",
                        amount=money(10_000),
                        reference=body_marker,
                    ),
                    metadata=key_metadata(caller="billing"),
                )
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        shard.terminate()
    text = shard.log_text()
    entries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    outcomes = [(e.get("key"), e.get("outcome")) for e in entries if e.get("logger") == "shardd.calls"]
    assert (md[0][1], "new") in outcomes and (md[0][1], "replay") in outcomes, outcomes
    assert password not in text
    assert body_marker not in text
    assert first.entry_id and first.entry_id not in text, "the stored response leaked into the log"


def test_answered_calls_are_not_logged_by_default(postgres, tmp_path) -> None:
    name = "logs_quiet"
    postgres.create_database(name)
    shard = shardd_process(tmp_path, shard_id="shard-quiet", dsn=postgres.dsn_for(name))
    shard.start()
    try:
        with grpc.insecure_channel(shard.address) as channel:
            stub = transfer_pb2_grpc.TransferServiceStub(channel)
            md = key_metadata()
            stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
            stub.Deposit(transfer_pb2.DepositRequest(account_id="alice", amount=money(5)), metadata=md)
        assert shard.terminate() == 0
    finally:
        shard.kill()
    calls = [json.loads(line) for line in shard.log_text().splitlines() if '"logger": "shardd.calls"' in line]
    assert calls == [], calls
    assert "serving on port" in shard.log_text()  # the daemon's own log is still there
