"""Plain PyTorch DDP, written like the PyTorch "Getting Started with DDP" tutorial: a toy model, the
`env://` rendezvous torchrun (or trainctl) sets up, SGD. It checkpoints to TRAINCTL_CHECKPOINT_DIR (the
current directory outside trainctl) and resumes from there, and adds one line for trainctl's metrics:
`trainctl.report(step=..., loss=..., tokens=...)`, with `eval_loss=...` on the steps that evaluated on
held-out data (every `--eval-interval` steps).

    python ddp_train.py [--steps N] [--step-seconds S] [--eval-interval N]
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import trainctl

BATCH = 20


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def evaluate(model: nn.Module, loss_fn: nn.Module, rank: int, world: int) -> float:
    """The mean loss over the ranks on a held-out batch (the same one every time, never trained on)."""
    held_out = torch.Generator().manual_seed(-1 - rank)
    inputs, labels = torch.randn(BATCH, 10, generator=held_out), torch.randn(BATCH, 5, generator=held_out)
    with torch.no_grad():
        loss = loss_fn(model(inputs), labels)
    dist.all_reduce(loss)
    return loss.item() / world


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (slow the run down)")
    parser.add_argument("--eval-interval", type=int, default=0, help="evaluate every N steps (0: never)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)

    checkpoint = Path(os.environ.get("TRAINCTL_CHECKPOINT_DIR", ".")) / "ddp_checkpoint.pt"
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"rank {rank} of {world} (restart {restart}) starts at step {start + 1}", flush=True)

    for step in range(start + 1, args.steps + 1):
        data = torch.Generator().manual_seed(step * world + rank)
        inputs, labels = torch.randn(BATCH, 10, generator=data), torch.randn(BATCH, 5, generator=data)
        optimizer.zero_grad()
        loss = loss_fn(ddp_model(inputs), labels)
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        if rank == 0:
            partial = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
            os.replace(partial, checkpoint)
            print(f"step {step} loss {mean_loss.item():.4f}", flush=True)
        eval_loss = None
        if args.eval_interval and step % args.eval_interval == 0:
            eval_loss = evaluate(ddp_model, loss_fn, rank, world)
            if rank == 0:
                print(f"eval step {step} loss {eval_loss:.4f}", flush=True)
        trainctl.report(step=step, loss=mean_loss.item(), tokens=BATCH * world, eval_loss=eval_loss)
        time.sleep(args.step_seconds)
    dist.barrier()
    # Free the DDP model before the group: its gradient reducer holds the group, and a gloo group whose last
    # reference goes with the reducer (at exit) is destroyed holding the GIL while gloo's worker thread needs
    # it to free its last work, a deadlock (pytorch/pytorch#56297); destroy_process_group releases the GIL.
    del ddp_model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
