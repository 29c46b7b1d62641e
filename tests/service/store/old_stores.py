"""Turn a store back into an older schema, as a store written by an earlier release would be, to test the
migrations that bring it forward."""

from __future__ import annotations

from trainctl.service.store.db import open_database

ADDED_COLUMNS = {
    8: {"jobs": ["request_digest"], "sweeps": ["request_digest"]},
    10: {"step_metrics": ["eval_loss"], "jobs": ["last_eval_loss"]},
    11: {"step_metrics": ["mfu_full_attention"], "jobs": ["mfu_full_attention"]},
    12: {"jobs": ["preemptions", "preempt_time"]},
}
"""Columns each schema version added (the store's migrations in trainctl/service/store/schema.py)."""
ADDED_INDEXES = {13: ["step_metrics_evaluated"]}
"""Indexes each schema version added (dropped first: a column an index names cannot be dropped)."""


def downgrade(location: str, version: int) -> None:
    """Drop the columns every schema after `version` added and record `version` as the store's schema."""
    db = open_database(location)
    db.begin_write()
    for added in sorted(v for v in ADDED_INDEXES if v > version):
        for index in ADDED_INDEXES[added]:
            db.execute(f"DROP INDEX {index}")
    for added in sorted(v for v in ADDED_COLUMNS if v > version):
        for table, columns in ADDED_COLUMNS[added].items():
            for column in columns:
                db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    db.set_schema_version(version)
    db.commit()
    db.close()
