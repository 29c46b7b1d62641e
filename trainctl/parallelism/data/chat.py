"""Chat records: a conversation rendered with the model's own chat template, and which tokens the loss covers.

`conversation_tokens(tokenizer, messages, where)` returns the token ids of the rendered conversation
(the tokenizer's own template, rendered as `apply_chat_template` renders it but within a size and time
limit: `chat_render`) and a mask that is 1 on the assistant's tokens only.

The mask comes from one of two methods, picked per tokenizer:

- Generation markers. A template with `{% generation %}` blocks: the tokens of the characters those
  blocks render, found as `apply_chat_template(return_assistant_tokens_mask=True)` finds them.
- Conversation prefixes. A template without markers: the text of assistant message `i` is what the
  rendering of messages[: i + 1] adds to the rendering of messages[: i] with the generation prompt
  (so the prompt header, e.g. `<|assistant|>`, stays out of the loss and whatever the template closes
  the turn with, e.g. an end-of-turn token, is in it, as with markers). This needs every rendering
  of a prefix to be a prefix of the full rendering; a template that rewrites earlier turns (e.g.
  drops past reasoning) breaks that, and the record is refused with an error that says so. Tokens
  whose characters fall in those spans (the fast tokenizer's offsets) are the assistant's.

Records are checked first: a list of {role, content} mappings with roles in `ROLES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trainctl.parallelism.data.chat_render import (
    RenderBudget,
    TemplateLimitExceeded,
    conversation_budget,
    render,
)
from trainctl.parallelism.errors import ConfigurationError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""Roles a chat record may use; any other is an error naming the file and record."""


class ChatError(ConfigurationError):
    """A chat record or template that cannot give an assistant-token mask (names file and record)."""


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """`messages` as a list of {role, content} dicts, or ChatError naming the spec field and `where` (file and record)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise ChatError(f"spec.data.messages_field: {where}: the conversation is not a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ChatError(f"spec.data.messages_field: {where}: message {i} is not a {{role, content}} mapping")
        if message["role"] not in ROLES:
            raise ChatError(f"spec.data.messages_field: {where}: message {i} has unknown role {message['role']!r} (known: {', '.join(sorted(ROLES))})")
        out.append(dict(message))
    if not any(m["role"] == "assistant" for m in out):
        raise ChatError(f"spec.data.messages_field: {where}: the conversation has no assistant message, so nothing to train on")
    return out


def has_generation_markers(hf_tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant text with `{% generation %}` blocks."""
    template = hf_tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    return isinstance(template, str) and "generation" in template and "endgeneration" in template


def conversation_tokens(hf_tokenizer: Any, messages: list[dict[str, Any]], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, assistant mask) of one checked conversation, both int64 / uint8 arrays."""
    if not getattr(hf_tokenizer, "chat_template", None):
        raise ChatError(f"spec.data.tokenizer: the tokenizer has no chat template, so {where} cannot be rendered")
    budget = conversation_budget(messages, where)
    try:
        if has_generation_markers(hf_tokenizer):
            return _marked(hf_tokenizer, messages, budget)
        return _by_prefixes(hf_tokenizer, messages, where, budget)
    except (ChatError, TemplateLimitExceeded):
        raise
    except Exception as exc:  # the template's own errors (jinja2 exceptions, raise_exception calls)
        raise ChatError(f"spec.data.messages_field: {where}: the chat template cannot render this conversation: {exc}") from exc


def _marked(hf_tokenizer: Any, messages: list[dict[str, Any]], budget: RenderBudget) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and mask as `apply_chat_template(..., return_assistant_tokens_mask=True)` gives them: the
    tokens from the one holding a block's first character to the one holding its last."""
    spans: list[tuple[int, int]] = []
    text = render(hf_tokenizer, messages, generation_prompt=False, budget=budget, generation_spans=spans)
    encoded = hf_tokenizer(text, add_special_tokens=False)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for start, end in spans:
        first, last = encoded.char_to_token(0, start), encoded.char_to_token(0, end - 1)
        if first is None:  # past the tokens (transformers stops here too)
            break
        mask[first : last + 1 if last else len(ids)] = 1
    return ids, mask


def _render(hf_tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, budget: RenderBudget) -> str:
    return render(hf_tokenizer, messages, generation_prompt=generation_prompt, budget=budget)


def _by_prefixes(
    hf_tokenizer: Any, messages: list[dict[str, Any]], where: str, budget: RenderBudget
) -> tuple[np.ndarray, np.ndarray]:
    if not getattr(hf_tokenizer, "is_fast", False):
        raise ChatError(
            f"spec.data.tokenizer: the chat template has no {{% generation %}} markers and the tokenizer is not a fast "
            f"tokenizer (no character offsets), so the assistant tokens of {where} cannot be found"
        )
    full = _render(hf_tokenizer, messages, False, budget)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(hf_tokenizer, messages[:i], True, budget) if i else ""
        through = _render(hf_tokenizer, messages[: i + 1], False, budget)
        if not (through.startswith(before) and full.startswith(through)):
            raise ChatError(
                f"spec.data.tokenizer: {where}: the chat template renders message {i} differently in a prefix of the conversation than in the "
                "whole, so its assistant tokens cannot be found without {% generation %} markers; add them to the template"
            )
        spans.append((len(before), len(through)))
    encoded = hf_tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for t, (start, end) in enumerate(encoded["offset_mapping"]):
        if end > start and any(lo <= start and end <= hi for lo, hi in spans):
            mask[t] = 1
    return ids, mask
