"""Making room for a queued job the pool cannot hold: preemption (running jobs of lower priority, or of
tenants borrowing beyond their guaranteed share, checkpoint and give their GPUs back) and autoscaling (the
map's hosts Ray lacks are asked of Ray's autoscaler). Admission (trainctl.service.scheduling) calls both
over the scheduler's one `SchedulerState`."""
