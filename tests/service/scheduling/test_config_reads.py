"""Issue 33: a job is resolved once per process role. An imported model's config.json is read once by
CreateJob (validation, warnings, fit check), once by the scheduler however often admission retries the
queued job, and once by the rank's trainer; `RankGrid.from_spec` and `resolve_model` stay in few places."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import transformers
from control_plane_fakes import ApiServer

from trainctl.cli.client import TrainctlClient
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.spec import hf_config
from trainctl.spec.files import FileRule
from trainctl.spec.job import TrainingJob

ROOT = Path(__file__).resolve().parents[3]
SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def count_config_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Reads of a file named config.json through the job's FileRule, by the reading thread's role
    ('scheduler' for the scheduler's loop, 'other' for everything else)."""
    reads: Counter[str] = Counter()
    read_bytes = FileRule.read_bytes

    def counted(self: FileRule, path: Path, *args: object, **kwargs: object) -> bytes:
        if Path(path).name == hf_config.CONFIG_FILE:
            reads["scheduler" if threading.current_thread().name == "trainctl-scheduler" else "other"] += 1
        return read_bytes(self, path, *args, **kwargs)

    monkeypatch.setattr(FileRule, "read_bytes", counted)
    return reads


def pretrained_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(directory)
    return directory


def job_of(directory: Path, corpus: str, name: str, gpus: int = 1) -> TrainingJob:
    return TrainingJob.model_validate({"metadata": {"name": name}, "spec": {
        "model": {"from_pretrained": str(directory)}, "data": {"paths": [corpus], "seq_len": 32, "tokenizer": "byte"},
        "training": {"steps": 1, "global_batch_size": gpus, "micro_batch_size": 1},
        "parallelism": {"dp_replicate": gpus}, "resources": {"gpus": gpus, "device": "cpu"}}})


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_config_json_is_read_once_per_job_per_process_role(
    tmp_path: Path, api: ApiServer, api_client: TrainctlClient, monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = pretrained_dir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few bytes of text to train on. " * 64)
    store = api.scheduler.store
    blocker = api_client.create_job(job_of(directory, str(corpus), "blocker", gpus=api.scheduler.pool.total))
    wait_for(lambda: store.get_job(blocker.id).reason.startswith("placed"))  # every GPU held
    reads = count_config_reads(monkeypatch)

    queued = api_client.create_job(job_of(directory, str(corpus), "queued"))
    assert reads == {"other": 1}  # CreateJob: validation, warnings and the fit check share one read

    wait_for(lambda: store.get_job(queued.id).reason.startswith("waiting for 1 GPUs"))
    for _ in range(3):  # admission retries the queued job on every pass
        api.scheduler.wake()
        time.sleep(0.2)
    api_client.cancel_job(blocker.id)
    wait_for(lambda: store.get_job(queued.id).reason.startswith("placed"))
    assert reads == {"other": 1, "scheduler": 1}

    Trainer(job_of(directory, str(corpus), "rank").spec, device="cpu")
    assert reads == {"other": 2, "scheduler": 1}  # the rank's set-up: one read more


def test_the_spec_is_derived_in_few_places() -> None:
    """`RankGrid.from_spec(` and `resolve_model(` are each called in at most three places in trainctl/."""
    sources = [p.read_text() for p in (ROOT / "trainctl").rglob("*.py")]
    for call in (r"RankGrid\.from_spec\(", r"(?<!def )resolve_model\("):
        sites = sum(len(re.findall(call, text)) for text in sources)
        assert sites <= 3, (call, sites)
