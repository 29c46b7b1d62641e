"""Layout search: `trainctl plan FILE --cluster PRESET:N --suggest` — the fastest layouts of a job's
model, sequence length and global batch on a whole cluster, by modelled step time.

Contract: every layout returned is valid under the spec's own rules (`semantic_violations` against
the cluster's GPU count; for a `from_pretrained` model, `pretrained_violations`: its directory is
checked once, its shape against each layout), its largest per-rank
memory estimate (the engine's estimator: `estimate_memory` / `peak_above_state` with the
data-parallel working copies, every pipeline stage's first shard, as `fit_violations` checks) fits
the smallest GPU of the map less `headroom` (default `HEADROOM`, 10 %: the allocator's fragmentation,
the CUDA context and libraries, NCCL's buffers and the estimator's own error), and its step time is
`sizing.step_time.modelled_step_time` with the placement solver's communication on the empty cluster
(`GpuPool.place`): what `trainctl plan` prints for the same job on the same map. Step time, tokens/s
and MFU are modelled (compute at the fraction of the GPU's peak its kernels sustain, sizing/step_time.py), not
measured.

Enumerated (docs/placement.md, "Layout search", says why each cut is sound):

- `tp`: powers of two up to the largest NVLink domain (one node's GPUs on a map without NVLink);
  with tp > 1, sequence parallelism on.
- `cp`: powers of two keeping at least `MIN_CP_TOKENS` tokens per rank.
- `pp`: divisors of n_layers (balanced stages); schedules 1f1b, zero_bubble, and interleaved_1f1b with
  2 virtual stages (GPipe is left out: the bubble of 1F1B with more activations in flight).
- `ep` (MoE models): powers of two dividing num_experts and dp_shard x cp.
- data parallel over the rest: FSDP (zero 3), ZeRO-2, DDP, HSDP (dp_shard a power of two, zero 3);
  ZeRO-1 is left out (the cost model prices it as ZeRO-2, which holds less). With pp > 1 the sharded
  splits are ZeRO-2 (HSDP zero 2), as torchtitan's default does: under a pipeline schedule ZeRO-3
  gathers each stage again for every micro-batch's forward, which the cost model (two gathers a step)
  does not price.
- `micro_batch_size` powers of two up to `MAX_MICRO_BATCH`; activation checkpointing none, selective,
  full.

GPU count: every GPU of the map, or `gpus` (`trainctl plan --suggest --gpus N`); the spec's
`resources.gpus` is what the search chooses, not an input.

Ranking, in two stages so that 1,024 GPUs answer in about a second (bench/layout_search.py):

1. Pre-ranking. Every variant gets the step time with an analytic communication estimate: the cost
   model's own traffic (`placement.solver.job_traffic`), each dimension's groups priced at the
   innermost fabric level that can hold their extent in grid order (`placement.cost.DimTraffic.seconds`
   at that level's bandwidth and latency; no contention, no rails). Variants are walked best first;
   each is checked against the spec's rules and its memory estimated until `top + 2` model-parallel
   shapes (pp, cp, tp, ep) each have their best valid, fitting variant (of estimates within `TIE`, the
   one needing the least memory).
2. Placement. Those are placed by the solver on the empty cluster (`GpuPool.place`, the call `plan`
   makes) and ranked by `modelled_step_time` with the solver's communication, then by memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import product

from trainctl.parallelism.layouts.dp_mode import effective_mode
from trainctl.parallelism.layouts.grid import LayoutError, RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.device_memory import gpu_memory_bandwidth, gpu_memory_bytes
from trainctl.parallelism.sizing.estimator import (
    LocalParam,
    MemoryEstimate,
    ModelPlan,
    local_params,
    model_plan,
    peak_above_state,
    state_bytes,
    working_copies,
)
from trainctl.parallelism.sizing.flops import (
    full_attention_flops_per_token,
    peak_flops,
    training_flops_per_token,
)
from trainctl.parallelism.sizing.step_time import StepTime, modelled_step_time
from trainctl.parallelism.sizing.working_copies import WorkingCopies
from trainctl.planning.pool import OFFLINE_BUDGET_S, GpuPool, PlannedPlacement
from trainctl.spec.hf_config import weights_problem
from trainctl.spec.job import JobSpecBody, ParallelismSpec, TrainingJob
from trainctl.spec.model_checks import model_violations
from trainctl.spec.presets import PretrainedConfigError, UnknownPresetError
from trainctl.spec.validate import semantic_violations
from trainctl.workers.placement.cost import Workload
from trainctl.workers.placement.fabric import LEVELS
from trainctl.workers.placement.solver import job_traffic
from trainctl.workers.topology import TopologyMap

MIN_CP_TOKENS = 8192
"""Fewest tokens per context-parallel rank: shorter shards make ring attention latency-bound."""
MAX_MICRO_BATCH = 8
"""Largest micro-batch tried (the model gains nothing from larger ones: compute is at peak)."""
AC_MODES = ("none", "selective", "full")
TIE = 1e-3
"""Relative difference under which two estimates tie (the one needing less memory is kept)."""
SCHEDULES = (("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2))
"""(pp_schedule, pp_virtual_stages) tried when pp > 1."""
HEADROOM = 0.10
"""Share of the GPU's memory a suggested layout leaves free by default."""


class LayoutSearchError(ValueError):
    """No layout can be suggested (names the reason: the job, the cluster, or the smallest need)."""


@dataclass(frozen=True)
class Layout:
    """One suggested layout: the job with it, its largest rank's memory and its modelled step."""

    body: JobSpecBody
    grid: RankGrid
    """The layout's rank grid."""
    memory: MemoryEstimate
    """The rank with the largest estimate (first shard of some pipeline stage)."""
    step: StepTime
    """The modelled step; its `mfu` is in Megatron's convention (causal attention halved)."""
    tokens_per_second: float
    placement: PlannedPlacement | None = None
    """The solver's placement on the empty cluster (None when the solver found none)."""
    mfu_full_attention: float | None = None
    """The modelled MFU in torchtitan's convention (attention counted unmasked)."""

@dataclass(frozen=True)
class SearchResult:
    """The best layouts, fastest first, and what the search did."""

    layouts: list[Layout]
    gpus: int
    capacity_bytes: int
    """Memory of the smallest GPU of the map."""
    budget_bytes: int
    """What a layout's largest rank may need: `capacity_bytes` less the headroom."""
    enumerated: int
    """Layouts (grid, zero stage, schedule, micro-batch, checkpointing) enumerated."""
    evaluated: int
    """Of those, validated and estimated before the walk stopped."""
    solved: int
    """Placed by the solver."""
    seconds: float
    """Wall time of the search (imports not counted)."""


@dataclass(frozen=True)
class _Variant:
    estimate: float
    """The step time with the pre-ranking's communication estimate."""
    traffic: float
    """That estimate's communication, hidden or not (breaks ties: less traffic first)."""
    body: JobSpecBody


def suggest_layouts(job: TrainingJob, topology: TopologyMap, source: str, *, top: int = 5, gpus: int | None = None,
                    headroom: float = HEADROOM) -> SearchResult:
    """The `top` fastest valid layouts of `job`'s model, data and training settings on `gpus` GPUs of
    `topology` (default all of them) whose largest rank needs at most 1 - `headroom` of the smallest GPU's
    memory (module docstring); LayoutSearchError when there is none, saying why."""
    started = time.perf_counter()
    if job.spec.command is not None:
        raise LayoutSearchError("spec.command: a command job runs its own program; its memory and step time are unknown here")
    if job.spec.resources.device == "cpu":
        raise LayoutSearchError("spec.resources.device: cpu; the search ranks layouts on the cluster's GPUs (use auto or cuda)")
    if not 0 <= headroom < 1:
        raise LayoutSearchError(f"headroom {headroom:g}: the share of GPU memory left free must be at least 0 and below 1")
    pool = GpuPool(topology, source, solver_budget_s=OFFLINE_BUDGET_S)
    world = pool.total if gpus is None else gpus
    if not 1 <= world <= pool.total:
        raise LayoutSearchError(f"--gpus {world}: {source} has {pool.total} GPUs; search on 1 to {pool.total}")
    models = sorted({pool.gpu_model(node) or "" for node, _ in pool.nodes()})
    capacities = [gpu_memory_bytes(m) for m in models]
    dtype = job.spec.training.dtype
    peaks = [peak_flops(m, dtype) for m in models]
    if None in capacities or None in peaks:
        unknown = [m or "unnamed" for m, c, p in zip(models, capacities, peaks, strict=True) if c is None or p is None]
        raise LayoutSearchError(f"{source}: GPU model {', '.join(unknown)} has no known memory or {dtype} peak; the search "
                                "ranks by modelled step time on known GPUs")
    capacity, peak = min(c for c in capacities if c), min(p for p in peaks if p)
    bandwidths = [gpu_memory_bandwidth(m) for m in models]
    bandwidth = None if None in bandwidths else min(bandwidths)
    try:
        resolved = ResolvedJob.resolve(job.spec)
    except PretrainedConfigError as exc:
        raise LayoutSearchError(f"spec.model.from_pretrained: {exc}") from None
    except UnknownPresetError as exc:
        raise LayoutSearchError(f"spec.model.preset: {exc}") from None
    except LayoutError as exc:
        raise LayoutSearchError(f"spec.parallelism: {exc}") from None
    weights = None if job.spec.model.from_pretrained is None else weights_problem(job.spec.model.from_pretrained)
    if weights:
        raise LayoutSearchError(f"spec.model.from_pretrained: {weights}")
    budget = int(capacity * (1 - headroom))
    search = _Search(job, resolved, pool, world, capacity, budget, peak, bandwidth)
    variants = sorted(search.variants(), key=lambda v: (v.estimate, v.traffic))
    solved = max(top, 1) + 2
    shortlist: dict[tuple[int, ...], _Variant] = {}  # model-parallel shape -> its best variant that is valid and fits
    evaluated = 0
    for variant in variants:
        full = len(shortlist) >= solved
        if full and variant.estimate > max(held.estimate for held in shortlist.values()) * (1 + TIE):
            break
        shape = _shape(variant.body)
        held = shortlist.get(shape)
        if held is None and full:
            continue
        if held is not None and variant.estimate > held.estimate * (1 + TIE):
            continue
        evaluated += 1
        if not search.valid(variant.body):
            continue
        need = search.peak_memory(variant.body).total_bytes
        if need <= budget and (held is None or need < search.peak_memory(held.body).total_bytes):
            shortlist[shape] = variant  # of equal estimates, the one with the most headroom
    if not shortlist:
        raise LayoutSearchError(search.why_none(variants))
    layouts = sorted((search.solved(variant) for variant in shortlist.values()),
                     key=lambda layout: (layout.step.total, layout.memory.total_bytes))
    return SearchResult(
        layouts=layouts[:top], gpus=world, capacity_bytes=capacity, budget_bytes=budget,
        enumerated=len(variants), evaluated=evaluated, solved=len(shortlist), seconds=time.perf_counter() - started,
    )


def _shape(body: JobSpecBody) -> tuple[int, ...]:
    """The model-parallel shape (pp, cp, tp, ep): the search suggests the best data-parallel split of each."""
    par = body.parallelism
    return (par.pp, par.cp, par.tp, par.ep)


def _grid_key(body: JobSpecBody) -> tuple:
    par = body.parallelism
    return (par.pp, par.dp_replicate, par.dp_shard, par.cp, par.tp, par.ep)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


class _Search:
    """The enumeration and the cached estimates of one search."""

    def __init__(self, job: TrainingJob, resolved: ResolvedJob, pool: GpuPool, world: int, capacity: int, budget: int,
                 peak: float, bandwidth: float | None):
        config = resolved.config
        self.job, self.resolved, self.config, self.pool, self.world, self.peak = job, resolved, config, pool, world, peak
        self.bandwidth = bandwidth
        self.capacity, self.budget = capacity, budget
        index = pool.index
        self.tp_limit = index.level_capacity.get("nvlink") or index.level_capacity.get("host", 1)
        seq_len, lora = job.spec.data.seq_len, job.spec.lora  # a LoRA job's frozen weights train cheaper
        self.flops_per_token = training_flops_per_token(config, seq_len, lora)
        self.full_attention_ratio = full_attention_flops_per_token(config, seq_len, lora) / self.flops_per_token
        self._plans: dict[tuple[int, int], ModelPlan] = {}
        self._static: dict[tuple, tuple[list[list[LocalParam]], int, int, int, WorkingCopies]] = {}
        self._above: dict[tuple, tuple[int, int]] = {}
        self._comm: dict[tuple, dict[str, float]] = {}
        self._memory: dict[tuple, MemoryEstimate] = {}
        self._variants: dict[tuple, ResolvedJob] = {}

    # ---- enumeration ---------------------------------------------------------------------------------
    def variants(self) -> Iterator[_Variant]:
        spec = self.job.spec
        for par in self._layouts():
            dp = par.dp
            per_rank, rem = divmod(spec.training.global_batch_size, dp)
            if rem:
                continue
            for micro, ac in product(_powers_of_two(min(per_rank, MAX_MICRO_BATCH)), AC_MODES):
                if per_rank % micro or (par.pp > 1 and per_rank // micro < par.pp):
                    continue
                training = spec.training.model_copy(update={"micro_batch_size": micro, "activation_checkpointing": ac})
                resources = spec.resources.model_copy(update={"gpus": self.world})
                body = spec.model_copy(update={"parallelism": par, "training": training, "resources": resources})
                communication = self.communication_estimate(body)
                step = modelled_step_time(self.config, body, self.peak, communication, memory_bandwidth=self.bandwidth,
                                      flops_per_token=self.flops_per_token)
                yield _Variant(step.total, sum(communication.values()), body)

    def _layouts(self) -> Iterator[ParallelismSpec]:
        config, seq = self.config, self.job.spec.data.seq_len
        for tp in _powers_of_two(min(self.tp_limit, self.world)):
            for cp in _powers_of_two(max(1, seq // MIN_CP_TOKENS)):
                rest, rem = divmod(self.world, tp * cp)
                if rem:
                    continue
                for pp in (p for p in range(1, rest + 1) if rest % p == 0 and config.n_layers % p == 0):
                    schedules = SCHEDULES if pp > 1 else (("1f1b", 1),)
                    for (schedule, virtual), (replicate, shard, zero) in product(schedules, _data_parallel(rest // pp, cp, pp)):
                        if config.n_layers % (pp * virtual):
                            continue
                        for ep in self._expert_degrees(shard * cp):
                            yield ParallelismSpec(
                                tp=tp, cp=cp, pp=pp, dp_replicate=replicate, dp_shard=shard, zero_stage=zero, ep=ep,
                                sequence_parallel=tp > 1, pp_schedule=schedule, pp_virtual_stages=virtual,
                            )

    def _expert_degrees(self, shard_cp: int) -> list[int]:
        moe = self.config.moe
        if moe is None:
            return [1]
        return [e for e in _powers_of_two(shard_cp) if shard_cp % e == 0 and moe.num_experts % e == 0]

    # ---- checks and estimates (cached by what each depends on) ------------------------------------------
    def valid(self, body: JobSpecBody) -> bool:
        job = self.job.model_copy(update={"spec": body})
        if semantic_violations(job, pool_gpus=self.pool.total, check_data=False):
            return False
        return body.model.from_pretrained is None or not model_violations(self.config, job)  # presets: in semantic_violations

    def peak_memory(self, body: JobSpecBody) -> MemoryEstimate:
        """The largest estimate over the first shard of every pipeline stage (as `fit_violations`)."""
        par, training = body.parallelism, body.training
        key = (_grid_key(body), par.zero_stage, par.pp_schedule, par.pp_virtual_stages, training.micro_batch_size,
               training.activation_checkpointing)
        if key not in self._memory:
            variant = self.variant(body)
            plan = self._plan(body)
            estimates = []
            for stage in range(par.pp):
                rank = variant.grid.rank_of(pp=stage)
                parts, *static, working = self._static_bytes(body, rank, stage, plan)
                activations, working_bytes = self._above_state(body, rank, stage, plan, parts, static[1], working)
                estimates.append(MemoryEstimate(rank, *static, activations, working_bytes))
            self._memory[key] = max(estimates, key=lambda m: m.total_bytes)
        return self._memory[key]

    def _plan(self, body: JobSpecBody) -> ModelPlan:
        par = body.parallelism
        key = (par.pp, par.pp_virtual_stages)
        if key not in self._plans:
            self._plans[key] = model_plan(self.config, body)
        return self._plans[key]

    def _static_bytes(self, body: JobSpecBody, rank: int, stage: int,
                      plan: ModelPlan) -> tuple[list[list[LocalParam]], int, int, int, WorkingCopies]:
        """(local parameters, parameter, gradient and optimizer bytes, working copies) of `rank`: they depend
        on the sharding, not on batch or schedule."""
        par = body.parallelism
        key = (par.tp, par.pp, par.pp_virtual_stages, par.dp_shard, par.cp, par.ep, par.zero_stage, par.dp_replicate > 1, stage)
        if key not in self._static:
            variant = self.variant(body)
            parts = local_params(variant, rank, plan)
            working = working_copies(variant, rank, plan, parts)
            self._static[key] = (parts, *state_bytes(variant, rank, parts), working)
        return self._static[key]

    def _above_state(self, body: JobSpecBody, rank: int, stage: int, plan: ModelPlan, parts: list[list[LocalParam]],
                     grads_bytes: int, working: WorkingCopies) -> tuple[int, int]:
        """(activations, working copies) at the step's peak beyond the sharded state."""
        par, training = body.parallelism, body.training
        micro_batches = training.global_batch_size // (par.dp * int(training.micro_batch_size))
        in_flight = micro_batches if par.pp_schedule == "gpipe" else min(micro_batches, par.pp)
        key = (par.tp, par.cp, par.sequence_parallel, par.pp, par.pp_virtual_stages, in_flight, min(in_flight, micro_batches - 1),
               training.micro_batch_size, training.activation_checkpointing, stage, grads_bytes, working,
               effective_mode(par, dtensor_params=par.tp > 1))
        if key not in self._above:
            peak = peak_above_state(self.variant(body), rank, grads_bytes, working, plan, parts)
            self._above[key] = (peak.activations, peak.working)
        return self._above[key]

    def communication_estimate(self, body: JobSpecBody) -> dict[str, float]:
        """Per dimension, the cost model's traffic of the layout (at micro-batch 1) with each group priced
        at the innermost level able to hold its extent in grid order (tp innermost, as the solver keeps
        it): the pre-ranking. Contention and rails are the solver's, for the shortlist."""
        par = body.parallelism
        key = (_grid_key(body), par.zero_stage)
        if key not in self._comm:
            index = self.pool.index
            unit = self.variant(body).with_spec(
                body.model_copy(update={"training": body.training.model_copy(update={"micro_batch_size": 1})}))
            seconds: dict[str, float] = {}
            for entry in job_traffic(unit.grid, self.config, Workload.from_job(unit)):
                first = entry.groups[0]
                extent = first[-1] - first[0] + 1  # a chain of pipeline pairs too: its slowest pair counts
                level = next((lv for lv in LEVELS if index.level_capacity.get(lv, 0) >= extent), index.outermost)
                seconds[entry.dim] = seconds.get(entry.dim, 0.0) + entry.seconds(index.level_bw[level], index.level_latency[level])
            self._comm[key] = seconds
        return self._comm[key]

    def solved(self, variant: _Variant) -> Layout:
        """The variant placed by the solver on the empty cluster, with its plan step time."""
        body = variant.body
        resolved = self.variant(body)
        placement = self.pool.place(resolved, empty=True)
        communication = placement.seconds_by_dim if placement is not None else {}
        step = modelled_step_time(self.config, body, self.peak, communication, memory_bandwidth=self.bandwidth,
                                      flops_per_token=self.flops_per_token)
        tokens = body.training.global_batch_size * body.data.seq_len
        return Layout(body, resolved.grid, self.peak_memory(body), step, tokens / step.total, placement,
                      step.mfu * self.full_attention_ratio)

    def variant(self, body: JobSpecBody) -> ResolvedJob:
        """The resolved job of the layout `body` (its grid derived once per grid, the model reused)."""
        key = _grid_key(body)
        if key not in self._variants:
            self._variants[key] = self.resolved.with_spec(body)
        return replace(self._variants[key], spec=body)

    def why_none(self, variants: list[_Variant]) -> str:
        """Why no layout fits: the smallest estimated need over every valid variant, against the budget."""
        valid = [v for v in variants if self.valid(v.body)]
        gpus = f"{self.world} GPUs of {self.capacity / 2**30:.1f} GiB"
        if not valid:
            return (f"no valid layout of this model on {gpus}: the spec's rules (heads and vocabulary divisible by tp, "
                    f"layers by pp, global_batch_size {self.job.spec.training.global_batch_size} by dp x micro_batch_size) "
                    "leave none; search another GPU count with --gpus N")
        smallest = min(valid, key=lambda v: self.peak_memory(v.body).total_bytes)
        m = self.peak_memory(smallest.body)
        return (f"no layout fits {gpus} with {self.budget / 2**30:.1f} GiB usable (the rest is headroom): the smallest "
                f"estimated need is {m.total_bytes / 2**30:.1f} GiB per rank ({describe(smallest.body)}: parameters "
                f"{m.params_bytes / 2**30:.1f}, gradients {m.grads_bytes / 2**30:.1f}, optimizer {m.optimizer_bytes / 2**30:.1f}, "
                f"activations {m.activations_bytes / 2**30:.1f}, working copies {m.working_bytes / 2**30:.1f} GiB); use more "
                "GPUs, GPUs with more memory, less headroom, or a smaller model, sequence or batch")


def _data_parallel(dp: int, cp: int, pp: int) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero_stage) splits of `dp` data-parallel ranks (ZeRO-2, not 3, under PP)."""
    sharded = 2 if pp > 1 else 3
    if dp == 1:
        return [(1, 1, 0), (1, 1, sharded)] if cp > 1 else [(1, 1, 0)]
    splits = [(1, dp, 3), (1, dp, 2), (dp, 1, 0)] if pp == 1 else [(1, dp, 2), (dp, 1, 0)]
    splits += [(dp // s, s, sharded) for s in _powers_of_two(dp // 2) if s > 1 and dp % s == 0]
    return splits


def describe(body: JobSpecBody) -> str:
    """A layout in one line: the grid, the data-parallel mode, the schedule, micro-batch and checkpointing."""
    par, training = body.parallelism, body.training
    dims = [f"{name}{getattr(par, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep") if getattr(par, name) > 1]
    parts = [" x ".join(dims) or "single rank"]
    if par.dp_shard > 1:
        parts.append({1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP" if par.dp_replicate == 1 else "HSDP"}[par.zero_stage])
    elif par.dp_replicate > 1:
        parts.append("DDP")
    if par.pp > 1:
        parts.append(par.pp_schedule + (f" v{par.pp_virtual_stages}" if par.pp_virtual_stages > 1 else ""))
    parts.append(f"micro-batch {training.micro_batch_size}")
    parts.append(f"AC {training.activation_checkpointing}")
    return ", ".join(parts)
