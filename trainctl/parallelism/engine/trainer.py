"""The training loop: one Trainer per rank, the same under torchrun, multiprocessing and a RankWorker.

Conventions that make every layout compute what one process computes:

- Every rank computes the mean cross-entropy over its local tokens for each micro-batch; the step's
  objective is the mean over its `n_micro` micro-batches (gradient accumulation). MoE layers' aux
  losses are added per micro-batch. With a loss mask (chat data) the cross-entropy is instead the sum
  over the global batch's covered targets divided by their count (engine/loss.py).
- Gradients are averaged over dp_replicate x dp_shard x cp (data_parallel); TP peers hold one shard of
  the same gradient; pipeline stages hold disjoint parameters.
- The reported loss is the global mean of that objective (cross-entropy + MoE aux), all-reduced
  (under PP every pipeline rank holds the last stage's value).
- The global gradient norm is taken over every shard and stage before clipping (optim.clip_gradients).
- bf16: autocast around forward (or FSDP2's bf16 all-gather), fp32 master weights, optimizer state and
  gradient reductions.

The process group (world_size > 1) must be initialised before constructing a Trainer
(`distributed.init_distributed`).

Every file the Trainer opens on the job's behalf (config.json, weights, `init_from`'s checkpoint, data,
tokenizer) is opened under `file_rule` (trainctl.spec.files): the service's rule for the job on its
ranks, the default (bounded reads, index entries kept in their directories) elsewhere. A file the rule
refuses raises `FileRuleError` before it is read, a configuration error like `ConfigurationError`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from trainctl.parallelism.checkpoint import dcp as ckpt
from trainctl.parallelism.checkpoint import pretrained
from trainctl.parallelism.checkpoint.memory_snapshots import SnapshotStore
from trainctl.parallelism.data.corpus import MicroBatch, ShardedLoader
from trainctl.parallelism.data.dataset import build_dataset
from trainctl.parallelism.data.token_shards import PrefetchLoader, build_loader
from trainctl.parallelism.engine import efficiency
from trainctl.parallelism.engine.distributed import resolve_device
from trainctl.parallelism.engine.evaluation import Evaluator, evaluation_dataset, training_holdout
from trainctl.parallelism.engine.loss import masked_loss_scale, objectives
from trainctl.parallelism.engine.model_setup import build_parallel_model
from trainctl.parallelism.engine.optim import build_optimizer, build_scheduler, clip_gradients
from trainctl.parallelism.engine.phase_timer import PhaseTimer
from trainctl.parallelism.engine.run_state import RunState, Templates
from trainctl.parallelism.engine.step_checkpoints import StepCheckpoints
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.parallelism.engine.step_reporting import StepReporter
from trainctl.parallelism.engine.step_snapshots import StepSnapshots
from trainctl.parallelism.errors import ConfigurationError
from trainctl.parallelism.layouts import float8
from trainctl.parallelism.layouts.context_parallel import shard_batch_for_cp
from trainctl.parallelism.layouts.dp_mode import gathers_parameters
from trainctl.parallelism.layouts.expert_parallel import reduce_expert_gradients
from trainctl.parallelism.layouts.mesh import ParallelMesh, build_mesh
from trainctl.parallelism.layouts.pipeline import PipelineRunner
from trainctl.parallelism.layouts.tensor_parallel import loss_context
from trainctl.parallelism.model.moe import pop_aux_loss
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.spec.files import FileRule
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import PretrainedConfigError

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run did, returned by `Trainer.run` on every rank."""

    steps_completed: int
    """The optimizer step count at the end (including steps before a resume)."""
    final_loss: float | None
    """Loss of the last step run, None when no step ran."""
    losses: list[float]
    """Loss of every step run in this session, in order."""
    tokens_seen: int
    """Tokens trained in this session."""
    wall_seconds: float
    """Duration of `run`."""
    resumed_from_step: int | None
    """Step of the checkpoint the run resumed from, None for a fresh start."""
    last_checkpoint: str | None
    """Path of the newest complete checkpoint written, None if none."""
    stopped_on_request: bool = False
    """Whether the run ended before `training.steps` because a stop was requested (`stop_requested`)."""


def check_world(job: JobSpecBody, world_size: int) -> None:
    """The layout's rank count is `world_size`, and a process group of that size exists when it is > 1."""
    if job.parallelism.world_size != world_size:
        raise ValueError(
            f"spec.parallelism: the layout needs {job.parallelism.world_size} ranks but world_size is {world_size}"
        )
    if world_size > 1 and not (dist.is_initialized() and dist.get_world_size() == world_size):
        raise RuntimeError(f"world_size {world_size} needs an initialised process group of that size")


def resolved_job(job: JobSpecBody, files: FileRule) -> ResolvedJob:
    """`job` with its grid and the model shape it trains; a `from_pretrained` config.json that cannot be
    used (or that `files` refuses) is a ConfigurationError naming the field."""
    try:
        return ResolvedJob.resolve(job, files)
    except PretrainedConfigError as exc:
        raise ConfigurationError(f"spec.model.from_pretrained: {exc}") from None


class Trainer:
    """Builds the model, layout, optimizer and data for one rank, and runs the loop.

    Setup, in order (each a method): check the world, resolve the micro-batch size, build the device
    mesh, build the model and parallelize it, build the optimizers, confirm the micro-batch size, write
    the run spec, build the data loader, build the pipeline runner. Resuming happens in `run`.

    ``file_rule``: where the job's files may lie and how much of each is read (module docstring).
    ``on_step`` (rank 0) gets a StepReport for every ``log_interval``-th step, the last step, every
    step that evaluates (`spec.evaluation`, engine/evaluation.py) and every step that saves a checkpoint; for the latter it runs before the checkpoint is committed, so a
    callback that returns once its report is recorded leaves no complete checkpoint ahead of the
    reported steps. Under `checkpoint.async_save` a checkpoint is committed at a later step, the first
    one after every rank has written it: that step is reported (with the checkpoint's size) before
    the commit. ``on_step_time`` (the other ranks) gets their wall time of the same steps.
    ``stop_requested``: a cheap, thread-safe poll of this rank (preemption); when it is given, every rank
    polls after each optimizer step and one all-reduce makes them agree, and when any rank's poll said
    stop, the run ends at that step as at its last (a checkpoint saved, the step reported). None: no stop
    can be requested and no collective is added.
    """

    def __init__(
        self,
        job: JobSpecBody,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "auto",
        checkpoint_dir: str | Path | None = None,
        on_step: Callable[[StepReport], Any] | None = None,
        on_event: Callable[[str], Any] | None = None,
        on_step_time: Callable[[int, float], Any] | None = None,
        file_rule: FileRule = FileRule(),
        stop_requested: Callable[[], bool] | None = None,
        snapshots: SnapshotStore | None = None,
    ):
        check_world(job, world_size)
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(device, rank)
        float8.check_float8_device(job.training.fp8, self.device)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.on_event = on_event
        self.file_rule = file_rule
        self.stop_requested = stop_requested
        resolved = efficiency.resolve_micro_batch_size(resolved_job(job, file_rule), self.device)
        self.grid, self.config, self.job = resolved.grid, resolved.config, resolved.spec
        self.autocast_dtype = torch.bfloat16 if job.training.dtype == "bfloat16" else None
        self.objectives = objectives(job.training.compile and self.grid.tp == 1)  # TP's vocab-sharded loss stays eager
        self.pmesh: ParallelMesh | None = build_mesh(self.grid, self.device.type) if world_size > 1 else None
        self.model = build_parallel_model(self.job, self.config, self.pmesh, self.device, file_rule)
        self.float8_scales = float8.precomputes_scales(
            job.training.fp8, self.pmesh is not None and gathers_parameters(self.job.parallelism)
        )
        self.optimizers, self.schedulers = self._build_optimizers()
        self.state_options = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=job.lora is not None)
        self.job = efficiency.confirm_micro_batch(
            self.job, self.model, self.device, self.autocast, requested_auto=job.training.micro_batch_size == "auto"
        )
        self._write_run_spec()
        self.loader = self._build_loader()
        self.run_state = RunState(self.model.parts, self.optimizers, self.schedulers, self.loader, self.state_options)
        self.snapshots = (
            StepSnapshots(snapshots, job.checkpoint.memory_interval_steps, self.device,
                          lambda: self.run_state.build(self.step), self._event)
            if snapshots is not None and job.checkpoint.memory_interval_steps and job.checkpoint.resume else None
        )
        self._loss_scale: float | None = None  # this step's masked-loss factor (None: unmasked data)
        self.pipeline = self._build_pipeline()
        self.evaluator = (
            Evaluator(self, self.job.evaluation, evaluation_dataset(self.job, self.config.vocab_size, file_rule))
            if self.job.evaluation is not None else None
        )
        self.step = 0
        self.reporter = StepReporter(
            self.job, self.config, rank=rank, world_size=world_size, device=self.device, on_step=on_step, on_step_time=on_step_time
        )

    # ---- setup steps --------------------------------------------------------------------------------
    def _build_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[LambdaLR]]:
        """One optimizer and LR schedule per model part (ZeRO-1: over the parameters this rank owns)."""
        optimizers = []
        for i, part in enumerate(self.model.parts):
            params = self.model.zero1[i].owned() if self.model.zero1 else part.parameters()
            optimizers.append(build_optimizer(params, self.job.training))
        return optimizers, [build_scheduler(opt, self.job.training) for opt in optimizers]

    def _write_run_spec(self) -> None:
        if self.checkpoint_dir is not None and self.rank == 0:
            pretrained.write_run_spec(self.checkpoint_dir, self.job)

    def _build_loader(self) -> ShardedLoader | PrefetchLoader:
        """This data-parallel rank's loader (CP, TP and PP peers read the same samples)."""
        job = self.job
        dataset = build_dataset(job.data, self.config.vocab_size, job.model.from_pretrained, self.file_rule, training_holdout(job))
        dp_group = self.grid.group(("dp_replicate", "dp_shard"), self.rank)
        return build_loader(
            dataset,
            job.data,
            self.device,
            global_batch_size=job.training.global_batch_size,
            micro_batch_size=job.training.micro_batch_size,
            dp_rank=dp_group.index(self.rank),
            dp_size=self.grid.dp,
        )

    def _build_pipeline(self) -> PipelineRunner | None:
        """The schedule over this rank's stages (None without PP)."""
        if self.grid.pp == 1:
            return None
        return PipelineRunner(
            self.model.chunks,
            schedule=self.job.parallelism.pp_schedule,
            n_microbatches=self.loader.n_micro,
            group=self.pmesh.group("pp"),
            device=self.device,
            loss_fn=self._pipeline_loss,
        )

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's micro-batch loss; masked, times n_micro because the schedule divides by it."""
        return self._micro_loss(logits, targets, self.loader.n_micro)

    def _micro_loss(self, logits: torch.Tensor, targets: torch.Tensor, n_micro: int) -> torch.Tensor:
        """One of `n_micro` micro-batches' objective: its mean, or masked its share of the global one."""
        if self._loss_scale is None:
            return self.objectives.mean(logits, targets)
        return self.objectives.summed(logits, targets) * (self._loss_scale * n_micro)

    # ---- one step, in pieces (tests call these directly) -------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast around a forward, unless FSDP casts the parameters itself (or dtype is fp32)."""
        if self.autocast_dtype is None or self.model.dp_mode in ("fsdp", "hsdp", "zero2"):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_context(self.grid.tp > 1)

    def _grad_sync(self, part: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's all-reduce on all but the last micro-batch of a step."""
        if isinstance(part, DistributedDataParallel) and not last:
            return part.no_sync()
        return contextlib.nullcontext()

    def _local_inputs(self, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens, targets, positions) of this rank: the CP shard under CP, else the whole micro-batch."""
        inputs = micro.inputs.to(self.device)
        targets = micro.targets.to(self.device)
        if self.grid.cp == 1:
            return inputs, targets, None
        return shard_batch_for_cp(inputs, targets, self.pmesh["cp"], self.job.parallelism.cp_load_balance)

    def forward_backward(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Forward and backward of one step's micro-batches; gradients end reduced over dp x cp.

        Returns this rank's mean local loss: cross-entropy plus MoE aux loss, the objective optimized.
        """
        loss = self._forward_backward(micro_batches)
        if self.model.expert_parallel:
            reduce_expert_gradients(self.model.parts)
        self._align_grad_placements()
        if self.model.tied is not None:
            self.model.tied.reduce_gradients()
        return loss

    @torch.no_grad()
    def _align_grad_placements(self) -> None:
        """Give every DTensor gradient its parameter's placements (e.g. a vocab-parallel embedding's
        gradient arrives replicated): the optimizer, clipping and memory then see true shards."""
        for p in self.model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)

    def _begin_batch(self, micro_batches: list[MicroBatch]) -> None:
        """Set the batch's masked-loss factor (None: unmasked data)."""
        loss_tokens = micro_batches[0].loss_tokens
        self._loss_scale = None if loss_tokens is None else masked_loss_scale(loss_tokens, self.grid.dp * self.grid.cp)

    def _pipeline_batch(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) of the batch as the pipeline schedule takes them. Under CP the stages exchange
        [batch, seq / cp, dim] shards; each stage takes its shard's positions from the pre-hook
        context_parallel installs, so only tokens and labels go in."""
        local = [self._local_inputs(m) for m in micro_batches]
        return torch.cat([x for x, _, _ in local]), torch.cat([y for _, y, _ in local])

    def _forward_backward(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self._begin_batch(micro_batches)
        if self.pipeline is not None:
            inputs, targets = self._pipeline_batch(micro_batches)
            with self._loss_context(), self.autocast():
                return self.pipeline.step(inputs, targets)
        (part,) = self.model.parts
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, micro in enumerate(micro_batches):
            inputs, targets, positions = self._local_inputs(micro)
            with self._grad_sync(part, last=i == n - 1), self._loss_context():
                with self.autocast():
                    logits = part(inputs, positions)
                loss = self._micro_loss(logits, targets, n)
                aux = pop_aux_loss(part)
                if aux is not None:
                    loss = loss + aux
                (loss / n).backward()
            total += loss.detach()
        return total / n

    def global_loss(self, local: torch.Tensor) -> float:
        """The global mean loss from every rank's local mean (pipeline ranks all hold the last stage's)."""
        value = local.detach().float().clone()
        if self.world_size > 1:
            dist.all_reduce(value)
            value /= self.world_size
        return float(value)

    def optimizer_step(self) -> float:
        """Clip by the global gradient norm, step every optimizer and scheduler, clear gradients;
        returns the norm before clipping."""
        pp_group = self.pmesh.group("pp") if self.pmesh is not None and self.grid.pp > 1 else None
        duplicates = self.model.tied.duplicates if self.model.tied is not None else ()
        norm = clip_gradients(self.model.parameters(), self.job.training.grad_clip, pp_group, duplicates)
        for opt in self.optimizers:
            opt.step()
        if self.float8_scales:
            float8.after_optimizer_step(self.model.parts)
        for sharding in self.model.zero1:
            sharding.broadcast_params()
        for sched in self.schedulers:
            sched.step()
        for part in self.model.parts:
            part.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def train_step(self) -> tuple[float, float, dict[str, float]]:
        """One optimizer step: (global loss, grad norm, seconds per phase)."""
        timer = PhaseTimer(self.device)
        batch = self.loader.next_batch()
        timer.mark("data")
        local = self.forward_backward(batch)
        timer.mark("forward_backward")
        loss = self.global_loss(local)
        norm = self.optimizer_step()
        timer.mark("optimizer")
        return loss, norm, timer.finish()

    # ---- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, before_commit: Callable[[int], Any] | None = None) -> Path:
        """Collectively save model, optimizer, scheduler, RNG and data offset at the current step
        (``before_commit``: see `checkpoint.dcp.save_checkpoint`)."""
        if self.checkpoint_dir is None:
            raise RuntimeError("no checkpoint_dir was given to this Trainer")
        return self._checkpoints(self.checkpoint_dir).save(self.step, before_commit)

    def _checkpoints(self, root: Path, async_save: bool = False) -> StepCheckpoints:
        return StepCheckpoints(root, self.job.checkpoint.keep_last, self.rank,
                               lambda: self.run_state.build(self.step)[1], self._event, async_save)

    def load_checkpoint(self, path: str | Path) -> None:
        """Collectively load a checkpoint written under any layout into this one."""
        templates, state = self.run_state.build(self.step)
        ckpt.load_checkpoint(path, state)
        self._apply_state(templates, state)

    def _apply_state(self, templates: Templates, state: dict[str, Any]) -> None:
        self.step = self.run_state.apply(templates, state)

    def maybe_resume(self) -> int | None:
        """Resume if resuming is on: from the newest in-memory snapshot every rank holds when it is newer
        than the newest complete checkpoint (`memory_snapshots`), else from that checkpoint; returns the
        step resumed from. Snapshots after it are dropped (they belong to the run before this restart)."""
        if not self.job.checkpoint.resume:
            return None
        found = None
        if self.checkpoint_dir is not None:
            found = ckpt.latest_checkpoint(
                self.checkpoint_dir, on_skip=lambda path, why: self._event(f"skipped checkpoint {path}: {why}")
            )
        step = self.snapshots.restore(found[0] if found else None, self._apply_state) if self.snapshots is not None else None
        if step is None and found is not None:
            step, path = found
            self.load_checkpoint(path)
            self._event(f"resumed from checkpoint {path} (step {step})")
        if self.snapshots is not None:
            self.snapshots.discard_after(step or 0)
        return step

    # ---- the loop -----------------------------------------------------------------------------------
    def _event(self, message: str) -> None:
        log.info("rank %d: %s", self.rank, message)
        if self.on_event is not None and self.rank == 0:
            self.on_event(message)

    def _evaluate_if_due(self, last: bool, breakdown: dict[str, float]) -> float | None:
        """The eval loss after this step when an evaluation is due (its time in `breakdown`), else None."""
        if self.evaluator is None or not self.evaluator.due(self.step, last):
            return None
        started = time.perf_counter()
        eval_loss = self.evaluator.evaluate()
        breakdown["evaluation"] = time.perf_counter() - started
        return eval_loss

    def _stop_agreed(self) -> bool:
        """Whether any rank's `stop_requested` poll says stop now: one all-reduce (MAX) when there are
        several ranks, so every rank decides the same at the same step. False without a poll."""
        if self.stop_requested is None:
            return False
        flag = torch.tensor([int(self.stop_requested())], dtype=torch.int32, device=self.device)
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _stopped_event(self) -> str:
        """The event of a run stopped on request at the current step."""
        if self.checkpoint_dir is None:
            return f"stopped at step {self.step} on request; no checkpoint directory, nothing saved"
        return f"stopped at step {self.step} on request; checkpoint step {self.step} saved"

    def run(self) -> TrainResult:
        """Resume if possible, train to `training.steps` (or to the step a stop is requested at),
        checkpoint on schedule and at the end."""
        start = time.perf_counter()
        train = self.job.training
        resumed = self.maybe_resume()
        self._event(f"training {self.grid.describe()} from step {self.step} to {train.steps}")
        losses: list[float] = []
        last_path: Path | None = None
        stopped = False
        interval = self.job.checkpoint.interval_steps
        checkpoints = (
            self._checkpoints(self.checkpoint_dir, self.job.checkpoint.async_save) if self.checkpoint_dir is not None else None
        )
        try:
            while self.step < train.steps and not stopped:
                lr = self.optimizers[0].param_groups[0]["lr"]
                t0 = time.perf_counter()
                loss, norm, breakdown = self.train_step()
                losses.append(loss)
                allocator = efficiency.after_step(self.step, train.empty_cache_steps, self.device)
                if allocator is not None:
                    breakdown.update(allocator.as_breakdown())
                end = self.step == train.steps
                eval_loss = self._evaluate_if_due(end, breakdown)
                stopped = not end and self._stop_agreed()
                last = end or stopped  # a stopped run checkpoints and reports its step as its last
                report_due = self.step % train.log_interval == 0 or last or eval_loss is not None
                plain = partial(self.reporter.report, self.step, t0, lr, loss, norm, breakdown, None, None, eval_loss)
                if checkpoints is None:
                    if report_due:
                        plain()
                else:
                    # Rank 0 reports a step before a checkpoint is committed; the other ranks time it after.
                    report = partial(
                        self.reporter.report, self.step, t0, lr, loss, norm, breakdown, time.perf_counter(), eval_loss=eval_loss
                    )
                    save_due = bool(interval and self.step % interval == 0) or last
                    committed = checkpoints.after_step(
                        self.step, save_due=save_due, last=last, report_due=report_due, report=report, plain=plain
                    )
                    last_path = committed or last_path
                if self.snapshots is not None:
                    self.snapshots.after_step(self.step, last)
            if stopped:
                self._event(self._stopped_event())
        finally:
            if checkpoints is not None:
                checkpoints.close()
        return TrainResult(
            steps_completed=self.step,
            final_loss=losses[-1] if losses else None,
            losses=losses,
            tokens_seen=len(losses) * self.reporter.tokens_per_step,
            wall_seconds=time.perf_counter() - start,
            resumed_from_step=resumed,
            last_checkpoint=str(last_path) if last_path else None,
            stopped_on_request=stopped,
        )
