"""Throw-away certificates for mTLS tests: one CA, a server certificate for 127.0.0.1, client certs."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    """Paths of one certificate, its key, and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


class TestCA:
    """A CA that issues server and client certificates into a folder; two CAs in one bundle need two
    names (`name`)."""

    __test__ = False  # not a pytest test class

    def __init__(self, folder: Path, name: str = "shard-router test CA") -> None:
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.ca_path = folder / "ca.crt"
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        common_name: str,
        *,
        server: bool = False,
        client: bool | None = None,
        uris: Sequence[str] = (),
        stem: str | None = None,
    ) -> CertFiles:
        """A certificate for `common_name` (for 127.0.0.1 and localhost if `server`); `client`: also for
        client authentication (default: only when not `server`). A shard's certificate is both, as
        cert-manager issues `shardd-tls`: its relay presents it to the other shards. `uris`: URI SANs
        (a SPIFFE ID, `spiffe://cluster.local/ns/<ns>/sa/<sa>`, as cert-manager's `uris:` puts it);
        `stem`: the files' name (default: the common name)."""
        client = not server if client is None else client
        usages = [
            u
            for u, wanted in (
                (ExtendedKeyUsageOID.SERVER_AUTH, server),
                (ExtendedKeyUsageOID.CLIENT_AUTH, client),
            )
            if wanted
        ]
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(
                x509.ExtendedKeyUsage(usages),
                critical=False,
            )
        )
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
        if server:
            names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = stem or common_name
        cert_path = self.folder / f"{stem}.crt"
        key_path = self.folder / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return CertFiles(cert_path, key_path, self.ca_path)


def publish_like_a_secret(
    folder: Path, version: str, cert: bytes, key: bytes, ca: bytes | None = None
) -> None:
    """Put `cert` and `key` (and `ca` as ca.crt) in `folder/version` and flip `folder/..data` to it in
    one atomic rename, as a Kubernetes Secret volume updates (`tls.crt` -> `..data/tls.crt` links stay
    as they are)."""
    import os

    target = folder / version
    target.mkdir()
    files = {"tls.crt": cert, "tls.key": key, **({"ca.crt": ca} if ca is not None else {})}
    for name, data in files.items():
        (target / name).write_bytes(data)
    (folder / "..data_tmp").symlink_to(version)
    os.replace(folder / "..data_tmp", folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(Path("..data") / name)
