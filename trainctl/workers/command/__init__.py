"""Command jobs on the ranks: the user's program as a child process of each RankWorker (DESIGN.md,
decision 13). `environment` builds the torchrun environment from the placement, `program` runs and kills
the process tree, `output` keeps and forwards its lines, `report_channel` turns `trainctl.report` calls
into the engine's StepReport."""
