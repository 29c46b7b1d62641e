"""TLS and mutual TLS for the gRPC port.

With a `TlsConfig` the server opens only a TLS port, so a plaintext client cannot even complete a
handshake. With `client_ca` set, clients must also present a certificate signed by that CA (mutual
TLS); the bearer token still decides the tenant and role.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """A TLS file is missing or unreadable; the message names the option and the file."""


def _read(option: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{option}: cannot read {path}: {exc.strerror}") from exc
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{option}: {path} holds no PEM block")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """Server-side TLS: the server's certificate chain and key, and optionally a CA for client certificates."""

    cert_file: Path
    """PEM certificate chain of the server (--tls-cert)."""
    key_file: Path
    """PEM private key of the server (--tls-key); keep it readable by the service user only."""
    client_ca_file: Path | None = None
    """PEM CA bundle; when set, every client must present a certificate it signed (--tls-client-ca)."""

    def __post_init__(self) -> None:
        if self.cert_file is None or self.key_file is None:
            raise TlsConfigError("--tls-cert and --tls-key go together: TLS needs both the certificate and its key")
        self.server_credentials()  # fail at configuration time, not after the rest of the service started

    @property
    def mutual(self) -> bool:
        """Whether client certificates are required."""
        return self.client_ca_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for `server.add_secure_port`."""
        cert = _read("--tls-cert", self.cert_file)
        key = _read("--tls-key", self.key_file)
        client_ca = _read("--tls-client-ca", self.client_ca_file)
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


def bind(server: grpc.Server, address: str, tls: TlsConfig | None) -> int:
    """Open the server's one port at `address`, TLS when configured; return the bound port."""
    credentials = tls.server_credentials() if tls else None
    try:
        return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's "Failed to bind to address"
        raise OSError(f"cannot bind gRPC port {address}: in use, or not an address of this machine") from exc


def channel_credentials(
    ca_file: Path | None = None, cert_file: Path | None = None, key_file: Path | None = None
) -> grpc.ChannelCredentials:
    """Client credentials: trust `ca_file` (system roots when None), present a client cert for mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise TlsConfigError("--tls-client-cert and --tls-client-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read("--tls-ca", ca_file),
        private_key=_read("--tls-client-key", key_file),
        certificate_chain=_read("--tls-client-cert", cert_file),
    )
