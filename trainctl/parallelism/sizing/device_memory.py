"""Memory of one GPU by model name: what a job's per-rank estimate is checked against at submit.

Substrings of the device name (`torch.cuda.get_device_name`, or a topology map's `gpu_model`), first
match wins; capacities are the vendor's (GB = 10^9 bytes unless the name says GiB). Devices not in the
table (CPUs, simulated GPUs, unlisted models) have an unknown capacity, and no fit check is made.
"""

from __future__ import annotations

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


def gpu_memory_bytes(device_name: str | None) -> int | None:
    """Bytes of memory of one device named `device_name`, or None when unknown."""
    if not device_name:
        return None
    for key, capacity in GPU_MEMORY_BYTES:
        if key in device_name:
            return capacity
    return None
