"""The wire: what the CLI and the service share about the API besides its generated code (trainctl.v1):
proto <-> spec conversions (`convert`, `sweep_convert`), a plan as PlanJobResponse (`plan_convert`, the
service's PlanJob and the offline `trainctl plan`), error details (`errors`), TLS credentials of either side
(`tls`) and the access file's tokens (`tokens`). It imports the spec layer and the generated code, never the
service, the workers or the engine (the planning layer for annotations only), so a client command loads
nothing of the server."""
