"""Evaluation during training (engine/evaluation.py; docs/engine.md, Evaluation).

The eval loss of every layout of the equivalence matrix against the single-process one is checked in
the matrix files themselves (run_layout / run_reference with `eval_after=EVAL_AFTER`). Here: when the
Trainer evaluates and reports; that evaluating leaves the training losses bit for bit as they were (one
process with LoRA dropout, and a pipeline layout); the held-out documents (text and JSONL, whose
records are cached as token shards) are disjoint from the training ones and deterministic; chat data
evaluates on assistant tokens only; too little held-out data is an error naming the fields.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from data_sources import build_tokenizer, conversations, write_jsonl
from harness import LayoutRun, mismatches, run_training, tiny_job

from trainctl.parallelism.data.corpus import IGNORE_INDEX, DataError
from trainctl.parallelism.data.dataset import build_dataset
from trainctl.parallelism.data.holdout import Holdout, held_out
from trainctl.parallelism.engine.step_report import StepReport
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec.job import DataSpec, JobSpecBody

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.2, "target_modules": ["wq", "wv", "w2"]}
LETTERS = 20
"""Documents of the holdout corpora: document i is letter i repeated, so a token names its document."""


def with_evaluation(body: JobSpecBody, **evaluation: object) -> JobSpecBody:
    data = body.model_dump()
    data["evaluation"] = evaluation
    return JobSpecBody.model_validate(data)


def _letter(i: int) -> str:
    return chr(ord("A") + i)


@pytest.fixture(scope="module")
def letter_files(tmp_path_factory: pytest.TempPathFactory) -> str:
    """20 text files, file i holding letter i (400 bytes each)."""
    root = tmp_path_factory.mktemp("letters")
    for i in range(LETTERS):
        (root / f"doc{i:02d}.txt").write_text(_letter(i) * 400)
    return str(root / "*.txt")


@pytest.fixture(scope="module")
def letter_records(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same 20 documents as JSONL records over two files."""
    root = tmp_path_factory.mktemp("letter-records")
    records = [{"text": _letter(i) * 400} for i in range(LETTERS)]
    write_jsonl(root / "a.jsonl", records[:12])
    write_jsonl(root / "b.jsonl", records[12:])
    return str(root / "*.jsonl")


def _letters_in(dataset) -> set[str]:
    tokens = np.unique(dataset.samples(0, dataset.n_samples).numpy())
    return {chr(int(t)) for t in tokens if chr(int(t)).isupper()}


@pytest.mark.parametrize("fmt", ["text", "jsonl"])
def test_held_out_documents_are_disjoint_from_training_and_deterministic(letter_files, letter_records, fmt):
    spec = DataSpec(paths=[letter_files if fmt == "text" else letter_records], format=fmt, seq_len=31, seed=3)
    fraction = 0.3
    evaluated = _letters_in(build_dataset(spec, 256, holdout=Holdout(fraction, spec.seed, evaluation=True)))
    trained = _letters_in(build_dataset(spec, 256, holdout=Holdout(fraction, spec.seed, evaluation=False)))
    want = {_letter(i) for i in range(LETTERS) if held_out(spec.seed, i, fraction)}
    assert 0 < len(want) < LETTERS
    assert evaluated == want
    assert trained == {_letter(i) for i in range(LETTERS)} - want
    again = build_dataset(spec, 256, holdout=Holdout(fraction, spec.seed, evaluation=True))
    assert _letters_in(again) == evaluated
    other_seed = {_letter(i) for i in range(LETTERS) if held_out(spec.seed + 1, i, fraction)}
    assert other_seed != want  # the split follows the data's seed


def test_prepared_token_shards_cannot_be_held_out(tmp_path):
    spec = DataSpec(paths=[str(tmp_path)], format="tokens", seq_len=31)
    with pytest.raises(DataError, match="spec.evaluation.holdout_fraction: data.format tokens keeps no document"):
        build_dataset(spec, 256, holdout=Holdout(0.1, 0, evaluation=True))


def test_too_little_held_out_data_names_the_fields(letter_files):
    body = with_evaluation(tiny_job(letter_files), holdout_fraction=0.1, batches=50)
    with pytest.raises(DataError, match=r"spec.evaluation.batches: 50 batches of spec.training.global_batch_size = 8 "
                                        r"sequences need 400 samples .* held-out data \(spec.evaluation.holdout_fraction"):
        Trainer(body, device="cpu")


def test_eval_data_errors_name_the_evaluation_field(corpus, tmp_path):
    body = with_evaluation(tiny_job(corpus), data={"paths": [str(tmp_path / "*.txt")], "seq_len": 32})
    with pytest.raises(DataError, match=r"^spec.evaluation.data.paths: .* match no files"):
        Trainer(body, device="cpu")


def test_trainer_evaluates_on_schedule_and_reports_every_eval_step(corpus):
    body = with_evaluation(tiny_job(corpus, steps=5, training={"log_interval": 100}), holdout_fraction=0.5, interval_steps=2)
    reports: list[StepReport] = []
    trainer = Trainer(body, device="cpu", on_step=reports.append)
    trainer.run()
    assert [(r.step, r.eval_loss is not None) for r in reports] == [(2, True), (4, True), (5, True)]
    assert all("evaluation" in r.breakdown for r in reports)
    # The same batches every time: evaluating twice without training gives the same loss.
    assert trainer.evaluator.evaluate() == reports[-1].eval_loss


def _training_losses(body: JobSpecBody, **evaluation: object) -> list[float]:
    if evaluation:
        body = with_evaluation(body, **evaluation)
    return Trainer(body, device="cpu").run().losses


def test_evaluation_changes_no_training_loss_with_lora_dropout(corpus, base_run):
    """LoRA dropout draws random numbers in training: an evaluation that left a part in eval mode, or
    moved torch's RNG, would change the next steps' losses."""
    job = tiny_job(corpus, steps=4, training={"micro_batch_size": 4, "warmup_steps": 1})
    body = JobSpecBody.model_validate({**job.model_dump(), "init_from": str(base_run), "lora": LORA})
    without = _training_losses(body)
    with_eval = _training_losses(body, data=body.data.model_dump(), interval_steps=1, batches=2)
    assert with_eval == without


def test_evaluation_changes_no_training_loss_under_a_pipeline(pool, corpus):
    body = tiny_job(corpus, steps=3, pp=2, pp_schedule="1f1b")
    without = run_training(pool, body).losses
    with_eval = run_training(pool, with_evaluation(body, data=body.data.model_dump(), interval_steps=1)).losses
    assert len(with_eval) == 3
    assert with_eval == without


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("chat-eval")
    tokenizer = build_tokenizer(root / "tokenizer")
    path = write_jsonl(root / "chat.jsonl", [{"messages": c} for c in conversations(80, seed=9)])
    return {"paths": [str(path)], "format": "jsonl", "messages_field": "messages", "tokenizer": str(tokenizer), "seq_len": 32}


def test_chat_data_evaluates_on_assistant_tokens(corpus, chat_data):
    body = with_evaluation(tiny_job(corpus, training={"micro_batch_size": 2}), data=chat_data, batches=2)
    trainer = Trainer(body, device="cpu")
    got = trainer.evaluator.evaluate()
    loader = trainer.evaluator.loader
    loader.offset = 0
    (part,) = trainer.model.parts
    part.eval()
    want = []
    with torch.no_grad():
        for _ in range(2):
            batch = loader.next_batch()
            inputs = torch.cat([m.inputs for m in batch])
            targets = torch.cat([m.targets for m in batch])
            assert (targets == IGNORE_INDEX).any() and (targets != IGNORE_INDEX).any()
            want.append(float(F.cross_entropy(part(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)))
    assert got == pytest.approx(sum(want) / 2, rel=1e-5)


def test_evaluation_restores_training_mode(corpus):
    trainer = Trainer(with_evaluation(tiny_job(corpus), holdout_fraction=0.5), device="cpu")
    (part,) = trainer.model.parts
    assert part.training
    trainer.evaluator.evaluate()
    assert all(m.training for m in part.modules())


def test_evaluation_batches_leave_the_training_data_order(corpus):
    plain = Trainer(tiny_job(corpus), device="cpu")
    evaluating = Trainer(with_evaluation(tiny_job(corpus), data={"paths": [corpus], "seq_len": 32, "seed": 7}), device="cpu")
    evaluating.evaluator.evaluate()
    for a, b in zip(plain.loader.next_batch(), evaluating.loader.next_batch(), strict=True):
        assert torch.equal(a.inputs, b.inputs)


def test_the_harness_compares_eval_losses():
    reference = LayoutRun(losses=[1.0], grads=[{}], eval_losses={1: 2.0})
    assert mismatches(LayoutRun([1.0], [{}], {1: 2.0 * (1 + 5e-6)}), reference) == []
    assert mismatches(LayoutRun([1.0], [{}], {1: 2.0 * (1 + 2e-5)}), reference)[0].startswith("after step 1: eval loss")
    assert mismatches(LayoutRun([1.0], [{}], {}), reference) == ["evaluated after steps [] != reference [1]"]
