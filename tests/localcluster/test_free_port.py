"""Ports for servers started later: never handed out twice in a process, and drawn from outside the
kernel's ephemeral range, from which outgoing connections could take one before the server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

from shardrouter.localcluster.postgres import free_port


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
