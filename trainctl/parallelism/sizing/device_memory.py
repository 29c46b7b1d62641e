"""Memory of one GPU by model name: its capacity, which a job's per-rank estimate is checked against at
submit, and its bandwidth, which prices the optimizer step in the step-time model.

Substrings of the device name (`torch.cuda.get_device_name`, or a topology map's `gpu_model`), first
match wins; capacities are the vendor's (GB = 10^9 bytes unless the name says GiB). Devices not in the
table (CPUs, simulated GPUs, unlisted models) have an unknown capacity, and no fit check is made.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

GB = 10**9
GiB = 2**30

GPU_MEMORY_BYTES: tuple[tuple[str, int], ...] = (
    ("GH200", 96 * GB),
    ("H200", 141 * GB),
    ("H100 NVL", 94 * GB),
    ("H100", 80 * GiB),
    ("GB200", 186 * GB),  # GB200 NVL72: 13.4 TB of HBM3e over 72 GPUs
    ("B200", 180 * GB),
    ("A100-SXM4-40GB", 40 * GiB),
    ("A100-PCIE-40GB", 40 * GiB),
    ("A100", 80 * GiB),
    ("L40S", 48 * GiB),
    ("L4", 24 * GiB),
)


def _first_match(table: tuple[tuple[str, T], ...], device_name: str | None) -> T | None:
    """The value of the first key that is a substring of `device_name` (None: no name, no match)."""
    if not device_name:
        return None
    return next((value for key, value in table if key in device_name), None)


def gpu_memory_bytes(device_name: str | None) -> int | None:
    """Bytes of memory of one device named `device_name`, or None when unknown."""
    return _first_match(GPU_MEMORY_BYTES, device_name)


GPU_MEMORY_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("GH200", 4.0e12),
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("GB200", 8.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("A100", 2.0e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
)
"""Vendor HBM / GDDR bandwidth of one device in bytes per second (substring of the name, first match)."""


def gpu_memory_bandwidth(device_name: str | None) -> float | None:
    """Bytes per second the device's memory moves (vendor figure), or None when unknown."""
    return _first_match(GPU_MEMORY_BANDWIDTH, device_name)

