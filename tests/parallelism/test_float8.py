"""`training.fp8`: which linears convert, where a job is refused, and the converted model on CPU
(torch's CPU float8 matmul runs the layers; jobs themselves refuse float8 on CPU). The float8 run on
a GPU is tests/parallelism/test_cuda.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from tests.parallelism.harness import (
    BF16_TP_TRAINING,
    DEFAULT_STEPS,
    FP8_SHAPE,
    assert_equivalent,
    run_layout,
    single_process,
    tiny_job,
)
from trainctl.parallelism.engine.trainer import Trainer
from trainctl.parallelism.layouts.float8 import Float8Unavailable, apply_float8, check_float8_device, converts
from trainctl.parallelism.layouts.parallelize import parallelize
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import resolve_model

FP8_LAYOUT_LOSS_RTOL = 2e-4
FP8_LAYOUT_GRAD_RTOL = 0.08
"""A float8 layout against the single-process float8 run, per step (3 steps, lr 1e-4). The layouts differ
from one process only in bf16-level reduction order, but each float8 cast rounds to 3 (e4m3) or 2 (e5m2)
mantissa bits, so a reduction-order difference that moves an element across a rounding boundary moves
it by up to 2^-3: measured on CPU, loss within 4.0e-5 and the worst gradient tensor within 3.2 %
(FSDP, w1) and 2.3 % (TP, w3) already at the first step, 3.4 % by the third (not growing like an
error would); PP is bit-identical. 2e-4 and 8 % leave 2-5x; a wrong or unreduced scale, a missed
gradient reduction or an unconverted layer moves the loss itself or a gradient by O(1)."""

float8 = pytest.importorskip("torchao.float8", reason="torchao is a dev requirement (requirements-dev.txt)")

@pytest.mark.parametrize(
    ("name", "in_features", "out_features", "recipe", "expected"),
    [
        ("layers.0.feed_forward.w1", 2048, 8192, "tensorwise", True),
        ("layers.0.attention.wq", 2048, 2048, "tensorwise", True),
        ("layers.0.attention.wk", 2048, 512, "tensorwise", False),  # K <= 4096 and N <= 1024
        ("layers.0.attention.wk", 8192, 512, "tensorwise", True),
        ("output", 2048, 128256, "tensorwise", False),  # the head stays in bf16
        ("layers.0.feed_forward.router", 2048, 4096, "tensorwise", False),
        ("layers.0.feed_forward.w1", 2048, 1000, "tensorwise", False),  # 1000 is not a multiple of 16
        ("layers.0.feed_forward.w1", 2000, 8192, "tensorwise", True),
        ("layers.0.feed_forward.w1", 2048, 8192, "rowwise", True),
        ("layers.0.attention.wq", 2048, 2048, "rowwise", False),  # N <= 2048
        ("layers.0.feed_forward.w2", 1024, 8192, "rowwise", False),  # K <= 1024
        ("layers.0.feed_forward.w1", 2048, 4096, "rowwise", False),  # N <= 4096 and K <= 2048
        ("layers.0.feed_forward.w1", 4096, 4096, "rowwise", True),
    ],
)
def test_which_linears_convert(name: str, in_features: int, out_features: int, recipe: str, expected: bool) -> None:
    layer = nn.Linear(in_features, out_features, bias=False, device="meta")
    assert converts(layer, name, recipe) is expected


def test_only_plain_linears_convert() -> None:
    assert not converts(nn.LayerNorm(4096, device="meta"), "norm", "tensorwise")
    assert not converts(nn.Embedding(128, 4096, device="meta"), "tok_embeddings", "tensorwise")


def fp8_job(corpus: str, recipe: str = "tensorwise") -> dict:
    """tiny_job's fields with FP8_SHAPE, bf16 and float8, on device auto (a CPU machine resolves it to cpu)."""
    job = tiny_job(corpus, model=FP8_SHAPE, training={"dtype": "bfloat16"}).model_dump(exclude_none=True)
    job["training"]["fp8"] = recipe
    job["resources"]["device"] = "auto"
    return job


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"training": {"dtype": "float32"}}, "spec.training.dtype bfloat16"),
        ({"resources": {"device": "cpu"}}, "spec.resources.device is cpu"),
        ({"lora": {"rank": 4}}, "spec.lora"),
    ],
)
def test_a_job_where_float8_cannot_run_is_refused_by_name(corpus: str, change: dict, named: str) -> None:
    job = fp8_job(corpus)
    for section, fields in change.items():
        job[section] = {**(job.get(section) or {}), **fields}
    with pytest.raises(ValidationError, match=named):
        JobSpecBody.model_validate(job)


def test_the_engine_refuses_float8_on_a_cpu_before_building_anything(corpus: str) -> None:
    job = JobSpecBody.model_validate(fp8_job(corpus))
    with pytest.raises(Float8Unavailable, match="needs a GPU with float8 tensor cores; this rank runs on cpu"):
        Trainer(job, device="cpu")
    check_float8_device("none", torch.device("cpu"))  # off: nothing to check


def test_the_converted_model_keeps_its_names_and_trains_close_to_bf16(corpus: str) -> None:
    job = JobSpecBody.model_validate(fp8_job(corpus))
    config = resolve_model(job.model)
    reference = build_model(config, seed=3)
    converted = parallelize(build_model(config, seed=3), None, job, torch.device("cpu"))
    (part,) = converted.parts
    expected = [f"layers.{i}.feed_forward.{w}" for i in range(config.n_layers) for w in ("w1", "w3")]
    assert converted.float8 == expected
    assert all(type(part.get_submodule(n)) is float8.float8_linear.Float8Linear for n in expected)
    assert type(part.get_submodule("output")) is nn.Linear
    assert part.state_dict().keys() == reference.state_dict().keys(), "checkpoints keep the same keys"

    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (reference, part):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # e4m3 keeps 3 mantissa bits (relative rounding 2^-4): at initialisation the loss is ln(vocab)
    # whatever the logits' small errors, so the two losses agree far inside that.
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    w1 = "layers.0.feed_forward.w1.weight"
    grads = dict(part.named_parameters())[w1].grad, dict(reference.named_parameters())[w1].grad
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < 0.15, "float8 gradients within a few e4m3/e5m2 roundings"


def test_a_rowwise_linear_trains_close_to_bf16() -> None:
    """Rowwise scaling converts only larger layers (out over 4096 or in over 2048 here); one such layer on CPU."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(2064, 4112, bias=False))
    converted = nn.Sequential(nn.Linear(2064, 4112, bias=False))
    converted.load_state_dict(reference.state_dict())
    assert apply_float8(converted, "rowwise", fsdp=False) == ["0"]
    assert type(converted[0]) is float8.float8_linear.Float8Linear
    x = torch.randn(64, 2064)
    outputs = []
    for model in (reference, converted):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        outputs.append(out.float().detach())
    # one e4m3 rounding of each operand (2^-4 relative) averaged over 2064 products: about 1 % of the output
    assert (outputs[1] - outputs[0]).norm() / outputs[0].norm() < 0.05
    grads = converted[0].weight.grad, reference[0].weight.grad
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < 0.15


def test_apply_float8_without_torchao_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    with pytest.raises(Float8Unavailable, match="needs torchao"):
        apply_float8(nn.Sequential(nn.Linear(64, 2048)), "tensorwise", fsdp=False)


def test_a_gpu_without_float8_tensor_cores_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(Float8Unavailable, match="compute capability 8.9 or newer .* NVIDIA A100-SXM4-80GB has 8.0"):
        check_float8_device("rowwise", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device("rowwise", torch.device("cuda", 0))


# ---- composition with the layouts, on CPU -----------------------------------------------------------------
@contextlib.contextmanager
def float8_on_cpu() -> Iterator[None]:
    """run_layout's `context` hook: lift the engine's CPU refusal inside the worker, so torch's CPU float8
    matmul stands in for a GPU's and the layouts' composition is tested here (jobs never get this)."""
    from trainctl.parallelism.layouts import float8 as layout

    refuse = layout.check_float8_device
    layout.check_float8_device = lambda recipe, device: None
    try:
        yield
    finally:
        layout.check_float8_device = refuse


def fp8_layout(corpus: str, **parallelism: int) -> JobSpecBody:
    job = tiny_job(corpus, steps=DEFAULT_STEPS, model=FP8_SHAPE, training=BF16_TP_TRAINING, **parallelism)
    data = job.model_dump(exclude_none=True)
    data["training"]["fp8"] = "tensorwise"
    data["resources"]["device"] = "auto"
    return JobSpecBody.model_validate(data)


@pytest.mark.parametrize("parallelism", [{"dp_shard": 2}, {"tp": 2}, {"pp": 2}], ids=["fsdp", "tp", "pp"])
def test_float8_composes_with_fsdp_tp_and_pp_like_one_process(pool, corpus: str, parallelism: dict) -> None:
    """FSDP2 (float8 all-gather, scales precomputed after each step), TP (DTensor Float8Linear weights) and PP
    against the single-process float8 run, every step's loss and gradients."""
    body = fp8_layout(corpus, **parallelism)
    hook = f"{__name__}:float8_on_cpu"
    run = run_layout(pool, body, context=hook)
    reference = run_layout(pool, single_process(body), context=hook)
    assert_equivalent(run, reference, loss_rtol=FP8_LAYOUT_LOSS_RTOL, grad_rtol=FP8_LAYOUT_GRAD_RTOL)
