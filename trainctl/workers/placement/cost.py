"""The communication cost model: bytes each parallel dimension moves per step, and their alpha-beta time.

Per step and per rank (formulas and sources in docs/placement.md):

- TP / SP: per layer and micro-batch, 2 all-reduces forward and 2 backward of the activation
  (b x s/cp x h); with sequence parallel each all-reduce is an all-gather plus a reduce-scatter.
- CP: ring attention passes each rank's K/V shard around the ring (cp - 1 steps) forward, and K/V
  plus their gradients backward.
- EP: per MoE layer and micro-batch, dispatch and combine all-to-alls forward and backward.
- PP: each micro-batch's activation forward and its gradient backward cross every stage boundary.
- DP / ZeRO: reduce-scatter of gradients and all-gather of parameters over the shard group (ZeRO-3
  gathers twice), all-reduce of the (sharded) gradients over the replicate group.

A collective over a group of g ranks costs `steps x alpha + (g - 1) / g x bytes / beta` (ring
algorithms), with alpha the latency and beta the per-GPU bandwidth of the outermost level the group
spans (inside a node with per-pair links: its best ring through them; across nodes: capped by its
members' PCIe paths to their NICs and paying their latency; `FabricIndex.link`), beta
divided by the contention on oversubscribed switch uplinks that the job's own groups of the same
dimension create. A dimension takes as long as its slowest group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import ceil
from typing import Literal

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.spec.presets import ModelConfig
from trainctl.workers.placement.fabric import LEVELS, FabricIndex, SlotId
from trainctl.workers.topology.model import TIERS

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
Pattern = Literal["ring", "all_to_all", "pairwise"]
SPLIT_DIMS: tuple[str, ...] = ("tp", "ep", "cp")
"""Dimensions whose groups should never cross an NVLink domain, most important first."""


class CostModelError(ValueError):
    """A layout the cost model cannot describe (names the mismatch)."""


@dataclass(frozen=True)
class Workload:
    """The per-step shape of a job, beyond the model: what sets the message sizes."""

    seq_len: int = 4096
    """Tokens per sample."""
    micro_batch_size: int = 1
    """Samples per micro-batch per data-parallel rank."""
    micro_batches: int = 8
    """Micro-batches per step per data-parallel rank (gradient accumulation or pipeline micro-batches)."""
    activation_bytes: int = 2
    """Bytes per activation / parameter element on the wire (2 = bf16)."""
    gradient_bytes: int = 4
    """Bytes per gradient element in reductions (4: the engine reduces in float32)."""
    zero_stage: int = 3
    """0 (replicate), 1/2 (shard optimizer state / gradients), 3 (shard parameters, FSDP)."""
    sequence_parallel: bool = True
    """TP collectives as all-gather + reduce-scatter (same bytes as all-reduce, twice the messages)."""

    @classmethod
    def from_job(cls, job: ResolvedJob) -> Workload:
        """From a resolved job's spec and grid; micro_batch_size `auto` counts as 1 (the engine picks it
        at start-up)."""
        training, data, par = job.spec.training, job.spec.data, job.spec.parallelism
        micro = 1 if training.micro_batch_size == "auto" else training.micro_batch_size
        per_step = training.global_batch_size // max(1, job.grid.dp * micro)
        elem = 2 if training.dtype == "bfloat16" else 4
        return cls(
            seq_len=data.seq_len,
            micro_batch_size=micro,
            micro_batches=max(1, per_step),
            activation_bytes=elem,
            gradient_bytes=4,
            zero_stage=par.zero_stage,
            sequence_parallel=par.sequence_parallel,
        )


@dataclass(frozen=True)
class Collective:
    """One kind of collective a dimension issues, `count` times per step with a `size`-byte buffer."""

    op: Op
    size: float
    """Bytes: the full buffer for all-reduce / all-gather / reduce-scatter, the send buffer for
    all-to-all, the message for send/recv."""
    count: float


@dataclass(frozen=True)
class DimTraffic:
    """The traffic of one parallel dimension over its groups."""

    dim: str
    """Reported dimension: tp, cp, ep, pp or dp."""
    groups: list[list[int]]
    collectives: list[Collective]
    pattern: Pattern = "ring"
    """ring: NCCL rings (one flow per direction leaves each switch a group spans); all_to_all: every
    member sends to every other; pairwise: point-to-point between consecutive members (pipeline)."""

    @property
    def pairwise(self) -> bool:
        return self.pattern == "pairwise"

    def bytes_per_rank(self) -> float:
        """Bytes one rank sends per step."""
        g = len(self.groups[0])
        total = 0.0
        for c in self.collectives:
            if c.op == "all_reduce":
                total += 2 * (g - 1) / g * c.size * c.count
            elif c.op == "send_recv":
                total += c.size * c.count
            else:
                total += (g - 1) / g * c.size * c.count
        return total

    def seconds(self, bandwidth: float, latency: float) -> float:
        """Alpha-beta time of all collectives over one group at the given bytes/s and seconds."""
        g = len(self.groups[0])
        total = 0.0
        for c in self.collectives:
            if c.op == "all_reduce":
                t = 2 * (g - 1) * latency + 2 * (g - 1) / g * c.size / bandwidth
            elif c.op == "send_recv":
                t = latency + c.size / bandwidth
            else:
                t = (g - 1) * latency + (g - 1) / g * c.size / bandwidth
            total += t * c.count
        return total


def parameter_counts(model: ModelConfig, grid: RankGrid) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of the heaviest pipeline stage."""
    h, hd = model.dim, model.head_dim
    attn = 2 * h * model.n_heads * hd + 2 * h * model.n_kv_heads * hd
    ffn = 3 * h * model.ffn_dim
    layers = ceil(model.n_layers / grid.pp)
    moe_layers = ceil(sum(model.is_moe_layer(i) for i in range(model.n_layers)) / grid.pp)
    dense = layers * attn + (layers - moe_layers) * ffn
    expert = 0.0
    if model.moe is not None:
        dense += moe_layers * (h * model.moe.num_experts + (ffn if model.moe.shared_expert else 0))
        expert = moe_layers * (model.moe.num_experts / grid.ep) * ffn / grid.tp
    dense += model.vocab_size * h * (2 if grid.pp == 1 else 1)
    return dense / grid.tp, expert


def build_traffic(grid: RankGrid, model: ModelConfig, work: Workload) -> list[DimTraffic]:
    """Every dimension's groups and collectives per step (dimensions of degree 1 move nothing)."""
    if model.moe is None and grid.ep > 1:
        raise CostModelError(f"ep={grid.ep} but the model has no MoE layers")
    h, e = model.dim, work.activation_bytes
    layers = ceil(model.n_layers / grid.pp)
    moe_layers = ceil(sum(model.is_moe_layer(i) for i in range(model.n_layers)) / grid.pp)
    tokens = work.micro_batch_size * work.seq_len / grid.cp
    nm = work.micro_batches
    out: list[DimTraffic] = []
    if grid.tp > 1:
        act = tokens * h * e
        ops = (
            [Collective("all_gather", act, 4 * layers * nm), Collective("reduce_scatter", act, 4 * layers * nm)]
            if work.sequence_parallel
            else [Collective("all_reduce", act, 4 * layers * nm)]
        )
        out.append(DimTraffic("tp", grid.groups("tp"), ops))
    if grid.cp > 1:
        kv_heads = max(1, model.n_kv_heads // grid.tp)
        kv = 2 * tokens * kv_heads * model.head_dim * e
        steps = (grid.cp - 1) * layers * nm
        out.append(DimTraffic("cp", grid.groups("cp"), [Collective("send_recv", kv, steps), Collective("send_recv", 2 * kv, steps)]))
    if grid.ep > 1 and model.moe is not None:
        routed = tokens / grid.tp * model.moe.top_k * h * e
        out.append(
            DimTraffic("ep", grid.groups("ep"), [Collective("all_to_all", routed, 4 * moe_layers * nm)], pattern="all_to_all")
        )
    if grid.pp > 1:
        boundary = tokens * h * e / grid.tp
        out.append(DimTraffic("pp", grid.groups("pp"), [Collective("send_recv", boundary, 2 * nm)], pattern="pairwise"))
    dense, expert = parameter_counts(model, grid)
    out.extend(_data_parallel(grid, dense, ("dp_shard", "cp"), grid.dp_shard * grid.cp, work))
    if expert and grid.ep > 1:
        ep_dp = grid.groups("ep_dp")
        if len(ep_dp[0]) > 1:
            out.extend(_shard_ops(ep_dp, expert, grid.dp_shard > 1, work))
    elif expert:
        out.extend(_data_parallel(grid, expert, ("dp_shard", "cp"), grid.dp_shard * grid.cp, work))
    return out


def _data_parallel(
    grid: RankGrid, params: float, shard_dims: tuple[str, ...], shard_size: int, work: Workload
) -> list[DimTraffic]:
    out: list[DimTraffic] = []
    sharded = grid.dp_shard > 1 and work.zero_stage > 0
    if shard_size > 1:
        out.extend(_shard_ops(grid.groups(shard_dims), params, sharded, work))
    if grid.dp_replicate > 1:
        held = params / shard_size if sharded else params
        out.append(
            DimTraffic("dp", grid.groups("dp_replicate"), [Collective("all_reduce", held * work.gradient_bytes, 1)])
        )
    return out


def _shard_ops(groups: list[list[int]], params: float, sharded: bool, work: Workload) -> list[DimTraffic]:
    grads = params * work.gradient_bytes
    weights = params * work.activation_bytes
    if not sharded:
        return [DimTraffic("dp", groups, [Collective("all_reduce", grads, 1)])]
    gathers = 2 if work.zero_stage == 3 else 1
    return [
        DimTraffic("dp", groups, [Collective("reduce_scatter", grads, 1), Collective("all_gather", weights, gathers)])
    ]


@dataclass
class CostBreakdown:
    """Modelled communication of one placement."""

    seconds_by_dim: dict[str, float] = field(default_factory=dict)
    bytes_by_dim: dict[str, float] = field(default_factory=dict)
    level_by_dim: dict[str, str] = field(default_factory=dict)
    """Outermost level any group of the dimension spans."""
    split_groups: dict[str, list[list[int]]] = field(default_factory=dict)
    """TP / EP / CP groups that cross an NVLink domain (or node, where there is no NVLink) and get
    less bandwidth for it than one domain (node) holding their block could give them
    (`FabricIndex.unit_bandwidth`)."""
    uplink_bytes: float = 0.0
    """Bytes per step the job sends up through leaf uplinks: what other tenants' traffic would slow."""

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds_by_dim.values())

    def objective(self) -> tuple[float, ...]:
        """What the solver minimises: split TP groups, then EP, then CP, then modelled seconds."""
        return (*(len(self.split_groups.get(d, [])) for d in SPLIT_DIMS), self.total_seconds)


@dataclass(frozen=True)
class _Span:
    """What the cost model needs to know about one group's slots (memoised by slot tuple)."""

    level: str
    units: int
    """NVLink units (or nodes, without NVLink) the group touches."""
    bandwidth: float
    """Bytes/s per GPU per direction, before contention."""
    latency: float
    """Seconds."""
    leaves: tuple[tuple[int, int], ...] = ()
    """(leaf id, members under it), only for groups that leave their leaves (spine / core)."""


def _span(index: FabricIndex, key: tuple[SlotId, ...]) -> _Span:
    link = index.link(list(key))
    units = len({index.node_unit[s[0]] for s in key})
    if link.level not in ("spine", "core"):
        return _Span(link.level, units, link.bandwidth, link.latency)
    return _Span(link.level, units, link.bandwidth, link.latency, tuple(Counter(index.gpu_leaf[s] for s in key).items()))


def evaluate(
    traffic: list[DimTraffic], slots: list[SlotId], index: FabricIndex, spans_seen: dict | None = None
) -> CostBreakdown:
    """Cost of placing rank r on `slots[r]`.

    `spans_seen` (optional) memoises what is known about each tuple of slots across calls: a local
    search that moves a few ranks re-analyses only the groups it touched.
    """
    memo: dict[tuple[SlotId, ...], _Span] = {} if spans_seen is None else spans_seen
    result = CostBreakdown()
    tp = next((len(t.groups[0]) for t in traffic if t.dim == "tp"), 1)
    for entry in traffic:
        worst = 0.0
        level_max = "nvlink"
        if entry.pairwise:
            spans = [[g[i], g[i + 1]] for g in entry.groups for i in range(len(g) - 1)]
        else:
            spans = entry.groups
        infos = []
        for span in spans:
            key = tuple(slots[r] for r in span)
            info = memo.get(key)
            if info is None:
                info = memo[key] = _span(index, key)
            infos.append(info)
        factors = _contention(entry.pattern, spans, infos, index)
        volume = entry.bytes_per_rank()
        for span, info, factor in zip(spans, infos, factors, strict=True):
            if info.leaves:
                result.uplink_bytes += volume * sum(_flows(entry.pattern, n, len(span)) for _, n in info.leaves)
            worst = max(worst, entry.seconds(info.bandwidth / factor, info.latency))
            if LEVELS.index(info.level) > LEVELS.index(level_max):
                level_max = info.level
            if entry.dim in SPLIT_DIMS and info.units > 1:
                inside = index.unit_bandwidth(len(span), 1 if entry.dim == "tp" else tp)
                if inside is None or info.bandwidth < inside:
                    result.split_groups.setdefault(entry.dim, []).append(list(span))
        result.seconds_by_dim[entry.dim] = result.seconds_by_dim.get(entry.dim, 0.0) + worst
        result.bytes_by_dim[entry.dim] = result.bytes_by_dim.get(entry.dim, 0.0) + volume
        prev = result.level_by_dim.get(entry.dim, "nvlink")
        result.level_by_dim[entry.dim] = max(prev, level_max, key=LEVELS.index)
    return result


def _contention(pattern: Pattern, spans: list[list[int]], infos: list[_Span], index: FabricIndex) -> list[float]:
    """Per span, the factor by which oversubscribed uplinks slow it (1 = none).

    A leaf with `p` GPU ports and uplink oversubscription `o` carries `p / o` full-rate flows up.
    Flows a span sends up through each switch it leaves: a ring, one per leaf (the ring enters and
    leaves each switch once); an all-to-all, each member's share of traffic to members elsewhere;
    a pipeline pair, one per member. Likewise for spines when a span reaches the core. Only the job's
    own traffic is counted: the map does not know what other jobs send.
    """
    o_leaf, o_spine = index.oversub["leaf"], index.oversub["spine"]
    if o_leaf <= 1 and o_spine <= 1:
        return [1.0] * len(spans)
    up_leaf: Counter[int] = Counter()
    up_spine: Counter[int] = Counter()
    for span, info in zip(spans, infos, strict=True):
        for leaf, members in info.leaves:
            up_leaf[leaf] += _flows(pattern, members, len(span))
        if info.level == "core":
            spines: Counter[int] = Counter()
            for leaf, members in info.leaves:
                spines[index.leaf_spine.get(leaf, -1)] += members
            for spine, members in spines.items():
                up_spine[spine] += _flows(pattern, members, len(span))
    factors = []
    for info in infos:
        f = 1.0
        for leaf, _ in info.leaves:
            if leaf >= 0:
                f = max(f, up_leaf[leaf] * o_leaf / index.leaf_ports[leaf])
            spine = index.leaf_spine.get(leaf, -1)
            if info.level == "core" and spine >= 0:
                f = max(f, up_spine[spine] * o_spine / index.spine_ports[spine])
        factors.append(f)
    return factors


def _flows(pattern: Pattern, inside: int, size: int) -> float:
    """Full-rate flows `inside` members of a `size`-member span send out of their switch."""
    if inside >= size:
        return 0.0
    if pattern == "ring":
        return 1.0
    if pattern == "all_to_all":
        return inside * (size - inside) / (size - 1)
    return float(inside)


def lower_bound(traffic: list[DimTraffic], index: FabricIndex) -> dict[str, float]:
    """Per dimension, the time if every group sat at the innermost level able to hold it, uncontended
    (inside nodes with per-pair links: the most any set of that size can get, `FabricIndex.pair_bound`;
    across nodes: through the best NIC path of the map, `FabricIndex.network`)."""
    out: dict[str, float] = {}
    for entry in traffic:
        size = 2 if entry.pairwise else len(entry.groups[0])
        options = [
            index.network(lv) if lv in TIERS else (index.level_bw[lv], index.level_latency[lv])
            for lv, cap in index.level_capacity.items()
            if cap >= size
        ]
        pair = index.pair_bound(size)
        if pair is not None:
            options.append(pair)
        if not options:
            raise CostModelError(f"dimension {entry.dim}: a group of {size} GPUs exceeds the whole map")
        bw = max(b for b, _ in options)
        latency = min(lat for _, lat in options)
        out[entry.dim] = out.get(entry.dim, 0.0) + entry.seconds(bw, latency)
    return out
