"""The perplexity of a loss, as the progress line and the run report show it (no heavy imports: the
progress line loads it)."""

from __future__ import annotations

import math

MAX_EXP = 700.0
"""Above this a loss's exp overflows a float (exp(709.8) does): its perplexity reads "inf"."""


def perplexity(loss: float) -> str:
    """exp(loss), the perplexity of a mean cross-entropy loss, to 4 significant digits."""
    if math.isnan(loss):
        return "nan"
    return f"{math.exp(loss):.4g}" if loss <= MAX_EXP else "inf"
