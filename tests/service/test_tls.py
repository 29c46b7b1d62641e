"""TLS and mutual TLS on the gRPC port, with a throwaway CA made at test time (no key is committed)."""

from __future__ import annotations

import datetime
import ipaddress
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from trainctl.service.hardening import MessageLimits
from trainctl.service.tls import TlsConfig, TlsConfigError, bind, channel_credentials


@dataclass
class Issued:
    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.chmod(0o600)
    return path


class Authority:
    """A throwaway certificate authority in a temporary directory."""

    def __init__(self, directory: Path, name: str):
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.cert_file = directory / f"{name}-ca.pem"
        self.cert_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, server: bool) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        cert = builder.sign(self.key, hashes.SHA256())
        cert_file = self.dir / f"{name}.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_file, _write_key(key, self.dir / f"{name}-key.pem"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory, "trainctl-test")
    rogue = Authority(directory, "rogue")
    return {
        "ca": ca,
        "server": ca.issue("server", server=True),
        "client": ca.issue("client", server=False),
        "rogue_client": rogue.issue("rogue-client", server=False),
    }


def serve(tls: TlsConfig | None):
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = bind(srv, "127.0.0.1:0", tls)
    srv.start()
    return srv, port


def check(channel: grpc.Channel) -> grpc.StatusCode:
    """The status of one health check on `channel` (OK when the connection works)."""
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def secure(port: int, credentials: grpc.ChannelCredentials) -> grpc.Channel:
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials)


def test_tls_serves_verified_clients_and_refuses_plaintext(pki: dict) -> None:
    srv, port = serve(TlsConfig(pki["server"].cert, pki["server"].key))
    try:
        assert check(secure(port, channel_credentials(pki["ca"].cert_file))) == grpc.StatusCode.OK
        assert check(grpc.insecure_channel(f"127.0.0.1:{port}")) == grpc.StatusCode.UNAVAILABLE
        # A client that trusts another CA refuses the server's certificate.
        assert check(secure(port, channel_credentials(pki["rogue_client"].cert.parent / "rogue-ca.pem"))) == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(None)


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki: dict) -> None:
    config = TlsConfig(pki["server"].cert, pki["server"].key, client_ca_file=pki["ca"].cert_file)
    assert config.mutual
    srv, port = serve(config)
    try:
        ca = pki["ca"].cert_file
        assert check(secure(port, channel_credentials(ca, pki["client"].cert, pki["client"].key))) == grpc.StatusCode.OK
        assert check(secure(port, channel_credentials(ca))) == grpc.StatusCode.UNAVAILABLE
        rogue = pki["rogue_client"]
        assert check(secure(port, channel_credentials(ca, rogue.cert, rogue.key))) == grpc.StatusCode.UNAVAILABLE
        assert check(grpc.insecure_channel(f"127.0.0.1:{port}")) == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(None)


def test_plaintext_server_without_tls_config(pki: dict) -> None:
    srv, port = serve(None)
    try:
        assert check(grpc.insecure_channel(f"127.0.0.1:{port}")) == grpc.StatusCode.OK
    finally:
        srv.stop(None)


def test_bad_tls_files_name_the_option(pki: dict, tmp_path: Path) -> None:
    with pytest.raises(TlsConfigError, match="--tls-key: cannot read"):
        TlsConfig(pki["server"].cert, tmp_path / "missing.pem").server_credentials()
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TlsConfigError, match="--tls-client-ca: .* holds no PEM block"):
        TlsConfig(pki["server"].cert, pki["server"].key, tmp_path / "junk.pem").server_credentials()
    with pytest.raises(TlsConfigError, match="go together"):
        channel_credentials(pki["ca"].cert_file, cert_file=pki["client"].cert)


def test_bind_refuses_a_port_already_taken() -> None:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=MessageLimits().server_options())
    first = bind(srv, "127.0.0.1:0", None)
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=MessageLimits().server_options())
    try:
        with pytest.raises(OSError, match="cannot bind"):
            bind(other, f"127.0.0.1:{first}", None)
    finally:
        srv.stop(None)
        other.stop(None)
