"""What placement returns: rank -> (node, GPU), the groups it had to split, and the modelled cost."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RankAssignment(_Frozen):
    rank: int = Field(ge=0)
    """Global rank."""
    node: str
    """Node name in the topology map (the `trainctl.io/node` label)."""
    gpu: int = Field(ge=0)
    """Local GPU index on that node (CUDA ordinal / `CUDA_VISIBLE_DEVICES`)."""


class SplitGroup(_Frozen):
    dim: str
    """tp, ep or cp."""
    ranks: list[int]
    """The group's ranks."""
    nodes: list[str]
    """The nodes it spans, in first-rank order."""


class Placement(_Frozen):
    """A plan for one job on one topology."""

    grid: str
    """The rank grid, e.g. 'pp4 x dp_shard32 x tp8 (1024 ranks)'."""
    assignments: list[RankAssignment]
    """One per rank, ordered by rank."""
    split_groups: list[SplitGroup] = Field(default_factory=list)
    """TP / EP / CP groups that cross an NVLink domain (node, without NVLink) and get less bandwidth for
    it than one domain could give them (the solver avoids this whenever it can)."""
    comm_seconds_by_dim: dict[str, float] = Field(default_factory=dict)
    """Modelled communication seconds per step for each parallel dimension."""
    comm_bytes_by_dim: dict[str, float] = Field(default_factory=dict)
    """Bytes one rank sends per step for each dimension."""
    level_by_dim: dict[str, str] = Field(default_factory=dict)
    """Outermost fabric level each dimension's groups span (nvlink, host, leaf, spine, core)."""
    lower_bound_seconds_by_dim: dict[str, float] = Field(default_factory=dict)
    """Each group at the innermost level able to hold it, without contention."""

    @property
    def comm_seconds(self) -> float:
        """Modelled communication seconds per step, all dimensions."""
        return sum(self.comm_seconds_by_dim.values())

    def gpus_by_node(self) -> dict[str, list[int]]:
        """Node -> the local GPU indices this plan takes there (sorted)."""
        out: dict[str, list[int]] = {}
        for a in self.assignments:
            out.setdefault(a.node, []).append(a.gpu)
        return {node: sorted(gpus) for node, gpus in out.items()}

    def to_table(self) -> str:
        """Human-readable plan: the rank table, split groups and the cost per dimension."""
        lines = [f"placement of {self.grid}", f"{'rank':>6}  {'node':<24} gpu"]
        lines += [f"{a.rank:>6}  {a.node:<24} {a.gpu}" for a in self.assignments]
        if self.split_groups:
            lines.append("split groups (cross an NVLink domain):")
            lines += [f"  {g.dim} ranks {g.ranks} over {', '.join(g.nodes)}" for g in self.split_groups]
        else:
            lines.append("split groups: none")
        lines.append(f"{'dim':<4} {'level':<7} {'MB/rank/step':>13} {'comm s/step':>12} {'lower bound':>12}")
        for dim, seconds in self.comm_seconds_by_dim.items():
            lines.append(
                f"{dim:<4} {self.level_by_dim.get(dim, '-'):<7} {self.comm_bytes_by_dim.get(dim, 0.0) / 1e6:>13.1f} "
                f"{seconds:>12.4f} {self.lower_bound_seconds_by_dim.get(dim, 0.0):>12.4f}"
            )
        lines.append(f"total modelled communication: {self.comm_seconds:.4f} s/step")
        return "\n".join(lines)
