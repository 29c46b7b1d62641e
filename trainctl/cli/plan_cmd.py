"""The spec commands: `validate FILE` (local) and `plan FILE` (on the server's pool, or offline on
`--cluster PRESET:N` / `--topology MAP`, with `--suggest` the layout search), and the spec loading
the job commands share. The spec models, the planner (trainctl.planning) and the estimator load only
when a command runs; the offline plan prints what the service's PlanJob answers (the same JobPlan,
converted by trainctl.wire.plan_convert), so both print alike.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from trainctl.cli.client import TrainctlClient
from trainctl.cli.errors import EXIT_INVALID, EXIT_OK, CliError
from trainctl.cli.progress import table
from trainctl.spec.violations import FieldViolation, SpecError

if TYPE_CHECKING:
    from trainctl.spec.job import TrainingJob
    from trainctl.v1 import training_pb2 as pb


def load_job(path: str) -> Any:
    """The job spec in `path`; CliError (exit 2, one line per offending field) when it is not one."""
    from trainctl.spec.validate import load_job_file

    try:
        return load_job_file(path)
    except SpecError as exc:
        raise CliError(f"{path} is not a valid job spec", EXIT_INVALID, exc.violations) from None


def plan(args: argparse.Namespace) -> int:
    from trainctl.parallelism.sizing.step_time import STEP_TERMS

    job = load_job(args.file)
    if args.suggest:
        return _suggest(args, job)
    if args.gpus is not None or args.headroom is not None:
        raise CliError("--gpus and --headroom choose what --suggest searches: add --suggest", EXIT_INVALID)
    if args.cluster or args.topology:
        result, where = _offline_plan(args, job)
    else:
        with TrainctlClient(args.server, fail_fast=True) as client:
            result = client.plan_job(job)
        where = ""
    if not result.valid:
        raise CliError(f"{args.file} is not a valid job" + (f" on {where}" if where else ""), EXIT_INVALID,
                       [FieldViolation(v.field, v.description) for v in result.violations])
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
    grid = " x ".join(f"{k}{result.grid[k]}" for k in order if result.grid.get(k, 1) > 1) or "single rank"
    pool = where or (f"pool {result.pool_gpus} GPUs, {result.free_gpus} free; "
                     f"{'fits now' if result.fits_now else 'would queue'}")
    print(f"valid: {result.world_size} ranks ({grid}); {pool}")
    if result.placement:
        rows = [[str(p.rank), p.node, str(p.gpu), " ".join(f"{k}={v}" for k, v in sorted(p.coords.items()))] for p in result.placement]
        print(table(rows, ["RANK", "NODE", "GPU", "COORDS"]))
    if result.HasField("placement_cost_seconds"):
        print(f"modelled communication per step: {result.placement_cost_seconds * 1e3:.3f} ms")
    if result.memory:
        kinds = sorted({k for m in result.memory for k in m.bytes}, key=lambda k: (k == "total", k))  # total last
        rows = [[str(m.rank), *(f"{m.bytes.get(k, 0) / 2**20:.1f}" for k in kinds)] for m in result.memory]
        print(table(rows, ["RANK", *(f"{k.upper()} MiB" for k in kinds)]))
    if result.HasField("step_time_seconds"):
        terms = result.step_time_breakdown
        names = [*(k for k in STEP_TERMS if k in terms), *sorted(set(terms) - set(STEP_TERMS))]
        parts = ", ".join(f"{k} {terms[k] * 1e3:.2f} ms" for k in names)
        print(f"modelled step time: {result.step_time_seconds * 1e3:.2f} ms" + (f" ({parts})" if parts else ""))
        if terms.get("compute_at_peak") and result.step_time_seconds > 0:
            print(_mfu_line(job, terms["compute_at_peak"] / result.step_time_seconds))
    for note in result.notes:
        print(note if note.startswith("warning: ") else f"note: {note}")
    return EXIT_OK


def _mfu_line(job: TrainingJob, mfu: float) -> str:
    """The modelled MFU in both conventions (sizing/flops.py), so it compares with either project's tables."""
    from trainctl.parallelism.sizing.flops import full_attention_flops_per_token, training_flops_per_token
    from trainctl.spec.presets import resolve_model

    megatron = f"modelled MFU: {mfu:.1%} (Megatron's convention, causal attention halved)"
    try:  # a Hugging Face model's config.json may lie on the server only
        config = resolve_model(job.spec.model)
    except (OSError, ValueError):
        return megatron
    seq_len, lora = job.spec.data.seq_len, job.spec.lora
    full = mfu * full_attention_flops_per_token(config, seq_len, lora) / training_flops_per_token(config, seq_len, lora)
    return f"{megatron}, {full:.1%} (torchtitan's, attention unmasked)"


def _suggest(args: argparse.Namespace, job: TrainingJob) -> int:
    """`plan --suggest`: the layout search on the cluster, offline (trainctl.planning.layout_search)."""
    from trainctl.cli.suggest_cmd import suggestion_lines
    from trainctl.planning.layout_search import HEADROOM, LayoutSearchError, suggest_layouts

    if not (args.cluster or args.topology):
        raise CliError("--suggest plans offline: give the cluster with --cluster PRESET:N or --topology MAP", EXIT_INVALID)
    if args.headroom is not None and not 0 <= args.headroom < 1:
        raise CliError(f"--headroom {args.headroom:g}: the share of GPU memory left free must be at least 0 and below 1",
                       EXIT_INVALID)
    topology, option = _offline_topology(args)
    try:
        result = suggest_layouts(job, topology, option, top=args.top, gpus=args.gpus,
                                 headroom=HEADROOM if args.headroom is None else args.headroom)
    except LayoutSearchError as exc:
        raise CliError(f"no layout to suggest for {args.file} on {option}: {exc}", EXIT_INVALID) from None
    print("\n".join(suggestion_lines(job, result, _cluster_words(job, topology, option, result.gpus))))
    return EXIT_OK


def _offline_topology(args: argparse.Namespace) -> tuple[Any, str]:
    """The map `--cluster PRESET:N` or `--topology MAP` names, and the option as written."""
    from trainctl.workers.topology import TopologyError, load_topology
    from trainctl.workers.topology.presets import cluster_topology

    flag, value = ("--cluster", args.cluster) if args.cluster else ("--topology", args.topology)
    try:
        topology = cluster_topology(args.cluster) if args.cluster else load_topology(args.topology)
    except TopologyError as exc:
        raise CliError(f"{flag}: {exc}", EXIT_INVALID) from None
    return topology, f"{flag} {value}"


def _cluster_words(job: TrainingJob, topology: Any, option: str, gpus: int) -> str:
    """`option: N GPUs, MODEL (peak ..., memory)` for the output's first line."""
    from trainctl.parallelism.sizing.device_memory import gpu_memory_bytes
    from trainctl.parallelism.sizing.flops import peak_flops

    dtype = job.spec.training.dtype
    models = []
    for model in dict.fromkeys(node.gpu_model for node in topology.nodes):
        peak, memory = peak_flops(model, dtype), gpu_memory_bytes(model)
        models.append(f"{model or 'unnamed GPUs'} ("
                      + (f"peak {peak / 1e12:,.0f} TFLOP/s {dtype}" if peak else f"no known peak for {dtype}")
                      + (f", {memory / 2**30:.1f} GiB" if memory else ", memory unknown") + ")")
    return f"{option}: {gpus} GPUs, " + ", ".join(models)


def _offline_plan(args: argparse.Namespace, job: TrainingJob) -> tuple[pb.PlanJobResponse, str]:
    """The plan on `--cluster PRESET:N` or `--topology MAP` with no server (the planning layer the
    service plans with, as PlanJob answers it), and the cluster described for the output."""
    from trainctl.planning.plan import plan_on_map
    from trainctl.wire.plan_convert import plan_to_proto

    topology, option = _offline_topology(args)
    result = plan_to_proto(plan_on_map(job, topology, option))
    return result, _cluster_words(job, topology, option, result.pool_gpus)


def validate(args: argparse.Namespace) -> int:
    from trainctl.spec.model_checks import pretrained_check, pretrained_warnings
    from trainctl.spec.validate import semantic_violations

    job = load_job(args.file)
    violations = semantic_violations(job, pool_gpus=args.pool_gpus, check_data=True)
    if violations:
        raise CliError(f"{args.file} is not a valid job spec", EXIT_INVALID, violations)
    print(f"{args.file}: valid ({job.spec.parallelism.world_size} ranks)")
    for warning in pretrained_warnings(job, pretrained_check(job)[0]):
        print(f"warning: {warning.field}: {warning.description}", file=sys.stderr)
    return EXIT_OK
