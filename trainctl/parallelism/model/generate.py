"""Sampling from a trained model: greedy, temperature, top-p (nucleus), with or without a KV cache.

`generate(model, prompt_ids, ...)` runs on a plain `model.Transformer` (weights from
`pretrained.load_weights`). With `use_cache`, the prompt is run once (prefill) and each new token
attends to the cached keys and values of every layer, so a step costs one token's work; without it
every step re-runs the whole sequence through `Transformer.forward`. Both compute the same logits
(the cached path reuses the model's own projections, RoPE and norms, at the token's absolute
position), so greedy decoding gives the same text either way (tested). A row stops at an
end-of-sequence id (`stop_ids`). `chat_prompt` renders a prompt as a user message with the tokenizer's
chat template (`trainctl generate --chat`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainctl.parallelism.data.tokenizer import TransformersTokenizer, load_tokenizer
from trainctl.parallelism.model.transformer import Transformer, repeat_kv


@dataclass
class KVCache:
    """Per layer, keys and values [batch, kv_heads, positions, head_dim] of every position so far."""

    keys: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Positions cached."""
        return next(iter(self.keys.values())).shape[2] if self.keys else 0


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal attention of new queries (at positions past..past+s-1) over all keys [0, past+s)."""
    s, total = q.shape[2], k.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if s == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    allowed = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(s, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [batch, s, vocab] of `tokens` continuing the sequence in `cache` (which is extended)."""
    past = cache.length
    b, s = tokens.shape
    positions = torch.arange(past, past + s, device=tokens.device)
    cos, sin = model.rope(positions)
    h = model.tok_embeddings(tokens)
    for name, layer in model.layers.items():
        attn = layer.attention
        x = layer.attention_norm(h)
        q, k, v = (t.transpose(1, 2) for t in attn.project(x, cos, sin))
        if name in cache.keys:
            k = torch.cat([cache.keys[name], k], dim=2)
            v = torch.cat([cache.values[name], v], dim=2)
        cache.keys[name], cache.values[name] = k, v
        out = _attend(q, k, v, past)
        h = h + attn.wo(out.transpose(1, 2).reshape(b, s, -1))
        ffn = layer.moe if hasattr(layer, "moe") else layer.feed_forward
        h = h + ffn(layer.ffn_norm(h))
    return model.output(model.norm(h))


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of `logits` [batch, vocab]: argmax when temperature is 0, else a sample
    from the temperature-scaled distribution restricted to the smallest set of tokens whose
    probability reaches `top_p`."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    use_cache: bool = True,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    pad_id: int | None = None,
) -> torch.Tensor:
    """`prompt` [batch, n] followed by up to `max_new_tokens` generated tokens. A row that produces one
    of `stop_ids` (end of sequence) is finished: its later tokens are `pad_id` (default: the first stop
    id), and generation ends once every row is finished, as transformers' `generate` does."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1 (got {max_new_tokens}, {temperature}, {top_p})")
    model.eval()
    device = prompt.device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = prompt
    cache = KVCache()
    step_input = prompt
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    pad = stop_ids[0] if pad_id is None and stop_ids else pad_id
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        logits = forward_cached(model, step_input, cache)[:, -1] if use_cache else model(tokens)[:, -1]
        chosen = next_token(logits, temperature, top_p, generator)
        if len(stops):
            chosen = torch.where(finished, pad, chosen)
            finished |= torch.isin(chosen, stops)
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        step_input = chosen[:, None]
        if finished.all():
            break
    return tokens


def decode(tokenizer: str, ids: list[int]) -> str:
    """Text of `ids` under the spec's tokenizer (`byte`, a tokenizer.json or a tokenizer directory); bad
    UTF-8 is replaced."""
    if Path(tokenizer).expanduser().is_dir():  # a Hugging Face tokenizer directory
        return TransformersTokenizer(Path(tokenizer).expanduser()).hf.decode(ids)
    if tokenizer == "byte":
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer))).decode(ids)


def encode(tokenizer: str, text: str) -> list[int]:
    """Token ids of `text` under the spec's tokenizer."""
    return [int(i) for i in load_tokenizer(tokenizer).encode(text.encode())]


def chat_prompt(hf_tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as one user message rendered with the tokenizer's chat template and the
    generation prompt, as `apply_chat_template(..., add_generation_prompt=True)` gives them (rendered
    within the data pipeline's limits: `chat_render`)."""
    from trainctl.parallelism.data.chat import ChatError
    from trainctl.parallelism.data.chat_render import TemplateLimitExceeded, conversation_budget, render

    if not getattr(hf_tokenizer, "chat_template", None):
        raise ChatError("--chat: the tokenizer has no chat template")
    messages = [{"role": "user", "content": text}]
    try:
        budget = conversation_budget(messages, "--prompt")
        rendered = render(hf_tokenizer, messages, generation_prompt=True, budget=budget)
    except TemplateLimitExceeded:
        raise
    except Exception as exc:  # the template's own errors (jinja2 exceptions, raise_exception calls)
        raise ChatError(f"--chat: the chat template cannot render the prompt: {exc}") from exc
    return list(hf_tokenizer(rendered, add_special_tokens=False)["input_ids"])
