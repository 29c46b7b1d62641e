"""Pipeline stage splitting: balance (embedding and output counted), placement, stage views."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainctl.parallelism.engine.loss import cross_entropy
from trainctl.parallelism.layouts.pipeline import split_pipeline_stages
from trainctl.parallelism.layouts.stage_split import (
    PipelineLayoutError,
    balanced_split,
    local_stage_indices,
    stage_rank,
)
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.presets import PRESETS


def stage_costs(ranges: list[range], emb: float = 1.0, out: float = 1.0) -> list[float]:
    costs = [float(len(r)) for r in ranges]
    costs[0] += emb
    costs[-1] += out
    return costs


def brute_force_best(n_layers: int, stages: int, emb: float = 1.0, out: float = 1.0) -> float:
    """The smallest achievable costliest stage, over every contiguous split."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, n_layers), stages - 1):
        bounds = (0, *cuts, n_layers)
        ranges = [range(a, b) for a, b in itertools.pairwise(bounds)]
        best = min(best, max(stage_costs(ranges, emb, out)))
    return best


@pytest.mark.parametrize(("n_layers", "stages"), [(4, 2), (8, 4), (7, 3), (16, 4), (10, 8), (5, 5), (12, 1)])
def test_split_is_contiguous_covering_and_optimal(n_layers: int, stages: int) -> None:
    ranges = balanced_split(n_layers, stages)
    assert len(ranges) == stages
    assert [i for r in ranges for i in r] == list(range(n_layers))
    assert all(len(r) >= 1 for r in ranges)
    assert max(stage_costs(ranges)) == brute_force_best(n_layers, stages)


def test_embedding_and_output_take_layers_off_the_end_stages() -> None:
    # 8 layers + embedding + output over 4 stages: the end stages carry one layer fewer.
    eight = [len(r) for r in balanced_split(8, 4)]
    assert max(stage_costs(balanced_split(8, 4))) == 3 and eight[0] <= min(eight[1:3]) and eight[-1] <= min(eight[1:3])
    assert [len(r) for r in balanced_split(6, 2)] == [3, 3]
    assert [len(r) for r in balanced_split(10, 4)] == [2, 3, 3, 2]
    # A heavy output head (e.g. a large vocabulary) moves layers to earlier stages.
    assert [len(r) for r in balanced_split(8, 2, output_cost=5.0)] == [6, 2]
    assert max(stage_costs(balanced_split(8, 2, output_cost=5.0), out=5.0)) == brute_force_best(8, 2, out=5.0)


def test_split_rejects_impossible_layouts() -> None:
    with pytest.raises(PipelineLayoutError, match="3 layers cannot fill 4 pipeline stages"):
        balanced_split(3, 4)
    with pytest.raises(PipelineLayoutError, match="num_stages"):
        balanced_split(3, 0)


def test_looped_placement_of_virtual_stages() -> None:
    assert local_stage_indices(0, 4, 2) == [0, 4]
    assert local_stage_indices(3, 4, 2) == [3, 7]
    assert [stage_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(PipelineLayoutError, match="pipeline rank 4 out of range"):
        local_stage_indices(4, 4, 1)


def test_stage_views_keep_names_and_share_no_containers() -> None:
    model = build_model(PRESETS["debug"], seed=3)
    full = dict(model.named_parameters())
    chunks = [c for rank in range(2) for c in split_pipeline_stages(model, pp_rank=rank, pp=2, virtual_stages=2)]
    assert sorted(c.index for c in chunks) == [0, 1, 2, 3]
    seen: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        names = dict(chunk.module.named_parameters())
        assert set(names).isdisjoint(seen), "a parameter is on two stages"
        seen.update(names)
        assert (chunk.module.tok_embeddings is not None) == chunk.is_first
        assert (chunk.module.output is not None) == (chunk.module.norm is not None) == chunk.is_last
    assert set(seen) == set(full)
    assert all(seen[n] is full[n] for n in full), "stages must reuse the model's parameters under their names"
    # Hooks registered on one stage stay on that stage (the views do not share hook tables).
    chunks[0].module.register_forward_hook(lambda *_: None)
    assert not chunks[1].module._forward_hooks and not model._forward_hooks


def test_stages_chained_reproduce_the_full_forward() -> None:
    model = build_model(PRESETS["debug"], seed=5)
    tokens = torch.randint(0, 256, (2, 16))
    want = model(tokens)
    chunks = sorted(
        (c for rank in range(2) for c in split_pipeline_stages(model, pp_rank=rank, pp=2, virtual_stages=2)),
        key=lambda c: c.index,
    )
    h = tokens
    for chunk in chunks:
        h = chunk.module(h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-rank gloo process group in this process (the runner's argument checks need a group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_runner_rejects_bad_schedules_and_batches(single_rank_group) -> None:
    from trainctl.parallelism.layouts.pipeline import PipelineRunner

    model = build_model(PRESETS["debug"], seed=0)
    one = split_pipeline_stages(model, pp_rank=0, pp=1)
    two = split_pipeline_stages(build_model(PRESETS["debug"], seed=0), pp_rank=0, pp=1, virtual_stages=2)
    cpu = torch.device("cpu")
    with pytest.raises(PipelineLayoutError, match="unknown pipeline schedule 'zb'"):
        PipelineRunner(one, schedule="zb", n_microbatches=2, group=single_rank_group, device=cpu, loss_fn=cross_entropy)
    with pytest.raises(PipelineLayoutError, match="'1f1b' runs one stage per rank, got 2"):
        PipelineRunner(two, schedule="1f1b", n_microbatches=2, group=single_rank_group, device=cpu, loss_fn=cross_entropy)
    with pytest.raises(PipelineLayoutError, match="interleaved_1f1b needs at least 2 virtual stages"):
        PipelineRunner(one, schedule="interleaved_1f1b", n_microbatches=2, group=single_rank_group, device=cpu, loss_fn=cross_entropy)
    runner = PipelineRunner(one, schedule="1f1b", n_microbatches=2, group=single_rank_group, device=cpu, loss_fn=cross_entropy)
    with pytest.raises(PipelineLayoutError, match="batch of 3 sequences is not divisible into 2 micro-batches"):
        runner.step(torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long))
