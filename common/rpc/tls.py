"""Transport security of the internal hops: mutual TLS between pdserve processes.

With ``TlsConfig`` set, a worker or block store serves only TLS and refuses a peer that
presents no certificate signed by ``ca`` (``require_client_auth``); its calls to other
pdserve processes present ``cert`` and check the server's against ``ca``. A server's
certificate must name the host others dial (a SAN): ``pdserve up --mtls`` issues one per
process for 127.0.0.1 and localhost (common/rpc/pki.py).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    cert: Path  # PEM: this process's certificate (server and client)
    key: Path  # PEM: its private key
    ca: Path  # PEM: the CA that signs every peer's certificate

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if not Path(path).is_file():
                raise FileNotFoundError(f"TLS {name} file {path} does not exist")

    @classmethod
    def from_flags(
        cls, cert: str | None, key: str | None, ca: str | None, what: str = "--tls"
    ) -> TlsConfig | None:
        """All three files or none (plaintext); anything in between is a mistake."""
        given = [v for v in (cert, key, ca) if v]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError(f"{what}-cert, {what}-key and {what}-ca go together: give all three")
        assert cert and key and ca
        return cls(Path(cert), Path(key), Path(ca))

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )


@dataclass(frozen=True)
class PublicTls:
    """TLS on the gateway's public port: server authentication only (clients prove who they
    are with API keys, not certificates)."""

    cert: Path
    key: Path

    def __post_init__(self) -> None:
        for name in ("cert", "key"):
            if not Path(getattr(self, name)).is_file():
                raise FileNotFoundError(f"public TLS {name} file {getattr(self, name)} missing")

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None) -> PublicTls | None:
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError("--public-tls-cert and --public-tls-key go together")
        return cls(Path(cert), Path(key))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())], require_client_auth=False
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate for the HTTP port."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context
