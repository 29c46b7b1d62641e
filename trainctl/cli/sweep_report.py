"""`trainctl report SWEEP` (or `trainctl sweep report SWEEP`): a PNG and an HTML page of one sweep.

Panels: the objective of every trial (by state, the best marked), the parameters of every trial in
parallel coordinates (one axis per parameter, log axes for log ranges, each line coloured by its
objective), and every trial's curve of the objective metric with the best trial's drawn bold (pruned
trials' curves end where they were stopped) and each trial's objective marked at the step it was read
(a metric reported on some steps only, as eval_loss on the steps that evaluated, is drawn with a point
per report, so a trial that reported it once is seen). Input: the sweep as GetSweep returns it and each
trial job's step metrics (GetJob, JOB_VIEW_FULL). matplotlib's object API on an Agg canvas, as the job
report.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from trainctl.cli.report import ReportFiles, save_figure
from trainctl.observability.run_report import ReportError, html_page, png_image
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.sweep_convert import value_from_proto

PANELS = ("Objective per trial", "Parameters", "Curves")
"""Axes titles, in reading order (tests find the panels by these)."""
STATE_COLOURS = {"COMPLETE": "C0", "PRUNED": "C1", "FAILED": "C3", "CANCELLED": "C7", "RUNNING": "C2"}


def _state(trial: pb.Trial) -> str:
    return pb.TrialState.Name(trial.state).removeprefix("TRIAL_STATE_")


def build_sweep_figure(sweep: pb.Sweep, curves: dict[str, list[pb.StepMetrics]]) -> Figure:
    """The sweep report's figure; `curves` maps trial job ids to their recorded steps."""
    trials = [t for t in sweep.status.trials if t.HasField("objective")]
    if not trials:
        raise ReportError(f"sweep {sweep.id} has no trial with an objective yet; nothing to report")
    fig = Figure(figsize=(16, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(zip(PANELS, fig.subplots(1, 3).flat, strict=True))
    for title, ax in axes.items():
        ax.set_title(title)
    metric = sweep.spec.objective.metric
    best = sweep.status.best_trial if sweep.status.HasField("best_trial") else None

    ax = axes["Objective per trial"]
    for state in STATE_COLOURS:
        chosen = [t for t in trials if _state(t) == state]
        if chosen:
            ax.scatter([t.number for t in chosen], [t.objective for t in chosen], color=STATE_COLOURS[state], label=state.lower())
    if best is not None:
        ax.scatter([best], [sweep.status.best_objective], s=200, facecolors="none", edgecolors="k", label="best")
    ax.set_xlabel("trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{metric} (at each trial's objective step)")
    ax.legend(loc="best", fontsize="small")

    _parallel_coordinates(axes["Parameters"], sweep, trials)

    ax = axes["Curves"]
    sparse = pb.StepMetrics.DESCRIPTOR.fields_by_name[metric].has_presence  # optional metrics: only steps that have it
    for trial in sweep.status.trials:
        steps = curves.get(trial.job_id, [])
        values = [(m.step, getattr(m, metric)) for m in steps if not sparse or m.HasField(metric)]
        if not values:
            continue
        is_best = trial.number == best
        ax.plot([s for s, _ in values], [v for _, v in values], color="k" if is_best else STATE_COLOURS.get(_state(trial), "C7"),
                linewidth=2.5 if is_best else 1.0, alpha=1.0 if is_best else 0.6, marker="o" if sparse else None, markersize=3,
                label=f"best: trial {trial.number}" if is_best else None)
    read = [t for t in trials if t.HasField("objective_step")]
    if read:
        ax.plot([t.objective_step for t in read], [t.objective for t in read], linestyle="none", marker="x", color="k",
                label="objective")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(metric)
    if best is not None or read:
        ax.legend(loc="upper right", fontsize="small")
    state = pb.SweepState.Name(sweep.status.state).removeprefix("SWEEP_STATE_")
    fig.suptitle(f"{sweep.metadata.name} ({sweep.id}): {state}, {len(sweep.status.trials)} of {sweep.spec.trials} trials")
    return fig


def _parallel_coordinates(ax: Axes, sweep: pb.Sweep, trials: list[pb.Trial]) -> None:
    """One vertical axis per parameter, each scaled to [0, 1] over its range (log ranges in log space,
    choices by position), and one line per trial coloured by its objective."""
    parameters = list(sweep.spec.parameters)
    positions = []
    for parameter in parameters:
        positions.append([_position(parameter, value_from_proto(t.params[parameter.path])) for t in trials])
    objectives = [t.objective for t in trials]
    low, high = min(objectives), max(objectives)
    colours = colormaps["viridis_r" if sweep.spec.objective.direction != pb.OBJECTIVE_DIRECTION_MAXIMIZE else "viridis"]
    x = list(range(len(parameters)))
    for i, trial in enumerate(trials):
        shade = (trial.objective - low) / (high - low) if high > low else 0.5
        style = "--" if _state(trial) == "PRUNED" else "-"
        ax.plot(x, [p[i] for p in positions], style, marker="o", color=colours(shade), alpha=0.8)
    labels = []
    for parameter in parameters:
        if parameter.type == pb.PARAMETER_TYPE_CHOICE:
            span = ", ".join(str(value_from_proto(v)) for v in parameter.values)
        else:
            span = f"{_short(value_from_proto(parameter.low))} .. {_short(value_from_proto(parameter.high))}" + (" (log)" if parameter.log else "")
        labels.append(f"{parameter.path.removeprefix('spec.')}\n{span}")
    ax.set_xticks(x, labels, fontsize="small")
    ax.set_ylim(-0.05, 1.05)
    ax.set_yticks([0, 1], ["low", "high"])
    for position in x:
        ax.axvline(position, color="0.8", zorder=0)
    ax.text(1.0, -0.12, "colour: objective (yellow best); dashed: pruned", transform=ax.transAxes, ha="right", fontsize="small")


def _position(parameter: pb.SweepParameter, value: Any) -> float:
    if parameter.type == pb.PARAMETER_TYPE_CHOICE:
        choices = [value_from_proto(v) for v in parameter.values]
        return choices.index(value) / max(1, len(choices) - 1) if value in choices else 0.5
    low, high = float(value_from_proto(parameter.low)), float(value_from_proto(parameter.high))
    if parameter.log:
        low, high, value = math.log(low), math.log(high), math.log(float(value))
    return (float(value) - low) / (high - low) if high > low else 0.5


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def write_sweep_report(sweep: pb.Sweep, curves: dict[str, list[pb.StepMetrics]], png: Path, *, html_page: bool = True) -> ReportFiles:
    """Write the PNG and, next to it (same name, .html), a page with the PNG and the trials table."""
    return save_figure(build_sweep_figure(sweep, curves), png, (lambda image: _html(sweep, image)) if html_page else None)


def _html(sweep: pb.Sweep, png_bytes: bytes) -> str:
    paths = [p.path for p in sweep.spec.parameters]
    metric = sweep.spec.objective.metric
    header = "".join(f"<th>{html.escape(h)}</th>" for h in ["trial", "job", "state", *paths, metric, "at step", "reason"])
    rows = []
    for t in sweep.status.trials:
        best = " style=\"font-weight:bold\"" if sweep.status.HasField("best_trial") and t.number == sweep.status.best_trial else ""
        cells = [str(t.number), t.job_id or "-", _state(t), *[_short(value_from_proto(t.params[p])) for p in paths],
                 f"{t.objective:.6g}" if t.HasField("objective") else "-",
                 str(t.objective_step) if t.HasField("objective_step") else "-", t.reason]
        rows.append(f"<tr{best}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    image = png_image(png_bytes, "objective per trial, parameters in parallel coordinates, curves")
    return html_page(f"trainctl sweep report: {sweep.metadata.name} ({sweep.id})", f"""{image}
<h2>Trials</h2><table><tr>{header}</tr>
{chr(10).join(rows)}</table>
""")
