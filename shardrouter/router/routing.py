"""Which account a call is routed by: the routing account of each method.

Each method's routing field is declared on it in the proto (`shardrouter.core.rpcs`); the router
decodes a copy of the request only to read that field (the bytes it forwards are the caller's own). The shard map
that turns the account into a shard is followed by `shardrouter.core.shardmap_file.ShardMapFile`.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from shardrouter.core.errors import FieldViolation, InvalidArgument, Reason
from shardrouter.core.rpcs import PUBLIC_SERVICE, RPCS, RpcDeclaration
from shardrouter.core.validation import account_id_problem

SERVICE = PUBLIC_SERVICE

#: The methods the router forwards: the public API, each routed by its declared routing field.
ROUTED_METHODS: tuple[RpcDeclaration, ...] = tuple(d for d in RPCS if d.service == PUBLIC_SERVICE)
METHODS_BY_PATH: dict[str, RpcDeclaration] = {m.full_name: m for m in ROUTED_METHODS}


def routing_account(method: RpcDeclaration, raw: bytes) -> str:
    """The routing account of a serialised request, or InvalidArgument naming the field."""
    try:
        request = method.request_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgument(
            f"the request body is not a valid {method.request_type.DESCRIPTOR.full_name} message (protobuf)",
            reason=Reason.INVALID_REQUEST,
        ) from exc
    account_id: str = getattr(request, method.routing_field)
    problem = account_id_problem(account_id)
    if problem is not None:
        raise InvalidArgument(
            f"invalid {method.name} request: {method.routing_field} {problem}",
            reason=Reason.INVALID_REQUEST,
            field_violations=[FieldViolation(method.routing_field, problem)],
        )
    return account_id


__all__ = [
    "METHODS_BY_PATH",
    "ROUTED_METHODS",
    "SERVICE",
    "routing_account",
]
