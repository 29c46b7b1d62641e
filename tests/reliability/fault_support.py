"""What the service-level fault tests share: reading a job's event stream, and proving that nothing of
a job is left in the (private, embedded) Ray cluster (Ray's state API; the cluster needs its dashboard)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

from ray.util.state import list_actors, list_placement_groups

from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay
from trainctl.workers.rank_group import owned_by
from trainctl.workers.supervisor import supervisor_name


def kind(event: pb.JobEvent) -> str:
    return event.WhichOneof("payload")


def states_of(events: list[pb.JobEvent]) -> list[int]:
    return [e.state_change.to_state for e in events if kind(e) == "state_change"]


def steps_of(events: list[pb.JobEvent]) -> list[int]:
    return [e.step.step for e in events if kind(e) == "step"]


def rank_pids(cluster: EmbeddedRay, job_id: str) -> dict[str, int]:
    """Live RankWorker actors of a job: name (trainctl-rank-<job>-g<generation>-<rank>) -> PID."""
    actors = list_actors(address=cluster.address, filters=[("state", "=", "ALIVE")], limit=10_000, detail=True)
    return {a.name: a.pid for a in actors if a.name and a.name.startswith("trainctl-rank-") and owned_by(a.name, job_id)}


def supervisor_pid(cluster: EmbeddedRay, job_id: str) -> int | None:
    actors = list_actors(
        address=cluster.address, filters=[("name", "=", supervisor_name(job_id)), ("state", "=", "ALIVE")], detail=True
    )
    return actors[0].pid if actors else None


def leftovers(cluster: EmbeddedRay) -> tuple[list[str], list[str]]:
    """Every live actor and not-removed placement group of the (private) cluster."""
    actors = [
        a.name or a.class_name
        for a in list_actors(address=cluster.address, filters=[("state", "=", "ALIVE")], limit=10_000)
    ]
    groups = [
        g.name or g.placement_group_id
        for g in list_placement_groups(address=cluster.address, filters=[("state", "!=", "REMOVED")], limit=10_000)
    ]
    return actors, groups


def assert_nothing_left(cluster: EmbeddedRay) -> None:
    deadline = time.monotonic() + 30
    while any(leftovers(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftovers(cluster) == ([], [])


def read_until(stream: Iterator[pb.JobEvent], seen: list[pb.JobEvent], done: Callable[[pb.JobEvent], bool]) -> None:
    for event in stream:
        seen.append(event)
        if done(event):
            return
    raise AssertionError(f"the stream ended before the condition held; states {states_of(seen)}")


def freeze_once_stepping(
    cluster: EmbeddedRay, stream: Iterator[pb.JobEvent], seen: list[pb.JobEvent], job_id: str
) -> dict[str, int]:
    """Read the job's watch until it runs and has made two steps, then SIGSTOP its two ranks (so it is
    certainly still running after what the test does to the control plane); their PIDs by actor name."""
    read_until(stream, seen, lambda e: kind(e) == "state_change" and e.state_change.to_state == pb.RUNNING)
    ranks = rank_pids(cluster, job_id)
    assert len(ranks) == 2, ranks
    read_until(stream, seen, lambda e: kind(e) == "step" and e.step.step >= 2)
    signal_all(list(ranks.values()), signal.SIGSTOP)
    return ranks


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)
