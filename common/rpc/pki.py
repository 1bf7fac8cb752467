"""A private certificate authority for one stack (``pdserve up --mtls``).

``make_ca`` writes a self-signed CA; ``issue`` signs a certificate for one process, valid as
both TLS server and client, naming the hosts it is dialled at (subject alternative names).
Keys are ECDSA P-256 and written 0600. Operators with their own PKI (cert-manager, Vault)
pass its files to the ``--tls-*`` flags instead.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.rpc.tls import TlsConfig

VALID_DAYS = 365
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class CertificateAuthority:
    cert_path: Path
    key_path: Path

    def _load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey), "pdserve CAs use EC keys"
        return cert, key

    def issue(self, name: str, directory: Path, hosts: Sequence[str] = DEFAULT_HOSTS) -> TlsConfig:
        """``directory/name.pem`` and ``name.key``, signed by this CA, for ``hosts``."""
        ca_cert, ca_key = self._load()
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        _write(key_path, _key_pem(key), private=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return TlsConfig(cert_path, key_path, self.cert_path)


def make_ca(directory: Path, name: str | None = None) -> CertificateAuthority:
    """A new self-signed CA in ``directory`` (ca.pem, ca.key); the directory is made 0700.
    Its name is unique (two stacks' CAs are told apart in handshake errors)."""
    name = name or f"pdserve stack CA {secrets.token_hex(4)}"
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    ca = CertificateAuthority(directory / "ca.pem", directory / "ca.key")
    _write(ca.key_path, _key_pem(key), private=True)
    _write(ca.cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return ca


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
