"""`trainctl report`: the PNG is written and read back, its panels hold the recorded data, and the
HTML page carries the image and a summary."""

from __future__ import annotations

import base64
import re

import matplotlib.image
import pytest

from trainctl.cli.report import write_report
from trainctl.observability.run_report import (
    PANELS,
    ReportError,
    build_figure,
    label_extent,
    node_labels,
    report_page,
)
from trainctl.v1 import training_pb2 as pb


def sample_job(steps: int = 12, mfu: bool = True) -> pb.Job:
    job = pb.Job(id="demo-1234", metadata=pb.ObjectMeta(name="demo"))
    job.status.state = pb.SUCCEEDED
    job.status.total_steps = steps
    for s in range(1, steps + 1):
        m = job.metrics.add(step=s, loss=5.0 / s, grad_norm=1.0 + 0.1 * s, lr=3e-4, tokens=4096,
                            tokens_per_second=1000.0 + s, step_time_seconds=0.5, peak_memory_bytes=2**30)
        m.breakdown.update({"data": 0.05, "forward_backward": 0.35, "optimizer": 0.1})
        if mfu:
            m.mfu = 0.3 + 0.01 * s
            m.mfu_full_attention = 0.315 + 0.0105 * s
    for rank in range(4):
        job.status.placement.add(rank=rank, node=f"node-{rank // 2}", gpu=rank % 2, coords={"dp_shard": rank})
    return job


def titled(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_figure_has_every_panel_with_the_recorded_data() -> None:
    job = sample_job()
    axes = titled(build_figure(job))
    assert list(axes) == list(PANELS)
    (loss,) = [line for line in axes["Loss"].get_lines()]
    assert list(loss.get_xdata()) == list(range(1, 13))
    assert list(loss.get_ydata()) == [m.loss for m in job.metrics]
    megatron, torchtitan = axes["MFU"].get_lines()  # causal attention halved, then counted unmasked
    assert list(megatron.get_ydata()) == pytest.approx([100 * m.mfu for m in job.metrics])
    assert list(torchtitan.get_ydata()) == pytest.approx([100 * m.mfu_full_attention for m in job.metrics])
    assert {t.get_text() for t in axes["MFU"].get_legend().get_texts()} == {
        "causal halved (Megatron)", "full attention (torchtitan)"}
    assert len(axes["Step-time breakdown"].collections) == 3  # one stacked band per phase
    assert {t.get_text() for t in axes["Step-time breakdown"].get_legend().get_texts()} == {
        "data", "forward_backward", "optimizer"}
    labels = [t.get_text() for t in axes["Placement"].texts]
    assert any(label.startswith("r3") for label in labels)
    assert [t.get_text() for t in axes["Placement"].get_yticklabels()] == ["node-0", "node-1"]


def test_unknown_mfu_is_said_not_drawn() -> None:
    axes = titled(build_figure(sample_job(mfu=False)))
    assert axes["MFU"].get_lines() == []
    assert "MFU unknown" in axes["MFU"].texts[0].get_text()


def test_png_and_html_are_written_and_read_back(tmp_path) -> None:
    files = write_report(sample_job(), tmp_path / "out" / "demo.png")
    image = matplotlib.image.imread(files.png)
    assert image.shape[:2] == (900, 1500)
    assert image[..., :3].std() > 0.05  # drawn, not blank
    page = files.html.read_text()
    embedded = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(embedded) == files.png.read_bytes()
    assert "SUCCEEDED" in page and "5 → 0.4167" in page and "<td>node-1</td><td>1</td>" in page
    assert "36.5% causal attention halved (Megatron), 38.3% full attention (torchtitan)" in page


def test_job_without_steps_is_a_clear_error(tmp_path) -> None:
    job = pb.Job(id="empty-1")
    job.status.state = pb.QUEUED
    with pytest.raises(ReportError, match="job empty-1 has recorded no step metrics yet .state QUEUED"):
        write_report(job, tmp_path / "x.png")


def command_job(steps: int = 3) -> pb.Job:
    """A command job whose program reported step, loss and tokens every 5 steps (the first report of
    the run has no rate), and nothing else."""
    job = pb.Job(id="cmd-1", metadata=pb.ObjectMeta(name="cmd"))
    job.status.state = pb.RUNNING
    for s in range(1, steps + 1):
        m = job.metrics.add(step=5 * s, loss=2.0 / s, tokens=256)
        if s > 1:
            m.tokens_per_second, m.step_time_seconds = 2560.0, 0.1
    job.status.placement.add(rank=0, node="node-0", gpu=0)
    return job


def test_unreported_metrics_are_left_out_of_their_panels(tmp_path) -> None:
    """Issue 34, point 5: no grad norm or memory curve at 0, no throughput at 0 for the first report."""
    axes = titled(build_figure(command_job()))
    assert [line.get_label() for line in axes["Loss"].get_legend().get_lines()] == ["loss"]
    (throughput,) = axes["Throughput"].get_lines()
    assert list(throughput.get_xdata()) == [10, 15] and list(throughput.get_ydata()) == [2560.0, 2560.0]
    assert [t.get_text() for t in axes["Step time and memory"].get_legend().get_texts()] == ["step time"]
    bare = command_job()
    for m in bare.metrics:
        m.ClearField("tokens_per_second")
        m.ClearField("step_time_seconds")
    axes = titled(build_figure(bare))
    assert axes["Throughput"].get_lines() == [] and "no tokens/s reported" in axes["Throughput"].texts[0].get_text()
    assert "no step time or memory reported" in axes["Step time and memory"].texts[0].get_text()
    page = write_report(bare, tmp_path / "bare.png").html.read_text()
    assert "<th>Tokens/s (mean)</th><td>not reported</td>" in page


def test_the_eval_loss_is_drawn_beside_the_loss_and_listed() -> None:
    """Issue 37: the eval curve has a point per step that evaluated (every 4th here) on the loss axes,
    and the page lists each eval loss with its perplexity."""
    job = sample_job()
    for m in job.metrics:
        if m.step % 4 == 0:
            m.eval_loss = 6.0 / m.step
    axes = titled(build_figure(job))
    lines = {line.get_label(): line for line in axes["Loss"].get_lines()}
    assert list(lines) == ["loss", "eval loss"]
    assert list(lines["eval loss"].get_xdata()) == [4, 8, 12]
    assert list(lines["eval loss"].get_ydata()) == [1.5, 0.75, 0.5]
    assert [t.get_text() for t in axes["Loss"].get_legend().get_texts()] == ["loss", "eval loss", "grad norm"]
    page = report_page(job, b"")  # the page around the image (test_png_and_html_are_written_and_read_back draws one)
    assert "<th>Eval loss</th><td>1.5 → 0.5 (perplexity 1.649)</td>" in page
    assert "<tr><td>8</td><td>0.75</td><td>2.117</td></tr>" in page
    plain = report_page(sample_job(), b"")
    assert "<th>Eval loss</th><td>not evaluated</td>" in plain and "<h2>Evaluation</h2>" not in plain


def test_an_elastic_job_running_shrunk_says_on_how_many_of_its_gpus() -> None:
    job = sample_job()
    assert "<th>GPUs</th><td>4</td>" in report_page(job, b"")
    job.spec.resources.gpus = 8
    assert "<th>GPUs</th><td>4 of 8 (elastic: shrunk after a node loss, scheduling.elastic)</td>" in report_page(job, b"")


def test_step_axes_have_whole_step_ticks_only() -> None:
    """Issue 34, point 7: three steps no longer get ticks at 1.25, 1.5, ..."""
    fig = build_figure(sample_job(steps=3))
    fig.canvas.draw()
    step_axes = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
    assert len(step_axes) >= 5
    for ax in step_axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert shown and all(float(t).is_integer() for t in shown), (ax.get_title(), shown)


def placement_job(nodes: int, gpus: int) -> pb.Job:
    job = sample_job(steps=2)
    del job.status.placement[:]
    for rank in range(nodes * gpus):
        node, gpu = divmod(rank, gpus)
        job.status.placement.add(rank=rank, node=f"gpu-worker-{node:03d}.training.cluster.example.com", gpu=gpu,
                                 coords={"dp_replicate": node, "dp_shard": gpu // 4, "tp": gpu % 4})
    return job


@pytest.mark.parametrize(("nodes", "gpus"), [(2, 4), (16, 8), (96, 64)])
def test_placement_labels_never_overlap(nodes: int, gpus: int) -> None:
    """Issue 34, point 7: the cell labels fit their cells (shrunk, without coordinates, or left out),
    each axis keeps only tick labels with room between them, and node names stay distinct."""
    fig = build_figure(placement_job(nodes, gpus))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = titled(fig)["Placement"]
    box = ax.get_window_extent(renderer)
    groups = {
        "cells": [t for t in ax.texts if t.get_visible()],
        "x": [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()],
        "y": [t for t in ax.get_yticklabels() if t.get_visible() and t.get_text()],
    }
    for name, texts in groups.items():
        extents = [label_extent(t, renderer) for t in texts]
        overlapping = [(texts[i].get_text(), texts[j].get_text()) for i, a in enumerate(extents)
                       for j, b in enumerate(extents[i + 1:], i + 1) if a.overlaps(b)]
        assert overlapping == [], (name, overlapping[:3])
    for extent in (label_extent(t, renderer) for t in groups["cells"]):
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1
    assert len(groups["y"]) >= min(nodes, 8) and len(groups["x"]) >= min(gpus, 8)
    if nodes * gpus <= 8:  # room for every rank and its coordinates
        assert len(groups["cells"]) == nodes * gpus and "dp_replicate1" in groups["cells"][-1].get_text()


def test_node_names_are_shortened_but_stay_distinct() -> None:
    names = [f"gpu-worker-{n:03d}.training.cluster.example.com" for n in range(3)]
    assert node_labels(names) == ["gpu-worker-000", "gpu-worker-001", "gpu-worker-002"]
    long = "a-very-long-kubernetes-node-name-pool-7f9c-017"
    assert node_labels([long]) == ["…" + long[-23:]] and len(node_labels([long])[0]) == 24
    assert node_labels(["node-0", "node-1"]) == ["node-0", "node-1"]
