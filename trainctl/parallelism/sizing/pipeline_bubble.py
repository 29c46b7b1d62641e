"""The pipeline bubble of the engine's schedules (`parallelism.pp_schedule`), from the configuration.

For `p` pipeline ranks, `m` micro-batches per step, `v` stages per rank, and per-micro-batch stage
times F (forward), B (input-gradient backward) and W (weight-gradient backward), the idle fraction
of an ideal step (no communication, balanced stages) is

    gpipe, 1f1b          (p - 1) / (m + p - 1)
    interleaved_1f1b     (p - 1) / (v m + p - 1)
    zero_bubble (ZB-H1)  (p - 1)(F + B - W) / (v m (F + B + W) + (p - 1)(F + B - W))

(Huang et al. 2019, GPipe; Narayanan et al. 2021, interleaved 1F1B; Qi et al. 2023, zero bubble).
bench/pipeline_bubble.py checks that torch's schedules reach these figures for v = 1 (and 2 for
interleaved 1F1B); the division by v for zero_bubble with v > 1 is this model's assumption, as for
interleaved 1F1B. With F = B = W (the backward's two halves each cost a forward), ZB-H1's bubble
is a third of 1F1B's.
"""

from __future__ import annotations


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """Idle fraction of a step of `schedule` (formulas in the module docstring); 0 for one stage, NaN
    for a zero_bubble step with no work at all."""
    if p <= 1:
        return 0.0
    if schedule == "zero_bubble":
        idle = (p - 1) * max(f + b - w, 0.0)
        return idle / (v * m * (f + b + w) + idle) if f + b + w > 0 else float("nan")
    chunks = v if schedule == "interleaved_1f1b" else 1
    return (p - 1) / (chunks * m + p - 1)


def bubble_seconds(compute_seconds: float, schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle seconds a pipeline adds to `compute_seconds` of busy work per rank and step."""
    fraction = bubble_fraction(schedule, p, m, v)
    return compute_seconds * fraction / (1.0 - fraction)
