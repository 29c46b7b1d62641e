"""`python -m trainctl.parallelism.launch job.yaml` under torchrun and alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import free_port

VENV_BIN = Path(sys.executable).parent


def write_job(path: Path, corpus: str, layout: str, gpus: int) -> Path:
    path.write_text(
        "apiVersion: trainctl/v1\nkind: TrainingJob\nmetadata: {name: launch-test}\nspec:\n"
        f"  data: {{paths: [{corpus!r}], seq_len: 32}}\n  parallelism: {layout}\n"
        "  training: {steps: 2, global_batch_size: 4, micro_batch_size: 1}\n"
        f"  resources: {{gpus: {gpus}, device: cpu}}\n"
    )
    return path


def test_torchrun_trains_and_checkpoints(tmp_path, corpus):
    job = write_job(tmp_path / "job.yaml", corpus, "{dp_shard: 2}", 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(VENV_BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "trainctl.parallelism.launch", str(job),
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-jsonl", str(tmp_path / "steps.jsonl")],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2/2 loss" in done.stdout and "done: 2 steps" in done.stdout
    assert (tmp_path / "ckpt" / "step_00000002" / "COMPLETE").is_file()
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]  # rank 0 only, one line per report
    assert steps[0]["time"] <= steps[1]["time"] and steps[1]["step_time_seconds"] > 0


def test_world_size_mismatch_is_reported(tmp_path, corpus):
    job = write_job(tmp_path / "job.yaml", corpus, "{dp_shard: 2}", 2)
    done = subprocess.run(
        [sys.executable, "-m", "trainctl.parallelism.launch", str(job)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "needs 2 ranks but WORLD_SIZE is 1" in done.stderr
