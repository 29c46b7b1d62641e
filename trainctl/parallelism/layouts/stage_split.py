"""Which layers each pipeline stage holds and which stages a pipeline rank runs: pure arithmetic (no
torch), shared by the pipeline layout and the memory estimator."""

from __future__ import annotations

from functools import cache


class PipelineLayoutError(ValueError):
    """A pipeline layout that cannot be built (names the offending setting)."""


def balanced_split(
    n_layers: int, num_stages: int, *, embedding_cost: float = 1.0, output_cost: float = 1.0
) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the costliest stage.

    Stage 0 also carries `embedding_cost` and the last stage `output_cost` (in layer-equivalents).
    Every stage gets at least one layer. Among optimal splits the one with the smallest sum of squared
    stage costs (the most even) is chosen, then the lexicographically first.
    """
    if num_stages < 1:
        raise PipelineLayoutError(f"num_stages must be >= 1, got {num_stages}")
    if n_layers < num_stages:
        raise PipelineLayoutError(f"{n_layers} layers cannot fill {num_stages} pipeline stages (one layer each at least)")
    if embedding_cost < 0 or output_cost < 0:
        raise PipelineLayoutError("embedding_cost and output_cost must be >= 0")

    def cost(stage: int, start: int, end: int) -> float:
        extra = (embedding_cost if stage == 0 else 0.0) + (output_cost if stage == num_stages - 1 else 0.0)
        return (end - start) + extra

    @cache
    def best(stage: int, start: int) -> tuple[float, float, tuple[int, ...]]:
        """(max cost, sum of squares, end offsets) for stages `stage..` covering layers `start..`."""
        if stage == num_stages - 1:
            c = cost(stage, start, n_layers)
            return c, c * c, (n_layers,)
        options = []
        for end in range(start + 1, n_layers - (num_stages - stage - 1) + 1):
            c = cost(stage, start, end)
            rest_max, rest_sq, rest_ends = best(stage + 1, end)
            options.append((max(c, rest_max), c * c + rest_sq, (end, *rest_ends)))
        return min(options)

    ends = best(0, 0)[2]
    starts = (0, *ends[:-1])
    return [range(s, e) for s, e in zip(starts, ends, strict=True)]


def stage_rank(stage_index: int, pp: int) -> int:
    """Pipeline rank that runs stage `stage_index` (looped placement)."""
    return stage_index % pp


def local_stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages run by pipeline rank `pp_rank`, in order."""
    if not 0 <= pp_rank < pp:
        raise PipelineLayoutError(f"pipeline rank {pp_rank} out of range [0, {pp})")
    return [pp_rank + v * pp for v in range(virtual_stages)]
