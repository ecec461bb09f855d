"""Property test: random interleavings of keys and request bodies against a model of the contract.

Model: the first request a key sees decides its fate for good; the same request again replays that
outcome; a different request with the key is refused as reused. Some sends go out concurrently.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardrouter.core.keys import new_key
from shardrouter.v1 import transfer_pb2
from tests.helpers import money

_accounts = itertools.count()


def _reason(err: grpc.RpcError) -> str:
    status = rpc_status.from_call(err)
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


steps = st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from([5, 7, 0, 11]), st.booleans()),  # key, amount, concurrent
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps)
def test_interleavings_match_the_model(stub, db, plan):
    account = f"prop-{next(_accounts)}"
    keys = [str(new_key()) for _ in range(4)]
    first_body: dict[int, int] = {}
    first_reply: dict[int, bytes] = {}
    applied = 0

    def send(key_index: int, amount: int):
        request = transfer_pb2.DepositRequest(account_id=account, amount=money(amount))
        give_up = time.monotonic() + 20  # bounded in time, not in tries: a loaded machine is slow
        while time.monotonic() < give_up:
            try:
                reply, call = stub.Deposit.with_call(
                    request, metadata=[("idempotency-key", keys[key_index])], timeout=10
                )
                return ("ok", reply.SerializeToString(), dict(call.trailing_metadata()))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.ABORTED:
                    time.sleep(0.005)  # in flight: the caller retries, as the contract says
                    continue
                return ("err", err.code(), _reason(err))
        raise AssertionError("in flight forever")

    def check(key_index: int, amount: int, result) -> None:
        nonlocal applied
        if amount == 0:  # invalid: answered before any claim, never decides the key
            assert result[:2] == ("err", grpc.StatusCode.INVALID_ARGUMENT)
            return
        if key_index not in first_body:
            first_body[key_index] = amount
        if amount != first_body[key_index]:
            assert result == ("err", grpc.StatusCode.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED")
            return
        assert result[0] == "ok"
        if key_index not in first_reply:
            first_reply[key_index] = result[1]
            if result[2].get("idempotency-replayed") != "true":
                applied += amount
        assert result[1] == first_reply[key_index]

    i = 0
    while i < len(plan):
        key_index, amount, concurrent = plan[i]
        if concurrent and i + 1 < len(plan):
            batch = [plan[i], plan[i + 1]]
            with ThreadPoolExecutor(2) as pool:
                results = list(pool.map(lambda step: send(step[0], step[1]), batch))
            # Concurrent twins: who was "first" is decided by the database; accept either order.
            if batch[0][0] == batch[1][0] and batch[0][1] != batch[1][1] and batch[0][0] not in first_body:
                winner = 0 if results[0][0] == "ok" else 1
                batch, results = [batch[winner], batch[1 - winner]], [results[winner], results[1 - winner]]
            for step, result in zip(batch, results, strict=True):
                check(step[0], step[1], result)
            i += 2
        else:
            check(key_index, amount, send(key_index, amount))
            i += 1
    row = db.execute(
        "SELECT coalesce(sum(amount_minor), 0), count(*) FROM ledger_entries WHERE account_id = %s",
        (account,),
    ).fetchone()
    assert row[0] == sum(first_body[k] for k in first_reply)
    assert row[1] == len(first_reply)
