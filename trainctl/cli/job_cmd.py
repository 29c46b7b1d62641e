"""The job commands against the server: `submit [--watch]`, `get`, `list`, `cancel`, `logs [-f]`, `report`.

Each takes the parsed arguments and a connected client (trainctl.cli.dispatch) and returns the exit status.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc

from trainctl.cli import sweep_cmd
from trainctl.cli.client import TrainctlClient
from trainctl.cli.errors import EXIT_ERROR, EXIT_INVALID, EXIT_OK, CliError
from trainctl.cli.plan_cmd import load_job
from trainctl.cli.progress import follow, json_text, state_name, table
from trainctl.v1 import training_pb2 as pb

LIST_HEADER = ["ID", "STATE", "PRIORITY", "GPUS", "STEP", "LOSS", "EVAL", "AGE", "REASON"]


def _time(ts: Any) -> str | None:
    return ts.ToDatetime().isoformat() + "Z" if ts.seconds or ts.nanos else None


STEP_METRICS = (
    "grad_norm", "lr", "tokens", "tokens_per_second", "mfu", "mfu_full_attention", "step_time_seconds",
    "peak_memory_bytes", "eval_loss",
)
"""StepMetrics' optional fields, in output order: a metric the job did not report is left out of its step.
`mfu` is Megatron's convention (causal attention halved), `mfu_full_attention` torchtitan's (unmasked)."""


def metrics_dict(m: pb.StepMetrics) -> dict[str, Any]:
    """One step's metrics as plain JSON values, without the metrics the job did not report."""
    reported = {name: getattr(m, name) for name in STEP_METRICS if m.HasField(name)}
    return {"step": m.step, "loss": m.loss, **reported, "breakdown": dict(m.breakdown), "time": _time(m.time)}


def job_document(job: pb.Job) -> dict[str, Any]:
    """A job as the document `get -o yaml|json` prints: the spec as written, status, metrics."""
    from trainctl.wire.convert import job_from_proto

    s = job.status
    status = {
        "state": state_name(s.state), "reason": s.reason,
        **{name: _time(getattr(s, name)) for name in ("create_time", "schedule_time", "start_time", "end_time", "update_time")},
        "steps_done": s.steps_done, "total_steps": s.total_steps,
        "first_loss": s.first_loss if s.HasField("first_loss") else None,
        "last_loss": s.last_loss if s.HasField("last_loss") else None,
        "last_eval_loss": s.last_eval_loss if s.HasField("last_eval_loss") else None,
        "restarts": s.restarts, "preemptions": s.preemptions, "preempt_time": _time(s.preempt_time),
        "tokens_per_second": s.tokens_per_second,
        "mfu": s.mfu if s.HasField("mfu") else None,
        "mfu_full_attention": s.mfu_full_attention if s.HasField("mfu_full_attention") else None,
        "run_dir": s.run_dir,
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


def _row(job: pb.Job) -> list[str]:
    s = job.status
    loss = f"{s.last_loss:.4f}" if s.HasField("last_loss") else "-"
    eval_loss = f"{s.last_eval_loss:.4f}" if s.HasField("last_eval_loss") else "-"
    return [
        job.id, state_name(s.state), str(job.spec.scheduling.priority), str(job.spec.resources.gpus),
        f"{s.steps_done}/{s.total_steps}" if s.total_steps else str(s.steps_done), loss, eval_loss, _age(s.create_time),
        s.reason[:60],
    ]


def submit(args: argparse.Namespace, client: TrainctlClient) -> int:
    job = client.create_job(load_job(args.file))
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
        summary += f" (loss {s.first_loss:.4f} -> {s.last_loss:.4f} over {s.steps_done} steps"
        summary += f", eval loss {s.last_eval_loss:.4f})" if s.HasField("last_eval_loss") else ")"
    print(summary, flush=True)
    return EXIT_OK if s.state == pb.SUCCEEDED else EXIT_ERROR


def get(args: argparse.Namespace, client: TrainctlClient) -> int:
    job = client.get_job(args.job, full=args.output in ("json", "yaml"))
    if args.output == "json":
        print(json_text(job_document(job)))
    elif args.output == "yaml":
        import yaml

        print(yaml.safe_dump(job_document(job), sort_keys=False), end="")
    else:
        print(table([_row(job)], LIST_HEADER))
    return EXIT_OK


def list_jobs(args: argparse.Namespace, client: TrainctlClient) -> int:
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


def cancel(args: argparse.Namespace, client: TrainctlClient) -> int:
    """Cancel a job that has not ended; one that has is the server's FAILED_PRECONDITION, one error line."""
    job = client.cancel_job(args.job)
    print(f"job {job.id} {state_name(job.status.state)}: {job.status.reason}")
    return EXIT_OK


def logs(args: argparse.Namespace, client: TrainctlClient) -> int:
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


def report(args: argparse.Namespace, client: TrainctlClient) -> int:
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
