"""Unit tests of the router's routing decisions, shard map reloads, settings and channel pool."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import grpc
import pytest
import yaml

from shardrouter.core.errors import InvalidArgument, Reason, Unavailable, to_grpc_status
from shardrouter.core.shardmap import ShardMap, ShardMapError, even_shard_map, shard_map_document
from shardrouter.core.shardmap_file import ShardMapFile
from shardrouter.router.channels import ChannelPool
from shardrouter.router.forwarding import has_our_error_info
from shardrouter.router.metadata import forwardable
from shardrouter.router.routing import METHODS_BY_PATH, ROUTED_METHODS, routing_account
from shardrouter.v1 import transfer_pb2

SERVICE = "/shardrouter.v1.TransferService/"


def _request(name: str, account: str) -> bytes:
    """A request of method `name` whose routing account is `account`, other account fields differ."""
    if name == "Transfer":
        msg = transfer_pb2.TransferRequest(
            source_account_id=account,
            destination_account_id="dst-other",
            reference="r",
            amount=transfer_pb2.Money(amount_minor=5, currency="EUR"),
        )
    elif name == "Deposit":
        msg = transfer_pb2.DepositRequest(
            account_id=account, amount=transfer_pb2.Money(amount_minor=5, currency="EUR")
        )
    elif name == "GetTransfer":
        msg = transfer_pb2.GetTransferRequest(
            source_account_id=account, transfer_id="t", wait_for_completion_ms=3
        )
    else:
        msg = transfer_pb2.GetBalanceRequest(account_id=account)
    return msg.SerializeToString()


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("Transfer", "source_account_id"),
        ("Deposit", "account_id"),
        ("GetTransfer", "source_account_id"),
        ("GetBalance", "account_id"),
    ],
)
def test_each_method_routes_by_its_field_one(name: str, field: str) -> None:
    method = METHODS_BY_PATH[SERVICE + name]
    assert method.routing_field == field
    assert method.request_type.DESCRIPTOR.fields_by_name[field].number == 1
    assert routing_account(method, _request(name, "acct-42")) == "acct-42"


def test_every_public_method_is_routed() -> None:
    service = transfer_pb2.DESCRIPTOR.services_by_name["TransferService"]
    assert {m.name for m in ROUTED_METHODS} == {m.name for m in service.methods}
    for m in ROUTED_METHODS:
        assert service.methods_by_name[m.name].input_type is m.request_type.DESCRIPTOR


@pytest.mark.parametrize("account", ["", "bad id!", "-leading-dash", "x" * 65])
@pytest.mark.parametrize("name", ["Transfer", "Deposit", "GetTransfer", "GetBalance"])
def test_malformed_routing_account_is_invalid_argument_naming_the_field(name: str, account: str) -> None:
    method = METHODS_BY_PATH[SERVICE + name]
    with pytest.raises(InvalidArgument) as caught:
        routing_account(method, _request(name, account))
    error = caught.value
    assert error.reason == Reason.INVALID_REQUEST
    assert [v.field for v in error.field_violations] == [method.routing_field]
    assert method.routing_field in error.message


def test_undecodable_request_is_invalid_argument() -> None:
    method = METHODS_BY_PATH[SERVICE + "Transfer"]
    with pytest.raises(InvalidArgument, match=r"not a valid shardrouter\.v1\.TransferRequest"):
        routing_account(method, b"\x0a\xff\xff\xff")  # field 1, a length running past the end


def test_transport_headers_are_not_forwarded_everything_else_is() -> None:
    sent = [
        ("user-agent", "x"),
        (":authority", "a"),
        ("grpc-timeout", "1S"),
        ("content-type", "application/grpc"),
        ("idempotency-key", "k"),
        ("traceparent", "00-1"),
        ("tracestate", "a=b"),
        ("x-caller-id", "alice"),
        ("x-foo", "bar"),
        ("x-blob-bin", b"\x00\x01"),
        ("x-foo", "again"),
    ]
    assert forwardable(sent) == sent[4:]


def test_our_error_info_is_recognised_in_trailers_and_nothing_else() -> None:
    ours = to_grpc_status(Unavailable("db down", reason=Reason.DATABASE_UNAVAILABLE))
    assert has_our_error_info(tuple(ours.trailing_metadata))
    assert not has_our_error_info(())
    assert not has_our_error_info((("grpc-status-details-bin", b"\xff\xff"),))
    assert not has_our_error_info((("x-other", "shardrouter.v1"),))


# --- shard map files -----------------------------------------------------------------------------------

GOOD = {"slots": 4, "shards": [{"id": "shard-0", "address": "127.0.0.1:1", "slot_ranges": [[0, 3]]}]}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read"),
        ("shards: [unclosed", "not valid YAML or JSON"),
        ("- just\n- a list\n", "top level must be a mapping"),
        (json.dumps({"slots": 0, "shards": GOOD["shards"]}), "'slots' must be an integer"),
        (json.dumps({"slots": 4, "shards": []}), "'shards' must be a non-empty list"),
        (json.dumps({"slots": 4, "shards": ["shard-0"]}), "shards[0] must be a mapping"),
        (
            json.dumps(
                {"slots": 4, "shards": [{"id": "Shard_0", "address": "h:1", "slot_ranges": [[0, 3]]}]}
            ),
            "shards[0].id must be a lower-case DNS label",
        ),
        (
            json.dumps(
                {
                    "slots": 4,
                    "shards": [
                        {"id": "a", "address": "h:1", "slot_ranges": [[0, 1]]},
                        {"id": "a", "address": "h:2", "slot_ranges": [[2, 3]]},
                    ],
                }
            ),
            "shards[1].id 'a' appears twice",
        ),
        (
            json.dumps({"slots": 4, "shards": [{"id": "a", "address": "nohost", "slot_ranges": [[0, 3]]}]}),
            "shards[0].address must be host:port",
        ),
        (
            json.dumps({"slots": 4, "shards": [{"id": "a", "address": "h:1", "slot_ranges": []}]}),
            "slots 0..3 are owned by no shard",
        ),
        (
            json.dumps({"slots": 4, "shards": [{"id": "a", "address": "h:1", "slot_ranges": "0-3"}]}),
            "shards[0].slot_ranges must be a list of [first, last] pairs",
        ),
        (
            json.dumps({"slots": 4, "shards": [{"id": "a", "address": "h:1", "slot_ranges": [[0, 4]]}]}),
            "must be [first, last] with 0 <= first <= last < 4",
        ),
        (
            json.dumps(
                {
                    "slots": 4,
                    "shards": [
                        {"id": "a", "address": "h:1", "slot_ranges": [[0, 2]]},
                        {"id": "b", "address": "h:2", "slot_ranges": [[2, 3]]},
                    ],
                }
            ),
            "slot 2 is owned twice",
        ),
        (
            json.dumps(
                {"slots": 4, "shards": [{"id": "a", "address": "h:1", "slot_ranges": [[0, 0], [2, 3]]}]}
            ),
            "slots 1..1 are owned by no shard",
        ),
        (
            json.dumps({"slots": 4, "shards": [{"id": "a", "address": "h:1", "slot_ranges": [[0, 2]]}]}),
            "slots 3..3 are owned by no shard",
        ),
    ],
)
def test_bad_shard_map_file_names_the_file_and_the_problem(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    path = tmp_path / "shard-map.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ShardMapError) as caught:
        ShardMapFile(path)
    assert str(path) in str(caught.value)
    assert problem in str(caught.value)


def _write(path: Path, shard_map: ShardMap) -> None:
    path.write_text(yaml.safe_dump(shard_map_document(shard_map)))


def _map(*addresses: str) -> ShardMap:
    return even_shard_map({f"shard-{i}": a for i, a in enumerate(addresses)})


def test_reload_picks_up_a_new_map_and_keeps_the_last_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "shard-map.yaml"
    _write(path, _map("127.0.0.1:1001"))
    changes: list[tuple[ShardMap, ShardMap]] = []
    holder = ShardMapFile(path, on_change=lambda old, new: changes.append((old, new)))
    assert holder.current.shards[0].address == "127.0.0.1:1001"
    assert holder.check() is False  # unchanged file: nothing happens

    _write(path, _map("127.0.0.1:2001", "127.0.0.1:2002"))
    assert holder.check() is True
    assert [s.address for s in holder.current.shards] == ["127.0.0.1:2001", "127.0.0.1:2002"]
    assert len(changes) == 1 and changes[0][1] is holder.current

    good = holder.current
    path.write_text("shards: [ this is not yaml")
    with caplog.at_level(logging.WARNING, logger="shardrouter.core.shardmap_file"):
        assert holder.check() is False
        assert holder.check() is False  # the same bad file is reported once
    assert holder.current is good
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "keeping the last good map" in warnings[0].getMessage()
    assert str(path) in warnings[0].getMessage()

    path.unlink()  # a file that vanishes also keeps the last good map
    assert holder.check() is False
    assert holder.current is good

    _write(path, _map("127.0.0.1:3001"))
    assert holder.check() is True
    assert holder.current.shards[0].address == "127.0.0.1:3001"


def test_rewrite_with_same_size_and_mtime_is_still_seen(tmp_path: Path) -> None:
    path = tmp_path / "shard-map.yaml"
    _write(path, _map("127.0.0.1:1001"))
    holder = ShardMapFile(path)
    before = path.stat()
    _write(path, _map("127.0.0.1:1002"))  # same length
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert holder.check() is True
    assert holder.current.shards[0].address == "127.0.0.1:1002"


def test_configmap_symlink_swap_is_seen(tmp_path: Path) -> None:
    # The layout kubelet gives a mounted ConfigMap: file -> ..data/file, ..data -> ..<timestamp>/,
    # and an update swaps ..data atomically (rename of a new symlink over it).
    mount = tmp_path / "config"
    (mount / "..v1").mkdir(parents=True)
    _write(mount / "..v1" / "shard-map.yaml", _map("127.0.0.1:1001"))
    (mount / "..data").symlink_to("..v1")
    (mount / "shard-map.yaml").symlink_to("..data/shard-map.yaml")
    holder = ShardMapFile(mount / "shard-map.yaml")
    assert holder.current.shards[0].address == "127.0.0.1:1001"

    (mount / "..v2").mkdir()
    _write(mount / "..v2" / "shard-map.yaml", _map("127.0.0.1:9009", "127.0.0.1:9010"))
    (mount / "..data_tmp").symlink_to("..v2")
    os.replace(mount / "..data_tmp", mount / "..data")
    assert holder.check() is True
    assert [s.address for s in holder.current.shards] == ["127.0.0.1:9009", "127.0.0.1:9010"]


def test_reload_thread_polls_the_file(tmp_path: Path) -> None:
    path = tmp_path / "shard-map.yaml"
    _write(path, _map("127.0.0.1:1001"))
    holder = ShardMapFile(path, interval_s=0.05)
    holder.start()
    try:
        _write(path, _map("127.0.0.1:1002"))
        deadline = time.monotonic() + 5
        while holder.current.shards[0].address != "127.0.0.1:1002" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert holder.current.shards[0].address == "127.0.0.1:1002"
    finally:
        holder.stop()


def test_unrouted_method_is_not_served() -> None:
    from shardrouter.router.forwarding import Forwarder
    from shardrouter.router.metadata import CallerPolicy

    class Details(grpc.HandlerCallDetails):
        def __init__(self, method: str) -> None:
            self.method = method
            self.invocation_metadata = ()

    class NoMaps:
        current = _map("127.0.0.1:1")

    forwarder = Forwarder(
        shard_maps=NoMaps(),  # type: ignore[arg-type]
        pool=ChannelPool(),
        callers=CallerPolicy(verifies_callers=False, dev_mode=True),
        forward_retries=2,
        max_deadline_s=60,
    )
    assert forwarder.service(Details(SERVICE + "Transfer")) is not None
    assert forwarder.service(Details("/shardrouter.internal.v1.ShardLedgerService/CreditTransfer")) is None
    assert forwarder.service(Details(SERVICE + "Nope")) is None
