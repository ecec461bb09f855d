"""Which shard a call goes to: the routing account of each method, and the live shard map.

Every routed method names its routing account in field 1 of its request; the router decodes a copy
of the request only to read that field (the bytes it forwards are the caller's own). The shard map
comes from a file that is polled and swapped in atomically when it changes; a bad new file never
replaces a good map.

The polling runs in a daemon thread, so reading and parsing the file never stalls the router's event
loop; the loop only reads `ShardMapHolder.current`, a reference that is replaced as a whole.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError, Message

from shardrouter.errors import FieldViolation, InvalidArgument, Reason
from shardrouter.shardmap import ShardMap, ShardMapError, load_shard_map
from shardrouter.v1 import transfer_pb2
from shardrouter.validation import account_id_problem

log = logging.getLogger(__name__)

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


MapListener = Callable[[ShardMap, ShardMap], None]


class ShardMapHolder:
    """The current shard map, reloaded from its file without a restart.

    Each check re-opens the file by path and hashes its bytes, so a Kubernetes ConfigMap update (an
    atomic swap of the `..data` symlink, which leaves the old inode intact) is seen as surely as an
    in-place rewrite, and a rewrite that keeps size and mtime is not missed either. The file is a
    few hundred bytes; reading it once a second costs nothing.

    `on_change` is called on the polling thread; a listener that touches event-loop objects must hop
    onto the loop (`loop.call_soon_threadsafe`), as the router's does.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        interval_s: float = 1.0,
        on_change: MapListener | None = None,
    ) -> None:
        self._path = Path(path)
        self._interval_s = interval_s
        self._on_change = on_change
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Raises ShardMapError: at start-up a bad file is fatal, there is no last good map.
        self._map = load_shard_map(self._path)
        self._seen_hash = self._content_hash()

    @property
    def path(self) -> Path:
        """The shard map file."""
        return self._path

    @property
    def current(self) -> ShardMap:
        """The map in force (replaced as a whole, so a reader never sees half of a change)."""
        return self._map

    def start(self) -> None:
        """Poll the file in a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="shard-map-reload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._interval_s + 1)

    def check(self) -> bool:
        """Reload if the file's content changed; True when a new map took effect."""
        with self._lock:
            digest = self._content_hash()
            if digest == self._seen_hash:
                return False
            # Remember what was tried, so a bad file is reported once, not once per poll.
            self._seen_hash = digest
            try:
                new = load_shard_map(self._path)
            except ShardMapError as exc:
                log.warning(
                    "shard map reload failed, keeping the last good map: %s",
                    exc,
                    extra={"path": str(self._path)},
                )
                return False
            old, self._map = self._map, new
        log.info(
            "shard map reloaded: %d shards",
            len(new.shards),
            extra={"path": str(self._path), "shards": ",".join(f"{s.id}={s.address}" for s in new.shards)},
        )
        if self._on_change is not None:
            try:
                self._on_change(old, new)
            except Exception:  # a failing listener must not stop the reloads
                log.exception("shard map change listener failed")
        return True

    def _content_hash(self) -> bytes | None:
        try:
            return hashlib.sha256(self._path.read_bytes()).digest()
        except OSError:
            return None  # gone for a moment (mid-swap) or unreadable: load_shard_map says why

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception:  # keep polling whatever happens; the last good map stays
                log.exception("shard map check failed")


__all__ = [
    "METHODS_BY_PATH",
    "ROUTED_METHODS",
    "SERVICE",
    "MapListener",
    "RoutedMethod",
    "ShardMapHolder",
    "routing_account",
]
