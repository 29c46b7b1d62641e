"""Per-rank memory and per-step FLOPs of a job, without building it.

Parameters, gradients and optimizer state are computed from the exact local shape of every parameter
on the rank, following what the engine does (formulas in docs/engine.md):

1. Full shapes from the configuration (`full_shapes`; no module is built).
2. Pipeline: the rank keeps the layers of its stages (pipeline.balanced_split), the embedding on the
   first stage, the final norm and output on the last (tied embeddings: one matrix without PP, a
   copy on the first and on the last stage with PP).
3. Tensor parallel (tensor_parallel's plan): wq, wk, wv (and their biases), w1, w3, tok_embeddings and
   output are split on dim 0, wo and w2 on dim 1; norms (q/k norms too) and MoE layers are replicated
   across TP ranks.
4. Expert parallel: the experts' stacked weights are split on dim 0 (experts) over the EP group.
5. FSDP / ZeRO-2 / HSDP (`fully_shard`): every dense parameter is split on dim 0 over dp_shard x cp;
   FSDP2 pads dim 0 to a multiple of the shard count, so parameter and gradient storage is
   ceil(rows / S) rows on every rank, while optimizer state follows the unpadded local rows.
   DDP and ZeRO-1 keep full parameters and gradients (DDP's gradient buckets are the gradients).
   What the step holds beyond this sharded state (FSDP's gathered parameters, unsharded gradients
   and reduce-scatter buffers, ZeRO-1's broadcast buffers) is `working_bytes` (sizing/working_copies.py).
6. Optimizer state per local parameter: AdamW 2 fp32 moments + a 4-byte step; SGD one momentum
   buffer; Adafactor row and column factors (or a full variance for vectors) + a 4-byte step.
   ZeRO-1 keeps state only for the parameters its rank owns (data_parallel.partition_sizes).
7. LoRA: each adapted projection gains `lora_a` [r, in] and `lora_b` [out, r] (lora.target_names);
   only adapters have gradients and optimizer state, the frozen weights are parameters only.

Master weights, gradients and optimizer state are float32 whatever the compute dtype. Activations
and working copies are modelled (sizing/activations.py, sizing/working_copies.py), not exact;
`MemoryEstimate.total_bytes` is the step's peak.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import ceil, prod

from trainctl.parallelism.layouts.dp_mode import effective_mode, gathers_parameters, partition_sizes
from trainctl.parallelism.layouts.stage_split import balanced_split, local_stage_indices
from trainctl.parallelism.model.lora_names import PARENTS, is_adapter
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing import activations
from trainctl.parallelism.sizing.flops import training_flops_per_token
from trainctl.parallelism.sizing.working_copies import (
    FsdpUnit,
    PartUnits,
    WorkingCopies,
    fsdp_working_copies,
    zero1_working_copies,
)
from trainctl.spec.job import JobSpecBody, LoRASpec
from trainctl.spec.presets import ModelConfig

FP32 = 4
TP_DIM0 = ("wq", "wk", "wv", "w1", "w3", "tok_embeddings", "output")
TP_DIM1 = ("wo", "w2")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a step (parameters, gradients and optimizer state are exact
    on CPU fp32)."""

    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    """The peak's activations beyond the other four (`peak_above_state`): when the peak comes before
    every gradient exists, the gradients are counted in full and this part is less them."""
    working_bytes: int = 0
    """What the data-parallel implementation holds at the peak beyond the sharded state: gathered
    parameters, unsharded gradients, communication buffers (sizing/working_copies.py)."""

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.working_bytes


@dataclass(frozen=True)
class LocalParam:
    """One parameter as a rank stores it."""

    name: str
    storage_shape: tuple[int, ...]
    """Shape of the storage behind it (padded under FSDP)."""
    shape: tuple[int, ...]
    """Shape of the rank's local values (what optimizer state is shaped like)."""
    full_shape: tuple[int, ...]
    """Shape before the data-parallel split (after TP and EP): what FSDP all-gathers, unpadded."""
    dense: bool
    """Data-parallel parameter (False for expert-parallel experts)."""
    trainable: bool = True
    """Has a gradient and optimizer state (False for weights LoRA freezes)."""


def _block_shapes(config: ModelConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name within the block, full shape) of decoder layer `layer`'s parameters, in module order."""
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("attention_norm.weight", (d,))]
    for proj, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads), ("wv", config.n_kv_heads)):
        shapes.append((f"attention.{proj}.weight", (heads * hd, d)))
        if config.qkv_bias:
            shapes.append((f"attention.{proj}.bias", (heads * hd,)))
    if config.qk_norm:
        shapes += [("attention.q_norm.weight", (hd,)), ("attention.k_norm.weight", (hd,))]
    shapes += [("attention.wo.weight", (d, config.n_heads * hd)), ("ffn_norm.weight", (d,))]
    moe = config.moe
    if moe is None or not config.is_moe_layer(layer):
        return [*shapes, ("feed_forward.w1.weight", (f, d)), ("feed_forward.w2.weight", (d, f)), ("feed_forward.w3.weight", (f, d))]
    shapes += [
        ("moe.router.weight", (moe.num_experts, d)),
        ("moe.experts.w1", (moe.num_experts, d, f)),
        ("moe.experts.w2", (moe.num_experts, f, d)),
        ("moe.experts.w3", (moe.num_experts, d, f)),
    ]
    if moe.shared_expert:
        shapes += [("moe.shared_expert.w1.weight", (f, d)), ("moe.shared_expert.w2.weight", (d, f)), ("moe.shared_expert.w3.weight", (f, d))]
    return shapes


def full_shapes(config: ModelConfig, lora: LoRASpec | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, by name, in the order of `Transformer(config).named_parameters()`,
    LoRA adapters right after the weight they adapt. `output.weight` is listed also when tied to the
    embedding (a pipeline's last stage holds its own copy; `_stage_names` drops it where it is shared).

    Computed from the configuration (the model is never built): cost is linear in n_layers, whatever
    the sizes (tests/parallelism/test_estimator.py checks it against the model on the meta device)."""
    adapted = {f"{PARENTS[t]}.{t}" for t in lora.target_modules} if lora is not None else set()
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, config.dim)}
    for layer in range(config.n_layers):
        block = _block_shapes(config, layer)
        for i, (name, shape) in enumerate(block):
            shapes[f"layers.{layer}.{name}"] = shape
            module = name.rsplit(".", 1)[0]
            last_of_module = i + 1 == len(block) or block[i + 1][0].rsplit(".", 1)[0] != module
            if module in adapted and last_of_module:  # adapters follow the weight (and bias) they adapt
                out_features, in_features = dict(block)[f"{module}.weight"]
                shapes[f"layers.{layer}.{module}.lora_a"] = (lora.rank, in_features)
                shapes[f"layers.{layer}.{module}.lora_b"] = (out_features, lora.rank)
    shapes["norm.weight"] = (config.dim,)
    shapes["output.weight"] = (config.vocab_size, config.dim)
    return shapes


def _module_of(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


@dataclass(frozen=True)
class ModelPlan:
    """What the estimates of every rank share: each parameter's full shape by name (`full_shapes`, with
    the job's LoRA adapters) and the layers of each pipeline stage. Estimating many ranks, compute it
    once (`model_plan`) and pass it on."""

    shapes: Mapping[str, tuple[int, ...]]
    stage_layers: tuple[range, ...]
    tied: bool = False
    """The output head is the embedding (one parameter where a part holds both)."""


def model_plan(config: ModelConfig, job: JobSpecBody) -> ModelPlan:
    """The `ModelPlan` of a model under a job's LoRA and pipeline settings."""
    par = job.parallelism
    stages = balanced_split(config.n_layers, par.pp * par.pp_virtual_stages) if par.pp > 1 else [range(config.n_layers)]
    return ModelPlan(shapes=full_shapes(config, job.lora), stage_layers=tuple(stages), tied=config.tie_embeddings)


def _stage_names(plan: ModelPlan, job: JobSpecBody, pp_rank: int) -> list[list[str]]:
    """The parameter names of each model part (pipeline chunk) this pipeline rank holds."""
    par = job.parallelism
    names = list(plan.shapes)
    if par.pp == 1:
        return [[name for name in names if not (plan.tied and name == "output.weight")]]
    num_stages = par.pp * par.pp_virtual_stages
    ranges = plan.stage_layers
    out = []
    for s in local_stage_indices(pp_rank, par.pp, par.pp_virtual_stages):
        layers = {str(i) for i in ranges[s]}
        keep = []
        for name in names:
            head = name.split(".")[0]
            if head == "layers":
                if name.split(".")[1] in layers:
                    keep.append(name)
            elif head == "tok_embeddings":
                if s == 0:
                    keep.append(name)
            elif s == num_stages - 1:
                keep.append(name)
        out.append(keep)
    return out


def _split(shape: tuple[int, ...], dim: int, ways: int) -> tuple[int, ...]:
    if shape[dim] % ways:
        raise ValueError(f"dimension {dim} of a parameter of shape {shape} is not divisible by {ways}")
    return (*shape[:dim], shape[dim] // ways, *shape[dim + 1 :])


def local_params(resolved: ResolvedJob, rank: int, plan: ModelPlan | None = None) -> list[list[LocalParam]]:
    """Per model part on `rank`, every parameter's local shape under the job's layout."""
    config, job, grid = resolved.config, resolved.spec, resolved.grid
    par = job.parallelism
    coords = grid.coords(rank)
    plan = plan or model_plan(config, job)
    shapes = plan.shapes
    fsdp = gathers_parameters(job.parallelism)
    shard_group = grid.group(("dp_shard", "cp"), rank)
    n_shard, shard_index = len(shard_group), shard_group.index(rank)
    parts = []
    for names in _stage_names(plan, job, coords["pp"]):
        part = []
        for name in names:
            shape = shapes[name]
            module = _module_of(name)
            is_expert = ".moe.experts." in name
            in_moe = ".moe." in name
            if par.tp > 1 and not in_moe:
                if module in TP_DIM0:
                    shape = _split(shape, 0, par.tp)
                elif module in TP_DIM1:
                    shape = _split(shape, 1, par.tp)
            if is_expert and par.ep > 1:
                shape = _split(shape, 0, par.ep)
            dense = not (is_expert and par.ep > 1)
            full, storage = shape, shape
            if fsdp and dense and n_shard > 1:
                rows = ceil(shape[0] / n_shard)
                storage = (rows, *shape[1:])
                mine = max(0, min(rows, shape[0] - shard_index * rows))
                shape = (mine, *shape[1:])
            trainable = job.lora is None or is_adapter(name)
            part.append(LocalParam(name=name, storage_shape=storage, shape=shape, full_shape=full, dense=dense,
                                   trainable=trainable))
        parts.append(part)
    return parts


def optimizer_state_bytes(shape: tuple[int, ...], optimizer: str, momentum: float) -> int:
    """Bytes of optimizer state for one local parameter of `shape` (float32)."""
    numel = prod(shape)
    if optimizer == "adamw":
        return 2 * numel * FP32 + FP32
    if optimizer == "sgd":
        return numel * FP32 if momentum > 0 else 0
    if optimizer == "adafactor":
        if len(shape) > 1:
            return (prod(shape[:-1]) + prod(shape[:-2]) * shape[-1]) * FP32 + FP32
        return numel * FP32 + FP32
    raise ValueError(f"unknown optimizer {optimizer!r}")


def _owners(dense: list[LocalParam], n_shard: int) -> list[int]:
    """ZeRO-1's owner of each dense trainable parameter, as `ZeroOneSharding` partitions them."""
    return partition_sizes([prod(p.shape) for p in dense], n_shard)


def _units(part: list[LocalParam], n_shard: int) -> PartUnits:
    """The `fully_shard` units of a part: one per decoder block, and the root (everything else);
    expert-parallel experts are left out (FSDP ignores them)."""
    blocks: dict[str, list[LocalParam]] = {}
    root: list[LocalParam] = []
    for p in part:
        if p.dense:
            (blocks.setdefault(p.name.split(".")[1], []) if p.name.startswith("layers.") else root).append(p)

    def unit(params: list[LocalParam]) -> FsdpUnit:
        trained = [p for p in params if p.trainable]
        return FsdpUnit(gathered=sum(prod(p.storage_shape) for p in params) * n_shard,
                        grads=sum(prod(p.full_shape) for p in trained),
                        reduced=sum(prod(p.storage_shape) for p in trained) * n_shard)

    return PartUnits(blocks=tuple(unit(b) for b in blocks.values()), root=unit(root))


def working_copies(resolved: ResolvedJob, rank: int, plan: ModelPlan | None = None,
                   parts: list[list[LocalParam]] | None = None) -> WorkingCopies:
    """What the data-parallel implementation holds on `rank` beyond its sharded state, per phase of the
    step (sizing/working_copies.py); `parts`: `local_params` of the rank when already computed."""
    job = resolved.spec
    plan = plan or model_plan(resolved.config, job)
    parts = parts if parts is not None else local_params(resolved, rank, plan)
    par = job.parallelism
    n_shard = par.dp_shard * par.cp
    if gathers_parameters(job.parallelism):
        return fsdp_working_copies(job, [_units(part, n_shard) for part in parts])
    if effective_mode(par, dtensor_params=par.tp > 1) != "zero1":
        return WorkingCopies()
    owner_bytes = []
    for part in parts:
        dense = [p for p in part if p.trainable and p.dense]
        per_owner = [0] * n_shard
        for p, o in zip(dense, _owners(dense, n_shard), strict=True):
            per_owner[o] += prod(p.shape) * FP32
        owner_bytes.append(per_owner)
    return zero1_working_copies(owner_bytes)


def peak_above_state(resolved: ResolvedJob, rank: int, grads_bytes: int, working: WorkingCopies,
                     plan: ModelPlan | None = None, parts: list[list[LocalParam]] | None = None) -> activations.PeakSplit:
    """What the step holds on `rank` at its peak beyond parameters, its `grads_bytes` of gradients and
    optimizer state, as activations (sizing/activations.py: saved activations, autocast's weight copies,
    logits and the loss's temporaries) and `working` copies, less the gradients not yet allocated when
    the peak comes before them; `parts`: `local_params` of the rank when already computed."""
    plan = plan or model_plan(resolved.config, resolved.spec)
    parts = parts if parts is not None else local_params(resolved, rank, plan)
    return _peak_of(resolved, rank, parts, plan, grads_bytes, working)


def _peak_of(resolved: ResolvedJob, rank: int, parts: list[list[LocalParam]], plan: ModelPlan,
             grads_bytes: int, working: WorkingCopies) -> activations.PeakSplit:
    stage = activations.stage_params([(p.name, p.storage_shape) for part in parts for p in part], tied=plan.tied)
    return activations.step_activations(resolved, rank, stage, grads_bytes, working).peak_above_state(grads_bytes)


def state_bytes(resolved: ResolvedJob, rank: int, parts: list[list[LocalParam]]) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes of `rank` holding `parts` (its `local_params`)."""
    job = resolved.spec
    par = job.parallelism
    train = job.training
    mode = effective_mode(par, dtensor_params=par.tp > 1)
    n_shard = par.dp_shard * par.cp
    shard_index = resolved.grid.group(("dp_shard", "cp"), rank).index(rank)
    params = grads = optim = 0
    for part in parts:
        params += sum(prod(p.storage_shape) * FP32 for p in part)
        trained = [p for p in part if p.trainable]
        grads += sum(prod(p.storage_shape) * FP32 for p in trained)
        owned = trained
        if mode == "zero1":
            dense = [p for p in trained if p.dense]
            owner = _owners(dense, n_shard)
            owned = [p for p, o in zip(dense, owner, strict=True) if o == shard_index] + [p for p in trained if not p.dense]
        optim += sum(optimizer_state_bytes(p.shape, train.optimizer, train.beta1) for p in owned)
    return params, grads, optim


def estimate_memory(resolved: ResolvedJob, rank: int, plan: ModelPlan | None = None) -> MemoryEstimate:
    """Bytes of parameters, gradients, optimizer state, activations and working copies on `rank` at
    the step's peak (`plan` computed here when not given)."""
    plan = plan or model_plan(resolved.config, resolved.spec)
    parts = local_params(resolved, rank, plan)
    params, grads, optim = state_bytes(resolved, rank, parts)
    peak = _peak_of(resolved, rank, parts, plan, grads, working_copies(resolved, rank, plan, parts))
    return MemoryEstimate(
        rank=rank,
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=optim,
        activations_bytes=peak.activations,
        working_bytes=peak.working,
    )


def estimate_all(resolved: ResolvedJob, ranks: Iterable[int] | None = None) -> list[MemoryEstimate]:
    """`estimate_memory` of `ranks` (default every rank), in that order, sharing one `ModelPlan`."""
    plan = model_plan(resolved.config, resolved.spec)
    chosen = range(resolved.grid.world_size) if ranks is None else ranks
    return [estimate_memory(resolved, r, plan) for r in chosen]


def flops_per_step(config: ModelConfig, job: JobSpecBody) -> int:
    """Training FLOPs of one optimizer step over all ranks (flops.training_flops_per_token x tokens; a LoRA
    job's frozen weights count as frozen)."""
    tokens = job.training.global_batch_size * job.data.seq_len
    return training_flops_per_token(config, job.data.seq_len, job.lora) * tokens
