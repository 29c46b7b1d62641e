"""Layout search (issues 17, 34): `trainctl plan FILE --cluster PRESET:N --suggest` returns valid layouts
that fit with 10 % of GPU memory to spare (the estimator's peak, data-parallel working copies included),
ranked by the step time `plan` itself reports, shaped like the published recipes for Llama 3 8B and 70B
on HGX H100 clusters (the table below; sources in docs/placement.md, "Layout search")."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path

import pytest

from trainctl.cli.main import EXIT_INVALID, main
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.device_memory import gpu_memory_bytes
from trainctl.parallelism.sizing.estimator import full_shapes
from trainctl.planning.fit import estimable, estimate_ranks
from trainctl.planning.layout_search import HEADROOM, Layout, LayoutSearchError, SearchResult, suggest_layouts
from trainctl.planning.plan import plan_on_map
from trainctl.spec.job import TrainingJob
from trainctl.spec.presets import resolve_model
from trainctl.spec.validate import parse_object, semantic_violations
from trainctl.workers.topology.presets import cluster_preset, cluster_topology

ROOT = Path(__file__).resolve().parents[2]
NOWHERE = "127.0.0.1:9"
SEQ_LEN = 8192
GPUS_PER_NODE = cluster_preset("hgx-h100").gpus_per_unit
"""GPUs per NVLink domain of an HGX H100 node."""
CAPACITY = gpu_memory_bytes(cluster_preset("hgx-h100").gpu_model)
"""Memory of one H100 SXM (80 GiB)."""


@dataclass(frozen=True)
class Recipe:
    """A published layout, reduced to the shape the search must reproduce."""

    model: str
    nodes: int
    """hgx-h100 nodes (8 GPUs each)."""
    sequences: int
    """Global batch in sequences of SEQ_LEN tokens."""
    source: str
    tp: str
    """"1" (no tensor parallelism: FSDP over every GPU), "node" (1 < tp <= GPUs per node, groups inside
    NVLink) or "any"."""
    pp: str
    """"1", or "across" (pp > 1, stage boundaries between nodes), or "any"."""


RECIPES = (
    # The recipes compile the model and the loss (torchtitan: compile.components = ["model", "loss"]); so do the
    # searched jobs (`job_of`): an eager loss holds three float32 [tokens, vocab] tensors more at its peak.
    # torchtitan llama3_8b.toml: FSDP over every GPU (data_parallel_shard_degree -1), TP 1, PP 1, seq 8192.
    Recipe("llama3-8b", 1, 128, "torchtitan llama3_8b.toml", tp="1", pp="1"),
    Recipe("llama3-8b", 4, 256, "torchtitan llama3_8b.toml; Ultra-Scale Playbook (ZeRO when the model fits)", tp="1", pp="1"),
    Recipe("llama3-8b", 8, 512, "torchtitan llama3_8b.toml (a preset for 64 GPUs)", tp="1", pp="1"),
    # torchtitan llama3_70b.toml: 64 GPUs, TP 8 inside a node, FSDP over the rest, local batch 8, seq 8192.
    Recipe("llama3-70b", 8, 64, "torchtitan llama3_70b.toml", tp="node", pp="any"),
    Recipe("llama3-70b", 32, 256, "torchtitan llama3_70b.toml; Llama 3 paper (TP 8 inside a server)", tp="node", pp="any"),
    # Llama 3 paper, 405B at 8K-16K GPUs: TP 8 inside a server, PP 16 across servers, DP over the rest, with
    # the batch (16M tokens) capping DP; the Playbook: 70B+ weights exceed a node, PP spans nodes.
    Recipe("llama3-70b", 128, 256, "Llama 3 paper (TP8, PP across servers, DP); Ultra-Scale Playbook", tp="node", pp="across"),
)


LLAMA3_70B_SPEC = """\
apiVersion: trainctl/v1
kind: TrainingJob
metadata: {name: llama3-70b}
spec:
  model: {preset: llama3-70b}
  data: {seq_len: 8192}
  training: {global_batch_size: 256, dtype: bfloat16}
  resources: {device: cuda}
"""
"""The spec of docs/placement.md's layout search example: no GPU count, so the whole cluster."""


def job_of(model: str, sequences: int, gpus: int | None = None) -> TrainingJob:
    resources: dict = {"device": "cuda"} if gpus is None else {"device": "cuda", "gpus": gpus}
    return parse_object({
        "metadata": {"name": "search"},
        "spec": {
            "model": {"preset": model}, "data": {"seq_len": SEQ_LEN},
            "training": {"global_batch_size": sequences, "dtype": "bfloat16", "compile": True}, "resources": resources,
        },
    })


def search(recipe: Recipe, top: int = 3) -> SearchResult:
    return suggest_layouts(job_of(recipe.model, recipe.sequences), cluster_topology(f"hgx-h100:{recipe.nodes}"),
                           f"hgx-h100:{recipe.nodes}", top=top)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.model}-{r.nodes * GPUS_PER_NODE}gpus")
def test_the_best_layout_has_the_shape_of_the_published_recipe(recipe: Recipe) -> None:
    """The first choice is the recipe's shape and leaves the default headroom (10 %) of every GPU free."""
    best = search(recipe).layouts[0]
    par, placement = best.body.parallelism, best.placement
    assert placement is not None and not placement.split_dims
    assert best.memory.total_bytes <= (1 - HEADROOM) * CAPACITY, f"{best.memory.total_bytes / 2**30:.1f} GiB"
    if recipe.tp == "1":
        assert par.tp == 1 and par.dp_shard == par.dp > 1 and par.zero_stage == 3, f"{recipe.source}: FSDP without TP"
    else:
        assert 1 < par.tp <= GPUS_PER_NODE and placement.level_by_dim["tp"] == "nvlink", f"{recipe.source}: TP inside a node"
    if recipe.pp == "1":
        assert par.pp == 1, recipe.source
    elif recipe.pp == "across":
        assert par.pp > 1 and placement.level_by_dim["pp"] != "nvlink" and par.dp > 1, f"{recipe.source}: PP across nodes"


@pytest.mark.parametrize("model, nodes", [("llama3-8b", 16), ("llama3-8b", 128), ("llama3-70b", 2), ("llama3-70b", 16)])
def test_tensor_parallel_groups_never_leave_a_node_at_any_size(model: str, nodes: int) -> None:
    """Across 8-1,024 GPUs (2M-token batches): every suggestion keeps tp within one node's NVLink."""
    for layout in search(Recipe(model, nodes, 256, "the Ultra-Scale Playbook: TP inside a node", "any", "any"), top=5).layouts:
        par, placement = layout.body.parallelism, layout.placement
        assert par.tp <= GPUS_PER_NODE and placement is not None and not placement.split_dims
        assert par.tp == 1 or placement.level_by_dim["tp"] == "nvlink"


@pytest.mark.parametrize("recipe", [RECIPES[1], RECIPES[4]], ids=["8b-32gpus", "70b-256gpus"])
def test_every_suggestion_is_valid_fits_and_is_what_plan_reports(recipe: Recipe) -> None:
    result = search(recipe)
    assert result.capacity_bytes == CAPACITY and result.budget_bytes == int(CAPACITY * (1 - HEADROOM))
    assert result.gpus == recipe.nodes * GPUS_PER_NODE
    steps = [layout.step.total for layout in result.layouts]
    assert len(steps) == 3 and steps == sorted(steps)
    topology = cluster_topology(f"hgx-h100:{recipe.nodes}")
    for layout in result.layouts:
        job = job_of(recipe.model, recipe.sequences).model_copy(update={"spec": layout.body})
        assert semantic_violations(job, pool_gpus=result.gpus, check_data=False) == []
        _assert_memory_is_the_estimators(job, layout)
        assert layout.memory.total_bytes <= result.budget_bytes
        plan = plan_on_map(job, topology, "hgx")
        assert plan.valid
        assert plan.step_time_seconds == pytest.approx(layout.step.total)
        assert dict(plan.step_time_breakdown) == pytest.approx(layout.step.terms())
        assert layout.tokens_per_second == pytest.approx(recipe.sequences * SEQ_LEN / plan.step_time_seconds)


def _assert_memory_is_the_estimators(job: TrainingJob, layout: Layout) -> None:
    """The search's memory is the estimator's largest first-shard estimate over the pipeline stages."""
    grid = layout.grid
    estimates, _ = estimate_ranks(estimable(ResolvedJob.resolve(job.spec)), [grid.rank_of(pp=p) for p in range(grid.pp)])
    worst = max(estimates.values(), key=lambda m: m.total_bytes)
    assert layout.memory.total_bytes == worst.total_bytes


def test_layouts_that_do_not_fit_are_dropped() -> None:
    """70B on 64 GPUs: without tensor or pipeline parallelism, FSDP alone leaves every block's
    activations on each rank; no such layout may be suggested, and what is suggested fits the budget."""
    result = search(RECIPES[3], top=5)
    for layout in result.layouts:
        assert layout.memory.total_bytes <= result.budget_bytes
        par = layout.body.parallelism
        assert not (par.tp == 1 and par.pp == 1 and layout.body.training.activation_checkpointing == "none")


def test_zero2_holds_the_gathered_parameters_it_keeps_for_backward() -> None:
    """Issue 34: ZeRO-2 keeps every block's bf16 parameters gathered from forward to backward; the search's
    memory counts them (70B, pp8 x dp_shard2 x tp4: 80 layers / 8 stages x a block's 856M / 4 parameters x 2 bytes)."""
    job = job_of("llama3-70b", 64)
    body = job.spec.model_copy(update={"parallelism": job.spec.parallelism.model_copy(update={
        "pp": 8, "dp_shard": 2, "tp": 4, "zero_stage": 2, "sequence_parallel": True, "pp_schedule": "1f1b"})})
    config = resolve_model(body.model)
    estimates, _ = estimate_ranks(ResolvedJob.resolve(body, model=config), [0])
    block = sum(prod(shape) for name, shape in full_shapes(config).items() if name.startswith("layers.0."))
    assert estimates[0].working_bytes >= config.n_layers // 8 * block // 4 * 2


def test_a_cluster_too_small_for_any_layout_is_refused_with_the_smallest_need() -> None:
    """70B on one HGX node: 16 bytes of weights, gradients and AdamW state per parameter alone exceed 8 x 80 GiB."""
    with pytest.raises(LayoutSearchError) as refused:
        suggest_layouts(job_of("llama3-70b", 64), cluster_topology("hgx-h100:1"), "hgx-h100:1")
    message = str(refused.value)
    assert message.startswith("no layout fits 8 GPUs of 80.0 GiB with 72.0 GiB usable (the rest is headroom): the "
                              "smallest estimated need is ")
    need = float(message.split("need is ")[1].split(" GiB")[0])
    params = sum(prod(shape) for shape in full_shapes(resolve_model(job_of("llama3-70b", 64).spec.model)).values())
    assert need > 80.0 and need * 2**30 >= 16 * params / 8 * 0.999


def test_jobs_the_search_cannot_rank_are_refused_by_field() -> None:
    topology = cluster_topology("hgx-h100:1")
    cases = {
        "spec.model.preset: unknown model preset 'llama9'": {"model": {"preset": "llama9"}},
        "spec.model.from_pretrained: ": {"model": {"from_pretrained": "/nonexistent/model"}},
        "spec.resources.device: cpu": {"model": {"preset": "llama3-8b"}, "resources": {"device": "cpu"}},
        "spec.command: a command job": {"command": {"program": "python"}},
    }
    for expected, spec in cases.items():
        with pytest.raises(LayoutSearchError, match=expected.replace(".", r"\.").replace("(", r"\(")):
            suggest_layouts(parse_object({"metadata": {"name": "bad"}, "spec": spec}), topology, "hgx-h100:1")


def test_the_search_uses_every_gpu_of_the_cluster_unless_told_another_count() -> None:
    """The spec's resources.gpus is what the search chooses: all the cluster's GPUs by default, `gpus` (--gpus N)
    when given, at most the cluster's."""
    topology = cluster_topology("hgx-h100:4")
    everything = suggest_layouts(job_of("llama3-8b", 64, gpus=16), topology, "hgx-h100:4", top=2)
    assert everything.gpus == 32 and all(layout.body.parallelism.world_size == 32 for layout in everything.layouts)
    part = suggest_layouts(job_of("llama3-8b", 64, gpus=16), topology, "hgx-h100:4", top=2, gpus=8)
    assert part.gpus == 8 and all(layout.body.resources.gpus == layout.body.parallelism.world_size == 8 for layout in part.layouts)
    with pytest.raises(LayoutSearchError, match="--gpus 64: hgx-h100:4 has 32 GPUs; search on 1 to 32"):
        suggest_layouts(job_of("llama3-8b", 64), topology, "hgx-h100:4", gpus=64)


def test_the_headroom_bounds_every_suggestion() -> None:
    """Llama 3 8B on one node: with half of each GPU kept free, every suggestion needs at most 40 GiB, and the
    fastest layout at the default headroom (FSDP without checkpointing, 64 GiB) gives way."""
    job, topology = job_of("llama3-8b", 128), cluster_topology("hgx-h100:1")
    default = suggest_layouts(job, topology, "hgx-h100:1", top=3)
    halved = suggest_layouts(job, topology, "hgx-h100:1", top=3, headroom=0.5)
    assert halved.budget_bytes == CAPACITY // 2
    assert all(layout.memory.total_bytes <= CAPACITY / 2 for layout in halved.layouts)
    assert default.layouts[0].memory.total_bytes > CAPACITY / 2 and halved.layouts[0].body != default.layouts[0].body
    with pytest.raises(LayoutSearchError, match="headroom 1: the share of GPU memory left free must be at least 0 and below 1"):
        suggest_layouts(job, topology, "hgx-h100:1", headroom=1.0)


def test_moe_layouts_split_experts_evenly() -> None:
    job = parse_object({
        "metadata": {"name": "moe"},
        "spec": {"model": {"preset": "moe-8x1b"}, "data": {"seq_len": 4096},
                 "training": {"global_batch_size": 64, "dtype": "bfloat16"}, "resources": {"device": "cuda"}},
    })
    result = suggest_layouts(job, cluster_topology("hgx-h100:2"), "hgx-h100:2", top=5)
    experts = resolve_model(job.spec.model).moe.num_experts
    assert any(layout.body.parallelism.ep > 1 for layout in result.layouts)
    for layout in result.layouts:
        par = layout.body.parallelism
        assert experts % par.ep == 0 and (par.dp_shard * par.cp) % par.ep == 0


def test_the_cli_suggests_offline_and_refuses_what_it_cannot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "llama3-70b.yaml"
    spec.write_text(LLAMA3_70B_SPEC)
    assert main(["--server", NOWHERE, "plan", str(spec), "--cluster", "hgx-h100:128", "--suggest", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("layouts for llama3-70b (seq_len 8,192, global batch 256 = 2,097,152 tokens, bfloat16) on "
                             "--cluster hgx-h100:128: 1024 GPUs, H100-SXM5-80GB")
    assert [line.split()[0] for line in out if line.startswith("#")] == ["#1", "#2"]
    assert any(line.strip().startswith("placement: tp inside one NVLink domain") for line in out)
    documented = (ROOT / "docs" / "placement.md").read_text().split("## Layout search", 1)[1].split("```")[1].splitlines()
    shown = [line for line in documented if line and not line.startswith("searched")]
    assert shown == [line for line in out if not line.startswith("searched")][: len(shown)], \
        "docs/placement.md's layout search output is stale"

    assert main(["--server", NOWHERE, "plan", str(spec), "--cluster", "hgx-h100:1", "--suggest"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "no layout to suggest" in err and "the smallest estimated need is" in err
    assert main(["--server", NOWHERE, "plan", str(spec), "--suggest"]) == EXIT_INVALID
    assert "--suggest plans offline: give the cluster with --cluster PRESET:N or --topology MAP" in capsys.readouterr().err


def test_the_cli_takes_the_gpu_count_and_the_headroom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "llama3-8b.yaml"
    spec.write_text(LLAMA3_70B_SPEC.replace("70b", "8b").replace("256", "64"))
    argv = ["--server", NOWHERE, "plan", str(spec), "--cluster", "hgx-h100:4", "--suggest", "--top", "1"]
    assert main([*argv, "--gpus", "8", "--headroom", "0.25"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("on --cluster hgx-h100:4: 8 GPUs, H100-SXM5-80GB (peak 989 TFLOP/s bfloat16, 80.0 GiB)")
    assert out[2].startswith("memory: at most 60.0 of 80.0 GiB per GPU (25% headroom); step time, tokens/s and MFU are modelled")
    assert any(line.startswith("    modelled: step ") for line in out) and "resources {gpus: 8}" in out[-1]
    assert main([*argv, "--headroom", "1.5"]) == EXIT_INVALID
    assert "--headroom 1.5: the share of GPU memory left free must be at least 0 and below 1" in capsys.readouterr().err
    assert main([*argv, "--gpus", "64"]) == EXIT_INVALID
    assert "--gpus 64: --cluster hgx-h100:4 has 32 GPUs" in capsys.readouterr().err
    assert main(["--server", NOWHERE, "plan", str(spec), "--cluster", "hgx-h100:4", "--gpus", "8"]) == EXIT_INVALID
    assert "--gpus and --headroom choose what --suggest searches: add --suggest" in capsys.readouterr().err
