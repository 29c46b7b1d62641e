"""TLS and mutual TLS on the gRPC port, with a throwaway CA made at test time (no key is committed)."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from throwaway_pki import Authority

from trainctl.service.security.hardening import MessageLimits
from trainctl.wire.tls import TlsConfig, TlsConfigError, bind, channel_credentials


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
        TlsConfig(pki["server"].cert, tmp_path / "missing.pem")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TlsConfigError, match="--tls-client-ca: .* holds no PEM block"):
        TlsConfig(pki["server"].cert, pki["server"].key, tmp_path / "junk.pem")
    with pytest.raises(TlsConfigError, match="--tls-cert and --tls-key go together"):
        TlsConfig(pki["server"].cert, None)  # type: ignore[arg-type] - what `serve --tls-cert X` alone passes
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
