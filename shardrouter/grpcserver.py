"""gRPC server plumbing shared by the router and the shard daemons: options, health, reflection, TLS,
and graceful shutdown on SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    # grpc-stubs makes these generic; at run time they are plain classes.
    ServerInterceptorBase = grpc.ServerInterceptor[Any, Any]
    MethodHandler = grpc.RpcMethodHandler[Any, Any]
else:
    ServerInterceptorBase = grpc.ServerInterceptor
    MethodHandler = grpc.RpcMethodHandler


class UnaryInterceptor(ServerInterceptorBase):
    """A server interceptor that wraps the unary-unary handlers of the methods it `applies_to`.

    Subclasses give `wrap` (the new handler); streaming methods, unknown methods and methods it does
    not apply to pass through untouched.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], MethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        """The wrapped handler, or the original one where this interceptor does not apply."""
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or not self.applies_to(method):
            return handler
        return self.wrap(method, handler)

    def applies_to(self, method: str) -> bool:
        """Whether to wrap `method` (a full path such as /shardrouter.v1.TransferService/Transfer)."""
        return True

    def wrap(self, method: str, handler: MethodHandler) -> MethodHandler:
        """The handler that replaces `handler` (a unary-unary handler of `method`)."""
        raise NotImplementedError


def with_behaviour(handler: MethodHandler, behaviour: Callable[[Any, Any], Any]) -> MethodHandler:
    """`handler`'s request decoding and response encoding around a new unary behaviour."""
    return grpc.unary_unary_rpc_method_handler(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def server_options(
    *, max_message_bytes: int, max_metadata_bytes: int, max_streams: int, share_port: bool = False
) -> list[tuple[str, int]]:
    """Channel arguments every server of ours uses; `share_port`: one of several serving processes
    of one daemon on one port (SO_REUSEPORT, the kernel spreads connections among them)."""
    return [
        # grpcio sets SO_REUSEPORT by default: a second server on a busy port would silently share it.
        ("grpc.so_reuseport", 1 if share_port else 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max(max_message_bytes, 4 * 1024 * 1024)),
        ("grpc.max_metadata_size", max_metadata_bytes),
        ("grpc.max_concurrent_streams", max_streams),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


FilesStamp = tuple[tuple[int, int, int], ...]
_T = TypeVar("_T")


def files_stamp(paths: Sequence[Path]) -> FilesStamp:
    """Identity of the files' current contents (inode, size, mtime); cheap enough for every handshake.

    stat() follows the symlinks a Kubernetes Secret volume swaps on update.
    """
    return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in (p.stat() for p in paths))


class WatchedFiles:
    """Files loaded together and loaded again when any of them changes (a certificate rotation).

    A set that changed but does not load (half-written) is logged and skipped: whoever holds the last
    good load keeps it until the new set loads.
    """

    def __init__(self, what: str, *paths: str) -> None:
        self._what = what
        self._paths = tuple(Path(p) for p in paths if p)
        self._lock = threading.Lock()
        self._stamp = files_stamp(self._paths)

    def load_if_changed(self, load: Callable[[], _T]) -> _T | None:
        """`load()` if the files changed since the last successful load, else None."""
        with self._lock:
            try:
                stamp = files_stamp(self._paths)
                if stamp == self._stamp:
                    return None
                loaded = load()
            except (OSError, ValueError) as exc:
                log.warning(
                    "%s files changed but cannot be loaded yet (%s); keeping the current ones",
                    self._what,
                    exc,
                )
                return None
            self._stamp = stamp
            log.info("%s files reloaded", self._what, extra={"files": ",".join(map(str, self._paths))})
            return loaded


def _pem_pair(cert: str, key: str) -> tuple[bytes, bytes]:
    """A certificate chain and its private key, checked to be PEM (a half-written file is not)."""
    chain, private = Path(cert).read_bytes(), Path(key).read_bytes()
    if b"CERTIFICATE" not in chain or b"PRIVATE KEY" not in private:
        raise ValueError(f"{cert} or {key} is not a PEM certificate and key")
    return chain, private


class CertificateFiles:
    """A server's certificate, key and client CA on disk, re-read when they change.

    grpc asks `fetch` at every TLS handshake; it answers None (keep the current configuration) unless
    the files changed since the last load, so a rotation (cert-manager renewing a Secret, which
    Kubernetes swaps in atomically) reaches new connections without a restart.
    """

    def __init__(self, cert: str, key: str, ca: str) -> None:
        self._cert, self._key, self._ca = cert, key, ca
        self._files = WatchedFiles("TLS server certificate", cert, key, ca)
        self.initial = self._configuration()  # start-up: an unreadable file is an error here

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration if the files changed, else None (grpc keeps the current one)."""
        return self._files.load_if_changed(self._configuration)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        chain, private = _pem_pair(self._cert, self._key)
        roots = Path(self._ca).read_bytes() if self._ca else None
        return grpc.ssl_server_certificate_configuration([(private, chain)], root_certificates=roots)


class ClientCertificateFiles:
    """A client's certificate, key and CA on disk: `changed()` gives new credentials after a rotation.

    grpc's channel credentials are fixed when a channel is made, so the owner of the channels polls
    this and replaces its channels when it returns credentials.
    """

    def __init__(self, cert: str, key: str, ca: str) -> None:
        self._cert, self._key, self._ca = cert, key, ca
        self._files = WatchedFiles("TLS client certificate", cert, key, ca)
        self.credentials = self._credentials()

    def changed(self) -> grpc.ChannelCredentials | None:
        """New credentials if the files changed and load, else None (also while a set is half-written)."""
        credentials = self._files.load_if_changed(self._credentials)
        if credentials is not None:
            self.credentials = credentials
        return credentials

    def _credentials(self) -> grpc.ChannelCredentials:
        chain, private = _pem_pair(self._cert, self._key) if self._cert else (None, None)
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self._ca).read_bytes() if self._ca else None,
            private_key=private,
            certificate_chain=chain,
        )


def server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials:
    """TLS server credentials that follow certificate rotation; with a CA, client certificates are
    required (mTLS)."""
    files = CertificateFiles(cert, key, ca)
    return grpc.dynamic_ssl_server_credentials(
        files.initial,
        files.fetch,  # type: ignore[arg-type]  # grpc documents None as "no change"; the stubs omit it
        require_client_authentication=bool(ca),
    )


def channel_credentials(cert: str, key: str, ca: str) -> grpc.ChannelCredentials:
    """TLS client credentials, with a client certificate when one is given."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


def new_server(
    *,
    workers: int,
    max_calls: int,
    interceptors: Sequence[ServerInterceptorBase],
    options: list[tuple[str, int]],
) -> grpc.Server:
    """A thread-pool gRPC server (see README: sync measured faster than asyncio here)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
        interceptors=list(interceptors),
        options=options,
        maximum_concurrent_rpcs=max_calls,
    )


def bind(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind `address`; fails loudly if the port is taken. Returns the bound port."""
    try:
        port = (
            server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        )
    except RuntimeError as exc:  # recent grpcio raises instead of returning 0
        raise SystemExit(f"cannot listen on {address}: the address is in use or invalid ({exc})") from None
    if port == 0:
        raise SystemExit(f"cannot listen on {address}: the address is in use or invalid")
    return port


def add_health_and_reflection(server: grpc.Server, service_names: Sequence[str]) -> health.HealthServicer:
    """Register gRPC health (all services NOT_SERVING until `mark_serving`) and reflection."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return servicer


def mark_serving(servicer: health.HealthServicer, service_names: Sequence[str]) -> None:
    """Report every service SERVING."""
    for name in ("", *service_names):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def install_termination_handlers() -> threading.Event:
    """Catch SIGTERM and SIGINT from now on; the returned event is set when one arrives.

    Install before the server starts, so a SIGTERM during start-up still leads to a clean stop.
    """
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def wait_for_termination_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    install_termination_handlers().wait()


def graceful_stop(server: grpc.Server, servicer: health.HealthServicer, grace_s: float) -> None:
    """Stop accepting calls (health NOT_SERVING first), let in-flight calls finish within `grace_s`."""
    servicer.enter_graceful_shutdown()
    server.stop(grace_s).wait(grace_s + 1)


def listen_host(listen: str) -> str:
    """The host part of a gRPC listen address ("[::]:50061" -> "::", "0.0.0.0:50061" -> "0.0.0.0").

    Side endpoints (/metrics) bind the same host, so a loopback daemon exposes them on loopback only.
    """
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return host.strip("[]") or "0.0.0.0"  # noqa: S104 - an empty host means every interface
