"""trainctl. For a command job's program, `trainctl.report(step=..., loss=..., tokens=...)`."""

from trainctl.reporting import report

__all__ = ["report"]
