"""`trainctl sweep create|get|list|cancel|watch`: hyperparameter sweeps (docs/sweeps.md).

    trainctl sweep create FILE [--watch]     trainctl sweep get SWEEP [-o table|yaml|json]
    trainctl sweep list                      trainctl sweep cancel SWEEP      trainctl sweep watch SWEEP
    trainctl sweep report SWEEP [--out FILE.png] [--no-html]

A sweep's trials are ordinary jobs: `trainctl list --label trainctl.sweep=SWEEP` lists them, and `get`,
`logs`, `report` work on each. `add_arguments(parser)` declares the group under the main parser's `sweep`.

`watch` (and `create --watch`) on a terminal redraws the sweep's table in place each time it changes;
into a pipe or file it prints the table once, then one line per change (a trial started, ended or got
its objective, the best trial or the sweep's state changed; a trial's step count alone is no change),
then the final table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from trainctl.cli.client import TrainctlClient
from trainctl.cli.progress import is_terminal, json_text, state_name, table
from trainctl.v1 import training_pb2 as pb

if TYPE_CHECKING:
    from trainctl.cli.report import ReportFiles

EXIT_OK, EXIT_ERROR = 0, 1
TRIAL_HEADER = ["TRIAL", "JOB", "STATE", "JOB STATE", "STEPS", "OBJECTIVE", "PARAMETERS", "REASON"]
SWEEP_HEADER = ["ID", "STATE", "TRIALS", "BEST", "OBJECTIVE", "REASON"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `create`, `get`, `list`, `cancel`, `watch` and `report` under the `sweep` command's parser."""
    commands = parser.add_subparsers(dest="sweep_command", required=True)
    create = commands.add_parser("create", help="submit a Sweep spec")
    create.add_argument("file")
    create.add_argument("--watch", "-w", action="store_true", help="show the trials until the sweep ends")
    get = commands.add_parser("get", help="one sweep: its trials, their parameters and objectives, the best")
    get.add_argument("sweep")
    get.add_argument("-o", "--output", choices=["table", "yaml", "json"], default="table")
    commands.add_parser("list", help="sweeps, newest first")
    cancel = commands.add_parser("cancel", help="stop a sweep and cancel its running trials")
    cancel.add_argument("sweep")
    watch = commands.add_parser("watch", help="show the trials each time they change, until the sweep ends")
    watch.add_argument("sweep")
    report = commands.add_parser("report", help="PNG + HTML: objective per trial, parameters, curves (also `trainctl report SWEEP`)")
    report.add_argument("sweep")
    report.add_argument("--out", type=Path, help="PNG path (default: <sweep id>-report.png)")
    report.add_argument("--no-html", action="store_true", help="write only the PNG")


def run(args: argparse.Namespace, client: TrainctlClient) -> int:
    """Run `trainctl sweep <command>` against the server."""
    if args.sweep_command == "create":
        from trainctl.spec.sweep import load_sweep_file  # spec models: only where a spec is read

        sweep = client.create_sweep(load_sweep_file(args.file))
        print(f"sweep {sweep.id} {_state(sweep.status.state)}", flush=True)
        return _watch(client, sweep.id) if args.watch else EXIT_OK
    if args.sweep_command == "get":
        sweep = client.get_sweep(args.sweep)
        if args.output == "table":
            print(describe(sweep))
        elif args.output == "json":
            print(json_text(sweep_document(sweep)))
        else:
            import yaml

            print(yaml.safe_dump(sweep_document(sweep), sort_keys=False), end="")
        return EXIT_OK
    if args.sweep_command == "list":
        print(table([_sweep_row(s) for s in client.list_sweeps()], SWEEP_HEADER))
        return EXIT_OK
    if args.sweep_command == "report":
        from trainctl.cli.report import ReportError

        try:
            files = report(client, args.sweep, args.out, html_page=not args.no_html)
        except ReportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        print(f"wrote {files.png}" + (f" and {files.html}" if files.html else ""))
        return EXIT_OK
    if args.sweep_command == "cancel":
        sweep = client.cancel_sweep(args.sweep)
        print(f"sweep {sweep.id} {_state(sweep.status.state)}: {sweep.status.reason}")
        return EXIT_OK
    return _watch(client, args.sweep)


def report(client: TrainctlClient, sweep_id: str, out: Path | None, *, html_page: bool = True) -> ReportFiles:
    """Write the sweep's report (trainctl.cli.sweep_report) from GetSweep and its trial jobs' steps."""
    from trainctl.cli.sweep_report import write_sweep_report

    sweep = client.get_sweep(sweep_id)
    curves = {t.job_id: list(client.get_job(t.job_id, full=True).metrics) for t in sweep.status.trials if t.job_id}
    return write_sweep_report(sweep, curves, out or Path(f"{sweep.id}-report.png"), html_page=html_page)


def _watch(client: TrainctlClient, sweep_id: str) -> int:
    final = show_changes(client.watch_sweep(sweep_id), sys.stdout) or client.get_sweep(sweep_id)
    return EXIT_OK if final.status.state == pb.SWEEP_STATE_SUCCEEDED else EXIT_ERROR


def show_changes(sweeps: Iterable[pb.Sweep], out: TextIO) -> pb.Sweep | None:
    """Show a sweep as it changes (module docstring: redrawn on a terminal, else a line per change);
    returns the last one seen."""
    last = None
    if is_terminal(out):
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        with Live(console=Console(file=out, highlight=False), auto_refresh=False) as live:
            for last in sweeps:
                live.update(Text(describe(last)), refresh=True)
        return last
    shown, changed = None, False
    for last in sweeps:
        lines = [describe(last)] if shown is None else changes(shown, last)
        for line in lines:
            print(line, file=out, flush=True)
        changed, shown = changed or (shown is not None and bool(lines)), last
    if changed:  # the end as a table, unless it is the one printed first
        print(describe(shown), file=out, flush=True)
    return last


def changes(before: pb.Sweep, after: pb.Sweep) -> list[str]:
    """One line per change from `before` to `after`: the sweep's state or reason, each trial that is new
    or changed state, job state, objective or reason, and the best trial."""
    lines = []
    b, a = before.status, after.status
    if (b.state, b.reason) != (a.state, a.reason):
        lines.append(f"sweep {after.id} {_state(a.state)}: {a.reason}")
    earlier = {t.number: t for t in b.trials}
    for trial in a.trials:
        seen = earlier.get(trial.number)
        if seen is None or _trial_key(seen) != _trial_key(trial):
            lines.append(_trial_line(trial))
    if a.HasField("best_trial") and (not b.HasField("best_trial") or (b.best_trial, b.best_objective) != (a.best_trial, a.best_objective)):
        lines.append(_best_line(after))
    return lines


def _trial_key(trial: pb.Trial) -> tuple[Any, ...]:
    return (trial.job_id, trial.state, trial.job_state, trial.objective if trial.HasField("objective") else None, trial.reason)


def _trial_line(trial: pb.Trial) -> str:
    parts = [" ".join(f"{k.removeprefix('spec.')}={_short(v)}" for k, v in _params(trial).items())]
    if trial.job_id:
        parts.append(f"job {trial.job_id} {state_name(trial.job_state)}")
    parts.append(f"step {trial.steps_done}")
    if trial.HasField("objective"):
        parts.append(f"objective {trial.objective:.6g}")
    reason = f": {trial.reason}" if trial.reason else ""
    return f"trial {trial.number} {_trial_state(trial.state)} ({', '.join(p for p in parts if p)}){reason}"


def _best_line(sweep: pb.Sweep) -> str:
    s = sweep.status
    best = s.trials[s.best_trial]
    params = ", ".join(f"{k}={_short(v)}" for k, v in _params(best).items())
    return f"best: trial {s.best_trial} ({best.job_id}) objective {s.best_objective:.6g} with {params}"


def _state(number: int) -> str:
    return pb.SweepState.Name(number).removeprefix("SWEEP_STATE_")


def _trial_state(number: int) -> str:
    return pb.TrialState.Name(number).removeprefix("TRIAL_STATE_")


def _params(trial: pb.Trial) -> dict[str, Any]:
    from trainctl.wire.sweep_convert import value_from_proto

    return {path: value_from_proto(trial.params[path]) for path in sorted(trial.params)}


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _objective(sweep: pb.Sweep) -> str:
    objective = sweep.spec.objective
    direction = pb.ObjectiveDirection.Name(objective.direction).removeprefix("OBJECTIVE_DIRECTION_").lower()
    at = f"at step {objective.step}" if objective.HasField("step") else "at the last step"
    return f"{direction} {objective.metric} {at}"


def describe(sweep: pb.Sweep) -> str:
    """A sweep as text: its state, objective, best trial and one row per trial."""
    s = sweep.status
    lines = [f"sweep {sweep.id} {_state(s.state)}: {s.reason}", f"objective: {_objective(sweep)}"]
    if s.HasField("best_trial"):
        lines.append(_best_line(sweep))
    rows = []
    for t in s.trials:
        objective = f"{t.objective:.6g}" if t.HasField("objective") else "-"
        params = " ".join(f"{k.removeprefix('spec.')}={_short(v)}" for k, v in _params(t).items())
        job_state = state_name(t.job_state) if t.job_state else "-"
        rows.append([str(t.number), t.job_id or "-", _trial_state(t.state), job_state, str(t.steps_done), objective, params, t.reason[:60]])
    return "\n".join([*lines, table(rows, TRIAL_HEADER)])


def sweep_document(sweep: pb.Sweep) -> dict[str, Any]:
    """A sweep as the document `sweep get -o yaml|json` prints: the spec as written, status, trials."""
    from trainctl.wire.sweep_convert import sweep_from_proto

    s = sweep.status
    trials = [
        {"number": t.number, "job_id": t.job_id or None, "state": _trial_state(t.state), "params": _params(t),
         "objective": t.objective if t.HasField("objective") else None,
         "objective_step": t.objective_step if t.HasField("objective_step") else None,
         "job_state": state_name(t.job_state) if t.job_state else None, "steps_done": t.steps_done, "reason": t.reason}
        for t in s.trials
    ]
    status = {
        "state": _state(s.state), "reason": s.reason,
        "best_trial": s.best_trial if s.HasField("best_trial") else None,
        "best_objective": s.best_objective if s.HasField("best_objective") else None, "trials": trials,
    }
    return {"id": sweep.id, **sweep_from_proto(sweep).model_dump(mode="json"), "status": status}


def _sweep_row(sweep: pb.Sweep) -> list[str]:
    s = sweep.status
    best = str(s.best_trial) if s.HasField("best_trial") else "-"
    objective = f"{s.best_objective:.6g}" if s.HasField("best_objective") else "-"
    return [sweep.id, _state(s.state), f"{len(s.trials)}/{sweep.spec.trials}", best, objective, s.reason[:60]]
