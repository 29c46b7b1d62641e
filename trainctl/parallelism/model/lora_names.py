"""Names of LoRA adapters and the layers they attach to (no torch), shared by the LoRA model code and the
memory estimator."""

from __future__ import annotations

PARENTS = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
           "w1": "feed_forward", "w2": "feed_forward", "w3": "feed_forward"}
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


def is_adapter(name: str) -> bool:
    """Whether a (canonical) parameter name is a LoRA adapter."""
    return name.endswith(ADAPTER_SUFFIXES)
