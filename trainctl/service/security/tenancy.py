"""Tenancy: who may see which job, and per-tenant quotas.

A job belongs to the tenant of the principal that created it. A `user` sees, watches and cancels only
its own tenant's jobs; to it another tenant's job does not exist (NOT_FOUND, never PERMISSION_DENIED,
so job ids cannot be probed). An `admin` sees every tenant.

Quotas are checked twice: at CreateJob (`admission_violation`: too many queued jobs, or a job that
could never fit the tenant's GPU quota, is refused with RESOURCE_EXHAUSTED) and by the scheduler
(`start_block_reason`: a job whose start would push the tenant over its running-GPU quota stays
QUEUED with that reason, as a full cluster would leave it). A tenant's `guaranteed_gpus` is its share of
the cluster: below it, its queued jobs may reclaim GPUs other tenants borrowed beyond theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainctl.wire.tokens import Role

DEFAULT_TENANT = "default"
"""The tenant of every job when authentication is off (the embedded default)."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the token's name (for audit logs), its tenant and its role."""

    name: str
    tenant: str
    role: Role

    @property
    def is_admin(self) -> bool:
        """True for the admin role."""
        return self.role is Role.ADMIN

    def can_access(self, tenant: str) -> bool:
        """Whether this principal may see and act on a job owned by `tenant`."""
        return self.is_admin or tenant == self.tenant

    def tenant_filter(self) -> str | None:
        """The tenant a listing must be restricted to, or None for every tenant (admins)."""
        return None if self.is_admin else self.tenant


ANONYMOUS = Principal(name="anonymous", tenant=DEFAULT_TENANT, role=Role.ADMIN)
"""The principal of every call when authentication is off: one tenant, full access."""


class Quota(BaseModel):
    """Limits for one tenant; None means unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    running_gpus: int | None = Field(default=None, ge=0)
    """GPUs the tenant's jobs may hold at once (SCHEDULED, RUNNING, RESTARTING, CANCELLING or PREEMPTED)."""
    queued_jobs: int | None = Field(default=None, ge=0)
    """Jobs the tenant may have waiting in QUEUED at once."""
    guaranteed_gpus: int | None = Field(default=None, ge=0)
    """GPUs the tenant is guaranteed: beyond them its jobs borrow GPUs other tenants leave idle (up to
    `running_gpus`), and a job of a tenant within its guarantee that does not fit takes borrowed GPUs
    back by preempting the borrowers' jobs, whatever their priority (trainctl.service.capacity.preemption).
    None: no guarantee (the tenant's jobs are always borrowing, reclaimable by any tenant within its own)."""

    @model_validator(mode="after")
    def _guarantee_within_the_cap(self) -> Quota:
        guaranteed, cap = self.guaranteed_gpus, self.running_gpus
        if guaranteed is not None and cap is not None and guaranteed > cap:
            raise ValueError(
                f"guaranteed_gpus ({self.guaranteed_gpus}) is more than running_gpus ({self.running_gpus}), "
                "the most the tenant may hold"
            )
        return self


@dataclass(frozen=True)
class TenantUsage:
    """What a tenant holds now, as counted from the store."""

    queued_jobs: int
    running_gpus: int


def admission_violation(tenant: str, quota: Quota, job_gpus: int, queued_jobs: Callable[[], int]) -> str | None:
    """Why a new job of `job_gpus` GPUs must be refused at CreateJob, or None to accept it.
    `queued_jobs()` counts the tenant's queued jobs, called only under a queued_jobs quota.

    The message names the quota and its limit; the caller answers RESOURCE_EXHAUSTED with it.
    """
    if quota.running_gpus is not None and job_gpus > quota.running_gpus:
        return (
            f"quota running_gpus of tenant {tenant!r} is {quota.running_gpus}: "
            f"a job of {job_gpus} GPUs could never start"
        )
    if quota.queued_jobs is not None and (queued := queued_jobs()) >= quota.queued_jobs:
        return (
            f"quota queued_jobs of tenant {tenant!r} is {quota.queued_jobs} and "
            f"{queued} jobs are already queued"
        )
    return None


def start_block_reason(tenant: str, quota: Quota, usage: TenantUsage, job_gpus: int) -> str | None:
    """Why the scheduler must keep a queued job waiting for quota, or None if quota lets it start."""
    if quota.running_gpus is None or usage.running_gpus + job_gpus <= quota.running_gpus:
        return None
    return (
        f"waiting for quota running_gpus of tenant {tenant!r}: {usage.running_gpus} of "
        f"{quota.running_gpus} GPUs in use, the job needs {job_gpus}"
    )


@dataclass(frozen=True)
class TenantShare:
    """A tenant's GPUs against its guaranteed share."""

    tenant: str
    used_gpus: int
    guaranteed_gpus: int | None

    @property
    def borrowed_gpus(self) -> int:
        """GPUs held beyond the guarantee (all of them without one): what a tenant within its share may reclaim."""
        return max(0, self.used_gpus - (self.guaranteed_gpus or 0))


def tenant_shares(holdings: Iterable[tuple[str, int]], quota_of: Callable[[str], Quota]) -> list[TenantShare]:
    """The share of each tenant holding GPUs, by name, from ``(tenant, gpus)`` of every active job."""
    used: dict[str, int] = {}
    for tenant, gpus in holdings:
        used[tenant] = used.get(tenant, 0) + gpus
    return [TenantShare(tenant, gpus, quota_of(tenant).guaranteed_gpus) for tenant, gpus in sorted(used.items())]
