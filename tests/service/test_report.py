"""`trainctl report`: the PNG is written and read back, its panels hold the recorded data, and the
HTML page carries the image and a summary."""

from __future__ import annotations

import base64
import re

import matplotlib.image
import pytest

from trainctl.cli.report import PANELS, ReportError, build_figure, write_report
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
    assert list(axes["MFU"].get_lines()[0].get_ydata()) == pytest.approx([100 * m.mfu for m in job.metrics])
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


def test_job_without_steps_is_a_clear_error(tmp_path) -> None:
    job = pb.Job(id="empty-1")
    job.status.state = pb.QUEUED
    with pytest.raises(ReportError, match="job empty-1 has recorded no step metrics yet .state QUEUED"):
        write_report(job, tmp_path / "x.png")
