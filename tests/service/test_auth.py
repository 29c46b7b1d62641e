"""Bearer-token authentication: the access file, hashing, the Authenticator and the interceptor over real gRPC."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.cli.token_cmd import token_main
from trainctl.service.auth import (
    MIN_TOKEN_LENGTH,
    TOKEN_PREFIX,
    AccessConfig,
    AuthConfigError,
    AuthenticationError,
    Authenticator,
    AuthInterceptor,
    check_exposure,
    generate_token,
    hash_token,
    is_loopback,
    load_access_config,
)
from trainctl.service.errors import ApiError
from trainctl.service.hardening import StreamLimiter
from trainctl.service.tenancy import ANONYMOUS, Principal, Quota, Role

ALICE = generate_token()
ROOT = generate_token()


def write_access(tmp_path: Path, extra: dict | None = None) -> Path:
    document = {
        "tokens": [
            {"name": "alice", "tenant": "vision", "role": "user", "sha256": hash_token(ALICE)},
            {"name": "root", "tenant": "ops", "role": "admin", "sha256": hash_token(ROOT)},
        ],
        "tenants": {"vision": {"running_gpus": 4, "queued_jobs": 2}},
        "default_quota": {"queued_jobs": 10},
    }
    document.update(extra or {})
    path = tmp_path / "access.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


class FakeContext:
    """The one ServicerContext method principal_of reads."""

    def __init__(self, metadata: list[tuple[str, str]]):
        self._metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata


def test_generated_tokens_are_long_prefixed_and_distinct() -> None:
    tokens = {generate_token() for _ in range(50)}
    assert len(tokens) == 50
    for token in tokens:
        assert token.startswith(TOKEN_PREFIX) and len(token) >= MIN_TOKEN_LENGTH + len(TOKEN_PREFIX)
        assert hash_token(token) == hashlib.sha256(token.encode()).hexdigest()


@pytest.mark.parametrize(("token", "complaint"), [("short", "at least 32"), ("x" * 40 + " y", "printable ASCII"), ("é" * 40, "printable ASCII")])
def test_hash_token_refuses_weak_or_unsendable_tokens(token: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        hash_token(token)


def test_access_file_loads_tokens_and_quotas(tmp_path: Path) -> None:
    config = load_access_config(write_access(tmp_path))
    assert [(t.name, t.tenant, t.role) for t in config.tokens] == [("alice", "vision", Role.USER), ("root", "ops", Role.ADMIN)]
    auth = Authenticator(config)
    assert auth.quota("vision") == Quota(running_gpus=4, queued_jobs=2)
    assert auth.quota("elsewhere") == Quota(queued_jobs=10)
    assert ALICE not in Path(tmp_path / "access.yaml").read_text()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokens": [{"name": "a", "tenant": "t", "sha256": "not-hex"}]}, "tokens[0].sha256"),
        ({"tokens": [{"name": "a", "tenant": "Bad_Tenant", "sha256": "0" * 64}]}, "tokens[0].tenant"),
        ({"tokens": [{"name": "a", "tenant": "t", "role": "root", "sha256": "0" * 64}]}, "tokens[0].role"),
        ({"tokens": [{"name": "a", "tenant": "t", "sha256": "0" * 64, "token": "plain"}]}, "tokens[0].token: unknown field"),
        ({"tokens": []}, "tokens"),
        ({"tokens": [{"name": "a", "tenant": "t", "sha256": "0" * 64}, {"name": "a", "tenant": "u", "sha256": "1" * 64}]}, "tokens[1].name repeats"),
        ({"tokens": [{"name": "a", "tenant": "t", "sha256": "0" * 64}, {"name": "b", "tenant": "u", "sha256": "0" * 64}]}, "tokens[1].sha256 repeats"),
        ({"tenants": {"vision": {"running_gpus": -1}}}, "tenants.vision.running_gpus"),
        ({"tenants": {"vision": {"gpus": 3}}}, "tenants.vision.gpus: unknown field"),
    ],
)
def test_bad_access_file_names_the_field(tmp_path: Path, change: dict, named: str) -> None:
    path = write_access(tmp_path, change)
    with pytest.raises(AuthConfigError, match=r"access file .*" + named.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_access_config(path)


def test_unreadable_or_malformed_access_file(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="cannot read access file"):
        load_access_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("tokens: [unclosed")
    with pytest.raises(AuthConfigError, match="not valid YAML"):
        load_access_config(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("")  # the placeholder Secret in deploy/: the service must refuse to start
    with pytest.raises(AuthConfigError, match="must be a mapping"):
        Authenticator.from_file(tmp_path / "empty.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(AuthConfigError, match="must be a mapping"):
        load_access_config(tmp_path / "list.yaml")


def test_authenticate_maps_tokens_to_principals(tmp_path: Path) -> None:
    auth = Authenticator.from_file(write_access(tmp_path))
    assert auth.enabled
    assert auth.authenticate([("authorization", f"Bearer {ALICE}")]) == Principal("alice", "vision", Role.USER)
    assert auth.authenticate([("Authorization", f"bearer   {ROOT} ")]) == Principal("root", "ops", Role.ADMIN)
    assert auth.authenticate_token(ROOT).is_admin
    cases = {
        "missing credentials": [],
        "invalid token": [("authorization", "Bearer " + generate_token())],
        "expected 'Bearer <token>'": [("authorization", ALICE)],
        "more than one": [("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {ROOT}")],
    }
    for message, metadata in cases.items():
        with pytest.raises(AuthenticationError, match=message):
            auth.authenticate(metadata)
    assert auth.principal_of(FakeContext([("authorization", f"Bearer {ALICE}")])).tenant == "vision"
    with pytest.raises(ApiError) as info:
        auth.principal_of(FakeContext([("authorization", "Bearer " + ALICE[:-1] + ("A" if ALICE[-1] != "A" else "B"))]))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_without_access_file_everyone_is_anonymous_admin_and_a_warning_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainctl.service.auth"):
        auth = Authenticator.from_file(None)
    assert not auth.enabled
    assert "authentication is OFF" in caplog.text
    assert auth.authenticate([]) is ANONYMOUS and auth.principal_of(FakeContext([])) is ANONYMOUS
    assert auth.quota("default") == Quota()


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1:50051", True), ("127.8.0.1:1", True), ("localhost:50051", True), ("[::1]:50051", True),
     ("0.0.0.0:50051", False), ("[::]:50051", False), ("10.0.0.7:50051", False), ("trainctl.example.com:443", False)],
)
def test_authentication_may_be_off_only_on_loopback(tmp_path: Path, address: str, loopback: bool) -> None:
    assert is_loopback(address) == loopback
    check_exposure(address, Authenticator.from_file(write_access(tmp_path)))  # with tokens: anywhere
    if loopback:
        check_exposure(address, Authenticator(None))
    else:
        with pytest.raises(AuthConfigError, match="without --tokens-file"):
            check_exposure(address, Authenticator(None))


def test_token_cli_new_prints_an_entry_that_authenticates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert token_main(["new", "--name", "bob", "--tenant", "nlp", "--role", "admin"]) == 0
    out, err = capsys.readouterr()
    token = err.rsplit(" ", 1)[-1].strip()
    assert token.startswith(TOKEN_PREFIX) and token not in out
    config = AccessConfig.model_validate(yaml.safe_load(out))
    assert Authenticator(config).authenticate_token(token) == Principal("bob", "nlp", Role.ADMIN)

    assert token_main(["new", "--name", "bob", "--tenant", "Not A Label"]) == 2
    assert "--tenant" in capsys.readouterr().err


def test_token_cli_hash_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(ALICE + "\n"))
    assert token_main(["hash"]) == 0
    assert capsys.readouterr().out.strip() == hash_token(ALICE)
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert token_main(["hash"]) == 2
    assert "at least 32" in capsys.readouterr().err


# ---- the interceptor over real gRPC on loopback ---------------------------------------------------

ECHO = "/test.Echo/Echo"
ECHO_STREAM = "/test.Echo/EchoStream"


@pytest.fixture
def server(tmp_path: Path):
    """A loopback server with health checking and a raw-bytes echo service behind the AuthInterceptor."""
    decoded: list[bytes] = []

    def deserialize(data: bytes) -> bytes:
        decoded.append(data)
        return data

    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request, request_deserializer=deserialize),
        "EchoStream": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([request, request]), request_deserializer=deserialize),
    }
    srv = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[AuthInterceptor(Authenticator.from_file(write_access(tmp_path)))],
    )
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", handlers)])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, decoded
    channel.close()
    srv.stop(None)


def call(channel: grpc.Channel, method: str, token: str | None, stream: bool = False):
    metadata = [("authorization", f"Bearer {token}")] if token else None
    if stream:
        return list(channel.unary_stream(method)(b"hello", metadata=metadata, timeout=10))
    return channel.unary_unary(method)(b"hello", metadata=metadata, timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_interceptor_refuses_missing_and_bad_tokens_without_decoding(server, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    channel, decoded = server
    method = ECHO_STREAM if stream else ECHO
    bad = generate_token()
    with caplog.at_level(logging.DEBUG):
        for token, message in ((None, "missing credentials"), (bad, "invalid token")):
            with pytest.raises(grpc.RpcError) as info:
                call(channel, method, token, stream)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in info.value.details()
        assert decoded == []  # a refused payload is never decoded
        assert call(channel, method, ALICE, stream) == ([b"hello", b"hello"] if stream else b"hello")
    assert decoded == [b"hello"]
    assert "refused /test.Echo" in caplog.text and "called by alice" in caplog.text
    assert bad not in caplog.text and ALICE not in caplog.text


def test_health_is_served_without_a_token(server) -> None:
    channel, _ = server
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_unknown_methods_stay_unimplemented(server) -> None:
    channel, _ = server
    with pytest.raises(grpc.RpcError) as info:
        call(channel, "/test.Echo/Nope", None)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.text(max_size=80), st.binary(max_size=80), st.builds(lambda t: f"Bearer {t}", st.text(max_size=60))))
def test_arbitrary_authorization_values_only_ever_fail_as_authentication_errors(value: str | bytes) -> None:
    auth = Authenticator(AccessConfig.model_validate({"tokens": [{"name": "alice", "tenant": "vision", "sha256": hash_token(ALICE)}]}))
    try:
        principal = auth.authenticate([("authorization", value)])
    except AuthenticationError:
        return
    assert principal.name == "alice"  # only the real token can get through


def test_open_streams_are_capped_per_tenant(tmp_path: Path) -> None:
    """A tenant holding its quota of streams gets RESOURCE_EXHAUSTED; other tenants and closed streams free slots."""
    bob = generate_token()
    access = write_access(tmp_path)
    document = load_access_config(access).model_dump(mode="json")
    document["tokens"].append({"name": "bob", "tenant": "nlp", "role": "user", "sha256": hash_token(bob)})
    config = AccessConfig.model_validate(document)
    limiter = StreamLimiter(2)
    release = threading.Event()

    def hold(request: bytes, context: grpc.ServicerContext):
        yield request
        while not release.is_set() and context.is_active():
            release.wait(0.05)

    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[AuthInterceptor(Authenticator(config), limiter)])
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {"Hold": grpc.unary_stream_rpc_method_handler(hold)})])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    hold_call = channel.unary_stream("/test.Echo/Hold")
    try:
        streams = [hold_call(b"x", metadata=bearer_of(ALICE), timeout=20) for _ in range(2)]
        assert [next(s) for s in streams] == [b"x", b"x"]  # both open and counted
        assert limiter.open_streams("vision") == 2
        with pytest.raises(grpc.RpcError) as info:
            next(hold_call(b"x", metadata=bearer_of(ALICE), timeout=20))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "'vision'" in info.value.details()
        other = hold_call(b"y", metadata=bearer_of(bob), timeout=20)
        assert next(other) == b"y"  # another tenant is not affected
        streams[0].cancel()
        deadline = time.monotonic() + 10
        while limiter.open_streams("vision") > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert next(hold_call(b"z", metadata=bearer_of(ALICE), timeout=20)) == b"z"  # the closed stream's slot is free
    finally:
        release.set()
        channel.close()
        srv.stop(None)
    # a stopped server's handlers end on their own threads, each releasing its slot as it returns
    deadline = time.monotonic() + 10
    while limiter.open_streams("vision") + limiter.open_streams("nlp") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert limiter.open_streams("vision") == 0 and limiter.open_streams("nlp") == 0


def bearer_of(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def touch_later(path: Path, seconds: int) -> None:
    """Give `path` a distinct modification time (file systems with coarse timestamps)."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 1_000_000_000))


def test_access_file_changes_apply_without_a_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_access(tmp_path)
    auth = Authenticator.from_file(path, reload_seconds=0)
    assert auth.authenticate_token(ALICE).tenant == "vision"
    assert auth.quota("vision") == Quota(running_gpus=4, queued_jobs=2)

    carol = generate_token()
    path.write_text(yaml.safe_dump({
        "tokens": [{"name": "carol", "tenant": "vision", "sha256": hash_token(carol)}],
        "tenants": {"vision": {"running_gpus": 1}},
    }))
    touch_later(path, 1)
    with pytest.raises(AuthenticationError, match="invalid token"):
        auth.authenticate_token(ALICE)  # revoked
    assert auth.authenticate_token(carol).name == "carol"
    assert auth.quota("vision") == Quota(running_gpus=1)

    path.write_text("tokens: [{name: broken}]")
    touch_later(path, 2)
    with caplog.at_level(logging.ERROR, logger="trainctl.service.auth"):
        assert auth.authenticate_token(carol).name == "carol"  # a bad edit keeps the version in force
    assert "keeping the previously loaded version" in caplog.text and "tokens[0].tenant" in caplog.text


def test_reloads_are_throttled(tmp_path: Path) -> None:
    path = write_access(tmp_path)
    auth = Authenticator.from_file(path, reload_seconds=3600)
    path.write_text(yaml.safe_dump({"tokens": [{"name": "x", "tenant": "t", "sha256": "0" * 64}]}))
    touch_later(path, 1)
    assert auth.authenticate_token(ALICE).name == "alice"  # not checked again within the interval
