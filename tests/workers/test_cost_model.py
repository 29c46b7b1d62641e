"""The cost model: message sizes by hand, alpha-beta times, contention, and the lower bound."""

from __future__ import annotations

import itertools
import random
from math import isclose

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.spec.presets import PRESETS
from trainctl.workers.placement import place
from trainctl.workers.placement.cost import (
    Collective,
    CostModelError,
    DimTraffic,
    Workload,
    build_traffic,
    evaluate,
    lower_bound,
    parameter_counts,
)
from trainctl.workers.placement.fabric import FabricIndex
from trainctl.workers.topology import simulated_topology
from trainctl.workers.topology.builders import rail_optimized_fleet

L8B = PRESETS["llama3-8b"]


def by_dim(traffic: list[DimTraffic]) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in traffic:
        out[t.dim] = out.get(t.dim, 0.0) + t.bytes_per_rank()
    return out


def test_alpha_beta_times() -> None:
    entry = DimTraffic("tp", [[0, 1, 2, 3]], [Collective("all_reduce", 4e6, 1)])
    assert isclose(entry.seconds(1e9, 1e-6), 2 * 3 * 1e-6 + 2 * 3 / 4 * 4e6 / 1e9)
    entry = DimTraffic("dp", [[0, 1, 2, 3]], [Collective("all_gather", 4e6, 2), Collective("reduce_scatter", 8e6, 1)])
    assert isclose(entry.seconds(1e9, 0.0), 2 * 0.75 * 4e6 / 1e9 + 0.75 * 8e6 / 1e9)
    assert isclose(entry.bytes_per_rank(), 0.75 * (8e6 + 8e6))
    entry = DimTraffic("pp", [[0, 1]], [Collective("send_recv", 1e6, 10)], pattern="pairwise")
    assert isclose(entry.seconds(1e9, 1e-6), 10 * (1e-6 + 1e-3)) and entry.bytes_per_rank() == 1e7


def test_tp_bytes_match_megatron() -> None:
    work = Workload(seq_len=4096, micro_batch_size=2, micro_batches=8, sequence_parallel=False)
    traffic = by_dim(build_traffic(RankGrid(tp=8, pp=4, dp_shard=2), L8B, work))
    act = 2 * 4096 * 4096 * 2  # b x s x h x bf16
    per_allreduce = 2 * 7 / 8 * act
    assert isclose(traffic["tp"], 4 * (32 // 4) * 8 * per_allreduce)
    sp = by_dim(build_traffic(RankGrid(tp=8, pp=4, dp_shard=2), L8B, Workload(seq_len=4096, micro_batch_size=2, micro_batches=8)))
    assert isclose(sp["tp"], traffic["tp"]), "SP moves the same bytes as TP all-reduces"
    assert isclose(traffic["pp"], 2 * 8 * act / 8)


def test_data_parallel_bytes_by_zero_stage() -> None:
    grid = RankGrid(dp_shard=4, tp=2)
    dense, _ = parameter_counts(L8B, grid)
    z3 = by_dim(build_traffic(grid, L8B, Workload(zero_stage=3)))["dp"]
    z1 = by_dim(build_traffic(grid, L8B, Workload(zero_stage=1)))["dp"]
    assert isclose(z3, 0.75 * dense * (4 + 2 * 2))
    assert isclose(z1, 0.75 * dense * (4 + 2))
    ddp = by_dim(build_traffic(RankGrid(dp_replicate=4, tp=2), L8B, Workload()))["dp"]
    assert isclose(ddp, 2 * 0.75 * dense * 4)
    hsdp = by_dim(build_traffic(RankGrid(dp_replicate=2, dp_shard=2, tp=2), L8B, Workload()))["dp"]
    assert isclose(hsdp, 0.5 * dense * 8 + 2 * 0.5 * dense / 2 * 4)


def test_parameter_count_of_llama3_8b() -> None:
    dense, expert = parameter_counts(L8B, RankGrid())
    assert 7.9e9 < dense < 8.1e9 and expert == 0


def test_cp_and_ep_bytes() -> None:
    work = Workload(seq_len=8192, micro_batches=2)
    cp = by_dim(build_traffic(RankGrid(cp=4, tp=2), L8B, work))["cp"]
    kv = 2 * (8192 / 4) * (8 // 2) * 128 * 2
    assert isclose(cp, 3 * 32 * 2 * (kv + 2 * kv))
    moe = PRESETS["moe-8x1b"]
    ep = by_dim(build_traffic(RankGrid(ep=4, dp_shard=4), moe, work))["ep"]
    routed = 8192 * 2 * 2048 * 2
    assert isclose(ep, 0.75 * routed * 4 * 16 * 2)
    with pytest.raises(CostModelError, match="ep=2 but the model has no MoE layers"):
        build_traffic(RankGrid(ep=2, dp_shard=2), L8B, work)


def test_time_follows_the_outermost_level() -> None:
    topo = simulated_topology(2, 4)
    index = FabricIndex.build(topo)
    traffic = build_traffic(RankGrid(tp=2, dp_shard=2), PRESETS["tiny"], Workload())
    inside = evaluate(traffic, [(0, 0), (0, 1), (0, 2), (0, 3)], index)
    across = evaluate(traffic, [(0, 0), (1, 0), (0, 1), (1, 1)], index)
    assert inside.level_by_dim == {"tp": "nvlink", "dp": "nvlink"} and not inside.split_groups
    assert across.level_by_dim == {"tp": "leaf", "dp": "nvlink"}
    assert across.split_groups["tp"] == [[0, 1], [2, 3]]
    tp = next(t for t in traffic if t.dim == "tp")
    assert isclose(inside.seconds_by_dim["tp"], tp.seconds(450e9, 2e-6))
    assert isclose(across.seconds_by_dim["tp"], tp.seconds(50e9, 5e-6))


def test_contention_on_oversubscribed_uplinks() -> None:
    pipeline = build_traffic(RankGrid(pp=2, tp=8), PRESETS["tiny"], Workload())
    slots = [(0, g) for g in range(8)] + [(4, g) for g in range(8)]  # stage 1 in the next scalable unit
    costs = {}
    for oversub in (1.0, 2.0, 4.0):
        index = FabricIndex.build(rail_optimized_fleet(8, su_nodes=4, sus_per_pod=2, oversubscription=oversub, name="c"))
        costs[oversub] = evaluate(pipeline, slots, index).seconds_by_dim["pp"]
    # one pipeline flow per rail leaf with 4 ports: never above p / o flows at 2:1 and 4:1 -> no slowdown
    assert costs[1.0] == costs[2.0] == costs[4.0]
    dense = build_traffic(RankGrid(pp=2, tp=1, dp_shard=16), PRESETS["tiny"], Workload())
    index1 = FabricIndex.build(rail_optimized_fleet(8, su_nodes=4, sus_per_pod=2, oversubscription=1.0, name="c"))
    index4 = FabricIndex.build(rail_optimized_fleet(8, su_nodes=4, sus_per_pod=2, oversubscription=4.0, name="c"))
    # 16 ranks per stage on 2 nodes of SU 0 and 2 of SU 1; every stage pair crosses on its own rail:
    # 2 flows per rail leaf of 4 ports, so 4:1 halves the bandwidth and 1:1 does not.
    slots = [(n, g) for n in (0, 1) for g in range(8)] + [(n, g) for n in (4, 5) for g in range(8)]
    entry = next(t for t in dense if t.dim == "pp")
    bw, latency = index1.level_bw["spine"], index1.level_latency["spine"]
    assert isclose(evaluate(dense, slots, index1).seconds_by_dim["pp"], entry.seconds(bw, latency))
    assert isclose(evaluate(dense, slots, index4).seconds_by_dim["pp"], entry.seconds(bw / 2, latency))


def test_lower_bound_is_never_beaten_exhaustively() -> None:
    topo = rail_optimized_fleet(3, gpus_per_node=2, su_nodes=2, sus_per_pod=1, oversubscription=2.0, name="b")
    index = FabricIndex.build(topo)
    for grid in (RankGrid(tp=2, dp_shard=2), RankGrid(pp=2, dp_shard=2), RankGrid(cp=2, tp=2)):
        traffic = build_traffic(grid, PRESETS["tiny"], Workload())
        bound = sum(lower_bound(traffic, index).values())
        slots = [(n, g) for n in range(3) for g in range(2)]
        best = min(evaluate(traffic, list(p), index).total_seconds for p in itertools.permutations(slots, grid.world_size))
        assert best >= bound * (1 - 1e-12)
        free = {n.name: set(n.gpus) for n in topo.nodes}
        assert isclose(place(grid, topo, free, model=PRESETS["tiny"]).comm_seconds, best, rel_tol=1e-9), grid.describe()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(2, 2, 1, 2), (1, 4, 1, 2), (2, 1, 2, 4), (1, 8, 1, 1), (4, 2, 1, 1)]))
def test_random_placements_never_beat_the_bound(seed: int, shape: tuple[int, int, int, int]) -> None:
    pp, dp, cp, tp = shape
    topo = rail_optimized_fleet(6, gpus_per_node=4, su_nodes=2, sus_per_pod=2, oversubscription=2.0, name="r")
    index = FabricIndex.build(topo)
    grid = RankGrid(pp=pp, dp_shard=dp, cp=cp, tp=tp)
    traffic = build_traffic(grid, PRESETS["tiny"], Workload())
    slots = [(n, g) for n in range(6) for g in range(4)]
    random.Random(seed).shuffle(slots)
    cost = evaluate(traffic, slots[: grid.world_size], index)
    bound = lower_bound(traffic, index)
    for dim, seconds in cost.seconds_by_dim.items():
        assert seconds >= bound[dim] * (1 - 1e-12), dim
