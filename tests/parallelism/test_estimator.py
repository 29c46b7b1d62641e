"""The estimator's parameter, gradient and optimizer bytes equal the real sharded tensors (CPU fp32), and
its peaks hold within 10 % of the peaks measured on CPU under gloo (every data-parallel mode, TP, PP)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
from harness import tiny_job
from torch.distributed.tensor import DTensor

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.parallelism.sizing.estimator import (
    estimate_all,
    estimate_memory,
    flops_per_step,
    full_shapes,
    local_params,
)
from trainctl.parallelism.sizing.flops import (
    active_matmul_params,
    adapter_params,
    full_attention_flops_per_token,
    recompute_flops_per_token,
    training_flops_per_token,
)
from trainctl.spec.job import JobSpecBody, LoRASpec
from trainctl.spec.presets import PRESETS, MoEConfig, resolve_model

ROOT = Path(__file__).resolve().parents[2]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors by their local shard)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() in seen and storage.nbytes():
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure(rank: int, world_size: int, body_json: str) -> dict[str, int]:
    """Worker: bytes of gradients after one backward, then of parameters and optimizer state after a step."""
    from trainctl.parallelism.engine.trainer import Trainer

    trainer = Trainer(JobSpecBody.model_validate_json(body_json), rank=rank, world_size=world_size, device="cpu")
    params = trainer.model.parameters()
    trainer.forward_backward(trainer.loader.next_batch())
    grads = storage_bytes(p.grad for p in params if p.grad is not None)
    trainer.optimizer_step()
    state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"params": storage_bytes(params), "grads": grads, "optimizer": storage_bytes(state)}


def memory_bench() -> ModuleType:
    """bench/memory_modes.py (its cases and its measurement), loaded once per process."""
    name = "bench_memory_modes"
    if name not in sys.modules:
        loader = importlib.util.spec_from_file_location(name, ROOT / "bench" / "memory_modes.py")
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # its dataclasses look their module up
        loader.loader.exec_module(module)
    return sys.modules[name]


def measure_peak(rank: int, world_size: int, body_json: str) -> dict[str, int]:
    """Worker: the measured peak of a step on this rank (bench/memory_modes.py `measure_rank`)."""
    return memory_bench().measure_rank(rank, world_size, body_json)


CASES = {
    "single": ({}, {}, {}),
    "ddp-dp2": ({"dp_replicate": 2}, {}, {}),
    "zero1-dp2-adafactor": ({"dp_shard": 2, "zero_stage": 1}, {}, {"optimizer": "adafactor"}),
    "fsdp-dp4-padded": ({"dp_shard": 4, "zero_stage": 3}, {"vocab_size": 258}, {}),
    "hsdp-2x2-zero2": ({"dp_replicate": 2, "dp_shard": 2, "zero_stage": 2}, {}, {}),
    "pp2-tp2-sgd": ({"pp": 2, "tp": 2}, {}, {"optimizer": "sgd"}),
    "moe-ep2-fsdp": ({"dp_shard": 2, "ep": 2}, {"preset": "debug-moe"}, {}),
}


@pytest.mark.parametrize(("layout", "model", "training"), CASES.values(), ids=CASES.keys())
def test_param_grad_optimizer_bytes_are_exact(pool, corpus, layout, model, training):
    body = tiny_job(corpus, steps=1, model=model, training=training, **layout)
    measured = pool.run(measure, body.parallelism.world_size, body.model_dump_json())
    config = resolve_model(body.model)
    for rank, got in enumerate(measured):
        est = estimate_memory(ResolvedJob.resolve(body, model=config), rank)
        assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (got["params"], got["grads"], got["optimizer"]), rank


@pytest.mark.parametrize("layout", [{}, {"dp_shard": 2, "zero_stage": 1}, {"dp_shard": 2, "zero_stage": 3}], ids=["single", "zero1", "fsdp"])
def test_lora_state_is_exact(pool, corpus, layout):
    """Under LoRA only the adapters have gradients and optimizer state; frozen weights count as parameters."""
    body = tiny_job(corpus, steps=1, **layout)
    body = JobSpecBody.model_validate({**body.model_dump(), "lora": {"rank": 4, "target_modules": ["wq", "wv", "w2"]}})
    measured = pool.run(measure, body.parallelism.world_size, body.model_dump_json())
    config = resolve_model(body.model)
    for rank, got in enumerate(measured):
        est = estimate_memory(ResolvedJob.resolve(body, model=config), rank)
        assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (got["params"], got["grads"], got["optimizer"]), rank
    assert est.grads_bytes < est.params_bytes / 10


@pytest.mark.skipif(memory_bench().heap_reader() is None, reason="the heap is measured with glibc's mallinfo2")
@pytest.mark.parametrize("case", [c for c in memory_bench().CASES if c.name in memory_bench().TESTED], ids=lambda c: c.name)
def test_estimated_peaks_match_the_peaks_measured_under_gloo(pool, corpus, case):
    """Every rank's estimated peak within 10 % of the peak its step reaches on CPU under gloo: parameters,
    gradients and optimizer state with what DDP, ZeRO-1, ZeRO-2, FSDP and HSDP hold during the step
    (buckets, gathered parameters, unsharded gradients, reduce-scatter and broadcast buffers), TP, PP and
    PP over ZeRO-3 (bench/memory_modes.py measures it; without the working copies ZeRO-2's estimate is
    31 % under, ZeRO-3's 15 %, PP over ZeRO-3's 30 %: docs/engine.md)."""
    body = memory_bench().case_job(case, [corpus])
    measured = pool.run(measure_peak, case.world, body.model_dump_json())
    config = resolve_model(body.model)
    for rank, got in enumerate(measured):
        estimate = estimate_memory(ResolvedJob.resolve(body, model=config), rank).total_bytes
        assert estimate == pytest.approx(got["peak"], rel=0.10), \
            f"rank {rank}: estimated {estimate / 2**20:.1f} MiB, measured {got['peak'] / 2**20:.1f} MiB"


def test_sharding_divides_the_state_and_padding_is_counted(corpus):
    single = estimate_memory(ResolvedJob.resolve(tiny_job(corpus)), 0)
    fsdp = estimate_all(ResolvedJob.resolve(tiny_job(corpus, dp_shard=4)))
    assert all(e.params_bytes * 4 == single.params_bytes for e in fsdp)
    padded = tiny_job(corpus, dp_shard=4, model={"vocab_size": 258})
    by_name = {p.name: p for p in local_params(ResolvedJob.resolve(padded), 3)[0]}
    assert by_name["output.weight"].storage_shape == (65, 64) and by_name["output.weight"].shape == (63, 64)


def test_activation_checkpointing_and_context_parallel_shrink_activations(corpus):
    """What backward starts with (the forward's saved tensors, logits, the loss's temporaries) without
    gradients or working copies: full checkpointing keeps less, CP halves the tokens and so the bytes."""
    from trainctl.parallelism.sizing.activations import stage_params, step_activations
    from trainctl.parallelism.sizing.working_copies import WorkingCopies

    def backward_start(body: JobSpecBody) -> int:
        config = resolve_model(body.model)
        stage = stage_params([(p.name, p.storage_shape) for part in local_params(ResolvedJob.resolve(body, model=config), 0) for p in part])
        phases = {phase.name: phase for phase in step_activations(ResolvedJob.resolve(body, model=config), 0, stage, 0, WorkingCopies()).phases}
        return phases["backward start"].activations

    base = backward_start(tiny_job(corpus))
    full = backward_start(tiny_job(corpus, training={"activation_checkpointing": "full"}))
    assert full < base and backward_start(tiny_job(corpus, cp=2)) * 2 == base


def test_flops_per_step_follows_the_documented_formula(corpus):
    body = tiny_job(corpus)
    config = resolve_model(body.model)
    d, f, v, layers, s = 64, 128, 256, 4, 32
    kv = 2 * 16
    n_active = layers * (2 * d * d + 2 * d * kv + 3 * d * f) + d * v
    assert training_flops_per_token(config, s) == 6 * n_active + 6 * layers * s * d
    assert flops_per_step(config, body) == training_flops_per_token(config, s) * 8 * s


@pytest.mark.parametrize(
    ("overrides", "lora"),
    [
        ({}, None),
        ({"n_layers": 5, "moe": MoEConfig(num_experts=4, top_k=2, shared_expert=True, interval=2)}, LoRASpec(target_modules=["wq", "w2", "wo"])),
        ({"n_heads": 8, "n_kv_heads": 2, "moe": MoEConfig(num_experts=2, top_k=1)}, LoRASpec(rank=3, target_modules=["w1", "wv"])),
        ({"qkv_bias": True, "qk_norm": True, "explicit_head_dim": 24, "tie_embeddings": True}, None),
        ({"qkv_bias": True, "tie_embeddings": True}, LoRASpec(rank=2, target_modules=["wq", "wo"])),
    ],
)
def test_full_shapes_from_the_configuration_match_the_model(overrides, lora):
    """The estimator's shape table (never a built module) equals the model's named_parameters, order included."""
    from trainctl.parallelism.model.lora import apply_lora
    from trainctl.parallelism.model.transformer import Transformer

    config = replace(PRESETS["debug"], **overrides)
    with torch.device("meta"):
        model = Transformer(config)
    if lora is not None:
        apply_lora(model, lora, seed=0)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}  # tied: both names
    assert full_shapes(config, lora) == expected
    assert list(full_shapes(config, lora)) == list(expected)


HF_CASES = {
    "llama-tied-single": ("llama", {}),
    "qwen2-bias-tied-pp2-tp2": ("qwen2", {"pp": 2, "tp": 2}),
    "qwen3-qknorm-tp2-fsdp2": ("qwen3", {"tp": 2, "dp_shard": 2}),
}


@pytest.mark.parametrize(("family", "layout"), HF_CASES.values(), ids=HF_CASES.keys())
def test_estimates_of_imported_models_are_exact(pool, corpus, tmp_path, family, layout):
    """Tied embeddings (one matrix, or a copy per end stage under PP), q/k/v biases and q/k norms."""
    from hf_models import BYTES, save_family

    directory = save_family(family, tmp_path / family)
    body = tiny_job(corpus, steps=1, model={"from_pretrained": str(directory)}, data=BYTES, **layout)
    measured = pool.run(measure, body.parallelism.world_size, body.model_dump_json())
    config = resolve_model(body.model)
    for rank, got in enumerate(measured):
        est = estimate_memory(ResolvedJob.resolve(body, model=config), rank)
        assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (got["params"], got["grads"], got["optimizer"]), rank


def test_flops_of_moe_models_count_the_moe_layers():
    config = replace(PRESETS["debug"], n_layers=5, moe=MoEConfig(num_experts=4, top_k=2, shared_expert=True, interval=2))
    d, f, v, kv = 64, 128, 256, 2 * 16
    attention, dense = 2 * d * d + 2 * d * kv, 3 * d * f
    assert active_matmul_params(config) == d * v + 5 * attention + 3 * dense + 2 * (d * 4 + 2 * dense + dense)


def test_full_attention_convention_matches_torchtitan_on_llama_1b():
    """torchtitan reported 8,220,192,768 FLOPs/token for llama-1b at seq 2048; its N also counts the norm
    weights (a few hundred thousand parameters), ours leaves them out."""
    config = PRESETS["llama-1b"]
    assert training_flops_per_token(config, 2048) == 7_817_134_080  # Megatron: causal attention halved
    attention_half = 6 * config.n_layers * 2048 * config.n_heads * config.head_dim
    assert attention_half == 402_653_184
    assert full_attention_flops_per_token(config, 2048) == 7_817_134_080 + 402_653_184 == 8_219_787_264
    norms = (2 * config.n_layers + 1) * config.dim
    assert full_attention_flops_per_token(config, 2048) + 6 * norms == 8_220_192_768


def model_counts(config, lora: LoRASpec | None) -> tuple[int, int]:
    """(matmul weights a token passes through, adapter parameters), counted on the model itself (meta device)."""
    from trainctl.parallelism.model.lora import apply_lora
    from trainctl.parallelism.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    if lora is not None:
        apply_lora(model, lora, seed=0)
    params = dict(model.named_parameters())
    adapters = sum(p.numel() for name, p in params.items() if name.endswith((".lora_a", ".lora_b")))
    matmuls = sum(p.numel() for name, p in params.items()
                  if name.endswith(tuple(f"{m}.weight" for m in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))) or name == "output.weight")
    return matmuls, adapters


@pytest.mark.parametrize("lora", [LoRASpec(rank=4, target_modules=["wq", "wv", "w2"]),
                                  LoRASpec(rank=8, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])])
def test_lora_flops_count_frozen_weights_without_weight_gradients(lora):
    """A frozen weight costs 4 FLOPs per token (forward + input gradient), an adapter 6, attention keeps its
    factor; a job without LoRA is unchanged."""
    config = PRESETS["debug"]
    s, layers = 32, config.n_layers
    attention = 6 * layers * s * config.n_heads * config.head_dim
    n_frozen, n_adapters = model_counts(config, lora)
    n_dense, _ = model_counts(config, None)
    assert n_frozen == n_dense == active_matmul_params(config) and n_adapters > 0
    assert adapter_params(config, lora) == n_adapters
    assert training_flops_per_token(config, s, lora) == 4 * n_frozen + 6 * n_adapters + attention
    assert full_attention_flops_per_token(config, s, lora) == 4 * n_frozen + 6 * n_adapters + 2 * attention
    assert training_flops_per_token(config, s) == training_flops_per_token(config, s, None) == 6 * n_dense + attention
    assert full_attention_flops_per_token(config, s) == 6 * n_dense + 2 * attention
    # recompute: one more forward of the blocks (adapters included), never the output layer
    blocks_forward = 2 * (n_frozen - config.dim * config.vocab_size) + 2 * n_adapters + attention / 3
    assert recompute_flops_per_token(config, s, "full", lora) == pytest.approx(blocks_forward)


def test_lora_flops_of_moe_models_adapt_dense_blocks_only():
    config = replace(PRESETS["debug"], n_layers=5, moe=MoEConfig(num_experts=4, top_k=2, shared_expert=True, interval=2))
    lora = LoRASpec(rank=3, target_modules=["wq", "w2", "wo"])
    _, n_adapters = model_counts(config, lora)
    assert adapter_params(config, lora) == n_adapters
    attention = 6 * config.n_layers * 32 * config.n_heads * config.head_dim
    assert training_flops_per_token(config, 32, lora) == 4 * active_matmul_params(config) + 6 * n_adapters + attention


def test_flops_per_step_of_a_lora_job_counts_frozen_weights(corpus):
    body = tiny_job(corpus)
    lora_body = body.model_copy(update={"lora": LoRASpec(rank=4)})
    config = resolve_model(body.model)
    assert flops_per_step(config, lora_body) == training_flops_per_token(config, 32, lora_body.lora) * 8 * 32
    assert flops_per_step(config, lora_body) < flops_per_step(config, body)


def test_peak_flops_table_and_unknown_devices():
    from trainctl.parallelism.sizing.flops import mfu, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert peak_flops(None, "bfloat16") is None and peak_flops("Some Future GPU", "bfloat16") is None
    assert mfu(1e9, 1e3, 2, None) is None
    assert mfu(1e9, 1e3, 2, 1e12) == pytest.approx(0.5)


def saved_bytes_per_token(config, lora: LoRASpec | None, autocast: bool, tokens: int = 160) -> float:
    """Bytes autograd saves per token in one decoder block of `config` (fresh storages only: the block
    input counts, its parameters and autocast's copies of them do not), found with saved-tensor hooks;
    autocast's weight copies are told apart by size, so tokens x any width must not equal a weight's size."""
    from torch import nn

    from trainctl.parallelism.model.lora import apply_lora
    from trainctl.parallelism.model.transformer import TransformerBlock, rope_cos_sin

    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": TransformerBlock(config, 0)})
    if lora is not None:
        apply_lora(holder, lora, seed=0)
    block = holder.layers["0"]
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    weight_sizes = {p.numel() for p in block.parameters() if p.dim() == 2}
    x = torch.randn(1, tokens, config.dim, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(tokens), config.head_dim, config.rope_theta)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and storage.nbytes() // t.element_size() not in weight_sizes:  # nor a copy
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        block(x, cos, sin)
    return sum(saved.values()) / tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora", [None, ["wq", "wv"], ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]], ids=["full", "lora-qv", "lora-all"])
def test_the_block_activation_model_matches_what_autograd_saves(dtype, lora):
    """`activations.block_bytes` (eager) against the bytes a real block saves, within 1 %."""
    from trainctl.parallelism.sizing.activations import block_bytes

    config = replace(PRESETS["tiny"], dim=256, n_heads=4, n_kv_heads=2, ffn_dim=704)
    spec = LoRASpec(rank=8, target_modules=lora) if lora else None
    body = JobSpecBody.model_validate({"training": {"dtype": dtype}, **({"lora": spec.model_dump()} if spec else {})})
    torch.manual_seed(0)
    measured = saved_bytes_per_token(config, spec, autocast=dtype == "bfloat16")
    modelled = block_bytes(config, body, 0)
    assert modelled == pytest.approx(measured, rel=0.01), f"modelled {modelled:.0f} vs saved {measured:.0f} bytes per token"


def _bench_gpu(monkeypatch):
    """bench/gpu.py as a module (its job_spec builds each row's job)."""
    import importlib.util
    import sys

    loader = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(loader)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench)  # its dataclasses look their module up
    loader.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize(
    ("results", "rel", "expected_runs"),
    [
        # llama-1b s2048 eager, compiled, under NCCL, fully checkpointed and with LoRA (2026-11-27): 5 %
        ("results-gpu.json", 0.05, 5),
        # compiled bf16 and float8 (tensorwise) on llama-1b and llama-3b at s2048 and llama-1b at s8192
        # (2026-11-28): the 10 %
        ("results-gpu-fp8.json", 0.10, 6),
    ],
)
def test_estimates_match_the_peaks_measured_on_a_gpu(monkeypatch, results, rel, expected_runs):
    """The estimator against the peaks `bench/gpu.py` measured on one H200, so a change to the
    activation model cannot silently lose what the GPU showed (docs/benchmarks.md, "GPU")."""
    import json

    bench = _bench_gpu(monkeypatch)
    saved = json.loads((ROOT / "bench" / results).read_text())
    checked = 0
    for row in saved["rows"]:
        run = next((r for r in bench.RUNS if r.name == row["run"]), None)
        if run is None or "peak_bytes" not in row:  # the torchtitan peers
            continue
        job = bench.job_spec(run, False, row["ranks"], saved["steps"], saved["micro_batch"],
                             row.get("seq_len", saved.get("seq_len")), row.get("preset", "llama-1b"))
        estimate = estimate_memory(ResolvedJob.resolve(JobSpecBody.model_validate(job)), 0).total_bytes
        assert estimate == pytest.approx(row["peak_bytes"], rel=rel), \
            f"{row.get('case', '')} {row['run']}: {estimate / 2**30:.2f} GiB vs {row['peak_bytes'] / 2**30:.2f} measured"
        checked += 1
    assert checked == expected_runs
