"""The planning layer: what a job would look like on a GPU pool, computed from the spec and a topology map
alone. `pool` (the pool's GPUs and the placement of a job's ranks), `fit` (the per-rank memory estimates
and the check that a job fits the pool's largest GPU), `plan` (`JobPlan`: placement, memory per rank,
modelled step time, notes) and `layout_search` (`plan --suggest`: the fastest valid layouts). Called by
the service (admission, PlanJob) and by `trainctl plan` offline alike; it imports the workers' Ray-free
placement and topology modules, the engine's torch-free sizing modules and the spec, never torch, Ray,
gRPC, protobuf, the wire, the service or the CLI (tests/test_layering.py). The wire turns a `JobPlan`
into the API's PlanJobResponse (trainctl.wire.plan_convert)."""
