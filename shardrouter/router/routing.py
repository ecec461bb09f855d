"""Which account a call is routed by: the routing account of each method.

Every routed method names its routing account in field 1 of its request; the router decodes a copy
of the request only to read that field (the bytes it forwards are the caller's own). The shard map
that turns the account into a shard is followed by `shardrouter.core.shardmap_file.ShardMapFile`.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from shardrouter.core.errors import FieldViolation, InvalidArgument, Reason
from shardrouter.core.validation import account_id_problem
from shardrouter.v1 import transfer_pb2

SERVICE = transfer_pb2.DESCRIPTOR.services_by_name["TransferService"].full_name


@dataclass(frozen=True)
class RoutedMethod:
    """A method the router forwards, and the request field holding its routing account."""

    name: str  # "Transfer"
    request_type: type[Message]
    account_field: str

    @property
    def full_name(self) -> str:
        """The gRPC method path, "/shardrouter.v1.TransferService/Transfer"."""
        return f"/{SERVICE}/{self.name}"


ROUTED_METHODS: tuple[RoutedMethod, ...] = (
    RoutedMethod("Transfer", transfer_pb2.TransferRequest, "source_account_id"),
    RoutedMethod("Deposit", transfer_pb2.DepositRequest, "account_id"),
    RoutedMethod("GetTransfer", transfer_pb2.GetTransferRequest, "source_account_id"),
    RoutedMethod("GetBalance", transfer_pb2.GetBalanceRequest, "account_id"),
)
METHODS_BY_PATH: dict[str, RoutedMethod] = {m.full_name: m for m in ROUTED_METHODS}


def routing_account(method: RoutedMethod, raw: bytes) -> str:
    """The routing account of a serialised request, or InvalidArgument naming the field."""
    try:
        request = method.request_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgument(
            f"the request body is not a valid {method.request_type.DESCRIPTOR.full_name} message (protobuf)",
            reason=Reason.INVALID_REQUEST,
        ) from exc
    account_id: str = getattr(request, method.account_field)
    problem = account_id_problem(account_id)
    if problem is not None:
        raise InvalidArgument(
            f"invalid {method.name} request: {method.account_field} {problem}",
            reason=Reason.INVALID_REQUEST,
            field_violations=[FieldViolation(method.account_field, problem)],
        )
    return account_id


__all__ = [
    "METHODS_BY_PATH",
    "ROUTED_METHODS",
    "SERVICE",
    "RoutedMethod",
    "routing_account",
]
