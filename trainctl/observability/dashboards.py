"""trainctl's Grafana dashboards: fleet / service overview, one job's training, cluster and placement.

Queries read only the metrics of `trainctl.service.metrics` (plus `up` for the scrape target, job
"trainctl"). `deploy/render.py` writes them to deploy/grafana/dashboards/<uid>.json. Each dashboard is a
declaration: panels and rows look alike by design.
"""

from __future__ import annotations

from trainctl.observability.grafana import Dashboard, Panel, Query, Row, Variable

RATE = "$__rate_interval"
JOB = 'job_id="$job"'


def _quantiles(metric: str, by: str, selector: str = "") -> tuple[Query, ...]:
    sel = "{" + selector + "}" if selector else ""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{sel}[{RATE}])))", f"p{int(q * 100)}{suffix}")
        for q in (0.5, 0.99)
    )


def fleet() -> Dashboard:
    """Is the service healthy, what runs, what waits, what the API and the scheduler are doing."""
    running = 'trainctl_job_state{state="RUNNING"} == 1'
    return Dashboard(
        uid="trainctl-fleet",
        title="trainctl / Fleet",
        description="Service health, jobs by state, the queue, API traffic and latency, scheduler and store.",
        links=("trainctl",),
        items=(
            Row("Overview"),
            Panel("stat", "Service up", (Query('up{job="trainctl"}', "{{instance}}"),), width=4, height=4,
                  description="1 when Prometheus scrapes the service."),
            Panel("stat", "Running jobs", (Query('sum(trainctl_jobs{state="RUNNING"})', "running"),), width=4,
                  height=4),
            Panel("stat", "Queued jobs", (Query("sum(trainctl_queue_depth)", "queued"),), width=4, height=4),
            Panel("stat", "Oldest queued job", (Query("max(trainctl_queue_oldest_age_seconds)", "age"),), unit="s",
                  width=4, height=4),
            Panel("stat", "Fleet throughput", (Query(f"sum(trainctl_job_tokens_per_second and on(job_id, tenant) "
                                                     f"({running}))", "tokens/s"),),
                  unit="short", width=4, height=4, description="Tokens per second over all running jobs."),
            Panel("stat", "Restarts and preemptions (1h)",
                  (Query("sum(increase(trainctl_job_restarts_total[1h]))", "restarts"),
                   Query("sum(increase(trainctl_job_preemptions_total[1h]))", "preemptions")),
                  width=4, height=4, decimals=0,
                  description="Rank-group restarts, and jobs stopped for a job of higher priority, over the last hour."),
            Panel("timeseries", "Jobs by state", (Query("sum by (state) (trainctl_jobs)", "{{state}}"),),
                  description="Job records in the store, by state."),
            Panel("table", "Running jobs",
                  (Query(f"sum by (job_id, tenant) (trainctl_job_tokens_per_second and on(job_id, tenant) ({running}))",
                         "tokens/s", instant=True),
                   Query(f"sum by (job_id, tenant) (trainctl_job_step and on(job_id, tenant) ({running}))", "step",
                         instant=True)),
                  description="Each running job's throughput and step."),
            Row("API"),
            Panel("timeseries", "Requests by method and code",
                  (Query(f"sum by (method, code) (rate(trainctl_grpc_requests_total[{RATE}]))", "{{method}} {{code}}"),),
                  unit="reqps"),
            Panel("timeseries", "Error ratio by method",
                  (Query(f'sum by (method) (rate(trainctl_grpc_requests_total{{code!="OK"}}[{RATE}])) / '
                         f"sum by (method) (rate(trainctl_grpc_requests_total[{RATE}]))", "{{method}}"),),
                  unit="percentunit", min=0, max=1, description="Share of requests answered with a code other than OK."),
            Panel("timeseries", "Request latency", _quantiles("trainctl_grpc_request_duration_seconds", "method"),
                  unit="s", width=24),
            Row("Scheduler and store"),
            Panel("timeseries", "Scheduling decisions",
                  (Query(f"sum by (decision) (rate(trainctl_scheduling_decisions_total[{RATE}]))", "{{decision}}"),),
                  unit="ops", width=8),
            Panel("timeseries", "Placement solver time",
                  _quantiles("trainctl_placement_solver_duration_seconds", ""), unit="s", width=8),
            Panel("timeseries", "Store latency", _quantiles("trainctl_store_operation_duration_seconds", "op"),
                  unit="s", width=8),
            Panel("timeseries", "Pending scale-up",
                  (Query("max(trainctl_scale_up_pending_nodes)", "nodes asked"),), width=12, decimals=0,
                  description="Nodes asked of Ray's autoscaler for the queued job at the head of the queue, not "
                              "placed on yet (docs/deploy.md, Autoscaling)."),
            Panel("timeseries", "Scale-up wait", (Query("max(trainctl_scale_up_pending_age_seconds)", "age"),),
                  unit="s", width=12, description="How long the pending scale-up has waited for its nodes."),
            Panel("table", "Build", (Query("trainctl_build_info", "{{version}}", instant=True),), width=24, height=5,
                  description="Versions of the running service."),
        ),
    )


def job() -> Dashboard:
    """One job's training: progress, loss, throughput, MFU, where the step time goes, memory, faults."""
    return Dashboard(
        uid="trainctl-job",
        title="trainctl / Job",
        description="One training job: loss, throughput, MFU, step-time breakdown, memory, checkpoints, "
                    "restarts, stragglers and placement.",
        variables=(Variable("job", "Job", "label_values(trainctl_job_state, job_id)"),),
        links=("trainctl",),
        items=(
            Row("Progress"),
            Panel("stat", "State", (Query(f"max by (state) (trainctl_job_state{{{JOB}}} == 1)", "{{state}}"),),
                  width=4, height=4),
            Panel("stat", "Step", (Query(f"max(trainctl_job_step{{{JOB}}})", "step"),), width=4, height=4, decimals=0),
            Panel("stat", "Loss", (Query(f"max(trainctl_job_loss{{{JOB}}})", "loss"),), width=4, height=4),
            Panel("stat", "Tokens/s", (Query(f"max(trainctl_job_tokens_per_second{{{JOB}}})", "tokens/s"),), width=4,
                  height=4),
            Panel("stat", "MFU",
                  (Query(f"max(trainctl_job_mfu_ratio{{{JOB}}})", "causal halved"),
                   Query(f"max(trainctl_job_mfu_full_attention_ratio{{{JOB}}})", "full attention")),
                  unit="percentunit", width=4, height=4,
                  description="MFU in Megatron's convention (causal attention halved) and torchtitan's (attention "
                              "counted unmasked)."),
            Panel("stat", "Restarts and preemptions",
                  (Query(f"max(trainctl_job_restarts_total{{{JOB}}})", "restarts"),
                   Query(f"max(trainctl_job_preemptions_total{{{JOB}}})", "preemptions")),
                  width=4, height=4, decimals=0),
            Row("Training"),
            Panel("timeseries", "Loss",
                  (Query(f"trainctl_job_loss{{{JOB}}}", "loss"), Query(f"trainctl_job_eval_loss{{{JOB}}}", "eval loss")),
                  width=8, description="Training loss at each reported step; eval loss at the last step that "
                                       "evaluated (spec.evaluation)."),
            Panel("timeseries", "Gradient norm", (Query(f"trainctl_job_grad_norm{{{JOB}}}", "grad norm"),), width=8),
            Panel("timeseries", "Learning rate", (Query(f"trainctl_job_learning_rate{{{JOB}}}", "lr"),), width=8),
            Panel("timeseries", "Throughput",
                  (Query(f"trainctl_job_tokens_per_second{{{JOB}}}", "reported"),
                   Query(f"rate(trainctl_job_tokens_total{{{JOB}}}[{RATE}])", "from token counter")),
                  unit="short", description="Tokens per second as reported at each step, and from the token counter."),
            Panel("timeseries", "MFU",
                  (Query(f"trainctl_job_mfu_ratio{{{JOB}}}", "causal halved (Megatron)"),
                   Query(f"trainctl_job_mfu_full_attention_ratio{{{JOB}}}", "full attention (torchtitan)")),
                  unit="percentunit", min=0,
                  description="Model FLOPs utilisation: achieved FLOP/s over the hardware's peak, in two conventions "
                              "that differ in how causal attention is counted: Megatron's (a query meets half the keys "
                              "on average) and torchtitan's (every key)."),
            Row("Step time"),
            Panel("timeseries", "Step-time breakdown",
                  (Query(f"sum by (phase) (trainctl_job_step_phase_seconds{{{JOB}}})", "{{phase}}"),), unit="s",
                  stack=True, description="Where the last reported step's time went, by phase (stacked)."),
            Panel("timeseries", "Step time", _quantiles("trainctl_job_step_duration_seconds", "", JOB), unit="s"),
            Row("Resources and faults"),
            Panel("timeseries", "Peak memory (max over ranks)",
                  (Query(f"trainctl_job_peak_memory_bytes{{{JOB}}}", "peak"),), unit="bytes", width=8),
            Panel("timeseries", "Straggler ratio",
                  (Query(f"trainctl_job_straggler_ratio{{{JOB}}}", "slowest / fastest"),), width=8, min=1,
                  description="Slowest over fastest rank step time; the job's events name the slowest rank."),
            Panel("timeseries", "Restarts", (Query(f"increase(trainctl_job_restarts_total{{{JOB}}}[1h])", "last hour"),),
                  width=8, min=0),
            Panel("timeseries", "Checkpoint save time",
                  _quantiles("trainctl_job_checkpoint_duration_seconds", "", JOB), unit="s", width=8),
            Panel("timeseries", "Checkpoint size", (Query(f"trainctl_job_checkpoint_size_bytes{{{JOB}}}", "size"),),
                  unit="bytes", width=8),
            Panel("bargauge", "Placement: GPUs by node",
                  (Query(f"sum by (node, nvlink_domain) (trainctl_job_gpus{{{JOB}}})", "{{node}} ({{nvlink_domain}})"),),
                  width=8, decimals=0),
        ),
    )


def cluster() -> Dashboard:
    """The GPU pool: used and free GPUs by node and NVLink domain, who holds them, and the queue."""
    free = "trainctl_cluster_gpus - trainctl_cluster_gpus_used"
    return Dashboard(
        uid="trainctl-cluster",
        title="trainctl / Cluster and placement",
        description="GPUs used and free by node and NVLink domain, jobs' placement, and the queue.",
        links=("trainctl",),
        items=(
            Row("Pool"),
            Panel("stat", "GPUs", (Query("sum(trainctl_cluster_gpus)", "total"),), width=6, height=4, decimals=0),
            Panel("stat", "GPUs used", (Query("sum(trainctl_cluster_gpus_used)", "used"),), width=6, height=4,
                  decimals=0),
            Panel("stat", "GPUs free", (Query(f"sum({free})", "free"),), width=6, height=4, decimals=0),
            Panel("stat", "Allocation", (Query("sum(trainctl_cluster_gpus_used) / sum(trainctl_cluster_gpus)",
                                               "allocated"),),
                  unit="percentunit", width=6, height=4),
            Row("By node and NVLink domain"),
            Panel("bargauge", "GPUs used by node",
                  (Query("sum by (node) (trainctl_cluster_gpus_used)", "{{node}}", instant=True),), decimals=0),
            Panel("bargauge", "GPUs free by node", (Query(f"sum by (node) ({free})", "{{node}}", instant=True),),
                  decimals=0),
            Panel("timeseries", "GPUs used by NVLink domain",
                  (Query("sum by (nvlink_domain) (trainctl_cluster_gpus_used)", "{{nvlink_domain}}"),), stack=True,
                  decimals=0),
            Panel("timeseries", "GPUs free by NVLink domain",
                  (Query(f"sum by (nvlink_domain) ({free})", "{{nvlink_domain}}"),), stack=True, decimals=0),
            Panel("table", "Placement: jobs' GPUs by node",
                  (Query("sum by (job_id, tenant, node, nvlink_domain) (trainctl_job_gpus)", "", instant=True),),
                  width=24, description="Every placed job's GPUs on each node (a restart may move a job)."),
            Row("Queue"),
            Panel("timeseries", "Queue depth", (Query("sum(trainctl_queue_depth)", "queued"),), decimals=0),
            Panel("timeseries", "Oldest queued job", (Query("max(trainctl_queue_oldest_age_seconds)", "age"),),
                  unit="s"),
        ),
    )


def all_dashboards() -> tuple[Dashboard, ...]:
    return (fleet(), job(), cluster())
