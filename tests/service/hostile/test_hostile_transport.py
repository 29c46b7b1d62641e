"""Transport hardening: undecodable bytes get INVALID_ARGUMENT (not INTERNAL), oversized messages are refused."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.service.api.rpc_server import RpcServer
from trainctl.service.readiness import HealthStatus
from trainctl.service.security.hardening import MalformedRequestInterceptor, MessageLimits, StreamLimiter

CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
# Field 1 (service, a string) with a length prefix far past the end: never decodes.
TRUNCATED = b"\x0a\xff\x01abc"


def start(interceptors: list, limits: MessageLimits | None = None):
    """The service's server (an asyncio gRPC server behind RpcServer) serving only gRPC health."""
    srv = RpcServer(workers=2, interceptors=interceptors, options=(limits or MessageLimits()).server_options())
    HealthStatus(srv).set("", health_pb2.HealthCheckResponse.SERVING)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])


@pytest.fixture(scope="module")
def hardened():
    srv, channel = start([MalformedRequestInterceptor()])
    yield channel
    channel.close()
    srv.stop(None)


def raw_code(channel: grpc.Channel, method: str, payload: bytes, stream: bool = False) -> tuple[grpc.StatusCode, str]:
    try:
        if stream:
            for _ in channel.unary_stream(method)(payload, timeout=5):
                break  # Watch streams forever; the first answer is enough
        else:
            channel.unary_unary(method)(payload, timeout=5)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_plain_grpc_answers_garbage_as_a_server_fault() -> None:
    """Why the interceptor exists: without it asyncio grpc answers the client's bad bytes UNKNOWN (a server fault)."""
    srv, channel = start([])
    try:
        assert raw_code(channel, CHECK, TRUNCATED)[0] == grpc.StatusCode.UNKNOWN
    finally:
        channel.close()
        srv.stop(None)


@pytest.mark.parametrize(("method", "stream"), [(CHECK, False), (WATCH, True)])
def test_undecodable_requests_get_invalid_argument_naming_the_message(hardened: grpc.Channel, method: str, stream: bool) -> None:
    code, details = raw_code(hardened, method, TRUNCATED, stream)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc.health.v1.HealthCheckRequest" in details
    valid = health_pb2.HealthCheckRequest(service="").SerializeToString()
    assert raw_code(hardened, method, valid, stream) == (grpc.StatusCode.OK, "")


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=256))
def test_random_bytes_always_get_a_well_formed_answer(hardened: grpc.Channel, payload: bytes) -> None:
    code, _ = raw_code(hardened, CHECK, payload)
    # Bytes that decode ask about some service: known ("") -> OK, unknown -> NOT_FOUND.
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}


def test_messages_over_the_limit_are_refused_and_the_server_keeps_serving() -> None:
    srv, channel = start([MalformedRequestInterceptor()], MessageLimits(max_receive_bytes=64 * 1024))
    try:
        big = health_pb2.HealthCheckRequest(service="x" * (128 * 1024)).SerializeToString()
        assert raw_code(channel, CHECK, big)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raw_code(channel, CHECK, health_pb2.HealthCheckRequest().SerializeToString())[0] == grpc.StatusCode.OK
    finally:
        channel.close()
        srv.stop(None)


def test_message_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_receive_bytes must be at least 1024"):
        MessageLimits(max_receive_bytes=10)
    options = dict(MessageLimits(max_receive_bytes=2048, max_send_bytes=4096).server_options())
    assert options == {"grpc.max_receive_message_length": 2048, "grpc.max_send_message_length": 4096, "grpc.so_reuseport": 0}


def test_stream_limiter_needs_a_positive_cap() -> None:
    with pytest.raises(ValueError, match="max_per_key must be at least 1"):
        StreamLimiter(0)
    limiter = StreamLimiter(1)
    assert limiter.acquire("t") and not limiter.acquire("t") and limiter.acquire("u")
    limiter.release("t")
    assert limiter.open_streams("t") == 0 and limiter.acquire("t")
