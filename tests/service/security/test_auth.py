"""Bearer-token authentication: the access file, hashing, the Authenticator, and authenticated calls over real gRPC."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from secure_service import bearer, job_message, start_service, stub, write_access_file

from trainctl.cli.token_cmd import token_main
from trainctl.service.security.auth import (
    AccessConfig,
    AuthConfigError,
    AuthenticationError,
    Authenticator,
    check_exposure,
    is_loopback,
    load_access_config,
)
from trainctl.service.security.tenancy import ANONYMOUS, Principal, Quota
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.tokens import MIN_TOKEN_LENGTH, TOKEN_PREFIX, Role, generate_token, hash_token

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
        ({"command_tenants": ["vision", "Not A Tenant"]}, "command_tenants[1]: 'Not A Tenant' is not a tenant name"),
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
    assert auth.authenticate([("authorization", f"Bearer {ALICE}")]).tenant == "vision"
    with pytest.raises(AuthenticationError, match="invalid token"):
        auth.authenticate([("authorization", "Bearer " + ALICE[:-1] + ("A" if ALICE[-1] != "A" else "B"))])


def test_without_access_file_everyone_is_anonymous_admin_and_a_warning_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainctl.service.security.auth"):
        auth = Authenticator.from_file(None)
    assert not auth.enabled
    assert "authentication is OFF" in caplog.text
    assert auth.authenticate([]) is ANONYMOUS and auth.authenticate(None) is ANONYMOUS
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


# ---- the TrainingService's calls over real gRPC on loopback (trainctl.service.api.rpc_calls) -------------

GET = "/trainctl.v1.TrainingService/GetJob"
WATCH = "/trainctl.v1.TrainingService/WatchJob"
GARBAGE = b"\x0a\xff\x01abc"  # field 1 with a length far past the end: never decodes


@pytest.fixture
def service(tmp_path: Path):
    tokens = write_access_file(tmp_path)
    running = start_service(tmp_path / "data", tokens.path)
    channel = running.channel()
    yield channel, tokens
    channel.close()
    running.stop()


def raw_call(channel: grpc.Channel, method: str, payload: bytes, token: str | None, stream: bool = False) -> tuple[grpc.StatusCode, str]:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        if stream:
            list(channel.unary_stream(method)(payload, metadata=metadata, timeout=10))
        else:
            channel.unary_unary(method)(payload, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("stream", [False, True])
def test_calls_without_a_valid_token_are_refused_before_their_payload_is_decoded(
    service, stream: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    channel, tokens = service
    method = WATCH if stream else GET
    bad = generate_token()
    with caplog.at_level(logging.DEBUG):
        for token, message in ((None, "missing credentials"), (bad, "invalid token")):
            code, details = raw_call(channel, method, GARBAGE, token, stream)
            assert code == grpc.StatusCode.UNAUTHENTICATED, details  # not INVALID_ARGUMENT: never decoded
            assert message in details
        code, details = raw_call(channel, method, GARBAGE, tokens.alice, stream)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "trainctl." in details
        code, details = raw_call(channel, method, b"", tokens.alice, stream)  # an empty request decodes: no id
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "a job id is required" in details
    assert f"refused {method}" in caplog.text and "called by alice" in caplog.text
    assert bad not in caplog.text and tokens.alice not in caplog.text


def test_health_is_served_without_a_token(service) -> None:
    channel, _ = service
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_unknown_methods_stay_unimplemented(service) -> None:
    channel, tokens = service
    for method in ("/trainctl.v1.TrainingService/Nope", "/test.Echo/Echo"):
        assert raw_call(channel, method, b"", tokens.alice)[0] == grpc.StatusCode.UNIMPLEMENTED


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
    tokens = write_access_file(tmp_path)
    running = start_service(tmp_path / "data", tokens.path, streams_per_tenant=2)
    channel = running.channel()
    api = stub(channel)
    try:
        alices = api.CreateJob(pb.CreateJobRequest(job=job_message("held")), metadata=bearer(tokens.alice)).id
        bobs = api.CreateJob(pb.CreateJobRequest(job=job_message("held")), metadata=bearer(tokens.bob)).id

        def follow(job_id: str, token: str):
            stream = api.WatchJob(pb.WatchJobRequest(id=job_id, follow=True), metadata=bearer(token), timeout=30)
            assert next(stream).state_change.to_state == pb.QUEUED  # open: its first event came
            return stream

        streams = [follow(alices, tokens.alice) for _ in range(2)]
        with pytest.raises(grpc.RpcError) as info:
            follow(alices, tokens.alice)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "'vision'" in info.value.details()
        other = follow(bobs, tokens.bob)  # another tenant is not affected
        streams[0].cancel()
        deadline = time.monotonic() + 10
        while True:  # the cancelled stream's slot is freed once the server has seen the cancel
            try:
                streams.append(follow(alices, tokens.alice))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
        for stream in (*streams, other):
            stream.cancel()
    finally:
        channel.close()
        running.stop()


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
    with caplog.at_level(logging.ERROR, logger="trainctl.service.security.auth"):
        assert auth.authenticate_token(carol).name == "carol"  # a bad edit keeps the version in force
    assert "keeping the previously loaded version" in caplog.text and "tokens[0].tenant" in caplog.text


def test_reloads_are_throttled(tmp_path: Path) -> None:
    path = write_access(tmp_path)
    auth = Authenticator.from_file(path, reload_seconds=3600)
    path.write_text(yaml.safe_dump({"tokens": [{"name": "x", "tenant": "t", "sha256": "0" * 64}]}))
    touch_later(path, 1)
    assert auth.authenticate_token(ALICE).name == "alice"  # not checked again within the interval


def test_undecodable_reflection_requests_get_invalid_argument(service) -> None:
    """Reflection, a request stream served without a token, refuses bytes that are not its request."""
    channel, _ = service
    method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    with pytest.raises(grpc.RpcError) as info:
        list(channel.stream_stream(method)(iter([GARBAGE]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc.reflection.v1alpha.ServerReflectionRequest" in info.value.details()
