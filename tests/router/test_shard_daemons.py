"""A shard served by several daemons: the router spreads calls over them and fails over at once,
with the same key, when one cannot be reached."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.localcluster.postgres import free_port
from shardrouter.v1 import transfer_pb2
from tests.processes import ServiceProcess, router_process
from tests.router.fakeshard import FakeShard, start_fake_shard

SERVICE = "/shardrouter.v1.TransferService/"
DEPOSIT = transfer_pb2.DepositRequest(
    account_id="acct-1", amount=transfer_pb2.Money(amount_minor=1, currency="EUR")
).SerializeToString()
BALANCE = transfer_pb2.GetBalanceRequest(account_id="acct-1").SerializeToString()


def _map(addresses: list[str]) -> str:
    return json.dumps(
        {"version": 1, "shards": [{"id": "shard-0", "addresses": addresses, "slot_ranges": [[0, 16383]]}]}
    )


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[tuple[list[FakeShard], str, ServiceProcess]]:
    fakes = [start_fake_shard(), start_fake_shard()]
    dead = f"127.0.0.1:{free_port()}"  # nobody listens here
    shard_map = tmp_path / "shard-map.json"
    shard_map.write_text(_map([dead, fakes[0].address, fakes[1].address]))
    # Without backoff rounds, so any failure to fail over at once shows as an error.
    router = router_process(tmp_path, shard_map=shard_map, extra_env={"ROUTER_FORWARD_RETRIES": "0"})
    router.start()
    try:
        yield fakes, dead, router
    finally:
        router.kill()
        for fake in fakes:
            fake.stop()


def _call(channel: grpc.Channel, method: str, body: bytes, keyed: bool) -> bytes:
    metadata = ((KEY_METADATA, str(new_key())),) if keyed else ()
    rpc = channel.unary_unary(SERVICE + method)
    result: bytes = rpc(body, metadata=metadata, timeout=5)
    return result


def test_calls_spread_over_the_daemons_and_skip_an_unreachable_one(daemons) -> None:
    fakes, _dead, router = daemons
    with grpc.insecure_channel(router.address) as channel:
        for _ in range(30):
            assert _call(channel, "Deposit", DEPOSIT, keyed=True) == DEPOSIT
        for _ in range(12):  # a keyless read fails over too
            assert _call(channel, "GetBalance", BALANCE, keyed=False) == BALANCE
    served = [len(f.calls) for f in fakes]
    assert sum(served) == 42  # each call reached exactly one daemon
    assert min(served) >= 10, f"calls were not spread over the daemons: {served}"


def test_losing_a_daemon_costs_the_caller_nothing(daemons) -> None:
    fakes, _dead, router = daemons
    with grpc.insecure_channel(router.address) as channel:
        assert _call(channel, "Deposit", DEPOSIT, keyed=True) == DEPOSIT
        fakes[0].stop()
        for _ in range(20):
            assert _call(channel, "Deposit", DEPOSIT, keyed=True) == DEPOSIT
    # The same key went to the next daemon: every call after the loss was served by the other one.
    keys_after = [dict(c.metadata)[KEY_METADATA] for c in fakes[1].calls]
    assert len(set(keys_after)) >= 20


def test_with_every_daemon_gone_the_caller_gets_a_retryable_unavailable(daemons) -> None:
    fakes, _dead, router = daemons
    for fake in fakes:
        fake.stop()
    with grpc.insecure_channel(router.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            _call(channel, "Deposit", DEPOSIT, keyed=True)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "shard shard-0 cannot be reached" in (caught.value.details() or "")


def _cancelled(call: object, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.CANCELLED, "the daemon stopped with this call still running")


def test_a_keyed_call_a_daemon_cancelled_goes_to_the_next_and_a_keyless_write_does_not(daemons) -> None:
    """CANCELLED without our details, while the router's caller still waits, means the daemon cut the
    call off (a stop past its grace period): it may have committed, so only a keyed call is resent."""
    fakes, _dead, router = daemons
    fakes[0].behaviour = _cancelled
    with grpc.insecure_channel(router.address) as channel:
        for _ in range(6):  # every call whose turn starts at the cancelling daemon ends at the other
            assert _call(channel, "Deposit", DEPOSIT, keyed=True) == DEPOSIT
        fakes[1].behaviour = _cancelled
        with pytest.raises(grpc.RpcError) as caught:
            _call(channel, "Deposit", DEPOSIT, keyed=False)
    assert caught.value.code() is grpc.StatusCode.CANCELLED
    assert len(fakes[0].calls) >= 2, "no keyed call met the cancelling daemon"
    keyless = [c for f in fakes for c in f.calls if KEY_METADATA not in dict(c.metadata)]
    assert len(keyless) == 1, "a keyless write the daemon cut off was sent again"
