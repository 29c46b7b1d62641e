"""The fine-tuning examples train as shipped: examples/finetune-hf-lora.yaml and finetune-hf-full.yaml,
read with `load_job_file` (their relative paths resolved against examples/), name the tiny Qwen2 in
examples/tiny-qwen2/ and the datasets in examples/data/; each trains its 10 steps under its own layout
(2 ranks, FSDP) on CPU, the loss falls, and its checkpoints are written on schedule; the LoRA example
reports its eval loss on held-out conversations after steps 5 and 10 (issue 37). The command job
example runs in tests/service/e2e/test_command_jobs_e2e.py; validation and planning of every example are in
tests/spec/test_examples.py.

The tiny model and datasets are what examples/tiny-qwen2/make_tiny_model.py writes (byte for byte), and
load in `transformers`: its chat template marks the assistant's turns, generation stops at `<|im_end|>`."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from harness import WorkerPool

from trainctl.parallelism.engine.step_report import StepReport
from trainctl.parallelism.engine.trainer import Trainer, TrainResult
from trainctl.spec.job import JobSpecBody
from trainctl.spec.validate import load_job_file, validate_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EVAL_STEPS = {"finetune-hf-lora": [5, 10], "finetune-hf-full": []}


def train_reporting(rank: int, world_size: int, body_json: str, checkpoint_dir: str) -> tuple[TrainResult, list[StepReport]] | None:
    """Worker body: `Trainer.run()` as the service runs it; rank 0's result and step reports."""
    reports: list[StepReport] = []
    body = JobSpecBody.model_validate_json(body_json)
    result = Trainer(body, rank=rank, world_size=world_size, device="cpu", checkpoint_dir=checkpoint_dir,
                     on_step=reports.append).run()
    return (result, reports) if rank == 0 else None


@pytest.mark.parametrize("name", ["finetune-hf-lora", "finetune-hf-full"])
def test_the_finetune_example_trains_the_tiny_model_as_shipped(pool: WorkerPool, name: str, tmp_path: Path) -> None:
    job = validate_job(load_job_file(EXAMPLES / f"{name}.yaml"))
    spec = job.spec
    assert spec.model.from_pretrained == str(EXAMPLES / "tiny-qwen2")
    assert spec.resources.device == "cpu" and spec.parallelism.world_size == spec.resources.gpus == 2
    result, reports = pool.run(train_reporting, 2, spec.model_dump_json(), str(tmp_path / "checkpoints"))[0]
    assert result.steps_completed == spec.training.steps == len(result.losses)
    assert result.losses[-1] < result.losses[0], result.losses
    evaluated = [r for r in reports if r.eval_loss is not None]
    assert [r.step for r in evaluated] == EVAL_STEPS[name]
    assert all(math.isfinite(r.eval_loss) and r.eval_loss > 0 for r in evaluated), evaluated
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000005", "step_00000010"]


def test_the_tiny_model_and_datasets_are_what_their_script_writes(tmp_path: Path) -> None:
    found = importlib.util.spec_from_file_location("make_tiny_model", EXAMPLES / "tiny-qwen2" / "make_tiny_model.py")
    script = importlib.util.module_from_spec(found)
    found.loader.exec_module(script)
    script.write_all(tmp_path)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert {p.parts[0] for p in written} == {"tiny-qwen2", "data"} and len(written) >= 8, written
    for path in written:
        assert (tmp_path / path).read_bytes() == (EXAMPLES / path).read_bytes(), f"examples/{path} differs from what the script writes"


def test_the_tiny_model_loads_in_transformers_with_its_chat_template() -> None:
    transformers = pytest.importorskip("transformers")
    directory = EXAMPLES / "tiny-qwen2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    assert type(model).__name__ == "Qwen2ForCausalLM" and len(tokenizer) == model.config.vocab_size
    messages = json.loads((EXAMPLES / "data" / "tiny-chat.jsonl").read_text().splitlines()[1])["messages"]
    rendered = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assistant = [t for t, m in zip(rendered["input_ids"], rendered["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(assistant) == messages[-1]["content"] + "<|im_end|>"
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
