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
