"""`trainctl plan FILE --cluster PRESET:N --suggest [--top K] [--gpus N] [--headroom F]`: the layout
search's answer as text. Step time, tokens/s and MFU are the search's model (compute at the GPU's peak,
the pipeline bubble, the communication the placement leaves exposed) and say so; MFU is shown in
Megatron's convention (causal attention halved), then torchtitan's (`full-attn MFU`, attention
counted unmasked). Memory is the estimator's, against the GPU's memory less the headroom.

Imported by `trainctl plan` only when --suggest is given (it loads the planning layer: the engine's
sizing modules, the placement solver).
"""

from __future__ import annotations

from trainctl.planning.layout_search import Layout, SearchResult, describe
from trainctl.spec.job import TrainingJob

LEVEL_WORDS = {
    "nvlink": "inside one NVLink domain",
    "nvlink_pair": "inside one node on NVLink-bridged / meshed GPUs",
    "PIX": "inside one node under one PCIe switch",
    "PXB": "inside one node across PCIe switches",
    "PHB": "inside one node through the CPU's PCIe host bridge",
    "NODE": "inside one node across PCIe host bridges of one socket",
    "SYS": "inside one node across CPU sockets",
    "host": "inside one node over PCIe",
    "leaf": "across nodes under one leaf switch",
    "spine": "across nodes through the spine",
    "core": "across nodes through the core",
}
"""What a fabric level means for where a dimension's groups land."""
DIM_ORDER = ("tp", "cp", "ep", "pp", "dp")


def suggestion_lines(job: TrainingJob, result: SearchResult, where: str) -> list[str]:
    """The search result as printed: a header, then per layout its grid, speed, memory and placement."""
    spec = job.spec
    tokens = spec.training.global_batch_size * spec.data.seq_len
    model = spec.model.from_pretrained or spec.model.preset
    lines = [
        f"layouts for {model} (seq_len {spec.data.seq_len:,}, global batch {spec.training.global_batch_size:,} = "
        f"{tokens:,} tokens, {spec.training.dtype}) on {where}",
        f"searched {result.enumerated:,} layouts in {result.seconds:.2f} s: {result.evaluated:,} checked against the "
        f"rules and memory, {result.solved} placed by the solver; fastest first by modelled step time",
        f"memory: at most {result.budget_bytes / 2**30:.1f} of {result.capacity_bytes / 2**30:.1f} GiB per GPU "
        f"({1 - result.budget_bytes / result.capacity_bytes:.0%} headroom); step time, tokens/s and MFU are modelled "
        "(compute at the fraction of the GPU's peak its kernels sustain, the optimizer step, pipeline bubble, exposed communication), not measured",
    ]
    for number, layout in enumerate(result.layouts, 1):
        lines += [f"#{number}  {describe(layout.body)}", *(f"    {line}" for line in _why(layout, result.capacity_bytes))]
    return lines


def _why(layout: Layout, capacity: int) -> list[str]:
    step, memory = layout.step, layout.memory
    terms = ", ".join(f"{name} {seconds * 1e3:,.2f} ms" for name, seconds in step.terms().items())
    hidden = f"; {step.overlapped * 1e3:,.2f} ms of dp/cp communication overlapped" if step.overlapped else ""
    full = f", full-attn MFU {layout.mfu_full_attention:.1%}" if layout.mfu_full_attention is not None else ""
    lines = [
        f"modelled: step {step.total * 1e3:,.2f} ms, {layout.tokens_per_second:,.0f} tokens/s, MFU {step.mfu:.1%}{full} "
        f"({terms}{hidden})",
        f"memory: rank {memory.rank} needs {memory.total_bytes / 2**30:.1f} GiB, {memory.total_bytes / capacity:.0%} of "
        f"{capacity / 2**30:.1f} (parameters {memory.params_bytes / 2**30:.1f}, gradients {memory.grads_bytes / 2**30:.1f}, "
        f"optimizer {memory.optimizer_bytes / 2**30:.1f}, activations {memory.activations_bytes / 2**30:.1f}, "
        f"working copies {memory.working_bytes / 2**30:.1f})",
    ]
    placement = layout.placement
    if placement is not None and placement.level_by_dim:
        lands = "; ".join(
            f"{dim} {LEVEL_WORDS.get(placement.level_by_dim[dim], placement.level_by_dim[dim])} "
            f"({placement.seconds_by_dim.get(dim, 0.0) * 1e3:,.2f} ms)"
            for dim in DIM_ORDER if dim in placement.level_by_dim
        )
        split = f"; split across NVLink domains: {', '.join(placement.split_dims)}" if placement.split_dims else ""
        lines.append(f"placement: {lands}{split}")
    par, training = layout.body.parallelism, layout.body.training
    settings = {name: getattr(par, name) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep") if getattr(par, name) > 1}
    if par.dp_shard > 1:
        settings["zero_stage"] = par.zero_stage
    if par.tp > 1:
        settings["sequence_parallel"] = "true"
    if par.pp > 1:
        settings["pp_schedule"] = par.pp_schedule
        if par.pp_virtual_stages > 1:
            settings["pp_virtual_stages"] = par.pp_virtual_stages
    spelled = ", ".join(f"{k}: {v}" for k, v in settings.items())
    lines.append(f"spec: parallelism {{{spelled}}}, training {{micro_batch_size: {training.micro_batch_size}, "
                 f"activation_checkpointing: {training.activation_checkpointing}}}, resources {{gpus: {par.world_size}}}")
    return lines
