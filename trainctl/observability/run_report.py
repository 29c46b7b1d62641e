"""The run report of one job: a figure of its recorded metrics and placement, as a PNG and a
self-contained HTML page, drawn from the job as `GetJob(view=JOB_VIEW_FULL)` returns it. `trainctl report`
writes it to files (trainctl.cli.report); the service logs it as an MLflow run's artifacts
(trainctl.service.tracking).

Panels: loss (with the eval loss of the steps that evaluated, and gradient norm), throughput, MFU (two
lines: Megatron's convention, causal attention halved, and torchtitan's, attention counted unmasked),
step-time breakdown by phase, step time and peak memory, and the placement (which rank runs on which
GPU of which node); the HTML page also lists the eval losses. Rendering uses matplotlib's object API on
an Agg canvas (no pyplot, no global figure state), so it runs in any thread and without a display.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.backend_bases import RendererBase
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Bbox

from trainctl.observability.perplexity import perplexity
from trainctl.v1 import training_pb2 as pb

PANELS = ("Loss", "Throughput", "MFU", "Step-time breakdown", "Step time and memory", "Placement")
"""Axes titles, in reading order (tests find the panels by these)."""


class ReportError(ValueError):
    """The job cannot be reported (e.g. it has recorded no steps yet)."""


@dataclass(frozen=True)
class RenderedReport:
    """A job's report in memory: the PNG and the HTML page that embeds it."""

    png: bytes
    html: str


def render(job: pb.Job) -> RenderedReport:
    """The job's report as a PNG and an HTML page (ReportError when it has recorded no steps)."""
    png = png_of(build_figure(job))
    return RenderedReport(png, report_page(job, png))


def png_of(fig: Figure) -> bytes:
    """`fig` drawn as a PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def build_figure(job: pb.Job) -> Figure:
    """The report's figure: one titled axes per entry of PANELS. A metric the job did not report (a
    command job's program may pass only step and loss) is left out of its panel, and a panel with nothing
    to draw says so."""
    steps = list(job.metrics)
    if not steps:
        raise ReportError(f"job {job.id} has recorded no step metrics yet (state "
                          f"{pb.JobState.Name(job.status.state)}); nothing to report")
    fig = Figure(figsize=(15, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(zip(PANELS, fig.subplots(2, 3).flat, strict=True))
    for title, ax in axes.items():
        ax.set_title(title)

    ax = axes["Loss"]
    ax.plot([m.step for m in steps], [m.loss for m in steps], color="C0", label="loss")
    if _reported(steps, "eval_loss"):
        ax.plot(*_series(steps, "eval_loss"), color="C6", marker="o", markersize=3, label="eval loss")
    _step_axis(ax)
    ax.set_ylabel("loss")
    lines = ax.get_lines()
    if _reported(steps, "grad_norm"):
        norm = ax.twinx()
        norm.plot(*_series(steps, "grad_norm"), color="C1", alpha=0.6, label="grad norm")
        norm.set_ylabel("gradient norm")
        lines += norm.get_lines()
    ax.legend(handles=lines, loc="upper right")

    ax = axes["Throughput"]
    if _reported(steps, "tokens_per_second"):
        ax.plot(*_series(steps, "tokens_per_second"), color="C2")
        ax.set_ylabel("tokens / s")
    else:
        _no_data(ax, "no tokens/s reported")
    _step_axis(ax)

    ax = axes["MFU"]
    if _reported(steps, "mfu"):
        x, mfu = _series(steps, "mfu")
        ax.plot(x, [100 * v for v in mfu], color="C3", label="causal halved (Megatron)")
        if _reported(steps, "mfu_full_attention"):
            x, full = _series(steps, "mfu_full_attention")
            ax.plot(x, [100 * v for v in full], color="C3", linestyle="--", label="full attention (torchtitan)")
            ax.legend(loc="lower right")
        ax.set_ylabel("MFU (%)")
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax, "MFU unknown:\nthe device's peak FLOP rate\nis not known")
    _step_axis(ax)

    _breakdown(axes["Step-time breakdown"], steps)
    _step_time_and_memory(axes["Step time and memory"], steps)
    _placement(axes["Placement"], list(job.status.placement))
    name = job.metadata.name or job.id
    fig.suptitle(f"{name} ({job.id}): {pb.JobState.Name(job.status.state)}, {len(steps)} steps recorded")
    _fit_placement_labels(fig, axes["Placement"])
    return fig


def _reported(steps: list[pb.StepMetrics], field: str) -> bool:
    return any(m.HasField(field) for m in steps)


def _series(steps: list[pb.StepMetrics], field: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the steps that reported ``field``."""
    have = [m for m in steps if m.HasField(field)]
    return [m.step for m in have], [float(getattr(m, field)) for m in have]


def _step_axis(ax: Axes) -> None:
    """An x axis of optimizer steps: whole numbers only."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _no_data(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_yticks([])


def _breakdown(ax: Axes, steps: list[pb.StepMetrics]) -> None:
    phases = sorted({p for m in steps for p in m.breakdown})
    if not phases:
        ax.text(0.5, 0.5, "no step-time breakdown recorded", ha="center", va="center", transform=ax.transAxes)
        return
    x = [m.step for m in steps]
    ax.stackplot(x, *[[m.breakdown.get(p, 0.0) for m in steps] for p in phases], labels=phases, alpha=0.8)
    _step_axis(ax)
    ax.set_ylabel("seconds")
    ax.legend(loc="upper right", fontsize="small")


def _step_time_and_memory(ax: Axes, steps: list[pb.StepMetrics]) -> None:
    _step_axis(ax)
    timed, memory = _reported(steps, "step_time_seconds"), _reported(steps, "peak_memory_bytes")
    if not timed and not memory:
        _no_data(ax, "no step time or memory reported")
        return
    lines = []
    if timed:
        ax.plot(*_series(steps, "step_time_seconds"), color="C4", label="step time")
        ax.set_ylabel("seconds")
        lines += ax.get_lines()
    if memory:
        mem = ax.twinx() if timed else ax
        x, peak = _series(steps, "peak_memory_bytes")
        mem.plot(x, [v / 2**30 for v in peak], color="C5", alpha=0.7, label="peak memory")
        mem.set_ylabel("peak memory (GiB, max over ranks)")
        lines += mem.get_lines()[-1:]
    ax.legend(handles=lines, loc="upper right")


PLACEMENT_FONT_POINTS = (8.0, 4.0)
"""Largest and smallest font of the placement panel's cell labels; below the smallest they are left out
(the HTML page lists every rank)."""
LABEL_PAD = 0.3
"""Padding of a cell label's box, in font sizes (matplotlib's default for a round box)."""
LABELLED_CELLS = 32
"""Nodes, or GPUs per node, past which the placement panel's cells get no labels (no font fits them)."""
NODE_LABEL_CHARS = 24
"""Node names longer than this are cut in the middle (an ellipsis) on the placement panel's axis."""


def _placement(ax: Axes, placement: list[pb.RankPlacement]) -> None:
    """Ranks on a node x GPU grid, each cell labelled with its rank and grid coordinates; the labels are
    fitted to the cells once the figure is laid out (`_fit_placement_labels`)."""
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
    if len(nodes) > LABELLED_CELLS or gpus > LABELLED_CELLS:
        _grid_ticks(ax, nodes, gpus)  # cells too small for any label: the colour is the rank
        return
    for p in placement:
        coords = " ".join(f"{k}{v}" for k, v in sorted(p.coords.items()) if v)
        label = ax.text(p.gpu, nodes.index(p.node), f"r{p.rank}\n{coords}".strip(), ha="center", va="center",
                        fontsize=PLACEMENT_FONT_POINTS[0],
                        bbox={"boxstyle": f"round,pad={LABEL_PAD}", "facecolor": "white", "alpha": 0.8})
        label.set_in_layout(False)  # fitted to its cell after the layout, so it must not move the layout
    _grid_ticks(ax, nodes, gpus)


def _grid_ticks(ax: Axes, nodes: list[str], gpus: int) -> None:
    ax.set_xticks(range(gpus), [str(g) for g in range(gpus)])
    ax.set_xlabel("GPU")
    ax.set_yticks(range(len(nodes)), node_labels(nodes))
    ax.tick_params(labelsize="small")


def node_labels(nodes: list[str], chars: int = NODE_LABEL_CHARS) -> list[str]:
    """Short names for ``nodes``: the domain they all share left out (``.cluster.local``), and a name
    still longer than ``chars`` cut to its last characters (where host names number their nodes)."""
    suffix = ""
    if len(nodes) > 1 and all("." in n for n in nodes):
        shared = [n.split(".", 1)[1] for n in nodes]
        suffix = "." + shared[0] if len(set(shared)) == 1 else ""
    short = [n.removesuffix(suffix) for n in nodes]
    return [n if len(n) <= chars else "…" + n[1 - chars:] for n in short]


def _fit_placement_labels(fig: Figure, ax: Axes) -> None:
    """Make the placement panel legible at any size, once the figure is laid out: keep every n-th tick
    label of an axis whose labels would overlap, then shrink the cell labels to fit their cells (first
    dropping the coordinates, and the labels themselves below the smallest font)."""
    if not ax.axison:
        return
    renderer = fig.canvas.get_renderer()
    fig.draw_without_rendering()
    if _thin_tick_labels(ax, "x", renderer) | _thin_tick_labels(ax, "y", renderer) and ax.texts:
        fig.draw_without_rendering()  # fewer labels may change the layout
    if not ax.texts:
        return
    box = ax.get_window_extent(renderer)
    rows, columns = ax.images[0].get_array().shape
    cell_width, cell_height = 0.9 * box.width / columns, 0.9 * box.height / rows
    labels = list(ax.texts)
    for drop_coordinates in (False, True):
        if drop_coordinates:
            for label in labels:
                label.set_text(label.get_text().split("\n")[0])
        pad = 2 * LABEL_PAD * PLACEMENT_FONT_POINTS[0] * fig.dpi / 72  # the box around each label, both sides
        extents = [label.get_window_extent(renderer) for label in labels]
        scale = min(min(cell_width / (e.width + pad), cell_height / (e.height + pad)) for e in extents)
        size = min(PLACEMENT_FONT_POINTS[0], PLACEMENT_FONT_POINTS[0] * scale)
        if size >= PLACEMENT_FONT_POINTS[1]:
            for label in labels:
                label.set_fontsize(size)
            return
    for label in labels:
        label.remove()


def _thin_tick_labels(ax: Axes, which: str, renderer: RendererBase) -> bool:
    """Keep every n-th tick (and label) of ``ax``'s x or y axis, n the smallest that leaves room between
    neighbouring labels; whether any was dropped."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    ticks, labels = list(axis.get_ticklocs()), axis.get_ticklabels()
    if len(ticks) < 2:
        return False
    extents = [label.get_window_extent(renderer) for label in labels]
    size = max(e.width if which == "x" else e.height for e in extents)
    centres = [(e.x0 + e.x1) / 2 if which == "x" else (e.y0 + e.y1) / 2 for e in extents]
    spacing = min(abs(b - a) for a, b in zip(centres, centres[1:], strict=False))
    stride = max(1, math.ceil(1.25 * size / spacing)) if spacing > 0 else len(ticks)
    if stride == 1:
        return False
    axis.set_ticks(ticks[::stride], [label.get_text() for label in labels][::stride])
    return True


def label_extent(label: Text, renderer: RendererBase) -> Bbox:
    """Where a drawn text is on the canvas, with its box (``bbox=``) when it has one."""
    patch = label.get_bbox_patch()
    text = label.get_window_extent(renderer)
    return text if patch is None else Bbox.union([text, patch.get_window_extent(renderer)])



def report_page(job: pb.Job, png_bytes: bytes) -> str:
    """The self-contained HTML page: a summary, the PNG embedded, the eval losses and the placement."""
    steps = list(job.metrics)
    last = steps[-1]
    mfu = [m.mfu for m in steps if m.HasField("mfu")]
    mfu_full = [m.mfu_full_attention for m in steps if m.HasField("mfu_full_attention")]
    tps = [m.tokens_per_second for m in steps if m.HasField("tokens_per_second")]
    evaluated = [m for m in steps if m.HasField("eval_loss")]
    rows = [
        ("Job", f"{job.metadata.name} ({job.id})"),
        ("State", f"{pb.JobState.Name(job.status.state)} {job.status.reason}".strip()),
        ("Steps", f"{last.step} of {job.status.total_steps}" if job.status.total_steps else str(last.step)),
        ("Loss", f"{steps[0].loss:.4g} → {last.loss:.4g}"),
        ("Eval loss", f"{evaluated[0].eval_loss:.4g} → {evaluated[-1].eval_loss:.4g} (perplexity "
                      f"{perplexity(evaluated[-1].eval_loss)})" if evaluated else "not evaluated"),
        ("Tokens/s (mean)", f"{sum(tps) / len(tps):,.0f}" if tps else "not reported"),
        ("MFU (mean)", (f"{100 * sum(mfu) / len(mfu):.1f}% causal attention halved (Megatron)" if mfu else
                        "unknown on this device")
         + (f", {100 * sum(mfu_full) / len(mfu_full):.1f}% full attention (torchtitan)" if mfu_full else "")),
        ("Restarts", str(job.status.restarts)),
        ("GPUs", _gpus(job)),
    ]
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    placement = "\n".join(
        f"<tr><td>{p.rank}</td><td>{html.escape(p.node)}</td><td>{p.gpu}</td>"
        f"<td>{html.escape(' '.join(f'{k}={v}' for k, v in sorted(p.coords.items())))}</td></tr>"
        for p in sorted(job.status.placement, key=lambda p: p.rank)
    )
    evaluations = "".join(
        f"<tr><td>{m.step}</td><td>{m.eval_loss:.6g}</td><td>{perplexity(m.eval_loss)}</td></tr>\n" for m in evaluated
    )
    evaluation = (f"<h2>Evaluation</h2><table><tr><th>step</th><th>eval loss</th><th>perplexity</th></tr>\n"
                  f"{evaluations}</table>\n" if evaluated else "")
    image = png_image(png_bytes, "loss, throughput, MFU, step-time breakdown, step time, placement")
    return html_page(f"trainctl report: {job.metadata.name or job.id}", f"""<table>{table}</table>
<h2>Curves</h2>{image}
{evaluation}<h2>Placement</h2><table><tr><th>rank</th><th>node</th><th>GPU</th><th>grid coordinates</th></tr>
{placement}</table>
""")


def _gpus(job: pb.Job) -> str:
    """The GPUs the job asked for, and those it runs on when an elastic job runs on fewer."""
    running = len(job.status.placement)
    asked = job.spec.resources.gpus if job.spec.resources.HasField("gpus") else running
    if running and running != asked:
        return f"{running} of {asked} (elastic: shrunk after a node loss, scheduling.elastic)"
    return str(asked)


def png_image(png_bytes: bytes, alt: str) -> str:
    """An <img> holding `png_bytes` inline (the page stays one self-contained file)."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png_bytes).decode()}">'


def html_page(title: str, body: str) -> str:
    """A self-contained HTML page: `title` (escaped here) as its title and heading, then `body` (HTML)."""
    title = html.escape(title)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}img{{max-width:100%}}</style></head>
<body><h1>{title}</h1>
{body}</body></html>
"""
