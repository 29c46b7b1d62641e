"""Baseline placement strategies the benchmark compares ours with. Each returns rank -> slot, or None.

- ray_pack: first fit by node id, ranks in node order (what Ray Train's packed placement group gives).
- megatron_block: Megatron's rank order on the lowest contiguous block of free GPUs (None if none).
- domain_constrained: the whole job inside the smallest topology domain that can hold it (Kueue
  topology-aware scheduling / Volcano network-topology style), nodes filled fullest-free first.
"""

from __future__ import annotations

from trainctl.workers.placement.fabric import FabricIndex, SlotId


def ray_pack(world: int, index: FabricIndex, free: dict[int, list[int]]) -> list[SlotId] | None:
    slots = [(n, g) for n in sorted(free) for g in free[n]]
    return slots[:world] if len(slots) >= world else None


def megatron_block(world: int, index: FabricIndex, free: dict[int, list[int]]) -> list[SlotId] | None:
    order = [(n, g) for n in range(len(index.node_names)) for g in index.node_gpus[n]]
    is_free = {(n, g) for n, gpus in free.items() for g in gpus}
    run = 0
    for i, slot in enumerate(order):
        run = run + 1 if slot in is_free else 0
        if run == world:
            return order[i - world + 1 : i + 1]
    return None


def domain_constrained(world: int, index: FabricIndex, free: dict[int, list[int]]) -> list[SlotId] | None:
    levels = [
        {n: n for n in range(len(index.node_names))},
        {n: index.node_unit[n] for n in range(len(index.node_names))},
        {n: index.node_leafset[n] for n in range(len(index.node_names))},
        {n: index.node_spineset[n] for n in range(len(index.node_names))},
        {n: 0 for n in range(len(index.node_names))},
    ]
    for domain_of in levels:
        totals: dict[int, int] = {}
        for n, gpus in free.items():
            totals[domain_of[n]] = totals.get(domain_of[n], 0) + len(gpus)
        fitting = [d for d, t in totals.items() if t >= world]
        if not fitting:
            continue
        chosen = min(fitting, key=lambda d: (totals[d], d))
        nodes = sorted((n for n in free if domain_of[n] == chosen), key=lambda n: (-len(free[n]), n))
        slots = [(n, g) for n in nodes for g in free[n]]
        return slots[:world]
    return None


STRATEGIES = {"ray-pack": ray_pack, "megatron-block": megatron_block, "domain-constrained": domain_constrained}
