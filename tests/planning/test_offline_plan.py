"""Offline planning (issue 17): `trainctl plan FILE --cluster PRESET:N | --topology MAP` with no server
plans every rank (the service's PlanJob answers the same plan on the same map: tests/service/api/test_api.py);
its step time is compute at the preset GPU's peak, the pipeline bubble and the placement's communication;
bad clusters and maps are refused naming the option, the field or the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainctl.cli.main import EXIT_INVALID, main
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.device_memory import gpu_memory_bandwidth
from trainctl.parallelism.sizing.estimator import flops_per_step
from trainctl.parallelism.sizing.flops import peak_flops, training_flops_per_token
from trainctl.parallelism.sizing.pipeline_bubble import bubble_seconds
from trainctl.parallelism.sizing.step_time import (
    HBM_FRACTION,
    OPTIMIZER_BYTES,
    SUSTAINED_FRACTION,
    updated_parameters,
)
from trainctl.planning.plan import plan_on_map
from trainctl.planning.pool import GpuPool
from trainctl.spec.job import TrainingJob
from trainctl.spec.presets import resolve_model
from trainctl.spec.validate import load_job_file, parse_object
from trainctl.workers.topology.presets import CLUSTER_PRESETS, cluster_preset, cluster_topology

ROOT = Path(__file__).resolve().parents[2]
HYBRID = ROOT / "examples" / "hybrid-3d.yaml"
NOWHERE = "127.0.0.1:9"
"""A server address nothing answers on: an offline plan must not need it."""


def resized(job: TrainingJob, **parallelism: int) -> TrainingJob:
    """`job` with other parallel degrees and the GPU count they make."""
    data = job.model_dump(mode="json")
    data["spec"]["parallelism"].update(parallelism)
    par = data["spec"]["parallelism"]
    data["spec"]["resources"]["gpus"] = par["pp"] * par["dp_replicate"] * par["dp_shard"] * par["cp"] * par["tp"]
    return parse_object(data)


def test_the_offline_plan_places_estimates_and_times_every_rank() -> None:
    topology = cluster_topology("hgx-h100:2")
    fits = resized(load_job_file(HYBRID), dp_shard=2)  # pp2 x dp_shard2 x tp4 = 16 ranks
    too_big = load_job_file(HYBRID)  # 32 ranks
    offline = plan_on_map(fits, topology, "--cluster hgx-h100:2")
    assert offline.valid and offline.world_size == 16
    assert offline.degrees == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 4, "ep": 1}
    assert offline.placement is not None and len(offline.placement.assignments) == 16
    assert [m.rank for m in offline.memory] == list(range(16))
    assert set(offline.step_time_breakdown) == {"compute_at_peak", "kernel_efficiency", "recompute", "optimizer",
                                                "pipeline_bubble", "communication"}
    assert offline.step_time_seconds == pytest.approx(sum(offline.step_time_breakdown.values()))
    refused = plan_on_map(too_big, topology, "--cluster hgx-h100:2")
    assert not refused.valid and [v.field for v in refused.violations] == ["spec.resources.gpus"]
    assert (refused.world_size, refused.placement, refused.memory, refused.notes) == (0, None, (), ())


@pytest.mark.parametrize("preset", ["hgx-h100:4", "gb200-nvl72:1", "pcie-h100-nvl:4"])
def test_step_time_is_compute_at_the_preset_peak_plus_recompute_bubble_and_exposed_communication(preset: str) -> None:
    job = resized(load_job_file(HYBRID), pp=4, dp_shard=2)  # 4 stages, 256 / (2 x 2) = 64 micro-batches
    plan = plan_on_map(job, cluster_topology(preset), preset)
    grid = RankGrid.from_spec(job.spec.parallelism)
    peak = peak_flops(cluster_preset(preset.split(":")[0]).gpu_model, job.spec.training.dtype)
    config = resolve_model(job.spec.model)
    compute = flops_per_step(config, job.spec) / grid.world_size / peak
    # full activation checkpointing runs every block's forward again: a third of the blocks' FLOPs
    blocks = compute * (1 - 6 * config.dim * config.vocab_size / training_flops_per_token(config, job.spec.data.seq_len))
    par, training = job.spec.parallelism, job.spec.training
    assert training.activation_checkpointing == "full"
    micro_batches = training.global_batch_size // (grid.dp * training.micro_batch_size)
    # data-parallel communication hides behind compute + recompute; tp and pp transfers are exposed
    by_dim = GpuPool(cluster_topology(preset), preset).place(ResolvedJob.resolve(job.spec), empty=True).seconds_by_dim
    assert sum(by_dim.values()) == pytest.approx(plan.placement.cost_seconds)
    exposed = by_dim["tp"] + by_dim["pp"] + max(0.0, by_dim["dp"] - compute - blocks / 3)
    # kernels at SUSTAINED_FRACTION of the peak; clipping and AdamW over this rank's ZeRO shard, memory-bound
    gpu = cluster_preset(preset.split(":")[0]).gpu_model
    optimizer = updated_parameters(config, job.spec) * OPTIMIZER_BYTES["adamw"] / (gpu_memory_bandwidth(gpu) * HBM_FRACTION)
    assert dict(plan.step_time_breakdown) == pytest.approx({
        "compute_at_peak": compute,
        "kernel_efficiency": (compute + blocks / 3) * (1 / SUSTAINED_FRACTION[training.compile] - 1),
        "optimizer": optimizer,
        "recompute": blocks / 3,
        "pipeline_bubble": bubble_seconds(compute + blocks / 3, par.pp_schedule, par.pp, micro_batches, par.pp_virtual_stages),
        "communication": exposed,
    })
    assert f"{(plan.placement.cost_seconds - exposed) * 1e3:.2f} ms of data- and context-parallel communication overlaps" in plan.notes[-1]


def test_the_cli_plans_offline_without_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--server", NOWHERE, "plan", str(HYBRID), "--cluster", "hgx-h100:4"]) == 0
    by_preset = capsys.readouterr().out.splitlines()
    expected = plan_on_map(load_job_file(HYBRID), cluster_topology("hgx-h100:4"), "")
    assert by_preset[0].startswith("valid: 32 ranks (pp2 x dp_shard4 x tp4); --cluster hgx-h100:4: 32 GPUs, H100-SXM5-80GB")
    placed = [line.split()[1] for line in by_preset if line.split()[1:2] and line.split()[1].startswith("hgx-h100-n")]
    assert len(placed) == 32 and set(placed) == {node.name for node in cluster_topology("hgx-h100:4").nodes}
    assert f"modelled step time: {expected.step_time_seconds * 1e3:.2f} ms (compute_at_peak" in "\n".join(by_preset)
    documented = (ROOT / "docs" / "placement.md").read_text().split("## Offline planning", 1)[1].split("```")[1].splitlines()
    shown = [line for line in documented if line and line != "..."]
    assert shown == [line for line in by_preset if line in shown or line.startswith(("valid:", "modelled"))], \
        "docs/placement.md's offline plan output is stale"
    map_file = tmp_path / "hgx.yaml"
    map_file.write_text(cluster_topology("hgx-h100:4").to_yaml())
    assert main(["--server", NOWHERE, "plan", str(HYBRID), "--topology", str(map_file)]) == 0
    by_file = capsys.readouterr().out.splitlines()
    assert by_file[0].startswith(f"valid: 32 ranks (pp2 x dp_shard4 x tp4); --topology {map_file}: 32 GPUs")
    assert by_file[1:] == by_preset[1:]


def _bad_map(tmp_path: Path) -> Path:
    path = tmp_path / "broken-map.yaml"
    data = yaml.safe_load(cluster_topology("hgx-h100:1").to_yaml())
    data["spec"]["nodes"][0]["nics"][0]["leaf"] = "no-such-leaf"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("option, expected", [
    (["--cluster", "dgx-a100:4"], ["--cluster: no cluster preset 'dgx-a100'", *(p.name for p in CLUSTER_PRESETS)]),
    (["--cluster", "hgx-h100:0"], ["--cluster: N='0': hgx-h100 takes a whole number of nodes from 1 to"]),
    (["--cluster", "gb200-nvl72"], ["--cluster: expected PRESET:N"]),
    (["--cluster", "hgx-h100:2"], ["not a valid job on --cluster hgx-h100:2: 16 GPUs",
                                   "spec.resources.gpus: 32 GPUs requested but the pool can never hold more than 16"]),
    (["--topology", "{tmp}/absent.yaml"], ["--topology: {tmp}/absent.yaml: cannot read topology map"]),
    (["--topology", "{bad}"], ["--topology: {bad}:", "'no-such-leaf', which is not a switch of the map"]),
])
def test_bad_clusters_and_maps_are_refused_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: list[str], expected: list[str]
) -> None:
    names = {"tmp": str(tmp_path), "bad": str(_bad_map(tmp_path))}
    assert main(["--server", NOWHERE, "plan", str(HYBRID), *(o.format(**names) for o in option)]) == EXIT_INVALID
    err = capsys.readouterr().err
    for text in expected:
        assert text.format(**names) in err, err


CONTROL_PLANE_IMPORTS = """
import sys
from trainctl.cli.main import main
import trainctl.service.server
code = main(["plan", sys.argv[1], "--cluster", "hgx-h100:4"])
print(code, sorted({m.split(".")[0] for m in sys.modules} & {"torch", "ray"}))
"""


def test_the_control_plane_loads_and_plans_without_torch_or_ray() -> None:
    """The service's modules and a full plan (placement, memory per rank, step time) need neither torch nor
    Ray loaded: the control plane starts in seconds and holds no engine in memory (Ray loads when it serves)."""
    done = subprocess.run([sys.executable, "-c", CONTROL_PLANE_IMPORTS, str(HYBRID)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout[-2000:]


def test_an_elastic_jobs_plan_names_the_layouts_it_may_shrink_to_and_whether_each_fits() -> None:
    """`scheduling.elastic`: each smaller layout of the plan's note, said not to fit when its larger shards do not (the
    scheduler never shrinks to one of those)."""
    topology = cluster_topology("hgx-h100:1")
    spec = {"model": {"preset": "llama3-8b"}, "data": {"seq_len": 2048}, "parallelism": {"dp_shard": 8},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, "activation_checkpointing": "full"},
            "resources": {"gpus": 8},
            "scheduling": {"elastic": {"min_gpus": 1}}}
    plan = plan_on_map(parse_object({"metadata": {"name": "e"}, "spec": spec}), topology, "hgx-h100:1")
    [note] = [n for n in plan.notes if n.startswith("scheduling.elastic")]
    assert note == (  # one H100 cannot hold the 8B model's 128 GB of weights, gradients and AdamW state
        "scheduling.elastic: after a node loss with no GPU to replace it, the job may shrink to 4 GPUs (dp_replicate 1 x "
        "dp_shard 4); 2 GPUs (dp_replicate 1 x dp_shard 2); 1 GPUs (dp_replicate 1 x dp_shard 1, which does not fit the "
        "pool's GPUs), the global batch kept; it grows back when GPUs are free"), note
