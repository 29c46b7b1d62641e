"""What a rank imports before its first step: every rank of every job pays it, at start and at each restart."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_a_rank_preloads_leaves_out_the_pipeline_schedules_and_dynamo() -> None:
    # torch.distributed.pipelining loads torch._dynamo: about 1 s of CPU (a third of the engine's imports on
    # the 2-core development machine) that only pipelined jobs need; PipelineRunner imports it itself.
    code = (
        "import sys; from trainctl.workers.rank_worker import preload_engine; preload_engine(); "
        "print(sorted(m for m in ('torch.distributed.pipelining', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


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
