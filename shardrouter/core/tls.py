"""TLS credentials from files on disk that follow certificate rotation without a restart.

Kubernetes updates a mounted Secret by swapping a symlink; cert-manager renews before expiry. Servers
re-read their files at the next handshake (`server_credentials`); clients poll `ClientCertificateFiles`
and replace their channels. A half-written set of files is skipped until it loads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)

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
    Kubernetes swaps in atomically) reaches new connections without a restart. Each configuration is
    a new OpenSSL context in grpc-core: a CA taken out of the bundle is distrusted by the next
    handshakes too (tested).
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


__all__ = [
    "CertificateFiles",
    "ClientCertificateFiles",
    "WatchedFiles",
    "channel_credentials",
    "files_stamp",
    "server_credentials",
]
