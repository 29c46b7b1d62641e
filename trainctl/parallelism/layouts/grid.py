"""The rank grid: one object that answers every "which ranks share this group" question.

The world is laid out as `pp x dp_replicate x dp_shard x cp x tp`, tp innermost (fastest-varying), so
tensor-parallel peers are adjacent ranks (and land on one NVLink domain when placement keeps adjacent
ranks together). Expert parallelism is carved from the flattened `dp_shard x cp` index: consecutive
blocks of `ep` of those positions form an EP group.

Pure Python on purpose: the engine, the placement solver and the metrics all read this, and the
service must be able to plan without importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Grid dimensions, outermost first."""


class LayoutError(ValueError):
    """A parallel layout that cannot exist (names the offending degree)."""


@dataclass(frozen=True)
class RankGrid:
    """Degrees of each dimension; `ep` is a sub-division of dp_shard x cp for MoE layers."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in (*DIMS, "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if (self.dp_shard * self.cp) % self.ep:
            raise LayoutError(
                f"ep={self.ep} must divide dp_shard x cp = {self.dp_shard * self.cp}: expert parallelism is carved "
                "from the data-shard and context dimensions"
            )

    @classmethod
    def from_spec(cls, parallelism: object) -> RankGrid:
        """From a `ParallelismSpec` (or anything with the same attributes)."""
        return cls(**{name: getattr(parallelism, name) for name in (*DIMS, "ep")})

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world_size(self) -> int:
        return prod(self.shape)

    @property
    def dp(self) -> int:
        """Ways the batch is split (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    # ---- coordinates -------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every dimension (and `ep` / `ep_dp` for MoE layers)."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        rest = rank
        for name in reversed(DIMS):
            size = getattr(self, name)
            out[name] = rest % size
            rest //= size
        flat = out["dp_shard"] * self.cp + out["cp"]
        out["ep"] = flat % self.ep
        out["ep_dp"] = flat // self.ep
        return {name: out[name] for name in (*DIMS, "ep", "ep_dp")}

    def rank_of(self, **coords: int) -> int:
        """Rank at the given coordinates (missing dimensions are 0)."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise LayoutError(f"unknown grid dimensions {sorted(unknown)}; known: {DIMS}")
        rank = 0
        for name in DIMS:
            size = getattr(self, name)
            value = coords.get(name, 0)
            if not 0 <= value < size:
                raise LayoutError(f"{name} coordinate {value} out of range [0, {size})")
            rank = rank * size + value
        return rank

    # ---- groups ------------------------------------------------------------------------------------
    def group(self, dims: str | Iterable[str], rank: int) -> list[int]:
        """Ranks that share every coordinate of `rank` except those in `dims`, in grid order.

        `dims` is a dimension name, a tuple of names (a flattened group such as
        ("dp_replicate", "dp_shard")), or "ep" / "ep_dp" for the expert groups of MoE layers.
        """
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        if names in (("ep",), ("ep_dp",)):
            for members in self._expert_groups(names[0]):
                if rank in members:
                    return members
            raise AssertionError("unreachable: every rank is in exactly one group")
        self._check_dims(names)
        coords = self.coords(rank)
        base = rank - sum(coords[d] * self._stride(d) for d in names)
        return self._members(base, [d for d in DIMS if d in names])

    def groups(self, dims: str | Iterable[str]) -> list[list[int]]:
        """Every group along `dims`: a partition of all ranks."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        if names in (("ep",), ("ep_dp",)):
            return self._expert_groups(names[0])
        self._check_dims(names)
        varying = [d for d in DIMS if d in names]
        bases = self._members(0, [d for d in DIMS if d not in names])
        offsets = self._members(0, varying)
        return [[base + offset for offset in offsets] for base in bases]

    def _stride(self, dim: str) -> int:
        """Rank distance between neighbours along `dim` (tp innermost: stride 1)."""
        return prod(getattr(self, d) for d in DIMS[DIMS.index(dim) + 1 :])

    def _members(self, base: int, varying: list[str]) -> list[int]:
        """The ranks `base + sum(coordinate x stride)` over every coordinate of `varying`, in grid order."""
        members = [base]
        for dim in varying:
            stride = self._stride(dim)
            steps = [i * stride for i in range(getattr(self, dim))]
            members = [m + step for m in members for step in steps]
        return members

    @staticmethod
    def _check_dims(names: tuple[str, ...]) -> None:
        unknown = set(names) - set(DIMS)
        if unknown:
            raise LayoutError(f"unknown grid dimensions {sorted(unknown)}; known: {DIMS} and 'ep', 'ep_dp'")

    def _expert_groups(self, which: str) -> list[list[int]]:
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            other = "ep_dp" if which == "ep" else "ep"
            key = (c["pp"], c["dp_replicate"], c["tp"], c[other])
            by_key.setdefault(key, []).append(rank)
        return list(by_key.values())

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} out of range for world size {self.world_size}")

    def describe(self) -> str:
        """Human-readable layout, e.g. 'pp2 x dp_replicate2 x tp2 (8 ranks)'."""
        parts = [f"{d}{getattr(self, d)}" for d in DIMS if getattr(self, d) > 1]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return f"{' x '.join(parts) or 'single rank'} ({self.world_size} ranks)"
