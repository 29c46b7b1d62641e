"""StepReport's dict form: what the supervisor's event log carries and the service reads back."""

from __future__ import annotations

import pytest

from trainctl.parallelism.engine.step_report import StepReport


def test_round_trip_keeps_every_field():
    report = StepReport(step=7, loss=1.25, grad_norm=0.5, lr=1e-4, tokens=2048, tokens_per_second=900.0, mfu=0.31,
                        step_time_seconds=2.25, breakdown={"data": 0.25, "checkpoint": 1.0}, peak_memory_bytes=1 << 20,
                        checkpoint_bytes=4096, mfu_full_attention=0.33)
    assert StepReport.from_dict(report.to_dict()) == report
    assert report.to_dict()["mfu_full_attention"] == 0.33


def test_a_log_written_before_the_full_attention_mfu_reads_it_as_none():
    """Old event logs carry `mfu` (Megatron's convention) only; torchtitan's convention then is unknown."""
    old = {"step": 2, "loss": 1.5, "grad_norm": 0.5, "lr": 1e-4, "tokens": 64, "tokens_per_second": 10.0, "mfu": 0.4,
           "step_time_seconds": 6.4, "breakdown": {}, "peak_memory_bytes": None, "checkpoint_bytes": None}
    report = StepReport.from_dict(old)
    assert report.mfu == 0.4 and report.mfu_full_attention is None


def test_missing_metrics_stay_absent_and_unknown_keys_are_ignored():
    """A command job's program reports what it chooses: what it leaves out is None (not reported), not 0."""
    report = StepReport.from_dict({"step": "3", "loss": 2, "mfu": None, "lr": 0, "time": 1.0, "straggler": None})
    assert report == StepReport(step=3, loss=2.0, grad_norm=None, lr=0.0, tokens=None, tokens_per_second=None,
                                mfu=None, step_time_seconds=None)
    assert report.checkpoint_bytes is None and report.peak_memory_bytes is None and report.breakdown == {}


def test_step_and_loss_are_required():
    with pytest.raises(KeyError, match="loss"):
        StepReport.from_dict({"step": 1})
