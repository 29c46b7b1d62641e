"""Tenancy rules: visibility by tenant and role, and the quota checks at admission and at start."""

from __future__ import annotations

import pytest

from trainctl.service.security.tenancy import (
    ANONYMOUS,
    DEFAULT_TENANT,
    Principal,
    Quota,
    Role,
    TenantUsage,
    admission_violation,
    start_block_reason,
)

ALICE = Principal("alice", "vision", Role.USER)
ROOT = Principal("root", "ops", Role.ADMIN)


def test_users_see_their_tenant_only_admins_see_all() -> None:
    assert ALICE.can_access("vision") and not ALICE.can_access("nlp")
    assert ROOT.can_access("vision") and ROOT.can_access("nlp")
    assert ALICE.tenant_filter() == "vision" and ROOT.tenant_filter() is None
    assert ANONYMOUS.is_admin and ANONYMOUS.tenant == DEFAULT_TENANT
    assert ALICE.role == "user"  # a StrEnum: compares equal to the plain string


def test_unlimited_quota_admits_and_starts_anything() -> None:
    usage = TenantUsage(queued_jobs=10_000, running_gpus=10_000)
    assert admission_violation("vision", Quota(), 512, lambda: 10_000) is None
    assert start_block_reason("vision", Quota(), usage, 512) is None


def test_queued_jobs_quota_refuses_at_the_limit_naming_it() -> None:
    quota = Quota(queued_jobs=2)
    assert admission_violation("vision", quota, 1, lambda: 1) is None
    message = admission_violation("vision", quota, 1, lambda: 2)
    assert message is not None and "quota queued_jobs" in message and "'vision'" in message and "2" in message


def test_a_job_larger_than_the_gpu_quota_is_refused_at_admission() -> None:
    quota = Quota(running_gpus=4)
    assert admission_violation("vision", quota, 4, lambda: 0) is None
    message = admission_violation("vision", quota, 8, lambda: 0)
    assert message is not None and "quota running_gpus" in message and "could never start" in message


@pytest.mark.parametrize(("running", "job", "blocked"), [(0, 4, False), (2, 2, False), (2, 3, True), (4, 1, True)])
def test_running_gpu_quota_holds_jobs_in_the_queue(running: int, job: int, blocked: bool) -> None:
    reason = start_block_reason("vision", Quota(running_gpus=4), TenantUsage(queued_jobs=0, running_gpus=running), job)
    assert (reason is not None) == blocked
    if blocked:
        assert "quota running_gpus" in reason and f"{running} of 4" in reason


def test_negative_quotas_are_rejected() -> None:
    with pytest.raises(ValueError, match="running_gpus"):
        Quota(running_gpus=-1)
