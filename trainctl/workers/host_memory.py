"""A rank's host-memory limit: how much private memory its process (an engine rank's RankWorker, or a
command job's program and everything it starts) may hold, enforced by the kernel with ``RLIMIT_DATA``.

The limit is the node's memory (its physical memory, or its cgroup's limit when lower, as in a
Kubernetes pod) divided among the node's GPU slots, or ``spec.resources.host_memory_gib`` when the job
sets it, up to that share: the scheduler does not reserve host memory, so a rank asking for more than its
GPU slot's share would take it from the other ranks of its node (a configuration error). ``RLIMIT_DATA`` counts a process's private writable mappings (heap, anonymous mmap, thread
stacks) since Linux 4.7, not shared mappings (Ray's object store) nor address space reserved without
access (CUDA's reservations); why not ``RLIMIT_AS``: docs/security.md, "Host memory". An allocation past
the limit fails (``MemoryError`` in Python, torch's "can't allocate memory"), and the job fails at once
with `HostMemoryExceeded` naming the limit: the same allocation would fail again after a restart.
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainctl.parallelism.errors import ConfigurationError

GIB = 2**30
SPEC_FIELD = "spec.resources.host_memory_gib"
CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""cgroup v2, then v1: the memory limit of the cgroup this process is in (a Kubernetes pod's)."""
OUT_OF_MEMORY_TEXT = re.compile(r"\bMemoryError\b|[Cc]an(?:'|no)t allocate memory|std::bad_alloc")
"""How a program that ran out of host memory says so on stderr (Python, torch / errno ENOMEM, C++)."""


@dataclass(frozen=True)
class HostMemoryLimit:
    """A rank's limit in bytes, and where it comes from (the spec field, or how the default was made)."""

    bytes: int
    source: str

    def __str__(self) -> str:
        return f"{self.bytes / GIB:.1f} GiB ({self.source})"


def node_memory_bytes() -> int:
    """This machine's memory: its physical memory, or its cgroup's memory limit when that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [physical]
    for path in CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits)


def spec_limit(gib: float) -> HostMemoryLimit:
    """The limit ``spec.resources.host_memory_gib`` sets."""
    return HostMemoryLimit(int(gib * GIB), SPEC_FIELD)


def node_share(node_bytes: int, node_slots: int) -> HostMemoryLimit:
    """The default limit: the node's memory (``node_bytes``) divided among its ``node_slots`` GPU slots."""
    slots = max(node_slots, 1)
    return HostMemoryLimit(
        node_bytes // slots,
        f"the node's {node_bytes / GIB:.1f} GiB over its {slots} GPU slot(s); {SPEC_FIELD} sets another",
    )


def rank_limit(spec_gib: float | None, node_bytes: int, node_slots: int) -> HostMemoryLimit:
    """A rank's limit on a node of ``node_bytes`` and ``node_slots`` GPU slots: ``spec_gib`` when set (a
    ConfigurationError when it is more than a slot's share), else the share."""
    share = node_share(node_bytes, node_slots)
    if spec_gib is None:
        return share
    requested = spec_limit(spec_gib)
    if requested.bytes > share.bytes:
        raise ConfigurationError(
            f"{SPEC_FIELD}: {spec_gib:g} GiB per rank is more than a GPU slot's share of this node's host memory, "
            f"{share}; host memory is not reserved by the scheduler, so a rank may hold at most its slot's share"
        )
    return requested


def limit_this_process(limit: HostMemoryLimit) -> None:
    """Set this process's ``RLIMIT_DATA`` (soft and hard: it cannot be raised again, and the processes it
    starts inherit it) to ``limit``, or keep a lower hard limit already in place."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    value = limit.bytes if hard == resource.RLIM_INFINITY else min(limit.bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (value, value))


def ran_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from or during, is an allocation that failed."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or (
            isinstance(current, RuntimeError) and "can't allocate memory" in str(current)
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def says_out_of_memory(lines: Iterable[str]) -> bool:
    """Whether a program's last stderr lines say an allocation failed (a MemoryError, ENOMEM, bad_alloc)."""
    return any(OUT_OF_MEMORY_TEXT.search(line) for line in lines)


class HostMemoryExceeded(ConfigurationError):
    """An engine rank's allocation failed at its host-memory limit: the job fails without a restart."""

    def __init__(self, rank: int, limit: str, detail: str) -> None:
        super().__init__(rank, limit, detail)
        self.rank, self.limit, self.detail = rank, limit, detail

    def __str__(self) -> str:
        return f"rank {self.rank} exceeded its host-memory limit of {self.limit}: {self.detail}"
