"""Using what was trained: the Hugging Face export loads in transformers with the same logits, and
`generate` gives the same greedy text with and without the KV cache (and as transformers does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import tiny_job

from trainctl.cli.main import main as trainctl_main
from trainctl.parallelism.checkpoint.hf_export import ExportError, hf_state_dict
from trainctl.parallelism.checkpoint.pretrained import load_weights, open_checkpoint
from trainctl.parallelism.model.generate import KVCache, encode, forward_cached, generate
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.presets import resolve_model

transformers = pytest.importorskip("transformers")


def _engine_model(root: Path) -> torch.nn.Module:
    source = open_checkpoint(root)
    model = build_model(source.config, 0)
    model.load_state_dict(load_weights(source))
    return model.eval()


def test_export_loads_in_transformers_with_the_same_logits(base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "hf"
    assert trainctl_main(["export", str(base_run), "--out", str(out)]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2

    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = _engine_model(base_run)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        got = hf(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(expected[:, 0], expected[:, -1])  # positions matter: RoPE is exercised


def test_bf16_export_and_refusal_of_moe_that_mixtral_cannot_hold(base_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    assert trainctl_main(["export", str(base_run), "--out", str(out), "--dtype", "bfloat16"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert next(hf.parameters()).dtype == torch.bfloat16
    moe = resolve_model(tiny_job("unused", model={"preset": "debug-moe", "moe": {"num_experts": 4, "shared_expert": True}}).model)
    with pytest.raises(ExportError, match="spec.model.moe.shared_expert: Mixtral has no shared expert"):
        hf_state_dict(build_model(moe, 0).state_dict(), moe)


def test_greedy_text_is_the_same_with_and_without_the_kv_cache(base_run: Path) -> None:
    model = _engine_model(base_run)
    prompt = torch.tensor([encode("byte", "the model trains"), encode("byte", "and every rank m")])
    cached = generate(model, prompt, max_new_tokens=24, use_cache=True)
    uncached = generate(model, prompt, max_new_tokens=24, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, : prompt.shape[1]], prompt) and cached.shape == (2, prompt.shape[1] + 24)

    # The cached forward's logits (prefill, then one token at a time) equal the full forward's.
    cache = KVCache()
    steps = [forward_cached(model, cached[:, :10], cache)] + [forward_cached(model, cached[:, i : i + 1], cache) for i in range(10, 20)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(steps, dim=1), model(cached[:, :20]), rtol=1e-5, atol=1e-5)


def test_greedy_generation_matches_transformers(base_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert trainctl_main(["export", str(base_run), "--out", str(out)]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt = torch.tensor([encode("byte", "the model trains")])
    ours = generate(_engine_model(base_run), prompt, max_new_tokens=16)
    theirs = hf.generate(prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_generate_command_and_sampling(base_run: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["generate", str(base_run), "--prompt", "the model", "--max-new-tokens", "12", "--device", "cpu"]
    assert trainctl_main(args) == 0
    with_cache = capsys.readouterr().out
    assert trainctl_main([*args, "--no-cache"]) == 0
    assert capsys.readouterr().out == with_cache and with_cache.startswith("the model")

    model = _engine_model(base_run)
    prompt = torch.tensor([encode("byte", "the")])
    sampled = [generate(model, prompt, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=s) for s in (1, 1, 2)]
    assert torch.equal(sampled[0], sampled[1])  # seeded
    narrow = generate(model, prompt, max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=3)
    assert torch.equal(narrow, generate(model, prompt, max_new_tokens=12))  # top-p -> 0 is greedy
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, max_new_tokens=1, top_p=0.0)
