"""The `trainctl` command.

    trainctl serve [--address HOST:PORT] [--health-address HOST:PORT] [--data-dir DIR] [--store URL] [--metrics-port N] [--ray-address ADDR] [--topology FILE] [--warm-pool]
                   [--nodes N] [--gpus-per-node G]
    trainctl submit FILE [--watch]       trainctl get JOB [-o yaml|json]     trainctl list [--state S] [--label k=v]
    trainctl cancel JOB                  trainctl logs JOB [-f] [--rank N]   trainctl plan FILE [--cluster PRESET:N | --topology MAP]
    trainctl plan FILE --cluster PRESET:N | --topology MAP --suggest [--top K]
    trainctl validate FILE               trainctl demo
    trainctl sweep create|get|list|cancel|watch   (hyperparameter sweeps: trainctl.cli.sweep_cmd)
    trainctl data prepare PATHS --out DIR   trainctl export JOB|CKPT --out DIR   trainctl generate JOB|CKPT --prompt T

Client commands find the server in --server or TRAINCTL_SERVER (default 127.0.0.1:50051; several replicas
comma-separated, failed over on UNAVAILABLE) and send
TRAINCTL_TOKEN as a bearer token. `serve --store` (or TRAINCTL_STORE) names a PostgreSQL job store. Exit status: 0 success, 1 an API or runtime error (or a watched job
that did not succeed), 2 an invalid spec or usage.
"""

from __future__ import annotations

import os

# Before anything imports Ray: an embedded Ray binds 127.0.0.1 only and reports no usage stats.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable, Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import grpc  # noqa: E402

from trainctl.cli import data_cmd, export_cmd, generate_cmd, sweep_cmd, topology_cmd  # noqa: E402
from trainctl.cli.client import DEFAULT_SERVER, SERVER_ENV, AddressError, TrainctlClient  # noqa: E402
from trainctl.cli.progress import follow, json_text, state_name, table  # noqa: E402
from trainctl.spec.violations import FieldViolation, SpecError  # noqa: E402
from trainctl.v1 import training_pb2 as pb  # noqa: E402
from trainctl.workers.topology.presets import CLUSTER_PRESETS  # noqa: E402

if TYPE_CHECKING:  # client commands load no spec models unless they read or print a spec
    from trainctl.spec.job import TrainingJob

EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


class CliError(Exception):
    """A failure to report as `error: ...` with an exit status."""

    def __init__(self, message: str, status: int = EXIT_ERROR, violations: Sequence[FieldViolation] = ()):
        super().__init__(message)
        self.status = status
        self.violations = list(violations)


# ---- output helpers -----------------------------------------------------------------------------------


def _time(ts: Any) -> str | None:
    return ts.ToDatetime().isoformat() + "Z" if ts.seconds or ts.nanos else None


def metrics_dict(m: pb.StepMetrics) -> dict[str, Any]:
    """One step's metrics as plain JSON values."""
    return {
        "step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr, "tokens": m.tokens,
        "tokens_per_second": m.tokens_per_second, "mfu": m.mfu if m.HasField("mfu") else None,
        "step_time_seconds": m.step_time_seconds, "peak_memory_bytes": m.peak_memory_bytes,
        "breakdown": dict(m.breakdown), "time": _time(m.time),
    }


def job_document(job: pb.Job) -> dict[str, Any]:
    """A job as the document `get -o yaml|json` prints: the spec as written, status, metrics."""
    from trainctl.service.convert import job_from_proto

    s = job.status
    status = {
        "state": state_name(s.state), "reason": s.reason,
        **{name: _time(getattr(s, name)) for name in ("create_time", "schedule_time", "start_time", "end_time", "update_time")},
        "steps_done": s.steps_done, "total_steps": s.total_steps,
        "first_loss": s.first_loss if s.HasField("first_loss") else None,
        "last_loss": s.last_loss if s.HasField("last_loss") else None,
        "restarts": s.restarts, "tokens_per_second": s.tokens_per_second,
        "mfu": s.mfu if s.HasField("mfu") else None, "run_dir": s.run_dir,
        "placement": [{"rank": p.rank, "node": p.node, "gpu": p.gpu, "coords": dict(p.coords)} for p in s.placement],
    }
    document = {"id": job.id, **job_from_proto(job).model_dump(mode="json"), "status": status}
    document["metrics"] = [metrics_dict(m) for m in job.metrics]
    return document


def _age(ts: Any) -> str:
    if not ts.seconds:
        return "-"
    seconds = max(0, int(time.time() - ts.seconds))
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m" if seconds < 7200 else f"{seconds // 3600}h"


STORE_ENV = "TRAINCTL_STORE"
"""The PostgreSQL URL `serve` uses when --store is not given (a Kubernetes Secret sets it)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _store_url(text: str) -> str:
    from trainctl.service.store_db import POSTGRES_SCHEMES

    if not text.startswith(POSTGRES_SCHEMES):
        raise argparse.ArgumentTypeError(
            f"expected a PostgreSQL URL (postgresql://user:password@host:port/database), got {text!r}; "
            "the SQLite store in --data-dir is the default"
        )
    return text


def _load(path: str) -> Any:
    from trainctl.spec.validate import load_job_file

    try:
        return load_job_file(path)
    except SpecError as exc:
        raise CliError(f"{path} is not a valid job spec", EXIT_INVALID, exc.violations) from None


# ---- commands -------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from trainctl.service.server import Service, ServiceConfig, settle_heap_for_serving
    from trainctl.service.shutdown import install_stop_signals
    from trainctl.service.store import StoreError
    from trainctl.service.tls import TlsConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert or args.tls_key else None
    sizes = (("embedded_nodes", args.nodes), ("embedded_gpus_per_node", args.gpus_per_node))
    embedded = {name: value for name, value in sizes if value is not None}  # unset: ServiceConfig's defaults
    config = ServiceConfig(
        address=args.address, data_dir=args.data_dir, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        store=args.store, ray_address=args.ray_address, **embedded,
        topology=args.topology, tokens_file=args.tokens_file, tls=tls, data_roots=args.data_root or [],
        allow_any_data_path=args.allow_any_data_path, warm_pool=args.warm_pool, health_address=args.health_address,
    )
    try:
        service = Service(config).start()
    except StoreError as exc:  # an unreachable or newer database: nothing was started
        raise CliError(f"the job store: {exc}") from exc
    print(f"trainctl serving on {service.target}; data in {config.data_dir}; store {service.store.location}"
          + (f"; metrics on http://{config.metrics_host}:{service.metrics_port}/metrics" if service.metrics_port else ""),
          flush=True)
    install_stop_signals(service.stop)
    settle_heap_for_serving()
    service.wait()
    return EXIT_OK


def cmd_submit(args: argparse.Namespace, client: TrainctlClient) -> int:
    job = client.create_job(_load(args.file))
    print(f"job {job.id} {state_name(job.status.state)}", flush=True)
    if not args.watch:
        return EXIT_OK
    return _follow(client, job.id, job.status.total_steps, after=0)


def _follow(client: TrainctlClient, job_id: str, total: int, after: int, rank: int | None = None) -> int:
    follow(of_rank(client.watch(job_id, after_sequence=after, follow=True), rank), total, sys.stdout)
    final = client.get_job(job_id)
    s = final.status
    summary = f"job {job_id} {state_name(s.state)}"
    if s.reason:
        summary += f": {s.reason}"
    if s.HasField("first_loss") and s.HasField("last_loss"):
        summary += f" (loss {s.first_loss:.4f} -> {s.last_loss:.4f} over {s.steps_done} steps)"
    print(summary, flush=True)
    return EXIT_OK if s.state == pb.SUCCEEDED else EXIT_ERROR


def cmd_get(args: argparse.Namespace, client: TrainctlClient) -> int:
    job = client.get_job(args.job, full=args.output in ("json", "yaml"))
    if args.output == "json":
        print(json_text(job_document(job)))
    elif args.output == "yaml":
        import yaml

        print(yaml.safe_dump(job_document(job), sort_keys=False), end="")
    else:
        print(table([_row(job)], LIST_HEADER))
    return EXIT_OK


LIST_HEADER = ["ID", "STATE", "PRIORITY", "GPUS", "STEP", "LOSS", "AGE", "REASON"]


def _row(job: pb.Job) -> list[str]:
    s = job.status
    loss = f"{s.last_loss:.4f}" if s.HasField("last_loss") else "-"
    return [
        job.id, state_name(s.state), str(job.spec.scheduling.priority), str(job.spec.resources.gpus),
        f"{s.steps_done}/{s.total_steps}" if s.total_steps else str(s.steps_done), loss, _age(s.create_time), s.reason[:60],
    ]


def cmd_list(args: argparse.Namespace, client: TrainctlClient) -> int:
    labels = {}
    for item in args.label or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--label {item!r}: expected key=value", EXIT_INVALID)
        labels[key] = value
    states = [s.upper() for s in args.state or ()]
    for s in states:
        if s not in pb.JobState.keys()[1:]:  # noqa: SIM118 - an EnumTypeWrapper, not a dict
            raise CliError(f"--state {s}: one of {', '.join(pb.JobState.keys()[1:])}", EXIT_INVALID)
    jobs = list(client.list_jobs(states=states, labels=labels))
    print(table([_row(j) for j in jobs], LIST_HEADER))
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace, client: TrainctlClient) -> int:
    job = client.cancel_job(args.job)
    print(f"job {job.id} {state_name(job.status.state)}: {job.status.reason}")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace, client: TrainctlClient) -> int:
    job = client.get_job(args.job)
    if args.follow:
        return _follow(client, job.id, job.status.total_steps, after=0, rank=args.rank)
    events = of_rank(client.watch(job.id, follow=False), args.rank)
    follow(events, job.status.total_steps, sys.stdout, force_plain=True)
    return EXIT_OK


def of_rank(events: Iterable[pb.JobEvent], rank: int | None) -> Iterator[pb.JobEvent]:
    """`events` without the log lines of other ranks (and of the supervisor) when `rank` is given."""
    for event in events:
        if rank is None or event.WhichOneof("payload") != "log" or (event.log.HasField("rank") and event.log.rank == rank):
            yield event


def cmd_plan(args: argparse.Namespace) -> int:
    from trainctl.parallelism.sizing.step_time import STEP_TERMS

    job = _load(args.file)
    if args.suggest:
        return _suggest(args, job)
    if args.cluster or args.topology:
        plan, where = _offline_plan(args, job)
    else:
        with TrainctlClient(args.server) as client:
            plan = client.plan_job(job)
        where = ""
    if not plan.valid:
        raise CliError(f"{args.file} is not a valid job" + (f" on {where}" if where else ""), EXIT_INVALID,
                       [FieldViolation(v.field, v.description) for v in plan.violations])
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
    grid = " x ".join(f"{k}{plan.grid[k]}" for k in order if plan.grid.get(k, 1) > 1) or "single rank"
    pool = where or (f"pool {plan.pool_gpus} GPUs, {plan.free_gpus} free; "
                     f"{'fits now' if plan.fits_now else 'would queue'}")
    print(f"valid: {plan.world_size} ranks ({grid}); {pool}")
    if plan.placement:
        rows = [[str(p.rank), p.node, str(p.gpu), " ".join(f"{k}={v}" for k, v in sorted(p.coords.items()))] for p in plan.placement]
        print(table(rows, ["RANK", "NODE", "GPU", "COORDS"]))
    if plan.HasField("placement_cost_seconds"):
        print(f"modelled communication per step: {plan.placement_cost_seconds * 1e3:.3f} ms")
    if plan.memory:
        kinds = sorted({k for m in plan.memory for k in m.bytes})
        rows = [[str(m.rank), *(f"{m.bytes.get(k, 0) / 2**20:.1f}" for k in kinds)] for m in plan.memory]
        print(table(rows, ["RANK", *(f"{k.upper()} MiB" for k in kinds)]))
    if plan.HasField("step_time_seconds"):
        terms = plan.step_time_breakdown
        names = [*(k for k in STEP_TERMS if k in terms), *sorted(set(terms) - set(STEP_TERMS))]
        parts = ", ".join(f"{k} {terms[k] * 1e3:.2f} ms" for k in names)
        print(f"modelled step time: {plan.step_time_seconds * 1e3:.2f} ms" + (f" ({parts})" if parts else ""))
    for note in plan.notes:
        print(f"note: {note}")
    return EXIT_OK


def _suggest(args: argparse.Namespace, job: TrainingJob) -> int:
    """`plan --suggest`: the layout search on the cluster, offline (its estimator loads torch here)."""
    from trainctl.cli.suggest_cmd import suggestion_lines
    from trainctl.service.layout_search import LayoutSearchError, suggest_layouts

    if not (args.cluster or args.topology):
        raise CliError("--suggest plans offline: give the cluster with --cluster PRESET:N or --topology MAP", EXIT_INVALID)
    topology, option = _offline_topology(args)
    try:
        result = suggest_layouts(job, topology, option, top=args.top)
    except LayoutSearchError as exc:
        raise CliError(f"no layout to suggest for {args.file} on {option}: {exc}", EXIT_INVALID) from None
    print("\n".join(suggestion_lines(job, result, _cluster_words(job, topology, option, result.gpus))))
    return EXIT_OK


def _offline_topology(args: argparse.Namespace) -> tuple[Any, str]:
    """The map `--cluster PRESET:N` or `--topology MAP` names, and the option as written."""
    from trainctl.workers.topology import TopologyError, load_topology
    from trainctl.workers.topology.presets import cluster_topology

    flag, value = ("--cluster", args.cluster) if args.cluster else ("--topology", args.topology)
    try:
        topology = cluster_topology(args.cluster) if args.cluster else load_topology(args.topology)
    except TopologyError as exc:
        raise CliError(f"{flag}: {exc}", EXIT_INVALID) from None
    return topology, f"{flag} {value}"


def _cluster_words(job: TrainingJob, topology: Any, option: str, gpus: int) -> str:
    """`option: N GPUs, MODEL (peak ..., memory)` for the output's first line."""
    from trainctl.parallelism.sizing.device_memory import gpu_memory_bytes
    from trainctl.parallelism.sizing.flops import peak_flops

    dtype = job.spec.training.dtype
    models = []
    for model in dict.fromkeys(node.gpu_model for node in topology.nodes):
        peak, memory = peak_flops(model, dtype), gpu_memory_bytes(model)
        models.append(f"{model or 'unnamed GPUs'} ("
                      + (f"peak {peak / 1e12:,.0f} TFLOP/s {dtype}" if peak else f"no known peak for {dtype}")
                      + (f", {memory / 2**30:.1f} GiB" if memory else ", memory unknown") + ")")
    return f"{option}: {gpus} GPUs, " + ", ".join(models)


def _offline_plan(args: argparse.Namespace, job: TrainingJob) -> tuple[pb.PlanJobResponse, str]:
    """The plan on `--cluster PRESET:N` or `--topology MAP` with no server (the service's own planning,
    so the engine's estimator and torch load here), and the cluster described for the output."""
    from trainctl.service.planning import plan_on_map

    topology, option = _offline_topology(args)
    plan = plan_on_map(job, topology, option)
    return plan, _cluster_words(job, topology, option, plan.pool_gpus)


def cmd_validate(args: argparse.Namespace) -> int:
    from trainctl.spec.validate import semantic_violations

    job = _load(args.file)
    violations = semantic_violations(job, pool_gpus=args.pool_gpus, check_data=True)
    if violations:
        raise CliError(f"{args.file} is not a valid job spec", EXIT_INVALID, violations)
    print(f"{args.file}: valid ({job.spec.parallelism.world_size} ranks)")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from trainctl.cli.demo import run_demo

    return run_demo(Path(args.spec), nodes=args.nodes, gpus_per_node=args.gpus_per_node)


def cmd_report(args: argparse.Namespace, client: TrainctlClient) -> int:
    from trainctl.cli.report import ReportError, write_report

    try:
        job = client.get_job(args.job, full=True)
    except grpc.RpcError as exc:  # not a job: a sweep's id gets the sweep report
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        job = None
    try:
        if job is None:
            try:
                files = sweep_cmd.report(client, args.job, args.out, html_page=not args.no_html)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                raise CliError(f"no job or sweep {args.job!r}") from None
        else:
            files = write_report(job, args.out or Path(f"{job.id}-report.png"), html_page=not args.no_html)
    except ReportError as exc:
        raise CliError(str(exc)) from None
    print(f"wrote {files.png}" + (f" and {files.html}" if files.html else ""))
    return EXIT_OK


def cmd_token(args: argparse.Namespace) -> int:
    from trainctl.cli.token_cmd import token_main

    return token_main(args.rest)


# ---- parser -----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainctl", description="Distributed LLM training service.")
    parser.add_argument("--server", help=f"service address HOST:PORT, or several replicas' comma-separated, tried in turn "
                        f"while one answers UNAVAILABLE (default: ${SERVER_ENV} or {DEFAULT_SERVER})")
    sub = parser.add_subparsers(dest="command", required=True)
    # One declaration per command below: a deliberate table of parsers.

    serve = sub.add_parser("serve", help="run the service")
    serve.add_argument("--address", default="127.0.0.1:50051", help="gRPC listen address HOST:PORT")
    serve.add_argument("--health-address", metavar="HOST:PORT",
                       help="also serve gRPC health, and only it, in plaintext here (for Kubernetes' gRPC probe, "
                            "which speaks no TLS; default: health only on --address)")
    serve.add_argument("--data-dir", type=Path, default=Path(".trainctl"), help="store and run directory")
    serve.add_argument("--store", type=_store_url, default=os.environ.get(STORE_ENV) or None,
                       help=f"PostgreSQL URL of the job store (default: ${STORE_ENV}, else SQLite in --data-dir)")
    serve.add_argument("--metrics-port", type=int, default=9464, help="Prometheus port (0: off)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="Prometheus listen address (0.0.0.0 in a pod, so Prometheus can scrape it)")
    serve.add_argument("--ray-address", help="Ray cluster to use (default: start an embedded local Ray)")
    serve.add_argument("--topology", type=Path, help="topology map file (default: simulated from the Ray cluster)")
    serve.add_argument("--nodes", type=_positive_int,
                       help="simulated nodes of the embedded Ray started without --ray-address (default 1)")
    serve.add_argument("--gpus-per-node", type=_positive_int,
                       help="simulated GPU slots per embedded node, one rank each (default 8)")
    serve.add_argument("--tokens-file", type=Path, help="access file with token hashes, tenants, quotas (default: auth off)")
    serve.add_argument("--tls-cert", type=Path)
    serve.add_argument("--tls-key", type=Path)
    serve.add_argument("--tls-client-ca", type=Path, help="require client certificates signed by this CA")
    serve.add_argument("--data-root", type=Path, action="append",
                       help="confine every path a job names to this directory (repeatable; required with --tokens-file)")
    serve.add_argument("--allow-any-data-path", action="store_true",
                       help="with --tokens-file, serve without --data-root: every tenant's jobs may read any file the service can")
    serve.add_argument("--warm-pool", action="store_true",
                       help="keep an engine-loaded rank process on every free GPU slot, so jobs start without the "
                            "imports (about 300 MB of host memory per slot)")
    serve.set_defaults(handler=cmd_serve, needs_client=False)

    submit = sub.add_parser("submit", help="submit a job spec")
    submit.add_argument("file")
    submit.add_argument("--watch", "-w", action="store_true", help="show live progress until the job ends")
    submit.set_defaults(handler=cmd_submit, needs_client=True)

    get = sub.add_parser("get", help="show one job")
    get.add_argument("job")
    get.add_argument("-o", "--output", choices=["table", "yaml", "json"], default="table")
    get.set_defaults(handler=cmd_get, needs_client=True)

    lst = sub.add_parser("list", help="list jobs")
    lst.add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    lst.add_argument("--label", action="append", help="only jobs with label key=value (repeatable)")
    lst.set_defaults(handler=cmd_list, needs_client=True)

    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job")
    cancel.set_defaults(handler=cmd_cancel, needs_client=True)

    logs = sub.add_parser("logs", help="a job's events (state changes, steps, log lines)")
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true", help="keep following until the job ends")
    logs.add_argument("--rank", type=int, help="only this rank's log lines (a command job's program output)")
    logs.set_defaults(handler=cmd_logs, needs_client=True)

    plan = sub.add_parser("plan", help="dry run: validation, placement, memory, step time (on the server's pool, or offline)")
    plan.add_argument("file")
    offline = plan.add_mutually_exclusive_group()
    offline.add_argument("--cluster", metavar="PRESET:N",
                         help="plan offline, no server, on N nodes or racks of a named cluster ("
                              + ", ".join(f"{p.name}: {p.gpus_per_unit} GPUs per {p.unit}" for p in CLUSTER_PRESETS) + ")")
    offline.add_argument("--topology", type=Path, metavar="MAP", help="plan offline, no server, on a topology map file")
    plan.add_argument("--suggest", action="store_true",
                      help="with --cluster or --topology: search the layouts of the job's model, sequence length and global "
                           "batch on all the cluster's GPUs and print the fastest by modelled step time")
    plan.add_argument("--top", type=_positive_int, default=5, metavar="K", help="with --suggest: how many layouts to print (default 5)")
    plan.set_defaults(handler=cmd_plan, needs_client=False)

    validate = sub.add_parser("validate", help="check a job spec locally")
    validate.add_argument("file")
    validate.add_argument("--pool-gpus", type=int, help="also check the job fits a pool of this many GPUs")
    validate.set_defaults(handler=cmd_validate, needs_client=False)

    demo = sub.add_parser("demo", help="embedded 2-node Ray + service + a hybrid-parallel job, end to end")
    demo.add_argument("--spec", default=str(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"))
    demo.add_argument("--nodes", type=int, default=2)
    demo.add_argument("--gpus-per-node", type=int, default=4)
    demo.set_defaults(handler=cmd_demo, needs_client=False)

    report = sub.add_parser("report", help="PNG + HTML report of a job's recorded steps and placement, or of a sweep's trials")
    report.add_argument("job", help="a job id, or a sweep id (objective per trial, parameters, curves)")
    report.add_argument("--out", type=Path, help="PNG path (default: <id>-report.png)")
    report.add_argument("--no-html", action="store_true", help="write only the PNG")
    report.set_defaults(handler=cmd_report, needs_client=True)

    token = sub.add_parser("token", help="make or hash an API token (see trainctl.cli.token_cmd)", add_help=False)
    token.add_argument("rest", nargs=argparse.REMAINDER)
    token.set_defaults(handler=cmd_token, needs_client=False)

    for command in (topology_cmd, data_cmd, export_cmd, generate_cmd, sweep_cmd):  # command groups that run themselves
        command.register(sub).set_defaults(dispatch=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "dispatch"):  # a command group registered by another module runs itself
            return args.dispatch(args)
        handler: Callable[..., int] = args.handler
        if getattr(args, "needs_client", False):
            with TrainctlClient(args.server) as client:
                return handler(args, client)
        return handler(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        for violation in exc.violations:
            print(f"  {violation}", file=sys.stderr)
        return exc.status
    except SpecError as exc:  # a spec refused past _load (one with no proto form, say)
        print("error: not a valid spec", file=sys.stderr)
        for violation in exc.violations:
            print(f"  {violation}", file=sys.stderr)
        return EXIT_INVALID
    except AddressError as exc:  # --server or $TRAINCTL_SERVER names no address
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:  # the reader went away (`trainctl logs JOB | head`): stop quietly
        with contextlib.suppress(OSError, ValueError):  # so the flush at exit has nowhere to fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except grpc.RpcError as exc:
        from trainctl.service.errors import field_violations

        violations = field_violations(exc)
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr) if not violations else print(
            f"error: {exc.code().name}: the server refused the request", file=sys.stderr)
        for violation in violations:
            print(f"  {violation}", file=sys.stderr)
        return EXIT_INVALID if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
