"""Data and checkpoint paths stay inside their configured roots: no '..', no symlink escape."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainctl.service.paths import DataPathPolicy
from trainctl.spec.job import DataSpec


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


def fields(policy: DataPathPolicy, **data) -> dict[str, str]:
    return {v.field: v.description for v in policy.violations(DataSpec(**data))}


def test_paths_inside_the_roots_pass(layout: dict[str, Path]) -> None:
    policy = DataPathPolicy([layout["root"]])
    root = layout["root"]
    assert fields(policy, paths=[f"{root}/corpus/*.txt", f"{root}/**/*.txt", "@stdlib"], tokenizer=str(root / "tok.json")) == {}


def test_escapes_are_rejected_naming_the_field(layout: dict[str, Path]) -> None:
    policy = DataPathPolicy([layout["root"]])
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
    policy = DataPathPolicy([root])
    got = fields(policy, paths=[f"{root}/corpus/*.txt", f"{root}/mounted/key.txt", f"{root}/corpus/a.txt"], tokenizer=str(root / "tok-link.json"))
    assert set(got) == {"spec.data.paths[0]", "spec.data.paths[1]", "spec.data.tokenizer"}
    assert "leak.txt" in got["spec.data.paths[0]"] and "symlink" in got["spec.data.paths[0]"]


def test_a_symlinked_root_and_several_roots(layout: dict[str, Path]) -> None:
    link = layout["tmp"] / "data-link"
    link.symlink_to(layout["root"], target_is_directory=True)
    policy = DataPathPolicy([link, layout["outside"]])
    assert fields(policy, paths=[f"{layout['root']}/corpus/a.txt", f"{link}/corpus/b.txt", str(layout["outside"] / "key.txt")]) == {}


def test_prefix_siblings_are_not_inside(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data-private").mkdir()
    (tmp_path / "data-private" / "x.txt").write_text("x")
    got = fields(DataPathPolicy([tmp_path / "data"]), paths=[str(tmp_path / "data-private" / "x.txt")])
    assert list(got) == ["spec.data.paths[0]"]


def test_policy_needs_existing_absolute_roots(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        DataPathPolicy([])
    with pytest.raises(ValueError, match="absolute"):
        DataPathPolicy(["relative/dir"])
    with pytest.raises(ValueError, match="not a directory"):
        DataPathPolicy([tmp_path / "missing"])


def test_the_policy_also_checks_that_confined_globs_match_readable_files(layout: dict[str, Path]) -> None:
    root = layout["root"]
    policy = DataPathPolicy([root])
    got = fields(policy, paths=[f"{root}/corpus/*.md", f"{root}/nothing/here.txt"])
    assert got == {
        "spec.data.paths[0]": f"{str(root) + '/corpus/*.md'!r} matches no files",
        "spec.data.paths[1]": f"{str(root) + '/nothing/here.txt'!r} matches no files",
    }


def test_a_glob_outside_the_roots_is_never_expanded(layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    expanded: list[list[str]] = []
    import trainctl.service.paths as paths_module

    real = paths_module.resolve_data_paths
    monkeypatch.setattr(paths_module, "resolve_data_paths", lambda patterns: expanded.append(patterns) or real(patterns))
    got = fields(DataPathPolicy([layout["root"]]), paths=["/**/*", f"{layout['outside']}/**"])
    assert set(got) == {"spec.data.paths[0]", "spec.data.paths[1]"}
    assert expanded == []  # a hostile '/**' costs a string check, not a walk of the filesystem
