"""What a checkpoint or an in-memory snapshot of one rank's run holds, built from the rank's training objects
and applied back to them: each model part's and optimizer's state dict (DCP's `get_state_dict`, sharded
and reshardable), the LR schedule, the RNG, the step and the data position.

`build` gives the templates (one model and optimizer state dict per model part, whose tensors are the live
ones) and the state made of them; a checkpoint load or a snapshot restore fills that state in place, and
`apply` sets it on the model parts, optimizers, schedules, RNG and loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim.lr_scheduler import LambdaLR

Templates = list[tuple[dict, dict]]
"""Per model part: its model state dict and its optimizer's."""


@dataclass(frozen=True)
class RunState:
    """The state of one rank's run. Build it once the model parts, optimizers, schedules and loader exist."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[LambdaLR]
    loader: Any
    """The data loader, whose `offset` is the run's global sample position."""
    options: StateDictOptions

    def build(self, step: int) -> tuple[Templates, dict[str, Any]]:
        """The templates and the state at ``step`` made of them."""
        templates = [get_state_dict(part, opt, options=self.options) for part, opt in zip(self.parts, self.optimizers, strict=True)]
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for part_model, part_optim in templates:
            model.update(part_model)
            optim.update(part_optim)
        train = {"step": step, "data_offset": self.loader.offset, "scheduler": self.schedulers[0].state_dict(),
                 "rng": torch.get_rng_state()}
        return templates, {"model": model, "optim": optim, "train": train}

    def apply(self, templates: Templates, state: dict[str, Any]) -> int:
        """Set the model parts, optimizers, schedules, RNG and data position from ``state`` (filled in place
        from `build`'s ``templates``); its step."""
        for (part, opt), (m, o) in zip(zip(self.parts, self.optimizers, strict=True), templates, strict=True):
            part_model = {k: state["model"][k] for k in m}
            part_optim = {k: state["optim"][k] for k in o}
            set_state_dict(part, opt, model_state_dict=part_model, optim_state_dict=part_optim, options=self.options)
        train = state["train"]
        self.loader.offset = int(train["data_offset"])
        for sched in self.schedulers:
            sched.load_state_dict(train["scheduler"])
        torch.set_rng_state(train["rng"])
        return int(train["step"])
