"""Experiment tracking (DESIGN decision 20): the service, which receives every step of every job, logs
each job's run to MLflow and writes TensorBoard event files; ranks hold no tracker or credential.

- `policy`: which MLflow servers jobs may name, and the checks CreateJob and `trainctl serve` make;
- `tracker`: what the scheduler's follower calls (a job runs, a step, a job ends), handing each sink
  what it needs;
- `flatten`: the resolved spec as dotted MLflow parameters, within MLflow's limits;
- `outbox`: a job's buffered steps (bounded, the oldest dropped with a count) and its end;
- `mlflow_sink`: the MLflow runs, logged from a background thread with retries and backoff, so a tracker
  that is down or slow never slows or fails a job;
- `tensorboard_sink`: event files in the run directory's `tensorboard/`.

MLflow and TensorBoard are optional installs (the `tracking` extra): they are imported only when used.
"""
