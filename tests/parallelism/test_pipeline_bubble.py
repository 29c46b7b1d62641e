"""The pipeline bubble the planner models (sizing.pipeline_bubble) against an event simulation of the
GPipe and 1F1B action orders, and the schedules' relative order."""

from __future__ import annotations

import pytest

from trainctl.parallelism.sizing.pipeline_bubble import bubble_fraction, bubble_seconds


def simulated_idle(schedule: str, p: int, m: int, f: float, b: float) -> float:
    """Idle fraction of one step: each rank runs its actions in schedule order, each when the rank is
    free and its input exists (forward from the previous stage, backward from the next)."""
    orders = []
    for stage in range(p):
        forwards = [("F", i) for i in range(m)]
        backwards = [("B", i) for i in range(m)]
        if schedule == "gpipe":
            orders.append(forwards + backwards)
            continue
        warmup = min(p - stage - 1, m)
        order = forwards[:warmup]
        for i in range(m - warmup):
            order += [forwards[warmup + i], backwards[i]]
        orders.append(order + backwards[m - warmup:])
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * p, [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            needs = [("F", s - 1, i)] if kind == "F" and s > 0 else [("B", s + 1, i)] if kind == "B" and s < p - 1 else []
            if kind == "B":
                needs.append(("F", s, i))
            if all(n in done for n in needs):
                start = max([clock[s], *(done[n] for n in needs)])
                clock[s] = done[(kind, s, i)] = start + (f if kind == "F" else b)
                position[s] += 1
    step = max(clock)
    return 1 - m * (f + b) / step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 4), (4, 16), (8, 3)])
def test_bubble_matches_the_simulated_schedule(schedule: str, p: int, m: int) -> None:
    assert bubble_fraction(schedule, p, m) == pytest.approx(simulated_idle(schedule, p, m, f=1.0, b=2.0))


def test_schedules_order_and_seconds() -> None:
    p, m = 4, 8
    one_f_one_b = bubble_seconds(1.0, "1f1b", p, m)
    assert one_f_one_b == pytest.approx(simulated_idle("1f1b", p, m, 1.0, 2.0) / (1 - simulated_idle("1f1b", p, m, 1.0, 2.0)))
    assert bubble_seconds(1.0, "interleaved_1f1b", p, m, v=1) == pytest.approx(one_f_one_b)
    assert bubble_seconds(1.0, "zero_bubble", p, m) < bubble_seconds(1.0, "interleaved_1f1b", p, m, v=2) < one_f_one_b
    assert bubble_seconds(1.0, "1f1b", 1, m) == 0.0
