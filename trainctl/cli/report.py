"""`trainctl report JOB`: a PNG (and a self-contained HTML page) of one run from its recorded metrics.

Panels: loss (and gradient norm), throughput, MFU, step-time breakdown by phase, step time and peak
memory, and the placement (which rank runs on which GPU of which node). Input is the job as
`GetJob(view=JOB_VIEW_FULL)` returns it. Rendering uses matplotlib's object API on an Agg canvas (no
pyplot, no global figure state), so it runs in any thread and without a display.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trainctl.v1 import training_pb2 as pb

PANELS = ("Loss", "Throughput", "MFU", "Step-time breakdown", "Step time and memory", "Placement")
"""Axes titles, in reading order (tests find the panels by these)."""


class ReportError(ValueError):
    """The job cannot be reported (e.g. it has recorded no steps yet)."""


@dataclass(frozen=True)
class ReportFiles:
    png: Path
    html: Path | None


def build_figure(job: pb.Job) -> Figure:
    """The report's figure: one titled axes per entry of PANELS."""
    steps = list(job.metrics)
    if not steps:
        raise ReportError(f"job {job.id} has recorded no step metrics yet (state "
                          f"{pb.JobState.Name(job.status.state)}); nothing to report")
    fig = Figure(figsize=(15, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(zip(PANELS, fig.subplots(2, 3).flat, strict=True))
    for title, ax in axes.items():
        ax.set_title(title)
    x = [m.step for m in steps]

    ax = axes["Loss"]
    ax.plot(x, [m.loss for m in steps], color="C0", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    norm = ax.twinx()
    norm.plot(x, [m.grad_norm for m in steps], color="C1", alpha=0.6, label="grad norm")
    norm.set_ylabel("gradient norm")
    ax.legend(handles=ax.get_lines() + norm.get_lines(), loc="upper right")

    ax = axes["Throughput"]
    ax.plot(x, [m.tokens_per_second for m in steps], color="C2")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")

    ax = axes["MFU"]
    mfu = [(m.step, m.mfu) for m in steps if m.HasField("mfu")]
    if mfu:
        ax.plot([s for s, _ in mfu], [100 * v for _, v in mfu], color="C3")
        ax.set_ylabel("MFU (%)")
        ax.set_ylim(bottom=0)
    else:
        ax.text(0.5, 0.5, "MFU unknown:\nthe device's peak FLOP rate\nis not known", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("step")

    _breakdown(axes["Step-time breakdown"], steps)

    ax = axes["Step time and memory"]
    ax.plot(x, [m.step_time_seconds for m in steps], color="C4", label="step time")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    mem = ax.twinx()
    mem.plot(x, [m.peak_memory_bytes / 2**30 for m in steps], color="C5", alpha=0.7, label="peak memory")
    mem.set_ylabel("peak memory (GiB, max over ranks)")
    ax.legend(handles=ax.get_lines() + mem.get_lines(), loc="upper right")

    _placement(axes["Placement"], list(job.status.placement))
    name = job.metadata.name or job.id
    fig.suptitle(f"{name} ({job.id}): {pb.JobState.Name(job.status.state)}, {len(steps)} steps recorded")
    return fig


def _breakdown(ax: Axes, steps: list[pb.StepMetrics]) -> None:
    phases = sorted({p for m in steps for p in m.breakdown})
    if not phases:
        ax.text(0.5, 0.5, "no step-time breakdown recorded", ha="center", va="center", transform=ax.transAxes)
        return
    x = [m.step for m in steps]
    ax.stackplot(x, *[[m.breakdown.get(p, 0.0) for m in steps] for p in phases], labels=phases, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(loc="upper right", fontsize="small")


def _placement(ax: Axes, placement: list[pb.RankPlacement]) -> None:
    if not placement:
        ax.text(0.5, 0.5, "no placement recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    nodes = sorted({p.node for p in placement})
    gpus = max(p.gpu for p in placement) + 1
    grid = [[-1.0] * gpus for _ in nodes]
    for p in placement:
        grid[nodes.index(p.node)][p.gpu] = p.rank
    ax.imshow([[v if v >= 0 else float("nan") for v in row] for row in grid], cmap="viridis", aspect="auto")
    for p in placement:
        coords = " ".join(f"{k}{v}" for k, v in sorted(p.coords.items()) if v)
        ax.text(p.gpu, nodes.index(p.node), f"r{p.rank}\n{coords}".strip(), ha="center", va="center",
                fontsize="small", bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8})
    ax.set_xticks(range(gpus), [f"GPU {g}" for g in range(gpus)])
    ax.set_yticks(range(len(nodes)), nodes)


def write_report(job: pb.Job, png: Path, *, html_page: bool = True) -> ReportFiles:
    """Write the PNG, and next to it (same name, .html) a page with the PNG and a summary."""
    return save_figure(build_figure(job), png, (lambda image: _html(job, image)) if html_page else None)


def save_figure(fig: Figure, png: Path, page_of: Callable[[bytes], str] | None) -> ReportFiles:
    """Write `fig` as a PNG and, given `page_of` (the PNG's bytes -> HTML), the page next to it (.html)."""
    png = Path(png)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    page = None if page_of is None else png.with_suffix(".html")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(buffer.getvalue())
        if page is not None and page_of is not None:
            page.write_text(page_of(buffer.getvalue()))
    except OSError as err:  # a path that cannot be written: one error line, not a traceback
        raise ReportError(f"cannot write {err.filename or png}: {err.strerror}") from None
    return ReportFiles(png, page)


def _html(job: pb.Job, png_bytes: bytes) -> str:
    steps = list(job.metrics)
    last = steps[-1]
    mfu = [m.mfu for m in steps if m.HasField("mfu")]
    rows = [
        ("Job", f"{job.metadata.name} ({job.id})"),
        ("State", f"{pb.JobState.Name(job.status.state)} {job.status.reason}".strip()),
        ("Steps", f"{last.step} of {job.status.total_steps}" if job.status.total_steps else str(last.step)),
        ("Loss", f"{steps[0].loss:.4g} → {last.loss:.4g}"),
        ("Tokens/s (mean)", f"{sum(m.tokens_per_second for m in steps) / len(steps):,.0f}"),
        ("MFU (mean)", f"{100 * sum(mfu) / len(mfu):.1f}%" if mfu else "unknown on this device"),
        ("Restarts", str(job.status.restarts)),
    ]
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    placement = "\n".join(
        f"<tr><td>{p.rank}</td><td>{html.escape(p.node)}</td><td>{p.gpu}</td>"
        f"<td>{html.escape(' '.join(f'{k}={v}' for k, v in sorted(p.coords.items())))}</td></tr>"
        for p in sorted(job.status.placement, key=lambda p: p.rank)
    )
    image = base64.b64encode(png_bytes).decode()
    title = html.escape(f"trainctl report: {job.metadata.name or job.id}")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}img{{max-width:100%}}</style></head>
<body><h1>{title}</h1>
<table>{table}</table>
<h2>Curves</h2><img alt="loss, throughput, MFU, step-time breakdown, step time, placement" src="data:image/png;base64,{image}">
<h2>Placement</h2><table><tr><th>rank</th><th>node</th><th>GPU</th><th>grid coordinates</th></tr>
{placement}</table>
</body></html>
"""
