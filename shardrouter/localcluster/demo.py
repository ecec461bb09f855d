"""The demo that `shard-router dev up` runs: transfers, a replay, an in-flight conflict, a cross-shard
transfer. It uses bare generated stubs with the key in metadata, as any gRPC client could; with
tracing on, its channel carries the tracing client interceptor, so its calls start the traces.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from shardrouter.client.status import trailer, was_replayed
from shardrouter.core import tracing
from shardrouter.core.keys import new_key
from shardrouter.core.shardmap import ShardMap
from shardrouter.core.wire_names import KEY_METADATA, REPLAYED_TRAILER, OutcomeKind
from shardrouter.v1 import transfer_pb2, transfer_pb2_grpc

DEMO_ACCOUNTS = ("alice", "bob", "carol", "dave", "erin", "frank")


def _eur(minor: int) -> str:
    return f"{minor / 100:.2f} EUR"


def seed_accounts(stub: transfer_pb2_grpc.TransferServiceStub, say: Callable[[str], None]) -> None:
    """Open the demo accounts with a deposit each (idempotent per run: new keys, new deposits)."""
    for account in DEMO_ACCOUNTS:
        reply = stub.Deposit(
            transfer_pb2.DepositRequest(
                account_id=account,
                amount=transfer_pb2.Money(amount_minor=100_00, currency="EUR"),
                reference="demo seed",
            ),
            metadata=((KEY_METADATA, str(new_key())),),
            timeout=10,
        )
        say(f"  deposit 100.00 EUR -> {account}: balance {_eur(reply.balance.amount_minor)}")


@dataclass
class DemoResult:
    """What the demo did: counts by outcome, and the key it replayed (to find its spans)."""

    counts: dict[str, int] = field(default_factory=lambda: {"replays": 0, "conflicts": 0, "applied": 0})
    replay_key: str = ""


@dataclass
class _Demo:
    """What every step of the demo works with: the router's stub, the map, where to say things, and
    what the steps have done so far."""

    stub: transfer_pb2_grpc.TransferServiceStub
    shard_map: ShardMap
    say: Callable[[str], None]
    result: DemoResult = field(default_factory=DemoResult)

    def transfer(
        self, request: transfer_pb2.TransferRequest, key: str
    ) -> tuple[transfer_pb2.TransferResponse, grpc.Call]:
        """One Transfer under `key`: the response and the call (its trailers)."""
        response, call = self.stub.Transfer.with_call(request, metadata=((KEY_METADATA, key),), timeout=10)
        return response, call


def run_demo(target: str, shard_map: ShardMap, say: Callable[[str], None] = print) -> DemoResult:
    """Run the demo against a router: seed the accounts, then the four steps, then the balances."""
    with grpc.insecure_channel(target) as plain:
        channel = (
            grpc.intercept_channel(plain, tracing.client_interceptor()) if tracing.tracing_active() else plain
        )
        demo = _Demo(transfer_pb2_grpc.TransferServiceStub(channel), shard_map, say)
        say("Seeding demo accounts:")
        seed_accounts(demo.stub, say)
        same = _pair(shard_map, same_shard=True) or (DEMO_ACCOUNTS[0], DEMO_ACCOUNTS[1])
        request, key, first = _transfer_once(demo, same)
        _retry_with_the_same_key(demo, request, key, first)
        _attempts_at_the_same_instant(demo, request)
        cross = _pair(shard_map, same_shard=False)
        if cross:
            _transfer_across_shards(demo, cross)
        _say_balances(demo)
    return demo.result


def _transfer_once(
    demo: _Demo, pair: tuple[str, str]
) -> tuple[transfer_pb2.TransferRequest, str, transfer_pb2.TransferResponse]:
    """Step 1: a transfer between two accounts of one shard, under a new key."""
    demo.say(f"\n1. A transfer {pair[0]} -> {pair[1]} (both on {demo.shard_map.shard_for(pair[0]).id}):")
    key = str(new_key())
    request = transfer_pb2.TransferRequest(
        source_account_id=pair[0],
        destination_account_id=pair[1],
        amount=transfer_pb2.Money(amount_minor=25_00, currency="EUR"),
        reference="demo",
    )
    first, _ = demo.transfer(request, key)
    demo.result.counts["applied"] += 1
    demo.say(
        f"   {KEY_METADATA} {key}\n   -> transfer {first.transfer.transfer_id} "
        f"{transfer_pb2.TransferState.Name(first.transfer.state)}"
    )
    return request, key, first


def _retry_with_the_same_key(
    demo: _Demo, request: transfer_pb2.TransferRequest, key: str, first: transfer_pb2.TransferResponse
) -> None:
    """Step 2: the same request under the same key: the stored answer, byte for byte, marked replayed."""
    demo.say("\n2. The caller retries with the same key (say its first answer was lost):")
    again, call = demo.transfer(request, key)
    demo.result.replay_key = key
    trailers = call.trailing_metadata()
    if was_replayed(trailers):
        demo.result.counts["replays"] += 1
    demo.say(
        f"   -> transfer {again.transfer.transfer_id}, identical bytes: "
        f"{again.SerializeToString() == first.SerializeToString()}, trailer {REPLAYED_TRAILER}: "
        f"{trailer(trailers, REPLAYED_TRAILER)!r}"
    )


def _attempts_at_the_same_instant(demo: _Demo, request: transfer_pb2.TransferRequest) -> None:
    """Step 3: eight attempts of one new operation at once: one applies, the others replay it or are
    told it is in flight (ABORTED)."""
    demo.say("\n3. Eight attempts of one new operation sent at the same instant:")
    key = str(new_key())
    outcomes: list[str] = []  # an OutcomeKind (new: applied, replay) or the refusal's code
    barrier = threading.Barrier(8)

    def attempt() -> None:
        barrier.wait()
        try:
            _, call = demo.transfer(request, key)
            outcomes.append(OutcomeKind.REPLAY if was_replayed(call.trailing_metadata()) else OutcomeKind.NEW)
        except grpc.RpcError as err:
            outcomes.append(err.code().name)

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    applied, replayed, aborted = (outcomes.count(o) for o in (OutcomeKind.NEW, OutcomeKind.REPLAY, "ABORTED"))
    demo.result.counts["conflicts"] += aborted
    demo.result.counts["applied"] += applied
    demo.result.counts["replays"] += replayed
    demo.say(f"   -> applied {applied}, replayed {replayed}, ABORTED (in flight, retry shortly) {aborted}")


def _transfer_across_shards(demo: _Demo, pair: tuple[str, str]) -> None:
    """Step 4: a transfer between shards: debited at once, credited by the relay, waited for."""
    src_shard, dst_shard = demo.shard_map.shard_for(pair[0]).id, demo.shard_map.shard_for(pair[1]).id
    demo.say(f"\n4. A transfer across shards {pair[0]} ({src_shard}) -> {pair[1]} ({dst_shard}):")
    request = transfer_pb2.TransferRequest(
        source_account_id=pair[0],
        destination_account_id=pair[1],
        amount=transfer_pb2.Money(amount_minor=10_00, currency="EUR"),
        reference="demo cross",
    )
    reply, _ = demo.transfer(request, str(new_key()))
    demo.say(f"   -> {transfer_pb2.TransferState.Name(reply.transfer.state)} (debited; credit in the outbox)")
    done = demo.stub.GetTransfer(
        transfer_pb2.GetTransferRequest(
            source_account_id=pair[0],
            transfer_id=reply.transfer.transfer_id,
            wait_for_completion_ms=10_000,
        ),
        timeout=15,
    )
    demo.say(
        f"   -> after the relay: {transfer_pb2.TransferState.Name(done.transfer.state)}, "
        f"{len(done.transfer.delivery_attempts)} delivery attempt(s)"
    )


def _say_balances(demo: _Demo) -> None:
    demo.say("\nBalances:")
    for account in DEMO_ACCOUNTS:
        b = demo.stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=account), timeout=5)
        demo.say(
            f"  {account:<6} {_eur(b.balance.amount_minor):>12}  ({demo.shard_map.shard_for(account).id})"
        )


def _pair(shard_map: ShardMap, *, same_shard: bool) -> tuple[str, str] | None:
    for a in DEMO_ACCOUNTS:
        for b in DEMO_ACCOUNTS:
            if a != b and (shard_map.shard_for(a) == shard_map.shard_for(b)) == same_shard:
                return a, b
    return None


__all__ = [
    "DEMO_ACCOUNTS",
    "DemoResult",
    "run_demo",
    "seed_accounts",
]
