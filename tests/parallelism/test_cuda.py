"""CUDA-only checks of the engine (every test here is skipped without a CUDA device).

- fp32 on CUDA reproduces the CPU fp32 run, and bf16 (autocast, fp32 master weights) tracks the CUDA fp32 run,
  losses and every parameter's gradient at every step;
- the attention core's SDPA call in bf16 under the flash and memory-efficient kernels agrees with the math
  kernel and with a float64 reference (outputs and input gradients), and the model's own call runs on flash;
- a CUDA Trainer puts parameters, optimizer state and batches on the device and picks the fused AdamW.

Tolerances are derived from measurements of the same jobs on CPU (see each constant). Tiny shapes: the file
takes seconds on one GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import (
    FP8_SHAPE,
    FP32_LOSS_RTOL,
    LayoutRun,
    assert_equivalent,
    relative_error,
    tiny_job,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.layouts.parallelize import canonical_name
from trainctl.parallelism.model.transformer import CausalAttentionCore, build_model
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 5
TRAINING = {"micro_batch_size": 4, "lr": 1e-4}
"""Two micro-batches of 4 per step (accumulation exercised); lr 1e-4 as in harness.BF16_TP_TRAINING, so
bf16's per-step differences do not compound through the weights over the steps."""

CUDA_CPU_LOSS_RTOL = FP32_LOSS_RTOL
"""fp32 CUDA (TF32 off) against fp32 CPU, per step. Both are fp32 with different reduction orders
(cuBLAS / the memory-efficient SDPA kernel against the CPU's): on CPU, the same job with another
reduction order (micro-batch 1 instead of 4) or with its matmuls in float64 moves the loss by <= 1e-7
relative over 5 steps; 1e-5 leaves 100x for the GPU's kernels."""
CUDA_CPU_GRAD_RTOL = 1e-4
"""Per-tensor ||g - g_ref|| / ||g_ref||. The same CPU measurements: <= 3.9e-6 for every parameter over 5
steps (the layouts' own measured worst is 1.3e-5, harness.FP32_GRAD_RTOL). 1e-4 is 25x that and still
100x below a 1 % error in one tensor."""
BF16_LOSS_RTOL = 1e-3
"""bf16 (autocast) against fp32, per step. bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3),
but the loss is computed in float32 from logits whose rounding errors are independent and average out in the
mean cross-entropy: CPU bf16 autocast on this job moves the loss by <= 1.2e-5 relative over 5 steps.
1e-3 is ~80x that (the GPU's flash kernel also rounds the softmax probabilities to bf16) and would still catch
bf16 master weights or a wrong loss dtype, which move it by more."""
BF16_GRAD_RTOL = 3e-2
"""Per-tensor gradient error of bf16 against fp32: CPU bf16 autocast on this job measures a median of
4.2e-3 (one bf16 rounding) and a worst of 7.1e-3 (attention wq / wk, two roundings through q.k) over the 5
steps at lr 1e-4. 3e-2 is ~4x the worst (about 8 bf16 roundings): GPU kernels round at other points."""
BF16_MIN_DIFFERENCE = 5e-4
"""The bf16 run must differ from fp32 somewhere at step 0 by more than this (one bf16 rounding gives
~4e-3; fp32 against fp32 differs by < 1e-5): otherwise autocast did not run in bf16 at all."""
SDPA_RTOL = 1.5e-2
"""Relative Frobenius error ||a - b|| / ||b|| of bf16 SDPA outputs and input gradients. Against the float64
reference, CPU bf16 measures 3.0e-3 (outputs) to 5.3e-3 (dk) for both its math and its flash kernel on
these shapes: the inputs' own bf16 rounding (2^-9 relative on average) plus one or two roundings of
intermediate results. 1.5e-2 is ~3x that (about 4 bf16 unit roundoffs), the usual bf16 bound of ~1e-2
with room for the GPU kernels' other rounding points; an indexing or masking error is O(1)."""


def cuda_job(corpus: str, dtype: str = "float32", **parallelism: Any) -> JobSpecBody:
    """The debug job (seq_len 32, global batch 8) of TRAINING in `dtype`, on CUDA."""
    job = tiny_job(corpus, steps=STEPS, training={**TRAINING, "dtype": dtype}, **parallelism)
    return job.model_copy(update={"resources": job.resources.model_copy(update={"device": "cuda"})})


def close_loader(trainer: Trainer) -> None:
    close = getattr(trainer.loader, "close", None)
    if close is not None:
        close()


def named_grads_on_cpu(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (fp32, on CPU) by canonical name (one process: plain tensors)."""
    return {
        canonical_name(name): param.grad.detach().float().cpu().clone()
        for part in trainer.model.parts
        for name, param in part.named_parameters(remove_duplicate=False)
        if param.grad is not None
    }


def train_steps(trainer: Trainer, steps: int = STEPS) -> LayoutRun:
    """Step `trainer` by hand: every step's global loss and full gradients (before clipping), on CPU."""
    losses, grads = [], []
    try:
        for _ in range(steps):
            local = trainer.forward_backward(trainer.loader.next_batch())
            losses.append(trainer.global_loss(local))
            grads.append(named_grads_on_cpu(trainer))
            trainer.optimizer_step()
    finally:
        close_loader(trainer)
    return LayoutRun(losses=losses, grads=grads)


@pytest.fixture(scope="module")
def cuda_fp32(corpus: str) -> LayoutRun:
    """The single-process fp32 run on cuda:0 (TF32 off, PyTorch's default)."""
    assert torch.backends.cuda.matmul.allow_tf32 is False, "TF32 matmuls would make the fp32 comparisons meaningless"
    assert torch.get_float32_matmul_precision() == "highest"
    return train_steps(Trainer(cuda_job(corpus), device="cuda"))


# ---- 1. fp32 on CUDA against CPU, bf16 against fp32 -------------------------------------------------
def test_cuda_fp32_matches_cpu_fp32(corpus: str, cuda_fp32: LayoutRun) -> None:
    cpu = train_steps(Trainer(tiny_job(corpus, steps=STEPS, training=TRAINING), device="cpu"))
    assert_equivalent(cuda_fp32, cpu, loss_rtol=CUDA_CPU_LOSS_RTOL, grad_rtol=CUDA_CPU_GRAD_RTOL)


def test_bf16_tracks_fp32_on_cuda(corpus: str, cuda_fp32: LayoutRun) -> None:
    trainer = Trainer(cuda_job(corpus, "bfloat16"), device="cuda")
    assert trainer.autocast_dtype is torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "master weights must stay fp32"
    bf16 = train_steps(trainer)
    assert all(g.dtype == torch.float32 for g in bf16.grads[0].values())
    assert_equivalent(bf16, cuda_fp32, loss_rtol=BF16_LOSS_RTOL, grad_rtol=BF16_GRAD_RTOL)
    step0 = max(relative_error(bf16.grads[0][n], cuda_fp32.grads[0][n]) for n in cuda_fp32.grads[0])
    assert step0 > BF16_MIN_DIFFERENCE, f"bf16 gradients equal fp32 ones ({step0:.1e}): autocast did not run in bf16"


# ---- 2. SDPA kernels ----------------------------------------------------------------------------------
def sdpa_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, dtype: torch.dtype,
             backend: SDPBackend) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of the model's attention core in `dtype` under `backend` only (raises if it cannot run)."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = CausalAttentionCore()(*leaves)
        out.backward(grad_out.to(dtype))
    return [out.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_sdpa_kernels_match_math_and_float64(head_dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(20240 + head_dim)
    b, hq, hkv, s = 2, 8, 2, 256  # GQA 4:1; the core expands k / v with repeat_kv before SDPA

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64)

    q, k, v, grad_out = randn(b, hq, s, head_dim), randn(b, hkv, s, head_dim), randn(b, hkv, s, head_dim), randn(b, hq, s, head_dim)
    reference = sdpa_run(q, k, v, grad_out, torch.float64, SDPBackend.MATH)
    math = sdpa_run(q, k, v, grad_out, torch.bfloat16, SDPBackend.MATH)
    errors = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        fused = sdpa_run(q, k, v, grad_out, torch.bfloat16, backend)
        for what, got, want_math, want_ref in zip(("out", "dq", "dk", "dv"), fused, math, reference, strict=True):
            assert got.dtype == torch.bfloat16 and got.shape == want_ref.shape
            for against, want in (("math bf16", want_math), ("float64", want_ref)):
                err = relative_error(got, want)
                if not err <= SDPA_RTOL:
                    errors.append(f"{backend.name} {what} vs {against}: {err:.2e} > {SDPA_RTOL:.1e}")
    for what, got, want in zip(("out", "dq", "dk", "dv"), math, reference, strict=True):
        err = relative_error(got, want)
        if not err <= SDPA_RTOL:
            errors.append(f"MATH bf16 {what} vs float64: {err:.2e} > {SDPA_RTOL:.1e}")
    assert not errors, "\n".join(errors)


def test_model_attention_runs_on_the_flash_kernel_in_bf16() -> None:
    """The model's own SDPA call (transposed q, repeat_kv'd k / v, causal) is accepted by the flash kernel
    under bf16 autocast: with only FLASH_ATTENTION allowed, SDPA raises when flash cannot run."""
    config = ModelConfig(vocab_size=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512)  # head_dim 64
    model = build_model(config, seed=3).cuda()
    tokens = torch.randint(0, config.vocab_size, (2, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_engine_bf16_step_runs_on_the_flash_kernel(corpus: str) -> None:
    """The Trainer's own bf16 forward / backward (the debug preset, head_dim 16) with only flash allowed."""
    trainer = Trainer(cuda_job(corpus, "bfloat16"), device="cuda")
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            loss = trainer.forward_backward(trainer.loader.next_batch())
        assert torch.isfinite(loss)
    finally:
        close_loader(trainer)


# ---- 3. placement and optimizer choice ------------------------------------------------------------------
def test_cuda_trainer_places_everything_on_the_device_and_uses_fused_adamw(corpus: str) -> None:
    trainer = Trainer(cuda_job(corpus), device="cuda")
    try:
        assert trainer.device == torch.device("cuda", 0)
        assert all(p.device == trainer.device for p in trainer.model.parameters())
        (optimizer,) = trainer.optimizers
        assert isinstance(optimizer, torch.optim.AdamW)
        assert all(group["fused"] is True and not group["foreach"] for group in optimizer.param_groups), \
            "optimizer_impl auto must pick the fused AdamW when every parameter is on CUDA"
        batch = trainer.loader.next_batch()
        assert all(m.inputs.is_pinned() and m.targets.is_pinned() for m in batch), "prefetched host batches are pinned"
        inputs, targets, _ = trainer._local_inputs(batch[0])
        assert inputs.device == trainer.device and targets.device == trainer.device
        loss = trainer.forward_backward(batch)
        assert loss.device == trainer.device
        trainer.optimizer_step()
        states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        assert states, "AdamW kept no state"
        assert all(t.device == trainer.device for t in states), "optimizer state (step included, fused) is on the device"
        assert all(t.dtype == torch.float32 for t in states)
    finally:
        close_loader(trainer)


# ---- float8 ---------------------------------------------------------------------------------------------
FP8_LOSS_RTOL = 2e-2
"""Float8 (tensorwise, w1 / w3 converted) against bf16, per step over the 5 steps at lr 1e-4. e4m3 keeps 3
mantissa bits (unit roundoff 2^-4) against bf16's 7, but as with bf16 against fp32 the errors of the
converted products are independent and average out in the mean cross-entropy; torchao's own
convergence checks hold float8 losses within about 1 % of bf16 on Llama pre-training. CPU float8 on the
same shape moves the first loss by well under 1e-2 relative (tests/parallelism/test_float8.py)."""


def test_float8_trains_on_cuda_and_tracks_bf16(corpus: str) -> None:
    def job(fp8: str) -> JobSpecBody:
        base = tiny_job(corpus, steps=STEPS, model=FP8_SHAPE, training={**TRAINING, "dtype": "bfloat16"})
        return JobSpecBody.model_validate({
            **base.model_dump(exclude_none=True),
            "training": {**base.training.model_dump(), "fp8": fp8},
            "resources": {**base.resources.model_dump(), "device": "cuda"},
        })

    bf16 = train_steps(Trainer(job("none"), device="cuda"))
    trainer = Trainer(job("tensorwise"), device="cuda")
    assert trainer.model.float8 == [f"layers.{i}.feed_forward.{w}" for i in range(4) for w in ("w1", "w3")]
    fp8 = train_steps(trainer)
    assert all(torch.isfinite(torch.tensor(fp8.losses)))
    for step, (a, b) in enumerate(zip(fp8.losses, bf16.losses, strict=True)):
        assert a == pytest.approx(b, rel=FP8_LOSS_RTOL), f"step {step}: float8 loss {a} against bf16 {b}"
    w1 = "layers.0.feed_forward.w1.weight"
    assert relative_error(fp8.grads[0][w1], bf16.grads[0][w1]) > 1e-3, "the float8 products did not run in float8"

