"""Autoscaling decisions over a scripted runtime: which map nodes Ray lacks a blocked queued job has asked
of the autoscaler (only those its placement needs, with the live ones, since Ray's request is a floor on
capacity), once per change, withdrawn once the job placed on them has its ranks up (or ended); the waiting reason, the scheduling
decision and the pending gauges; nothing asked when it fits, when even the whole map cannot hold it, or
when Ray refuses (asked again next pass); GetCluster's `scale_up` as each tenant sees it. The same over
Ray's autoscaler is
tests/service/e2e/test_autoscaling_e2e.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from control_plane_fakes import ScriptedRuntime
from prometheus_client import CollectorRegistry
from small_jobs import small_job

from trainctl.parallelism.resolved_job import ResolvedJob
from trainctl.planning.pool import GpuPool
from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.capacity.autoscaling import nodes_to_add
from trainctl.service.metrics import ServiceMetrics
from trainctl.service.scheduling.scheduler import Scheduler
from trainctl.service.security.auth import Authenticator
from trainctl.service.security.tenancy import Principal
from trainctl.service.store import JobStore
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.tokens import Role
from trainctl.workers.events import JobState
from trainctl.workers.topology import simulated_topology

REASON = "waiting for the autoscaler to add {} (asked for this job's placement)"


class Requests(list):
    """Every node request the scheduler sent (each a list of map node names); `fail` makes it raise."""

    fail = False

    def __call__(self, nodes: Sequence[str]) -> None:
        if self.fail:
            raise ConnectionError("the GCS is away")
        self.append(list(nodes))


def autoscaled(tmp_path: Path, live: set[str], map_nodes: int = 3) -> tuple[Scheduler, ScriptedRuntime, Requests, CollectorRegistry]:
    """A scheduler with autoscaling on over a map of `map_nodes` 4-GPU nodes, of which Ray has `live`, past
    its first pass (which withdraws whatever request stands: see the leader test below)."""
    runtime, requests, registry = ScriptedRuntime(nodes=set(live)), Requests(), CollectorRegistry()
    pool = GpuPool(simulated_topology(map_nodes, 4), "simulated")
    s = Scheduler(JobStore(tmp_path), pool, runtime, tmp_path / "runs", metrics=ServiceMetrics(registry), request_nodes=requests)
    s.tick()
    assert requests == [[]]
    requests.clear()
    return s, runtime, requests, registry


def submit(s: Scheduler, name: str, gpus: int) -> str:
    return s.store.create_job(small_job(name, gpus=gpus))[0].id


def placed_on(s: Scheduler, job_id: str) -> set[str]:
    return {slot["node"] for slot in s.store.get_job(job_id).placement}


def test_a_blocked_job_asks_for_the_node_it_needs_once_and_withdraws_when_its_ranks_run(tmp_path: Path) -> None:
    s, runtime, requests, registry = autoscaled(tmp_path, live={"node-0"})
    first = submit(s, "first", 4)
    s.tick()
    assert placed_on(s, first) == {"node-0"} and requests == [], "a job that fits asks for nothing"
    second = submit(s, "second", 4)
    s.tick()
    assert requests == [["node-0", "node-1"]], "the live node and the one the placement needs"
    waiting = s.store.get_job(second)
    assert waiting.state == JobState.QUEUED and waiting.reason == REASON.format("node-1")
    assert s.autoscaling is not None and s.autoscaling.pending is not None
    assert (s.autoscaling.pending.job_id, s.autoscaling.pending.nodes) == (second, ("node-1",))
    assert registry.get_sample_value("trainctl_scheduling_decisions_total", {"decision": "scaling_up"}) == 1
    assert registry.get_sample_value("trainctl_scale_up_pending_nodes") == 1
    assert registry.get_sample_value("trainctl_scale_up_pending_age_seconds") >= 0
    since = s.autoscaling.pending.since

    s.tick()
    s.tick()
    assert len(requests) == 1, "the same need is not asked again"
    assert s.autoscaling.pending.since == since

    runtime.nodes.add("node-1")  # the node joined
    s.tick()
    assert s.store.get_job(second).state == JobState.SCHEDULED and placed_on(s, second) == {"node-1"}
    assert s.autoscaling.pending is None, "nothing is pending: the node is up"
    assert registry.get_sample_value("trainctl_scale_up_pending_nodes") == 0
    assert registry.get_sample_value("trainctl_scale_up_pending_age_seconds") == 0
    s.tick()
    assert requests == [["node-0", "node-1"]], "the request stands while the job placed on node-1 starts: its slots are free"

    runtime.state(second, JobState.RUNNING, "ranks up")  # the ranks hold node-1's slots
    s.tick()
    assert requests[-1] == [], "withdrawn: the idle nodes may go after the autoscaler's idle timeout"
    assert len(requests) == 2


def test_a_request_stands_until_the_job_placed_on_the_new_node_leaves_scheduled_however_it_does(tmp_path: Path) -> None:
    s, runtime, requests, _ = autoscaled(tmp_path, live=set(), map_nodes=1)
    job = submit(s, "job", 4)
    s.tick()
    runtime.nodes.add("node-0")
    s.tick()
    assert s.store.get_job(job).state == JobState.SCHEDULED and requests == [["node-0"]]
    runtime.state(job, JobState.FAILED, "the ranks could not start")
    s.tick()
    assert s.store.get_job(job).state == JobState.FAILED and requests[-1] == []


def test_a_job_cancelled_while_its_node_is_asked_for_withdraws_the_request(tmp_path: Path) -> None:
    s, _, requests, registry = autoscaled(tmp_path, live=set(), map_nodes=1)
    job = submit(s, "job", 4)
    s.tick()
    assert requests == [["node-0"]]
    s.request_cancel(job, "not needed")
    s.tick()
    assert s.store.get_job(job).state == JobState.CANCELLED and requests[-1] == []
    assert registry.get_sample_value("trainctl_scale_up_pending_nodes") == 0


def test_a_job_spanning_nodes_asks_for_every_node_its_placement_needs(tmp_path: Path) -> None:
    s, _, requests, _ = autoscaled(tmp_path, live=set())
    job = submit(s, "wide", 8)
    s.tick()
    assert requests == [["node-0", "node-1"]]
    assert s.store.get_job(job).reason == REASON.format("node-0, node-1")


def test_nothing_is_asked_when_even_the_whole_map_cannot_hold_the_job_now(tmp_path: Path) -> None:
    s, _, requests, _ = autoscaled(tmp_path, live={"node-0", "node-1"}, map_nodes=3)
    for name in ("a", "b"):
        submit(s, name, 4)
    s.tick()
    waiting = submit(s, "needs-two-free-nodes", 8)  # node-2 alone is not enough while a and b run
    s.tick()
    assert requests == []
    assert s.store.get_job(waiting).reason == "waiting for 8 GPUs: 0 of 12 free"


def test_a_request_ray_refuses_is_sent_again_by_the_next_pass(tmp_path: Path) -> None:
    s, _, requests, _ = autoscaled(tmp_path, live=set(), map_nodes=1)
    submit(s, "job", 4)
    requests.fail = True
    s.tick()
    assert requests == [] and s.autoscaling is not None and s.autoscaling.pending is None
    requests.fail = False
    s.tick()
    assert requests == [["node-0"]] and s.autoscaling.pending is not None


def test_autoscaling_off_asks_nothing_and_keeps_the_plain_reason(tmp_path: Path) -> None:
    runtime = ScriptedRuntime(nodes=set())
    s = Scheduler(JobStore(tmp_path), GpuPool(simulated_topology(1, 4), "simulated"), runtime, tmp_path / "runs")
    job = submit(s, "job", 4)
    s.tick()
    assert s.autoscaling is None
    assert s.store.get_job(job).reason == "waiting for 4 GPUs: 0 of 4 free"


def test_nodes_to_add_names_the_down_nodes_the_placement_needs_and_none_when_they_would_not_do(tmp_path: Path) -> None:
    pool = GpuPool(simulated_topology(2, 4), "simulated")
    job = ResolvedJob.resolve(small_job("job", gpus=4).spec)
    assert nodes_to_add(pool, job, down=set()) == ()
    assert nodes_to_add(pool, job, down={"node-0", "node-1"}) == ("node-0",)
    too_big = ResolvedJob.resolve(small_job("big", gpus=16).spec)
    assert nodes_to_add(pool, too_big, down={"node-0", "node-1"}) == ()


def test_get_cluster_shows_the_pending_scale_up_and_hides_another_tenants_job(tmp_path: Path) -> None:
    s, _, _, _ = autoscaled(tmp_path, live=set(), map_nodes=1)
    job = s.store.create_job(small_job("vision-job", gpus=4), tenant="vision")[0].id
    s.tick()
    servicer = TrainingServicer(s.store, s, s.pool, Authenticator(None))
    owner = Principal(name="v", tenant="vision", role=Role.USER)
    other = Principal(name="n", tenant="nlp", role=Role.USER)
    shown = servicer.GetCluster(pb.GetClusterRequest(), owner).scale_up
    assert (shown.job_id, list(shown.nodes)) == (job, ["node-0"])
    assert shown.request_time.seconds == int(s.autoscaling.pending.since)
    assert servicer.GetCluster(pb.GetClusterRequest(), other).scale_up.job_id == "(another tenant)"
    off = Scheduler(JobStore(tmp_path / "off"), s.pool, ScriptedRuntime(nodes=set()), tmp_path / "off" / "runs")
    assert not TrainingServicer(off.store, off, off.pool, Authenticator(None)).GetCluster(
        pb.GetClusterRequest(), owner).HasField("scale_up")


def test_a_new_leader_withdraws_the_request_an_earlier_one_left_standing(tmp_path: Path) -> None:
    # Ray holds one request for the cluster: one a leader made before it stopped leading would otherwise keep
    # its nodes from the idle timeout for good.
    s, _, requests, _ = autoscaled(tmp_path, live=set(), map_nodes=1)
    job = submit(s, "job", 4)
    s.tick()
    assert requests == [["node-0"]]
    assert s.autoscaling is not None
    s.autoscaling.forget()  # it stops leading; the job is cancelled meanwhile
    s.request_cancel(job, "not needed")
    s.tick()  # it leads again, or another replica does: it knows nothing of what stands
    assert requests[-1] == [] and len(requests) == 2
    s.tick()
    assert len(requests) == 2, "sent once"
