"""A verified certificate's identity: its one SPIFFE ID (`spiffe://` URI SAN), else its common name.

The certificates are made here (`tests.tls`) and presented over real mTLS to a gRPC server in this
process, whose handler decides the caller with the core functions every part uses
(`peer_identity`, `claimed_caller`, `CallerRule`); what gRPC's `auth_context()` exposes is the real
thing, not a fake. The shard's own use of them is at the end (`IdentityPolicy`, admission).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest

from shardrouter.core.callers import (
    CALLER_PATTERN,
    MAX_CALLER_LENGTH,
    CallerRule,
    certificate_identity,
    claimed_caller,
    is_spiffe_id,
    peer_common_name,
    peer_identity,
)
from shardrouter.core.errors import InvalidArgument, ShardRouterError
from tests.tls import TestCA

TEAM_A = "spiffe://cluster.local/ns/payments/sa/team-a"
ROUTER = "spiffe://cluster.local/ns/shard-router/sa/router"
METHOD = "/test.Identity/Who"


@dataclass(frozen=True)
class Seen:
    """What the server decided about one call."""

    common_name: str | None
    identity: str | None
    caller: str | None


@dataclass
class Server:
    port: int
    ca: TestCA


def _who(trusted: frozenset[str]) -> grpc.RpcMethodHandler:
    rule = CallerRule(dev_mode=False, trusted_proxies=trusted)

    def who(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            claimed = claimed_caller(context.invocation_metadata())
        except ShardRouterError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        identity = peer_identity(context)
        return json.dumps([peer_common_name(context), identity, rule.caller(identity, claimed)]).encode()

    return grpc.unary_unary_rpc_method_handler(who)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A TLS server requiring client certificates; `router` (by CN) and ROUTER (by URI) are trusted
    proxies on `/test.Identity/Who`, only ROUTER on `/test.Identity/WhoByUri`."""
    ca = TestCA(tmp_path_factory.mktemp("identity-pki"))
    files = ca.issue("server", server=True)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    grpc_server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Identity",
                {
                    "Who": _who(frozenset({"router", ROUTER})),
                    "WhoByUri": _who(frozenset({ROUTER})),
                },
            )
        ]
    )
    credentials = grpc.ssl_server_credentials(
        [(files.key.read_bytes(), files.cert.read_bytes())],
        root_certificates=ca.ca_path.read_bytes(),
        require_client_auth=True,
    )
    port = grpc_server.add_secure_port("127.0.0.1:0", credentials)
    grpc_server.start()
    try:
        yield Server(port, ca)
    finally:
        grpc_server.stop(0).wait(5)


def _call(
    server: Server,
    common_name: str,
    uris: tuple[str, ...] = (),
    claim: str | None = None,
    method: str = METHOD,
) -> Seen:
    stem = "-".join([common_name, *(str(abs(hash(u))) for u in uris)])
    files = server.ca.issue(common_name, uris=uris, stem=stem)
    credentials = grpc.ssl_channel_credentials(
        server.ca.ca_path.read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
    )
    metadata = [("x-caller-id", claim)] if claim is not None else []
    with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
        reply = channel.unary_unary(method)(b"", metadata=metadata, timeout=5)
    return Seen(*json.loads(reply))


def test_the_uri_san_is_the_identity_and_the_common_name_stays_readable(server: Server) -> None:
    assert _call(server, "alice", (TEAM_A,)) == Seen("alice", TEAM_A, TEAM_A)


def test_without_a_uri_san_the_common_name_is_the_identity(server: Server) -> None:
    assert _call(server, "alice") == Seen("alice", "alice", "alice")
    # URI SANs of another scheme do not name the caller: still the common name.
    assert _call(server, "alice", ("https://example.com/alice",)) == Seen("alice", "alice", "alice")


def test_common_name_router_with_another_uri_is_that_uri_not_a_trusted_proxy(server: Server) -> None:
    """`CN=router` (a trusted proxy by name) with a URI SAN naming team-a is team-a: its x-caller-id
    is not believed, so it cannot speak for (and read the keys of) a victim."""
    assert _call(server, "router", (TEAM_A,), claim="victim") == Seen("router", TEAM_A, TEAM_A)


def test_trusted_proxies_named_by_uri(server: Server) -> None:
    # The router's certificate, carrying its SPIFFE ID: its x-caller-id is believed.
    assert _call(server, "router", (ROUTER,), claim=TEAM_A, method="/test.Identity/WhoByUri") == Seen(
        "router", ROUTER, TEAM_A
    )
    # CN=router without the URI, where only the URI is trusted: not a proxy, its own name is the caller.
    assert _call(server, "router", claim=TEAM_A, method="/test.Identity/WhoByUri") == Seen(
        "router", "router", "router"
    )


def test_several_spiffe_ids_name_no_one(server: Server) -> None:
    """Not an SVID (exactly one URI SAN, SPIFFE-ID spec): no identity at all, never the CN."""
    seen = _call(server, "router", (ROUTER, TEAM_A), claim="victim")
    assert seen == Seen("router", None, None)


@pytest.mark.parametrize(
    ("common_name", "uris", "identity"),
    [
        ("alice", (), "alice"),
        (None, (TEAM_A,), TEAM_A),
        ("router", (TEAM_A, "https://example.com/x"), TEAM_A),
        ("router", (TEAM_A, ROUTER), None),
        ("router", ("spiffe://Cluster.Local/ns/a/sa/b",), None),  # upper-case trust domain: invalid
        ("router", ("SPIFFE://cluster.local/ns/a/sa/b",), None),  # the scheme is lower case
        ("router", ("spiffe://cluster.local/ns/a/sa/b?x=1",), None),
        ("router", ("spiffe://cluster.local/ns/../sa/b",), None),
        ("router", ("spiffe://cluster.local/ns/a/sa/b/",), None),
        ("router", ("spiffe://" + "a" * MAX_CALLER_LENGTH,), None),  # longer than a caller name
        (None, (), None),
    ],
)
def test_certificate_identity(common_name: str | None, uris: tuple[str, ...], identity: str | None) -> None:
    assert certificate_identity(common_name, uris) == identity


def test_spiffe_ids_are_caller_names_up_to_the_limit() -> None:
    longest = "spiffe://cluster.local/ns/payments/sa/" + "s" * (MAX_CALLER_LENGTH - 38)
    assert len(longest) == MAX_CALLER_LENGTH
    assert is_spiffe_id(longest)
    assert CALLER_PATTERN.fullmatch(longest)
    assert claimed_caller([("x-caller-id", TEAM_A)]) == TEAM_A
    assert claimed_caller([("x-caller-id", longest)]) == longest
    with pytest.raises(InvalidArgument):
        claimed_caller([("x-caller-id", longest + "s")])


# The shard decides its key scopes (`IdentityPolicy`) and admission buckets with the same rule; until
# it reads `peer_identity` instead of `peer_common_name` (shardrouter/shardd/identity.py and
# admission.py, being changed for the authorization policy), CN=router with a URI SAN naming someone
# else is still the router to it. Strict: the marker must go when the shard switches.
@dataclass
class _Context:
    common_name: str
    uris: tuple[str, ...]
    claim: str

    def auth_context(self) -> dict[str, list[bytes]]:
        return {
            "transport_security_type": [b"ssl"],
            "x509_common_name": [self.common_name.encode()],
            "peer_uri": [uri.encode() for uri in self.uris],
        }

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [("x-caller-id", self.claim)]

    def peer(self) -> str:
        return "ipv4:10.0.0.7:51234"


def test_the_shard_takes_the_uri_over_the_common_name() -> None:
    from shardrouter.shardd.admission import caller_bucket
    from shardrouter.shardd.identity import IdentityPolicy

    context = _Context("router", (TEAM_A,), "victim")
    policy = IdentityPolicy(dev_mode=False, trusted_proxies=frozenset({"router"}))
    assert policy.caller_of(context, context.invocation_metadata()) == TEAM_A  # type: ignore[arg-type]
    assert caller_bucket(context, frozenset({"router"}), dev_mode=False) == TEAM_A  # type: ignore[arg-type]
