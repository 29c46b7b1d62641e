"""Activation memory of one training step on one rank: what the step holds at its peak beyond
parameters and optimizer state, as the engine's step runs (trainer.forward_backward).

1. Forward keeps, per micro-batch, what autograd saves in each decoder block (`block_bytes`); under
   bf16 autocast also the bf16 copy of every weight it multiplies (autocast casts each weight once
   per forward and the matmul saves the copy, frozen weights included); then the final norm's and
   the output layer's saved inputs and the logits, which live until backward ends.
2. Backward starts with the loss's temporaries on top: eager, three float32 [tokens, vocab] tensors
   (the log-softmax output, its gradient and the logits' gradient); compiled (`training.compile`
   without TP: engine/loss.py `objectives`), the logits' gradient alone, in their dtype. For a large
   vocabulary this is the step's peak, reached before any gradient exists, unless gradients are
   already held: DDP's bucket views (`gradients_in_buckets`), and from the second micro-batch on
   (gradient accumulation, pipeline schedules).
3. Backward frees each block's saved tensors as its gradients appear: while the blocks run backward
   the forward's tensors are held (a bound); at the end every gradient is held, with at most one
   block's saved tensors (a bound).
4. Activation checkpointing: a checkpointed block keeps only its input; backward recomputes it, with
   the blocks below it still saved, one full block, its weights' copies and (a bound) every gradient.
5. Each phase also holds the data-parallel implementation's working copies of that phase (gathered
   parameters, unsharded gradients, reduce-scatter and broadcast buffers: sizing/working_copies.py),
   and the optimizer step is a phase of its own (every gradient and ZeRO-1's broadcast buffers).

Per token and block, in bytes (`block_bytes`), with d_n = dim (/ tp under sequence parallel), q = heads
x head_dim / tp, f = ffn_dim / tp (an MoE layer: top_k experts, plus the shared one), e = 2 under bf16
and 4 under float32, and s the residual stream's bytes (4: fp32 parameters keep it fp32 under
autocast; 2 under FSDP's bf16 parameters):

- eager: each RMSNorm (computed in float32) saves its float32 input (4 d_n) and, when its weight
  trains, its normalized value (4 d_n); the attention input is cast once per projection under
  autocast (3 e d_n; e d_n otherwise), the feed-forward input likewise (2 e d_n; e d_n); q, the
  GQA-expanded k and v, and the attention output, which is also wo's input (4 e q); w1 x, w3 x, silu(w1 x) and the product
  (4 e f); and small terms (the rotary tables, the attention's log-sum-exp, the norms' statistics).
  qk_norm adds 8 (q + kv) for its two norms. Under LoRA a frozen projection without an adapter saves
  no input (its own cast; w2's input, the product), and each adapter saves its A x (e r).
- `training.compile`: Inductor recomputes the norms and the SwiGLU activation in backward, and saves
  each norm's input (s d_n), one bf16 copy of each norm's output (2 e d_n), q, k, v and the attention
  output (4 e q), and w1 x, w3 x and the product (3 e f).
- a checkpointed block: its input (s d_n).
- `training.fp8` (compiled; layouts/float8.py): the tensors that feed a float8 linear are kept in
  float8 (1 byte) instead of bf16: wo's input (the attention output, q) when wo converts, and two of
  the feed-forward's three saved tensors when w2 converts (2 f). And no bf16 copy of a float8
  linear's weight is made (torchao casts the fp32 weight to float8 itself), so the weight copies above
  leave out every converted linear's (`float8_weight_elements`). Both measured on one H200 with
  llama-1b and llama-3b at seq 2048 and llama-1b at seq 8192 (compiled, tensorwise): the saving is
  (q + 2 f) bytes per token and block plus 2 bytes per converted weight element, to within 1 %
  (docs/benchmarks.md, "GPU: float8"). Not measured: eager float8 (modelled as compiled, weight
  copies only), rowwise, and FSDP's float8 all-gather (the gathered copies are counted in bf16).

llama-1b on one H200 (bf16, 4 x 2048 tokens) measured 66.2 d bytes per token and block eager (this
model: 66 d), 58.2 d under LoRA with every projection adapted (58 d) and about 42 d compiled (44 d):
docs/benchmarks.md, "GPU".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from trainctl.parallelism.layouts.dp_mode import effective_mode, gathers_parameters
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.flops import float8_blocks, float8_weight_elements
from trainctl.parallelism.sizing.working_copies import WorkingCopies
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig

FP32 = 4
LOSS_TEMPORARIES = 3
"""float32 [tokens, vocab] tensors the eager loss adds at the start of backward (module docstring, 2)."""
MATMUL_MODULES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output", "router", "experts", "lora_a", "lora_b")
"""Parameters autocast casts to bf16 (module names; norms and the embedding lookup are not cast)."""


@dataclass(frozen=True)
class Precision:
    """How a job's dtype and data-parallel mode store activations."""

    stream: int
    """Bytes per value of the residual stream between blocks."""
    compute: int
    """Bytes per value of matmul inputs and outputs."""
    autocast: bool
    """Casts at each use: a norm output once per projection it feeds, each weight once per forward."""


def precision(job: JobSpecBody) -> Precision:
    """fp32; bf16 where FSDP2 runs (ZeRO-2 / ZeRO-3 / HSDP, DDP over TP parameters: the parameters
    themselves are gathered in bf16, no weight copies); bf16 autocast over fp32 parameters otherwise
    (the Trainer's `autocast`)."""
    if job.training.dtype != "bfloat16":
        return Precision(stream=FP32, compute=FP32, autocast=False)
    if gathers_parameters(job.parallelism):
        return Precision(stream=2, compute=2, autocast=False)
    return Precision(stream=FP32, compute=2, autocast=True)


def block_bytes(config: ModelConfig, job: JobSpecBody, layer: int) -> float:
    """Bytes autograd saves per token in decoder block `layer`, not checkpointed (module docstring)."""
    par = job.parallelism
    p = precision(job)
    e = p.compute
    d_norm = config.dim / (par.tp if par.sequence_parallel else 1)
    q = config.n_heads * config.head_dim / par.tp
    kv = config.n_kv_heads * config.head_dim / par.tp
    moe = config.moe
    if moe is not None and config.is_moe_layer(layer):
        f = config.ffn_dim * (moe.top_k + (1 if moe.shared_expert else 0))
    else:
        f = config.ffn_dim / par.tp
    if job.training.compile:
        norms = 2 * (p.stream + 2 * e) * d_norm + (FP32 * (q + kv) if config.qk_norm else 0)
        fp8 = float8_blocks(config, job.training.fp8)
        in_float8 = (q if "wo" in fp8 else 0) + (2 * f if "w2" in fp8 and not config.is_moe_layer(layer) else 0)
        return norms + 4 * e * q + 3 * e * f - (e - 1) * in_float8
    lora = job.lora
    trained = {m for m in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") if lora is None or m in lora.target_modules}
    normalized = FP32 if lora is None else 0  # a frozen norm weight needs no saved normalized value
    norms = 2 * (FP32 + normalized) * d_norm + ((FP32 + normalized) * 2 * (q + kv) if config.qk_norm else 0)
    inputs = 0.0  # a projection saves its input only when its weight (or its adapter) trains
    for group in (("wq", "wk", "wv"), ("w1", "w3")):
        saving = len(trained.intersection(group))
        inputs += (saving if p.autocast else min(saving, 1)) * e * d_norm
    attention = 4 * e * q  # q, the expanded k and v, and the output SDPA saves (wo's input is a view of it)
    feed_forward = (3 + ("w2" in trained)) * e * f  # w1 x, w3 x, silu(w1 x); w2's input
    small = FP32 * (config.head_dim + config.n_heads / par.tp + 2)  # rotary tables, log-sum-exp, norm statistics
    adapters = 0 if lora is None else e * lora.rank * len(trained)  # each adapter's A x
    return norms + inputs + attention + feed_forward + small + adapters


def checkpointed_layers(layers: Sequence[int], activation_checkpointing: str) -> list[bool]:
    """Which of `layers` the engine checkpoints: all under `full`, the even-numbered under `selective`."""
    return [activation_checkpointing == "full" or (activation_checkpointing == "selective" and i % 2 == 0) for i in layers]


def gradients_in_buckets(job: JobSpecBody) -> bool:
    """Whether gradients exist before the step's first backward: under DDP and ZeRO-1 they are views of
    buckets allocated with the model. Otherwise (FSDP2, one process) they appear during the first
    backward and are held from the second micro-batch on."""
    par = job.parallelism
    return effective_mode(par, dtensor_params=par.tp > 1) in ("ddp", "zero1") and not gathers_parameters(job.parallelism)


@dataclass(frozen=True)
class StageParams:
    """What the activation model needs of the parameters a rank holds."""

    layers: tuple[int, ...]
    """Decoder layers of the rank's pipeline stages, in forward order."""
    weight_bytes_by_layer: dict[int, int]
    """Bytes of the bf16 copies autocast makes of each layer's matmul weights (local shapes)."""
    output_weight_bytes: int
    """The same for the output layer (0 when the rank has none)."""
    has_output: bool
    has_norm: bool


def stage_params(local: Sequence[tuple[str, tuple[int, ...]]], tied: bool = False) -> StageParams:
    """`StageParams` of the (name, local shape) pairs of a rank's parameters; `tied`: the output layer
    multiplies by the embedding (listed once, as `tok_embeddings.weight`, where a part holds both)."""
    weights: dict[int, int] = {}
    layers: list[int] = []
    output = 0
    has_output = has_norm = False
    embedding: tuple[int, ...] | None = None
    for name, shape in local:
        parts = name.split(".")
        module = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
        copy = 2 * prod(shape) if module in MATMUL_MODULES and len(shape) >= 2 else 0
        if parts[0] == "layers":
            layer = int(parts[1])
            if layer not in weights:
                layers.append(layer)
                weights[layer] = 0
            weights[layer] += copy
        elif parts[0] == "output":
            has_output, output = True, copy
        elif parts[0] == "norm":
            has_norm = True
        elif parts[0] == "tok_embeddings":
            embedding = shape
    if tied and not has_output and has_norm and embedding is not None:  # the head is the embedding
        has_output, output = True, 2 * prod(embedding)
    return StageParams(tuple(layers), weights, output, has_output, has_norm)


@dataclass(frozen=True)
class PeakSplit:
    """A step's peak beyond parameters, every (sharded) gradient and optimizer state, in bytes."""

    activations: int
    working: int
    """The data-parallel working copies held at the peak (sizing/working_copies.py), with gradients held
    unsharded beyond the sharded ones."""


@dataclass(frozen=True)
class Phase:
    """What one moment of a step holds beyond parameters and optimizer state, in bytes."""

    name: str
    grads: int
    """Gradients held: none yet, the sharded ones, or (FSDP under a pipeline schedule) unsharded ones."""
    activations: int
    working: int

    @property
    def total(self) -> int:
        return self.grads + self.activations + self.working


@dataclass(frozen=True)
class StepActivations:
    """The moments of one step on a rank where its peak may come (module docstring)."""

    phases: tuple[Phase, ...]

    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    def peak_above_state(self, grads_bytes: int) -> PeakSplit:
        """The step's peak beyond parameters, every gradient (`grads_bytes`) and optimizer state (0 or
        more: the end of backward holds every gradient), as activations and working copies. Gradients the
        peak holds beyond `grads_bytes` count as working copies; where it holds fewer, the difference
        comes off its activations, then its working copies."""
        peak = self.peak()
        short = grads_bytes - peak.grads
        if short <= 0:
            return PeakSplit(activations=peak.activations, working=peak.working - short)
        activations = max(0, peak.activations - short)
        return PeakSplit(activations=activations, working=max(0, peak.working - (short - peak.activations + activations)))


def step_activations(resolved: ResolvedJob, rank: int, stage: StageParams, grads_bytes: int,
                     working: WorkingCopies) -> StepActivations:
    """The activation memory of `rank` (holding `stage`, with `grads_bytes` of gradients and the
    data-parallel implementation's `working` copies) over one step."""
    config, job, grid = resolved.config, resolved.spec, resolved.grid
    par, training = job.parallelism, job.training
    pp_rank = grid.coords(rank)["pp"]
    p = precision(job)
    tokens = int(training.micro_batch_size) * job.data.seq_len // par.cp
    d_norm = config.dim / (par.tp if par.sequence_parallel else 1)
    vocab = config.vocab_size / par.tp
    checkpointed = checkpointed_layers(stage.layers, training.activation_checkpointing)
    full = [block_bytes(config, job, layer) * tokens for layer in stage.layers]
    kept = [p.stream * d_norm * tokens if c else b for c, b in zip(checkpointed, full, strict=True)]
    copies = [stage.weight_bytes_by_layer[layer] - p.compute * float8_weight_elements(config, job.training.fp8, layer) / job.parallelism.tp if p.autocast else 0
              for layer in stage.layers]
    kept_copies = sum(c for c, ckpt in zip(copies, checkpointed, strict=True) if not ckpt)
    output = 0.0
    loss = 0.0
    if stage.has_output:
        final_norm = (p.stream + 2 * p.compute) * d_norm if training.compile else (FP32 + (0 if job.lora else FP32)) * d_norm
        output = tokens * (final_norm * stage.has_norm + p.compute * config.dim + p.compute * vocab)
        output += stage.output_weight_bytes if p.autocast else 0
        compiled_loss = training.compile and par.tp == 1  # engine/loss.py `objectives`
        loss = (p.compute if compiled_loss else LOSS_TEMPORARIES * FP32) * vocab * tokens
    forward = sum(kept) + kept_copies + output
    n_micro = training.global_batch_size // (grid.dp * int(training.micro_batch_size))
    in_flight = 1 if par.pp == 1 else (n_micro if par.pp_schedule == "gpipe" else min(n_micro, par.pp - pp_rank))
    earlier = (in_flight - 1) * forward
    grads_held = working.unsharded_grads or grads_bytes  # what every gradient takes once it exists
    w = working
    first = in_flight * forward  # the step's first backward: no gradient yet, but DDP's buckets
    phases = [
        Phase("backward start", grads_bytes if gradients_in_buckets(job) else 0, int(first + loss), w.backward_start),
        Phase("blocks' backward", grads_bytes if gradients_in_buckets(job) else 0, int(first), w.blocks),
        Phase("backward end", grads_held, int(earlier + max(full, default=0)), w.backward_end),
        Phase("optimizer step", grads_bytes, 0, w.optimizer),
    ]
    if n_micro > 1:  # the next backward: every gradient, one forward fewer once the schedule runs out of micro-batches
        later = min(in_flight, n_micro - 1) * forward
        phases += [Phase("next backward start", grads_held, int(later + loss), w.backward_start),
                   Phase("next blocks' backward", grads_held, int(later), w.blocks)]
    recompute = max((sum(kept[:i]) + full[i] + copies[i] for i, c in enumerate(checkpointed) if c), default=None)
    if recompute is not None:
        phases.append(Phase("recompute", grads_held, int(earlier + recompute), w.blocks))
    if w.reduction:
        phases.append(Phase("deferred reduction", 0, 0, w.reduction))
    return StepActivations(tuple(phases))
