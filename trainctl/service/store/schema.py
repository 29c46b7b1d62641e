"""The store's schema: `MIGRATIONS[i]` upgrades a version-i database to i+1, in the portable SQL of
`db` (`$int`, `$real` and `$serial` column types, `db.ddl`), and `migrate` applies whatever a database
is missing when a store opens it. The schema version lives where the backend keeps it (SQLite's
`user_version`, PostgreSQL's `trainctl_schema` row)."""

from __future__ import annotations

from trainctl.service.store.db import Database, StoreError, run_script

MIGRATIONS: tuple[str, ...] = (
    # 0 -> 1: the initial schema.
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        seq $int NOT NULL UNIQUE,
        request_id TEXT UNIQUE,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        priority $int NOT NULL,
        state TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        create_time $real NOT NULL,
        schedule_time $real,
        start_time $real,
        end_time $real,
        update_time $real NOT NULL,
        steps_done $int NOT NULL DEFAULT 0,
        total_steps $int NOT NULL,
        first_loss $real,
        last_loss $real,
        restarts $int NOT NULL DEFAULT 0,
        tokens_per_second $real NOT NULL DEFAULT 0,
        mfu $real,
        placement TEXT NOT NULL DEFAULT '[]',
        run_dir TEXT NOT NULL DEFAULT '',
        runtime_cursor TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX jobs_state ON jobs(state);
    CREATE INDEX jobs_tenant ON jobs(tenant, seq);
    CREATE TABLE job_labels (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (job_id, key)
    );
    CREATE INDEX job_labels_kv ON job_labels(key, value);
    CREATE TABLE events (
        sequence $serial,
        job_id TEXT NOT NULL REFERENCES jobs(id),
        time $real NOT NULL,
        type TEXT NOT NULL,
        payload TEXT NOT NULL
    );
    CREATE INDEX events_job ON events(job_id, sequence);
    CREATE TABLE step_metrics (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        step $int NOT NULL,
        time $real NOT NULL,
        loss $real NOT NULL,
        grad_norm $real NOT NULL DEFAULT 0,
        lr $real NOT NULL DEFAULT 0,
        tokens $int NOT NULL DEFAULT 0,
        tokens_per_second $real NOT NULL DEFAULT 0,
        mfu $real,
        step_time_seconds $real NOT NULL DEFAULT 0,
        peak_memory_bytes $int NOT NULL DEFAULT 0,
        breakdown TEXT NOT NULL DEFAULT '{}',
        PRIMARY KEY (job_id, step)
    );
    """,
    # 1 -> 2: sweeps and their trials (docs/sweeps.md).
    """
    CREATE TABLE sweeps (
        id TEXT PRIMARY KEY,
        seq $int NOT NULL UNIQUE,
        request_id TEXT UNIQUE,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        create_time $real NOT NULL,
        update_time $real NOT NULL,
        end_time $real
    );
    CREATE INDEX sweeps_state ON sweeps(state);
    CREATE INDEX sweeps_tenant ON sweeps(tenant, seq);
    CREATE TABLE sweep_trials (
        sweep_id TEXT NOT NULL REFERENCES sweeps(id),
        number $int NOT NULL,
        job_id TEXT UNIQUE REFERENCES jobs(id),
        params TEXT NOT NULL,
        state TEXT NOT NULL,
        objective $real,
        objective_step $int,
        reason TEXT NOT NULL DEFAULT '',
        create_time $real NOT NULL,
        end_time $real,
        PRIMARY KEY (sweep_id, number)
    );
    """,
    # 2 -> 3: leases (leadership among service replicas, trainctl.service.scheduling.leadership).
    """
    CREATE TABLE leases (
        name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        epoch $int NOT NULL,
        expires $real NOT NULL
    );
    """,
    # 3 -> 4: indexes that keep reads off a scan of every job at 10,000 jobs (docs/benchmarks.md, store
    # scale): a listing filtered by state reads its page in order, the admission pass reads the queue a
    # page at a time in its order, a tenant's usage counts its own jobs by state.
    """
    CREATE INDEX jobs_state_seq ON jobs(state, seq);
    CREATE INDEX jobs_queue ON jobs(state, priority DESC, seq);
    CREATE INDEX jobs_tenant_state ON jobs(tenant, state);
    """,
    # 4 -> 5: a job row's change count, which every write of the row adds one to: a reader that keeps
    # records built (cache.RecordCache) reads a listing's ids and versions and builds only what changed.
    """
    ALTER TABLE jobs ADD COLUMN version $int NOT NULL DEFAULT 0;
    """,
    # 5 -> 6: a label filter looks up each walked job's label by the primary key (job_id, key); with the
    # (key, value) index there as well, PostgreSQL without fresh statistics (a young or fast-growing
    # table) chose it for every walked job, reading every job's label each time (a filtered page of
    # 51 among 3,000 jobs: 97 ms instead of 2 ms). Nothing else reads labels by value.
    """
    DROP INDEX job_labels_kv;
    """,
    # 6 -> 7: a trial's job had the idempotency key `sweep/<sweep id>/<number>`, which a tenant named
    # `sweep` could produce with CreateJob (`<tenant>/<request id>`): it got the trial's job back, or took
    # the key first and made the trial's creation fail for good. Trial keys now start with '/' (see
    # `trial_key`), which no tenant's key does (a tenant name is never empty).
    """
    UPDATE jobs SET request_id = '/' || request_id WHERE EXISTS (
        SELECT 1 FROM sweep_trials WHERE sweep_trials.job_id = jobs.id
        AND jobs.request_id = 'sweep/' || sweep_trials.sweep_id || '/' || sweep_trials.number
    );
    """,
    # 7 -> 8: the digest of the request a request id first created a job or sweep with, so that the id
    # sent again with a different request is refused (`RequestReused`) instead of answered the first
    # one as a retry. NULL for rows created before it, whose retries are not compared.
    """
    ALTER TABLE jobs ADD COLUMN request_digest TEXT;
    ALTER TABLE sweeps ADD COLUMN request_digest TEXT;
    """,
    # 8 -> 9: a step's metrics other than its loss may be absent (NULL): a command job's program reports
    # what it chooses (`trainctl.report`), and a metric it never passes is no value, not 0. SQLite cannot
    # drop NOT NULL from a column, so the table is rebuilt (nothing references it); rows keep their values.
    """
    CREATE TABLE step_metrics_nullable (
        job_id TEXT NOT NULL REFERENCES jobs(id),
        step $int NOT NULL,
        time $real NOT NULL,
        loss $real NOT NULL,
        grad_norm $real,
        lr $real,
        tokens $int,
        tokens_per_second $real,
        mfu $real,
        step_time_seconds $real,
        peak_memory_bytes $int,
        breakdown TEXT NOT NULL DEFAULT '{}',
        PRIMARY KEY (job_id, step)
    );
    INSERT INTO step_metrics_nullable SELECT job_id, step, time, loss, grad_norm, lr, tokens, tokens_per_second,
        mfu, step_time_seconds, peak_memory_bytes, breakdown FROM step_metrics;
    DROP TABLE step_metrics;
    ALTER TABLE step_metrics_nullable RENAME TO step_metrics;
    """,
    # 9 -> 10: evaluation (spec.evaluation, `trainctl.report(eval_loss=...)`): a step's loss on the
    # evaluation data, NULL on a step that ran no evaluation, and the job's newest one.
    """
    ALTER TABLE step_metrics ADD COLUMN eval_loss $real;
    ALTER TABLE jobs ADD COLUMN last_eval_loss $real;
    """,
    # 10 -> 11: MFU in torchtitan's convention (attention counted unmasked) beside `mfu` (Megatron's,
    # causal attention halved); NULL on the steps and jobs recorded before it, and where mfu is NULL.
    """
    ALTER TABLE step_metrics ADD COLUMN mfu_full_attention $real;
    ALTER TABLE jobs ADD COLUMN mfu_full_attention $real;
    """,
    # 11 -> 12: preemption: how often the job was stopped for a job of higher priority and queued
    # again, and when last (what keeps the scheduler from preempting it again soon).
    """
    ALTER TABLE jobs ADD COLUMN preemptions $int NOT NULL DEFAULT 0;
    ALTER TABLE jobs ADD COLUMN preempt_time $real;
    """,
    # 12 -> 13: the steps that evaluated, by job and step: GetJob(JOB_VIEW_FULL) of a long run spreads its
    # eval curve over them by index lookups (`events.thinned_step_metrics`) instead of reading every step
    # (a million-step job: docs/benchmarks.md, "A job of a million steps in the service").
    """
    CREATE INDEX step_metrics_evaluated ON step_metrics(job_id, step) WHERE eval_loss IS NOT NULL;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(db: Database) -> None:
    """Bring `db`'s schema to SCHEMA_VERSION, inside the open write transaction; StoreError for a
    database written by a newer trainctl."""
    version = db.schema_version()
    if version > SCHEMA_VERSION:
        raise StoreError(f"{db.location} has schema version {version}; this trainctl knows up to {SCHEMA_VERSION}")
    for target in range(version, SCHEMA_VERSION):
        run_script(db, MIGRATIONS[target])
        db.set_schema_version(target + 1)
