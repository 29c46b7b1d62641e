"""The script body both sides of `bench_command_first_line.py` run: what a torchrun-style program does
before its first line of output (import torch, join the gloo process group), then that line, whose wall
time rank 0 writes to the file named by its first argument. Run as a program (a trainctl command job:
it joins the group from the torchrun environment) or called as `main(marker)` inside Ray Train's
TorchTrainer loop (which has joined the group already)."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(marker: str) -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        Path(marker).write_text(str(time.time()))
    print(f"rank {rank} of {world}: first line (torch {torch.__version__})", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    import torch.distributed as dist

    dist.destroy_process_group()
