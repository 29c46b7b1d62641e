"""What a rank imports before its first step: every rank of every job pays it, at start and at each restart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_the_engine_a_rank_preloads_leaves_out_the_pipeline_schedules() -> None:
    # Only pipelined jobs use them; PipelineRunner imports them itself.
    code = (
        "import sys; from trainctl.workers.rank_worker import preload_engine; preload_engine(); "
        "print('torch.distributed.pipelining' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_first_training_step_after_the_preload_imports_none_of_torchs_lazily_loaded_packages() -> None:
    # The optimizer's first step imports torch._dynamo (through `torch._disable_dynamo`) when the preload has
    # not: 0.5-1 s a spare or pooled worker would pay after the rendezvous, its group waiting. A checkpoint
    # is saved and resumed too.
    lazy = ("torch._dynamo", "torch._inductor", "torch.onnx", "torch._functorch")
    code = (
        "import sys, tempfile\n"
        "from trainctl.workers.rank_worker import preload_engine; preload_engine()\n"
        "before = set(sys.modules)\n"
        "from small_jobs import small_job\n"
        "from trainctl.parallelism.engine.trainer import Trainer\n"
        "spec = small_job('lazy', gpus=1, steps=2, checkpoint={'interval_steps': 1}).spec\n"
        "root = tempfile.mkdtemp()\n"
        "Trainer(spec, rank=0, world_size=1, device='cpu', checkpoint_dir=root).run()\n"
        "Trainer(spec.model_copy(update={'training': spec.training.model_copy(update={'steps': 3})}), rank=0,"
        " world_size=1, device='cpu', checkpoint_dir=root).run()\n"
        f"print(sorted({{p for m in set(sys.modules) - before for p in {lazy!r} if m == p or m.startswith(p + '.')}}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_the_engine_a_rank_preloads_asks_nothing_of_cuda() -> None:
    # A spare rank process (trainctl.workers.spares) imports the engine before it knows its GPU and sets
    # CUDA_VISIBLE_DEVICES when it is bound: that only works while nothing has asked the CUDA driver yet.
    code = (
        "import torch\n"
        "asked = []\n"
        "def record(name, real):\n"
        "    def call(*args, **kwargs):\n"
        "        asked.append(name)\n"
        "        return real(*args, **kwargs)\n"
        "    return call\n"
        "for name in ('is_available', 'device_count', '_lazy_init', 'init'):\n"
        "    setattr(torch.cuda, name, record(name, getattr(torch.cuda, name)))\n"
        "if hasattr(torch._C, '_cuda_getDeviceCount'):  # CUDA builds only\n"
        "    torch._C._cuda_getDeviceCount = record('_cuda_getDeviceCount', torch._C._cuda_getDeviceCount)\n"
        "from trainctl.workers.rank_worker import preload_engine; preload_engine()\n"
        "print(asked, torch.cuda.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"
