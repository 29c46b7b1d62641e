"""Pipeline parallelism: balanced stage splitting and a runner over `torch.distributed.pipelining`.

Splitting. The model is cut into `pp x virtual_stages` contiguous stages; the token embedding and the
final norm + output projection each count as one layer-equivalent (`embedding_cost`, `output_cost`),
and the split minimises the most expensive stage (ties: the most even split). Stage `s` runs on
pipeline rank `s % pp` (looped placement: interleaved 1F1B and interleaved zero-bubble). A stage is a
shallow copy of the full model that keeps the parent's sub-modules for its own layers under their
original names (`layers.5` stays `layers.5`), with `tok_embeddings` / `norm` / `output` set to None
where absent, so TP plans, FSDP and checkpoints see the same names as on the full model.

Schedules (spec `pp_schedule`): `gpipe` (ScheduleGPipe), `1f1b` (Schedule1F1B), `interleaved_1f1b`
(ScheduleInterleaved1F1B, >= 2 virtual stages per rank) and `zero_bubble`
(ScheduleInterleavedZeroBubble, the ZB-H1 split of backward into input and weight gradients, with
one or more stages per rank). All four run on CPU / gloo with torch 2.13.

Loss. Each micro-batch's loss is the mean over its tokens (plus the MoE aux loss of that
micro-batch), the schedule backpropagates each and divides gradients by the number of micro-batches,
so gradients and the returned loss equal the single-process mean over the rank's batch. For MoE
models every stage returns `(hidden, aux)` where `aux` is the running sum of the MoE layers'
aux-loss states (`moe.AuxLoss`: their scaled losses, or for the `transformers` convention their
per-expert router statistics, which the loss needs over all layers together) of the micro-batch so
far; the last stage adds `AuxLoss.value` of it to the language-model loss, and its gradient flows
back through the pipeline to every stage's routers.

Evaluation (`PipelineRunner.evaluate`) runs the same schedule forward only (its `eval`, which every
schedule above supports) and leaves the aux loss out of the returned loss.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainctl.parallelism.layouts.stage_split import (
    PipelineLayoutError,
    balanced_split,
    local_stage_indices,
    stage_rank,
)
from trainctl.parallelism.model.moe import AuxLoss, aux_loss_of, pop_aux_state

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
"""Pipeline schedule names, as in the spec's `parallelism.pp_schedule`."""

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class PipelineChunk:
    """One stage this rank runs: its global index and its part of the model."""

    index: int
    num_stages: int
    module: nn.Module

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def _stage_view(model: nn.Module, layer_ids: range, first: bool, last: bool) -> nn.Module:
    """A shallow copy of `model` holding only `layer_ids` (same sub-module objects, same names)."""
    for part in ("tok_embeddings", "layers", "norm", "output"):
        if not hasattr(model, part):
            raise PipelineLayoutError(f"the model has no {part!r} sub-module; pipeline splitting needs the decoder's names")
    stage = copy.copy(model)
    # Fresh containers (sub-modules, parameters, buffers, hook tables): stages of one model are independent.
    stage.__dict__.update({k: copy.copy(v) for k, v in model.__dict__.items() if isinstance(v, dict)})
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def split_pipeline_stages(
    model: nn.Module,
    *,
    pp_rank: int,
    pp: int,
    virtual_stages: int = 1,
    embedding_cost: float = 1.0,
    output_cost: float = 1.0,
) -> list[PipelineChunk]:
    """This rank's stages of the full `model`, which the caller then discards (stages share its modules)."""
    if virtual_stages < 1:
        raise PipelineLayoutError(f"virtual_stages must be >= 1, got {virtual_stages}")
    num_stages = pp * virtual_stages
    ranges = balanced_split(
        len(model.layers), num_stages, embedding_cost=embedding_cost, output_cost=output_cost
    )
    return [
        PipelineChunk(index=s, num_stages=num_stages, module=_stage_view(model, ranges[s], s == 0, s == num_stages - 1))
        for s in local_stage_indices(pp_rank, pp, virtual_stages)
    ]


# ---- running ---------------------------------------------------------------------------------------
class AuxCarrier:
    """Makes a stage of an MoE model carry the micro-batch's summed aux-loss state to the next stage.

    Forward hooks on the stage module (so DDP / FSDP wrappers stay visible to the schedule): the
    pre-hook takes `(hidden, aux)` from the previous stage and passes `hidden` on; the post-hook
    returns `(output, aux + this stage's MoE layers' states)`. The first stage starts at zero.
    """

    def __init__(self, module: nn.Module, aux: AuxLoss):
        self._aux = aux
        self._incoming: Tensor | None = None
        module.register_forward_pre_hook(self._before, prepend=True)
        module.register_forward_hook(self._after)

    def _before(self, module: nn.Module, args: tuple) -> tuple | None:
        if len(args) == 2:
            hidden, self._incoming = args
            return (hidden,)
        self._incoming = None
        return None

    def _after(self, module: nn.Module, args: tuple, output: Tensor) -> tuple[Tensor, Tensor]:
        total = self._incoming
        self._incoming = None
        if total is None:
            total = self._aux.zero_state(output.device)
        local = pop_aux_state(module)
        return output, total if local is None else total + local


class PipelineRunner:
    """Runs one optimizer step's forward and backward through the pipeline schedule.

    `step(tokens, labels)` takes this data-parallel rank's whole batch ([batch, seq], the same on
    every pipeline rank of the group), splits it into `n_microbatches`, runs the schedule and
    returns the mean loss over the batch (language-model loss plus MoE aux loss) on every pipeline
    rank (broadcast from the last stage). Gradients are left in `.grad` of the chunks' parameters,
    already divided by the number of micro-batches; the caller reduces over data parallel, clips
    and steps the optimizer.
    """

    def __init__(
        self,
        chunks: list[PipelineChunk],
        *,
        schedule: str,
        n_microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: LossFn,
    ):
        if schedule not in SCHEDULES:
            raise PipelineLayoutError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        if not chunks:
            raise PipelineLayoutError("a pipeline rank needs at least one stage")
        pp = dist.get_world_size(group)
        if n_microbatches < pp:
            raise PipelineLayoutError(f"{n_microbatches} micro-batches cannot fill a {pp}-stage pipeline (need >= pp)")
        multi = schedule in ("interleaved_1f1b", "zero_bubble")
        if not multi and len(chunks) != 1:
            raise PipelineLayoutError(f"schedule {schedule!r} runs one stage per rank, got {len(chunks)}")
        if schedule == "interleaved_1f1b" and len(chunks) < 2:
            raise PipelineLayoutError("interleaved_1f1b needs at least 2 virtual stages per rank")

        self.chunks = chunks
        self.group = group
        self.n_microbatches = n_microbatches
        self.is_first = any(c.is_first for c in chunks)
        self.is_last = any(c.is_last for c in chunks)
        self._last_rank = dist.get_global_rank(group, stage_rank(chunks[0].num_stages - 1, pp))
        self._device = device
        aux = next((found for c in chunks if (found := aux_loss_of(c.module)) is not None), None)
        self._with_aux = True  # False while `evaluate` runs: an eval loss leaves the MoE aux loss out

        def stage_loss(output: Tensor | tuple[Tensor, Tensor], labels: Tensor) -> Tensor:
            if aux is not None:
                logits, state = output
                return loss_fn(logits, labels) + aux.value(state) if self._with_aux else loss_fn(logits, labels)
            return loss_fn(output, labels)

        self._carriers = [AuxCarrier(c.module, aux) for c in chunks] if aux is not None else []
        # Imported here, by pipelined jobs only: it loads torch._dynamo, about 1 s of CPU that every rank
        # of every other job would pay at start.
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        stages = [PipelineStage(c.module, c.index, c.num_stages, device, group=group) for c in chunks]
        if schedule == "gpipe":
            self.schedule = ScheduleGPipe(stages[0], n_microbatches, loss_fn=stage_loss)
        elif schedule == "1f1b":
            self.schedule = Schedule1F1B(stages[0], n_microbatches, loss_fn=stage_loss)
        elif schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=stage_loss)
        else:
            self.schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches, loss_fn=stage_loss)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter of this rank's stages."""
        return [p for c in self.chunks for p in c.module.parameters()]

    def step(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """Forward + backward of one batch; returns the detached mean loss on every pipeline rank."""
        return self._run(self.schedule.step, tokens, labels)

    def evaluate(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """Forward only (the schedule's `eval`, every schedule here supports it) of one batch; returns
        the mean language-model loss (MoE aux losses left out) on every pipeline rank."""
        self._with_aux = False
        try:
            return self._run(self.schedule.eval, tokens, labels)
        finally:
            self._with_aux = True

    def _run(self, run: Callable[..., object], tokens: Tensor, labels: Tensor) -> Tensor:
        if tokens.shape[0] % self.n_microbatches:
            raise PipelineLayoutError(
                f"batch of {tokens.shape[0]} sequences is not divisible into {self.n_microbatches} micro-batches"
            )
        losses: list[Tensor] = []
        args = (tokens.to(self._device),) if self.is_first else ()
        target = labels.to(self._device) if self.is_last else None
        run(*args, target=target, losses=losses, return_outputs=False)
        if self.is_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            loss = torch.zeros((), device=self._device, dtype=torch.float32)
        dist.broadcast(loss, src=self._last_rank, group=self.group)
        return loss
