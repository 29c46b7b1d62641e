"""Every path a job names stays inside the configured roots (no '..', no symlink escape) and out of
run directories of jobs the caller may not read; `init_from: job:<id>` names the caller's own jobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainctl.service.security.paths import JobPathPolicy
from trainctl.service.security.tenancy import Principal, Role
from trainctl.spec.data_checks import data_violations
from trainctl.spec.job import DataSpec, JobSpecBody

ALICE = Principal("alice", "vision", Role.USER)


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "data"
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "a.txt").write_text("hello")
    (root / "corpus" / "b.txt").write_text("world")
    (root / "tok.json").write_text("{}")
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key.txt").write_text("do not train on me")
    return {"root": root, "outside": outside, "tmp": tmp_path}


def policy_of(roots: list, runs: Path | None = None) -> JobPathPolicy:
    return JobPathPolicy(roots, runs or Path("/nonexistent/runs"))


def fields(policy: JobPathPolicy, **data) -> dict[str, str]:
    return {v.field: v.description for v in policy.violations(JobSpecBody(data=DataSpec(**data)), ALICE, lambda _id: None)}


def test_paths_inside_the_roots_pass(layout: dict[str, Path]) -> None:
    policy = policy_of([layout["root"]])
    root = layout["root"]
    assert fields(policy, paths=[f"{root}/corpus/*.txt", f"{root}/**/*.txt", "@stdlib"], tokenizer=str(root / "tok.json")) == {}


def test_escapes_are_rejected_naming_the_field(layout: dict[str, Path]) -> None:
    policy = policy_of([layout["root"]])
    root, outside = layout["root"], layout["outside"]
    got = fields(
        policy,
        paths=[
            f"{root}/corpus/*.txt",  # fine
            f"{root}/../secret/key.txt",  # traversal
            str(outside / "key.txt"),  # plainly outside
            "corpus/*.txt",  # relative: resolved against the server's cwd
            "/*/*.txt",  # glob whose fixed part is '/'
            "",
            "~/notes.txt",
        ],
        tokenizer=str(outside / "key.txt"),
    )
    assert set(got) == {f"spec.data.paths[{i}]" for i in range(1, 7)} | {"spec.data.tokenizer"}
    assert "'..'" in got["spec.data.paths[1]"]
    assert "outside the data roots" in got["spec.data.paths[2]"] and str(policy.roots[0]) in got["spec.data.paths[2]"]
    assert "absolute path" in got["spec.data.paths[3]"]
    assert "outside the data roots" in got["spec.data.paths[4]"]
    assert "empty" in got["spec.data.paths[5]"]
    assert "absolute path" in got["spec.data.paths[6]"]
    assert "outside the data roots" in got["spec.data.tokenizer"]


def test_symlinks_out_of_the_root_are_caught(layout: dict[str, Path]) -> None:
    root, outside = layout["root"], layout["outside"]
    (root / "corpus" / "leak.txt").symlink_to(outside / "key.txt")
    (root / "mounted").symlink_to(outside, target_is_directory=True)
    (root / "tok-link.json").symlink_to(outside / "key.txt")
    policy = policy_of([root])
    got = fields(policy, paths=[f"{root}/corpus/*.txt", f"{root}/mounted/key.txt", f"{root}/corpus/a.txt"], tokenizer=str(root / "tok-link.json"))
    assert set(got) == {"spec.data.paths[0]", "spec.data.paths[1]", "spec.data.tokenizer"}
    assert "leak.txt" in got["spec.data.paths[0]"] and "symlink" in got["spec.data.paths[0]"]


def test_a_symlinked_root_and_several_roots(layout: dict[str, Path]) -> None:
    link = layout["tmp"] / "data-link"
    link.symlink_to(layout["root"], target_is_directory=True)
    policy = policy_of([link, layout["outside"]])
    assert fields(policy, paths=[f"{layout['root']}/corpus/a.txt", f"{link}/corpus/b.txt", str(layout["outside"] / "key.txt")]) == {}


def test_prefix_siblings_are_not_inside(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data-private").mkdir()
    (tmp_path / "data-private" / "x.txt").write_text("x")
    got = fields(policy_of([tmp_path / "data"]), paths=[str(tmp_path / "data-private" / "x.txt")])
    assert list(got) == ["spec.data.paths[0]"]


def test_policy_needs_existing_absolute_roots(tmp_path: Path) -> None:
    assert policy_of([]).roots == ()  # no roots: no confinement to roots (single-user set-ups)
    with pytest.raises(ValueError, match="absolute"):
        policy_of(["relative/dir"])
    with pytest.raises(ValueError, match="not a directory"):
        policy_of([tmp_path / "missing"])


def test_confined_globs_are_then_checked_to_match_readable_files(layout: dict[str, Path]) -> None:
    root = layout["root"]
    data = DataSpec(paths=[f"{root}/corpus/*.md", f"{root}/nothing/here.txt"])
    assert fields(policy_of([root]), **data.model_dump()) == {}  # confined; existence is the data check's
    got = {v.field: v.description for v in data_violations(data)}
    assert got == {
        "spec.data.paths[0]": f"{str(root) + '/corpus/*.md'!r} matches no files",
        "spec.data.paths[1]": f"{str(root) + '/nothing/here.txt'!r} matches no files",
    }


def test_a_glob_outside_the_roots_is_never_expanded(layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    expanded: list[list[str]] = []
    import trainctl.service.security.paths as paths_module

    real = paths_module.resolve_data_paths
    monkeypatch.setattr(paths_module, "resolve_data_paths", lambda patterns: expanded.append(patterns) or real(patterns))
    got = fields(policy_of([layout["root"]]), paths=["/**/*", f"{layout['outside']}/**"])
    assert set(got) == {"spec.data.paths[0]", "spec.data.paths[1]"}
    assert expanded == []  # a hostile '/**' costs a string check, not a walk of the filesystem


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    """A data root that also holds the service's run directory, with one job of tenant vision and one of nlp."""
    root = tmp_path / "shared"
    runs_dir = root / "svc" / "runs"
    for job in ("job-mine", "job-theirs"):
        (runs_dir / job / "checkpoints").mkdir(parents=True)
        (runs_dir / job / "checkpoints" / "job.json").write_text("{}")
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("hello")
    (root / "corpus" / "theirs").symlink_to(runs_dir / "job-theirs", target_is_directory=True)
    return {"root": root, "runs": runs_dir}


TENANTS = {"job-mine": "vision", "job-theirs": "nlp"}


def job_fields(policy: JobPathPolicy, principal: Principal = ALICE, **spec) -> dict[str, str]:
    return {v.field: v.description for v in policy.violations(JobSpecBody.model_validate(spec), principal, TENANTS.get)}


def test_no_path_field_reaches_into_another_tenants_run_directory(runs: dict[str, Path]) -> None:
    root, runs_dir = runs["root"], runs["runs"]
    theirs = runs_dir / "job-theirs"
    for policy in (policy_of([root], runs_dir), policy_of([], runs_dir)):  # with and without data roots
        got = job_fields(
            policy,
            data={"paths": [f"{theirs}/checkpoints/*.json", f"{runs_dir}/*/checkpoints/*", f"{root}/corpus/theirs/*/*", f"{root}/corpus/*.txt"],
                  "tokenizer": str(theirs / "checkpoints" / "job.json")},
            init_from=str(theirs),
        )
        assert set(got) == {"spec.data.paths[0]", "spec.data.paths[1]", "spec.data.paths[2]", "spec.data.tokenizer", "spec.init_from"}
        assert "not yours" in got["spec.init_from"] and "job:<id>" in got["spec.init_from"]
        assert "glob over the service's run directory" in got["spec.data.paths[1]"]
        assert "job-theirs" not in got["spec.data.paths[2]"]  # a match through a symlink is not named
        # an unknown job's directory gets exactly the refusal another tenant's gets: ids cannot be probed
        unknown = job_fields(policy, init_from=str(runs_dir / "job-nobody"))["spec.init_from"]
        assert unknown.replace("job-nobody", "X") == got["spec.init_from"].replace("job-theirs", "X")


def test_own_and_admin_run_directories_and_job_references(runs: dict[str, Path]) -> None:
    root, runs_dir = runs["root"], runs["runs"]
    policy = policy_of([root], runs_dir)
    mine = runs_dir / "job-mine"
    assert job_fields(policy, data={"paths": [f"{mine}/checkpoints/*.json"]}, init_from=str(mine)) == {}
    admin = Principal("root", "ops", Role.ADMIN)
    assert job_fields(policy, admin, data={"paths": [f"{runs_dir}/*/checkpoints/*"]}, init_from=str(runs_dir / "job-theirs")) == {}
    assert job_fields(policy, init_from="job:job-mine") == {}
    refused = {ref: job_fields(policy, init_from=f"job:{ref}")["spec.init_from"] for ref in ("job-theirs", "job-nobody", "")}
    assert refused["job-theirs"].replace("job-theirs", "X") == refused["job-nobody"].replace("job-nobody", "X")
    assert "no job" in refused[""]
    resolved = policy.resolve(JobSpecBody(init_from="job:job-mine"))
    assert resolved.init_from == str(mine)
    assert policy.resolve(JobSpecBody(init_from="/x/y")).init_from == "/x/y"


def test_token_shard_directories_are_confined_as_literal_paths(runs: dict[str, Path]) -> None:
    root, runs_dir = runs["root"], runs["runs"]
    policy = policy_of([root], runs_dir)
    got = job_fields(policy, data={"format": "tokens", "paths": [str(root / "corpus"), str(runs_dir / "job-theirs"), "/etc"]})
    assert set(got) == {"spec.data.paths[1]", "spec.data.paths[2]"}


def test_a_server_with_tenants_needs_data_roots_or_the_loud_opt_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from secure_service import write_access_file

    from trainctl.service.security.paths import ConfinementConfigError, check_confinement
    from trainctl.service.server import Service, ServiceConfig

    access = write_access_file(tmp_path).path
    with pytest.raises(ConfinementConfigError, match="--data-root.*--allow-any-data-path"):
        Service(ServiceConfig(data_dir=tmp_path / "svc", tokens_file=access, metrics_port=0)).start()  # before Ray starts
    check_confinement(False, [], False)  # no tenants: no roots needed
    check_confinement(True, [tmp_path], False)
    with caplog.at_level("WARNING", logger="trainctl.service.security.paths"):
        check_confinement(True, [], True)
    assert "--allow-any-data-path" in caplog.text and caplog.records[0].levelname == "WARNING"


def test_from_pretrained_is_confined_like_every_path(runs: dict[str, Path], tmp_path: Path) -> None:
    root, runs_dir = runs["root"], runs["runs"]
    outside = tmp_path / "elsewhere" / "model"
    outside.mkdir(parents=True)
    policy = policy_of([root], runs_dir)
    field = "spec.model.from_pretrained"
    assert job_fields(policy, model={"from_pretrained": str(root / "corpus")}) == {}
    assert job_fields(policy, model={"from_pretrained": str(runs_dir / "job-mine")}) == {}
    assert "outside the data roots" in job_fields(policy, model={"from_pretrained": str(outside)})[field]
    assert "absolute path" in job_fields(policy, model={"from_pretrained": "relative/model"})[field]
    for each in (policy, policy_of([], runs_dir)):  # with and without data roots
        theirs = job_fields(each, model={"from_pretrained": str(runs_dir / "job-theirs" / "checkpoints")})[field]
        assert "not yours" in theirs
        via_link = job_fields(each, model={"from_pretrained": str(root / "corpus" / "theirs")})[field]
        assert "job-theirs" not in via_link and "not yours" in via_link


def test_without_roots_relative_paths_are_refused_naming_each_field(runs: dict[str, Path]) -> None:
    """A spec sent to the service has no directory to resolve a relative path against (the CLI resolves a
    spec file's against the file's directory first): every path field says so; `~` and absolute paths pass."""
    policy = policy_of([], runs["runs"])
    relative = job_fields(
        policy, data={"paths": ["corpus/*.txt", "@stdlib"], "tokenizer": "tok.json"}, init_from="checkpoints",
    )
    command = job_fields(policy, command={"program": "python", "working_dir": "code"})
    pretrained = job_fields(policy, model={"from_pretrained": "models/tiny"})
    found = {**relative, **command, **pretrained}
    assert set(found) == {"spec.data.paths[0]", "spec.data.tokenizer", "spec.init_from", "spec.command.working_dir",
                          "spec.model.from_pretrained"}
    for description in found.values():
        assert "is a relative path" in description
        assert "resolve a spec file's relative paths against the file's directory" in description
    assert job_fields(policy, data={"paths": ["~/corpus/*.txt", str(runs["root"] / "corpus" / "*.txt")]}) == {}
