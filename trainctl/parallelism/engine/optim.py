"""Optimizers and the learning-rate schedule, from `spec.training`.

Weight decay applies to matrices (2-D and higher parameters); norms' vectors are not decayed.
Schedule: linear warm-up from lr/warmup to lr over `warmup_steps`, then cosine decay to
`lr * min_lr_ratio` at `steps`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainctl.spec.job import TrainingSpec


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Decayed matrices and undecayed vectors, each split into DTensor and plain parameters (foreach
    kernels cannot mix the two, e.g. expert-parallel experts beside DDP parameters); empty groups
    are dropped."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for p in params:
        if p.requires_grad:
            groups.setdefault((p.dim() >= 2, isinstance(p, DTensor)), []).append(p)
    return [
        {"params": groups[key], "weight_decay": weight_decay if key[0] else 0.0}
        for key in sorted(groups, reverse=True)
    ]


def kernel_options(params: list[nn.Parameter], impl: str) -> dict[str, bool]:
    """`foreach=True` or `fused=True` for AdamW / SGD: `auto` is fused when every parameter is on CUDA."""
    if impl == "auto":
        impl = "fused" if params and all(p.device.type == "cuda" for p in params) else "foreach"
    return {"fused": True} if impl == "fused" else {"foreach": True}


def build_optimizer(params: Iterable[nn.Parameter], spec: TrainingSpec) -> torch.optim.Optimizer:
    """AdamW (decoupled decay), Adafactor (torch.optim.Adafactor, plain tensors only) or SGD with
    momentum = beta1 (coupled L2 weight decay is not applied to SGD)."""
    params = list(params)
    if spec.optimizer == "adafactor" and any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            "spec.training.optimizer: adafactor cannot step sharded (DTensor) parameters, which this layout "
            "creates (FSDP / ZeRO-2/3, TP or EP); use adamw or sgd, or DDP / ZeRO-1 without TP"
        )
    groups = param_groups(params, spec.weight_decay)
    kernel = kernel_options(params, spec.optimizer_impl)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps, **kernel)
    if spec.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=spec.lr, foreach=False)
    if spec.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.beta1, **kernel)
    raise ValueError(f"spec.training.optimizer: unknown optimizer {spec.optimizer!r}")


def lr_multiplier(step: int, spec: TrainingSpec) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if spec.warmup_steps and step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    decay_steps = max(1, spec.steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, spec: TrainingSpec) -> LambdaLR:
    """LambdaLR applying `lr_multiplier`; step it once after each optimizer step."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, spec))


def global_grad_norm(
    params: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None = None, duplicates: Iterable[nn.Parameter] = ()
) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model, identical on every rank (float32).

    DTensor gradients (FSDP, TP, EP shards) are reduced over their own mesh, grouped by mesh and
    placements; plain gradients are complete replicas (DDP / ZeRO-1 / single process) and count once.
    Pipeline stages hold disjoint parameters, so the squares are summed over `pp_group`; `duplicates`
    (the last stage's copy of tied embeddings) are left out.
    """
    grouped: dict[tuple, list[torch.Tensor]] = {}
    device = None
    skip = {id(p) for p in duplicates}
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        g = p.grad
        device = g.device
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else (None,)
        grouped.setdefault(key, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in grouped.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float().pow(2)
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_gradients(
    params: Iterable[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    duplicates: Iterable[nn.Parameter] = (),
) -> float:
    """Scale all gradients so their global norm (`duplicates` counted elsewhere) is at most `max_norm`
    (0 disables); returns the norm before clipping."""
    params = list(params)
    total = global_grad_norm(params, pp_group, duplicates)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.mul_(coef.to(grad.device))
    return float(total)
