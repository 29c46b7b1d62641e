"""Evaluation on held-out data during training (`spec.evaluation`; docs/engine.md, Evaluation).

After optimizer step N, where `interval_steps` > 0 divides N, and after the last step when `at_end`,
every rank evaluates: the first `batches` global batches of the evaluation data in its seeded order
(the same batches every time), each split over the data-parallel ranks as training splits a batch and
sharded over CP as training shards it, forward only (`torch.no_grad`, the pipeline schedule's `eval`),
under the job's autocast / FSDP mixed precision and TP loss context, with every model part in eval
mode (LoRA dropout off) and MoE aux losses discarded. The loss is training's cross-entropy
(engine/loss.py): the mean per micro-batch, or for masked (chat) data the global batch's summed token
loss over its loss tokens, averaged over micro-batches and batches and all-reduced like the training
loss, so every rank holds it. Nothing of training's state moves: the evaluation loader is its own, and
torch's RNG state and each part's train / eval mode are restored afterwards.

The evaluation data is `evaluation.data`, read by the same dataset code as training, or with
`holdout_fraction` the held-out documents of `spec.data` (data.holdout), which the training dataset
then leaves out (`training_holdout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from trainctl.parallelism.data.corpus import DataError, MicroBatch, PackedDataset, ShardedLoader
from trainctl.parallelism.data.dataset import build_dataset
from trainctl.parallelism.data.holdout import HOLDOUT_FIELD, Holdout
from trainctl.parallelism.data.token_shards import TokenShardDataset
from trainctl.parallelism.model.moe import pop_aux_loss
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.job import EvaluationSpec, JobSpecBody

if TYPE_CHECKING:
    from trainctl.parallelism.engine.trainer import Trainer

EVAL_DATA_FIELD = "spec.evaluation.data"


def training_holdout(job: JobSpecBody) -> Holdout | None:
    """The training side of `spec.evaluation.holdout_fraction`'s split (None: training reads all data)."""
    evaluation = job.evaluation
    if evaluation is None or evaluation.holdout_fraction is None:
        return None
    return Holdout(evaluation.holdout_fraction, job.data.seed, evaluation=False)


def _renamed(text: str) -> str:
    """A data error's field under `spec.evaluation.data` (the dataset code names `spec.data`)."""
    return text.replace("spec.data.", f"{EVAL_DATA_FIELD}.")


def evaluation_dataset(
    job: JobSpecBody, vocab_size: int, files: FileRule = FileRule()
) -> PackedDataset | TokenShardDataset:
    """The evaluation data of `job` (files opened under `files`); DataError naming the fields when it
    holds fewer than `batches` global batches."""
    evaluation = job.evaluation
    assert evaluation is not None
    model_dir = job.model.from_pretrained
    if evaluation.data is not None:
        source = EVAL_DATA_FIELD
        try:
            dataset = build_dataset(evaluation.data, vocab_size, model_dir, files)
        except FileRuleError as exc:
            raise FileRuleError(_renamed(exc.field), exc.message) from None
        except DataError as exc:
            raise DataError(_renamed(str(exc))) from None
    else:
        source = f"held-out data ({HOLDOUT_FIELD} {evaluation.holdout_fraction} of spec.data)"
        holdout = Holdout(evaluation.holdout_fraction, job.data.seed, evaluation=True)
        dataset = build_dataset(job.data, vocab_size, model_dir, files, holdout)
    need = evaluation.batches * job.training.global_batch_size
    if dataset.n_samples < need:
        raise DataError(
            f"spec.evaluation.batches: {evaluation.batches} batches of spec.training.global_batch_size = "
            f"{job.training.global_batch_size} sequences need {need} samples of seq_len + 1 tokens, but the {source} "
            f"holds {dataset.n_samples}"
        )
    return dataset


@contextlib.contextmanager
def _frozen_state(trainer: Trainer) -> Iterator[None]:
    """Every part in eval mode, no autograd; the parts' modes and torch's RNG state restored after."""
    modes = [(m, m.training) for part in trainer.model.parts for m in part.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None
    try:
        for part in trainer.model.parts:
            part.eval()
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, trainer.device)


class Evaluator:
    """One rank's evaluation: when it is due and the global eval loss (collective: every rank calls it)."""

    def __init__(self, trainer: Trainer, evaluation: EvaluationSpec, dataset: PackedDataset | TokenShardDataset):
        self.trainer = trainer
        self.spec = evaluation
        dp_group = trainer.grid.group(("dp_replicate", "dp_shard"), trainer.rank)
        self.loader = ShardedLoader(
            dataset,
            global_batch_size=trainer.job.training.global_batch_size,
            micro_batch_size=trainer.job.training.micro_batch_size,
            dp_rank=dp_group.index(trainer.rank),
            dp_size=trainer.grid.dp,
        )

    def due(self, step: int, last: bool) -> bool:
        """Whether the evaluation runs after optimizer step `step` (`last`: the run's final step)."""
        interval = self.spec.interval_steps
        return bool(interval and step % interval == 0) or (last and self.spec.at_end)

    def evaluate(self) -> float:
        """The global mean eval loss over the first `batches` batches of the evaluation data."""
        trainer = self.trainer
        self.loader.offset = 0
        total = torch.zeros((), device=trainer.device)
        with _frozen_state(trainer):
            for _ in range(self.spec.batches):
                total += self._batch_loss(self.loader.next_batch())
        return trainer.global_loss(total / self.spec.batches)

    def _batch_loss(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """This rank's loss of one batch, as training computes its objective (without MoE aux losses)."""
        trainer = self.trainer
        trainer._begin_batch(micro_batches)
        if trainer.pipeline is not None:
            inputs, targets = trainer._pipeline_batch(micro_batches)
            with trainer._loss_context(), trainer.autocast():
                return trainer.pipeline.evaluate(inputs, targets)
        (part,) = trainer.model.parts
        total = torch.zeros((), device=trainer.device)
        for micro in micro_batches:
            inputs, targets, positions = trainer._local_inputs(micro)
            with trainer._loss_context():
                with trainer.autocast():
                    logits = part(inputs, positions)
                total += trainer._micro_loss(logits, targets, len(micro_batches)).float()
            pop_aux_loss(part)  # MoE aux losses train the router; they are no part of the eval loss
        return total / len(micro_batches)
