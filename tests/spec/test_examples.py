"""Every example spec users copy is valid: schema, semantics, data paths; and the demo fits the demo pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainctl.spec.validate import load_job_file, semantic_violations

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples_for_every_layout() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"demo", "dp", "fsdp", "hybrid-3d", "moe", "long-context-cp"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_valid(path: Path) -> None:
    job = load_job_file(path)
    assert semantic_violations(job, check_data=True) == []
    assert path.read_text().lstrip().startswith("#"), "examples start with a comment saying what they show"


def test_demo_fits_the_demo_cluster_and_is_hybrid() -> None:
    job = load_job_file(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")
    assert semantic_violations(job, pool_gpus=8) == []
    par = job.spec.parallelism
    assert sum(d > 1 for d in (par.pp, par.dp_replicate, par.dp_shard, par.cp, par.tp)) >= 3
