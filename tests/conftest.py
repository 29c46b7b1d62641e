"""What every test directory shares: the Ray environment guard, the embedded cluster and the served
service of a test module, and which tests are `slow` (left out of `make test-fast`): those on a Ray
cluster fixture and those in SLOW_TESTS.

Shapes: a module's `pytestmark = pytest.mark.cluster(nodes=2, gpus_per_node=4, fast_node_failure=True)`
changes its cluster (default: 2 nodes x 1 simulated GPU, the dashboard on for `ray.util.state`), and
`pytest.mark.service(warm_pool=True)` adds ServiceConfig fields to its service. Consecutive modules of one
shape share one cluster, each finding it empty (tests/shared_cluster.py). The workers tests share one
connected 3-node cluster for their whole directory instead (`embedded_ray`, tests/workers/conftest.py).
Job builders: small_jobs.py. `postgres` / `private_postgres`: a real PostgreSQL server the tests start
(tests/postgres_server.py).
"""

from __future__ import annotations

import logging
import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from postgres_server import PostgresServer
    from shared_cluster import SharedCluster

    from trainctl.cli.client import TrainctlClient
    from trainctl.service.server import Service
    from trainctl.workers.embedded import EmbeddedRay

RAY_FIXTURES = ("cluster", "embedded_ray")
"""A test that uses one of these starts or shares a Ray cluster: it is `slow` (not in `make test-fast`)."""

SLOW_TESTS = (
    "reliability/",  # processes killed and restarted, real Ray clusters started
    "deploy/test_prometheus_live.py",  # a service, a Prometheus server and a 20-step job
    "deploy/test_existing_ray.py",  # `ray start` and `trainctl serve` processes
    "service/e2e/test_readme_commands.py",  # a `trainctl serve` process training the README's 8-rank demo job
    "service/tracking/test_tracking_e2e.py",  # `mlflow server` and `trainctl serve` processes, a sweep and a job
    "service/store/test_store_outage.py::test_losing_the_database",  # a PostgreSQL server stopped for seconds under load
    "service/scheduling/test_leadership.py",  # leases lapsing and taken over, seconds each
    # Engine runs measured at 5 s or more (call time, 2-core machine); the quick layouts stay in the fast tier.
    "parallelism/test_equivalence_pp_ep.py::test_layout_matches_single_process[dp2-tp2-pp2]",
    "parallelism/test_equivalence_pp_ep.py::test_layout_matches_single_process[moe-",
    "parallelism/test_equivalence_pp_ep.py::test_layout_matches_single_process[pp4-zero-bubble]",
    "parallelism/test_equivalence_pp_ep.py::test_resume_under_another_layout_continues_the_run",
    "parallelism/test_dp_equivalence.py::test_data_parallel_matches_single_process[hsdp-2x2]",
    "parallelism/test_dp_equivalence.py::test_data_parallel_matches_single_process[fsdp-dp4]",
    "parallelism/test_dp_equivalence.py::test_activation_checkpointing_composes_with_fsdp",
    "parallelism/test_equivalence_tp_cp.py::test_layout_matches_single_process[tp2_sp]",
    "parallelism/test_equivalence_tp_cp.py::test_layout_matches_single_process[tp4]",
    "parallelism/test_equivalence_tp_cp.py::test_layout_matches_single_process[fsdp2_tp2_sp_cp2]",
    "parallelism/test_equivalence_tp_cp.py::test_layout_matches_single_process[cp4_zigzag]",
    "parallelism/test_equivalence_tp_cp.py::test_layout_matches_single_process[moe_tp2_sp]",
    "parallelism/test_equivalence_tp_cp.py::test_layout_matches_single_process[moe_transformers_aux_tp2_sp]",
    "parallelism/test_equivalence_tp_cp.py::test_resume_dp4_checkpoint_under_tp2",
    "parallelism/test_equivalence_tp_cp.py::test_sp_pipeline_stage_boundaries_carry_local_shards[2]",
    "parallelism/test_estimator.py::test_param_grad_optimizer_bytes_are_exact[pp2-tp2-sgd]",
    "parallelism/test_estimator.py::test_estimated_peaks_match_the_peaks_measured_under_gloo",  # 8 layouts, 2-4 ranks: ~40 s
    "parallelism/test_hf_mixtral.py::test_saved_mixtral_runs_under_expert_parallel_with_the_same_logits",
    "parallelism/test_hf_finetune.py::test_trained_import_exports_and_generates_as_in_transformers",  # 4 ranks, export, generate
    "parallelism/test_examples_finetune.py::test_the_finetune_example_trains",  # 2 ranks, 10 steps: 15-65 s each (transformers' import)
    "parallelism/test_launch.py",  # torchrun starts 2 processes; the world-size check starts one importing torch
    "parallelism/test_stop_request.py",  # three 2-rank FSDP runs and a resume: about 20 s
    "parallelism/test_equivalence_masked.py::test_gradient_accumulation_does_not_change_the_masked_objective",
    "parallelism/test_equivalence_masked.py::test_masked_layout_matches_single_process[ddp2]",
    "parallelism/test_equivalence_masked.py::test_masked_layout_matches_single_process[tp2_sp]",
    "parallelism/test_equivalence_masked.py::test_masked_layout_matches_single_process[cp2_zigzag]",
    "parallelism/test_equivalence_masked.py::test_masked_layout_matches_single_process[pp2]",
    "parallelism/test_equivalence_masked.py::test_masked_layout_matches_single_process[dp2_pp2]",
    # Measured at 8 s or more beside other test runs (about 4 s idle):
    "parallelism/test_equivalence_masked.py::test_masked_layout_matches_single_process[fsdp2]",
    "parallelism/test_equivalence_cp_pp.py::",  # every CP x PP case: 4 to 8 ranks
    "parallelism/test_checkpoint_resume.py::test_resume_under_another_layout_continues_the_run",  # a 4-rank FSDP run first
    "parallelism/test_data_formats.py::test_trainer_resumed_under_another_dp_size_trains_every_sample_once",
    "parallelism/test_dp_equivalence.py::test_bf16_mixed_precision_tracks_fp32[fsdp-bf16]",
    "parallelism/test_hf_import.py::test_imported_models_train_alike_under_tp_dp_and_pp",  # 8 cases, 2-4 ranks: 13-23 s each
    "parallelism/test_hf_import.py::test_tied_pp_checkpoints_resume_in_one_process_and_export",
    "parallelism/test_hf_finetune.py::test_fine_tuning_matches_transformers[qwen2-full]",
    "parallelism/test_hf_finetune.py::test_fine_tuning_matches_transformers[llama-lora]",
    "parallelism/test_equivalence_training_options.py::test_bf16_under_tensor_parallel_tracks_bf16_single_process",
    "parallelism/test_equivalence_training_options.py::test_compiled_blocks_under_fsdp_match_eager_single_process",
    "parallelism/test_equivalence_training_options.py::test_selective_activation_checkpointing_under_tp_sp_matches",
    "parallelism/test_harness.py::test_one_percent_is_caught_under_the_bf16_tolerance",
    "parallelism/test_estimator.py::test_param_grad_optimizer_bytes_are_exact[fsdp-dp4-padded]",
    "parallelism/test_estimator.py::test_estimates_of_imported_models_are_exact[qwen3-qknorm-tp2-fsdp2]",
    "parallelism/test_lora.py::test_lora_under_data_parallel_matches_one_process[fsdp]",
    "parallelism/test_optimizers.py::test_sharded_optimizer_state_round_trips[adamw-fsdp]",
    "parallelism/test_optimizers.py::test_sharded_optimizer_state_round_trips[sgd-fsdp]",
    "parallelism/test_optimizers.py::test_optimizer_trains_and_resumes_bit_for_bit[adamw-fused]",
    "parallelism/test_distributed_teardown.py::test_teardown_releases_every_process_group",
    "parallelism/test_grid.py::test_device_mesh_groups_match_the_grid",  # 8 ranks: 4 more pool workers to start
    # Two 2-rank FSDP runs (sync, async) and a resume: 36-70 s beside other test runs.
    "parallelism/test_checkpoint_async.py::test_async_saving_changes_no_loss_and_keeps_the_same_checkpoints",
    "parallelism/test_checkpoint_async.py::test_one_save_in_flight_and_commits_after_their_step_is_reported",
    "parallelism/test_checkpoint_async.py::test_resume_from_an_async_checkpoint_continues_bit_for_bit",
    "parallelism/test_evaluation.py::test_evaluation_changes_no_training_loss_under_a_pipeline",  # two 2-rank runs: ~10 s
)
"""Test ids (below tests/, prefixes) that are `slow` without using a Ray fixture."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster(nodes, gpus_per_node, fast_node_failure): the module's cluster shape")
    config.addinivalue_line("markers", "service(**fields): ServiceConfig fields of the module's service")
    config.addinivalue_line("markers", "scheduling_errors: the test makes the scheduling loops log errors (conftest)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from shared_cluster import grouped_by_shape

    for item in items:
        on_ray = any(name in getattr(item, "fixturenames", ()) for name in RAY_FIXTURES)
        if on_ray or item.nodeid.removeprefix("tests/").startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    items[:] = grouped_by_shape(items)


def running_postgres() -> Iterator[PostgresServer]:
    """A started PostgreSQL server (tests/postgres_server.py), removed afterwards; missing binaries fail
    the test with the package to install (CI installs it), they never skip it."""
    from postgres_server import PostgresMissing, PostgresServer

    try:
        server = PostgresServer()
    except PostgresMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        server.start()
        yield server
    finally:
        server.remove()


SCHEDULING_LOGGER = "trainctl.service.scheduling"
"""The scheduler's and the sweep runner's logger: their loops log an error and go on, so nothing else fails."""


class _ErrorRecords(logging.Handler):
    """Keeps the records of ERROR and above that reach it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def _scheduling_errors_fail_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A scheduler tick, a job's follow or a sweep pass that raised is logged and retried, so a bug there
    passes any test that does not look for it: an error the scheduling loops log during a test fails it,
    unless the test is marked `scheduling_errors` (it makes them: a store outage, a supervisor killed)."""
    handler = _ErrorRecords()
    logger = logging.getLogger(SCHEDULING_LOGGER)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.records and request.node.get_closest_marker("scheduling_errors") is None:
        first = handler.records[0]
        detail = logging.Formatter().format(first)
        pytest.fail(f"{len(handler.records)} error(s) logged by {first.name}; the first:\n{detail}", pytrace=False)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server on 127.0.0.1, started on first use (tests must not stop it)."""
    yield from running_postgres()


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for this test alone, which it may stop and start."""
    yield from running_postgres()


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Cached token shards (data formats jsonl / parquet / arrow) under the module's temporary directory,
    for this process and the processes it starts afterwards (`cluster` keeps a cache of its own)."""
    from trainctl.parallelism.data.dataset import CACHE_ENV

    root = tmp_path_factory.mktemp("data-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root))
        yield root


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedCluster]:
    """The session's embedded Ray behind `cluster`, kept between modules of one shape (shared_cluster.py)."""
    from shared_cluster import SharedCluster

    keeper = SharedCluster(tmp_path_factory)
    try:
        yield keeper
    finally:
        keeper.close()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, shared_cluster: SharedCluster) -> Iterator[EmbeddedRay]:
    """An embedded Ray on loopback for one test module, shaped by the module's `cluster` marker (the
    dashboard on, for `ray.util.state`), with no actor or placement group left by an earlier module; its
    ranks cache token shards in a directory of the cluster's own. A cluster of the shape the next module
    asks for is kept for it (tests/shared_cluster.py)."""
    from shared_cluster import module_shape, next_module_shape

    items = request.session.items
    shape = module_shape(items, request.module)
    assert shape is not None, f"{request.module.__name__} uses `cluster` in none of its selected tests"
    yield shared_cluster.get(shape)
    shared_cluster.after_module(next_module_shape(items, request.module))


@pytest.fixture(scope="module")
def service(request: pytest.FixtureRequest, cluster: EmbeddedRay,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The real service in this process on the module's cluster and its simulated map, on a free port."""
    from trainctl.service.server import Service, ServiceConfig

    marker = request.node.get_closest_marker("service")
    config = ServiceConfig(address="127.0.0.1:0", data_dir=tmp_path_factory.mktemp("service"), metrics_port=0,
                           ray_address=cluster.address, **(marker.kwargs if marker else {}))
    with Service(config, topology=cluster.topology) as running:
        yield running


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[TrainctlClient]:
    """A client of the module's `service`."""
    from trainctl.cli.client import TrainctlClient

    with TrainctlClient(service.target) as c:
        yield c
