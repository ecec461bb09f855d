"""Ports for servers started later: never handed out twice in a process, and drawn from outside the
kernel's ephemeral range, from which outgoing connections could take one before the server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shardrouter.localcluster.postgres import PORT_RANGE_ENV, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low > 11_000:
        assert max(ports) < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_held_by_an_outgoing_connection_is_not_handed_out() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            taken = {server.getsockname()[1], client.getsockname()[1]}
            assert not taken & {free_port() for _ in range(200)}


def test_a_port_range_of_its_own_is_kept(monkeypatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-20099")
    ports = {free_port() for _ in range(50)}
    assert len(ports) == 50 and all(20000 <= port <= 20099 for port in ports)


@pytest.mark.parametrize("value", ["20000", "20100-20000", "a-b", "80-90", "20000-70000"])
def test_a_malformed_port_range_is_refused_by_name(monkeypatch, value: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, value)
    with pytest.raises(ValueError, match="SHARD_ROUTER_PORT_RANGE must be LOW-HIGH"):
        free_port()
