"""The committed generated code matches proto/ (regenerated into a temp dir and compared byte for byte)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainctl.proto_gen import REPO_ROOT, ProtocError, generate


def test_committed_generated_code_is_fresh(tmp_path: Path) -> None:
    produced = generate(tmp_path)
    assert produced, "protoc produced nothing"
    stale = []
    for path in produced:
        relative = path.relative_to(tmp_path)
        committed = REPO_ROOT / relative
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(relative))
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


def test_generate_reports_a_broken_proto(tmp_path: Path) -> None:
    root = tmp_path / "proto"
    (root / "trainctl" / "v1").mkdir(parents=True)
    (root / "trainctl" / "v1" / "training.proto").write_text('syntax = "proto3"; message {')
    with pytest.raises(ProtocError):
        generate(tmp_path / "out", proto_root=root)
