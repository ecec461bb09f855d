"""The demo that `shard-router dev up` runs: transfers, a replay, an in-flight conflict, a cross-shard
transfer. It uses bare generated stubs with the key in metadata, as any gRPC client could; with
tracing on, its channel carries the tracing client interceptor, so its calls start the traces.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from shardrouter.core import tracing
from shardrouter.core.keys import KEY_METADATA, new_key
from shardrouter.core.shardmap import ShardMap
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


def run_demo(target: str, shard_map: ShardMap, say: Callable[[str], None] = print) -> DemoResult:
    """Run the demo against a router."""
    result = DemoResult()
    counts = result.counts
    with grpc.insecure_channel(target) as plain:
        channel = (
            grpc.intercept_channel(plain, tracing.client_interceptor()) if tracing.tracing_active() else plain
        )
        stub = transfer_pb2_grpc.TransferServiceStub(channel)
        say("Seeding demo accounts:")
        seed_accounts(stub, say)
        same = _pair(shard_map, same_shard=True) or (DEMO_ACCOUNTS[0], DEMO_ACCOUNTS[1])
        cross = _pair(shard_map, same_shard=False)

        say(f"\n1. A transfer {same[0]} -> {same[1]} (both on {shard_map.shard_for(same[0]).id}):")
        key = str(new_key())
        request = transfer_pb2.TransferRequest(
            source_account_id=same[0],
            destination_account_id=same[1],
            amount=transfer_pb2.Money(amount_minor=25_00, currency="EUR"),
            reference="demo",
        )
        first, call = stub.Transfer.with_call(request, metadata=((KEY_METADATA, key),), timeout=10)
        counts["applied"] += 1
        say(
            f"   idempotency-key {key}\n   -> transfer {first.transfer.transfer_id} "
            f"{transfer_pb2.TransferState.Name(first.transfer.state)}"
        )

        say("\n2. The caller retries with the same key (say its first answer was lost):")
        again, call = stub.Transfer.with_call(request, metadata=((KEY_METADATA, key),), timeout=10)
        result.replay_key = key
        trailers = dict(call.trailing_metadata())
        if trailers.get("idempotency-replayed") == "true":
            counts["replays"] += 1
        say(
            f"   -> transfer {again.transfer.transfer_id}, identical bytes: "
            f"{again.SerializeToString() == first.SerializeToString()}, trailer idempotency-replayed: "
            f"{trailers.get('idempotency-replayed')!r}"
        )

        say("\n3. Eight attempts of one new operation sent at the same instant:")
        key = str(new_key())
        outcomes: list[str] = []
        barrier = threading.Barrier(8)

        def attempt() -> None:
            barrier.wait()
            try:
                _, c = stub.Transfer.with_call(request, metadata=((KEY_METADATA, key),), timeout=10)
                replayed = dict(c.trailing_metadata()).get("idempotency-replayed") == "true"
                outcomes.append("replay" if replayed else "applied")
            except grpc.RpcError as err:
                outcomes.append(err.code().name)

        threads = [threading.Thread(target=attempt) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts["conflicts"] += outcomes.count("ABORTED")
        counts["applied"] += outcomes.count("applied")
        counts["replays"] += outcomes.count("replay")
        say(
            f"   -> applied {outcomes.count('applied')}, replayed {outcomes.count('replay')}, "
            f"ABORTED (in flight, retry shortly) {outcomes.count('ABORTED')}"
        )

        if cross:
            src_shard, dst_shard = shard_map.shard_for(cross[0]).id, shard_map.shard_for(cross[1]).id
            say(f"\n4. A transfer across shards {cross[0]} ({src_shard}) -> {cross[1]} ({dst_shard}):")
            reply = stub.Transfer(
                transfer_pb2.TransferRequest(
                    source_account_id=cross[0],
                    destination_account_id=cross[1],
                    amount=transfer_pb2.Money(amount_minor=10_00, currency="EUR"),
                    reference="demo cross",
                ),
                metadata=((KEY_METADATA, str(new_key())),),
                timeout=10,
            )
            say(
                f"   -> {transfer_pb2.TransferState.Name(reply.transfer.state)} (debited; credit in the outbox)"
            )
            done = stub.GetTransfer(
                transfer_pb2.GetTransferRequest(
                    source_account_id=cross[0],
                    transfer_id=reply.transfer.transfer_id,
                    wait_for_completion_ms=10_000,
                ),
                timeout=15,
            )
            say(
                f"   -> after the relay: {transfer_pb2.TransferState.Name(done.transfer.state)}, "
                f"{len(done.transfer.delivery_attempts)} delivery attempt(s)"
            )

        say("\nBalances:")
        for account in DEMO_ACCOUNTS:
            b = stub.GetBalance(transfer_pb2.GetBalanceRequest(account_id=account), timeout=5)
            say(f"  {account:<6} {_eur(b.balance.amount_minor):>12}  ({shard_map.shard_for(account).id})")
    return result


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
