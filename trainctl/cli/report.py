"""`trainctl report JOB`: the run report (trainctl.observability.run_report) of one job, written as a PNG
and, next to it, a self-contained HTML page. Input is the job as `GetJob(view=JOB_VIEW_FULL)` returns it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from trainctl.observability.run_report import ReportError, build_figure, png_of, report_page
from trainctl.v1 import training_pb2 as pb


@dataclass(frozen=True)
class ReportFiles:
    png: Path
    html: Path | None


def write_report(job: pb.Job, png: Path, *, html_page: bool = True) -> ReportFiles:
    """Write the PNG, and next to it (same name, .html) a page with the PNG and a summary."""
    return save_figure(build_figure(job), png, (lambda image: report_page(job, image)) if html_page else None)


def save_figure(fig: Figure, png: Path, page_of: Callable[[bytes], str] | None) -> ReportFiles:
    """Write `fig` as a PNG and, given `page_of` (the PNG's bytes -> HTML), the page next to it (.html)."""
    png = Path(png)
    image = png_of(fig)
    page = None if page_of is None else png.with_suffix(".html")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(image)
        if page is not None and page_of is not None:
            page.write_text(page_of(image))
    except OSError as err:  # a path that cannot be written: one error line, not a traceback
        raise ReportError(f"cannot write {err.filename or png}: {err.strerror}") from None
    return ReportFiles(png, page)
