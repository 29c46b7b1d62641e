"""What Ray must find in the environment before the process first imports it: an embedded cluster binds
127.0.0.1 only (Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when `ray` is imported) and reports no usage
statistics. Standard library only, so the CLI can call it before it loads anything else."""

from __future__ import annotations

import os

RAY_ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
"""Variables and the values trainctl gives them where the caller has not set them."""


def prepare_ray_environment() -> None:
    """Set each of RAY_ENVIRONMENT that is unset; call before the process's first `import ray`."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
