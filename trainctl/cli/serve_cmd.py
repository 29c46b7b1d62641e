"""`trainctl serve`: the service in this process, until SIGTERM or Ctrl-C (docs/api.md, the serve row).

The service's modules (and Ray) load when it runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from trainctl.cli.errors import EXIT_OK, CliError

STORE_ENV = "TRAINCTL_STORE"
"""The PostgreSQL URL `serve` uses when --store is not given (a Kubernetes Secret sets it)."""


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, at least 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds of at least 0, got {text}")
    return value


def _store_url(text: str) -> str:
    from trainctl.service.store.db import POSTGRES_SCHEMES

    if not text.startswith(POSTGRES_SCHEMES):
        raise argparse.ArgumentTypeError(
            f"expected a PostgreSQL URL (postgresql://user:password@host:port/database), got {text!r}; "
            "the SQLite store in --data-dir is the default"
        )
    return text


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--address", default="127.0.0.1:50051", help="gRPC listen address HOST:PORT")
    serve.add_argument("--health-address", metavar="HOST:PORT",
                       help="also serve gRPC health, and only it, in plaintext here (for Kubernetes' gRPC probe, "
                            "which speaks no TLS; default: health only on --address)")
    serve.add_argument("--data-dir", type=Path, default=Path(".trainctl"), help="store and run directory")
    serve.add_argument("--store", type=_store_url, default=os.environ.get(STORE_ENV) or None,
                       help=f"PostgreSQL URL of the job store (default: ${STORE_ENV}, else SQLite in --data-dir)")
    serve.add_argument("--metrics-port", type=int, default=9464, help="Prometheus port (0: off)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="Prometheus listen address (0.0.0.0 in a pod, so Prometheus can scrape it)")
    serve.add_argument("--ray-address", help="Ray cluster to use (default: start an embedded local Ray)")
    serve.add_argument("--topology", type=Path, help="topology map file (default: simulated from the Ray cluster)")
    serve.add_argument("--nodes", type=positive_int,
                       help="simulated nodes of the embedded Ray started without --ray-address (default 1)")
    serve.add_argument("--gpus-per-node", type=positive_int,
                       help="simulated GPU slots per embedded node, one rank each (default 8)")
    serve.add_argument("--tokens-file", type=Path, help="access file with token hashes, tenants, quotas (default: auth off)")
    serve.add_argument("--tls-cert", type=Path)
    serve.add_argument("--tls-key", type=Path)
    serve.add_argument("--tls-client-ca", type=Path, help="require client certificates signed by this CA")
    serve.add_argument("--data-root", type=Path, action="append",
                       help="confine every path a job names to this directory (repeatable; required with --tokens-file)")
    serve.add_argument("--allow-any-data-path", action="store_true",
                       help="with --tokens-file, serve without --data-root: every tenant's jobs may read any file the service can")
    serve.add_argument("--mlflow-tracking-uri", metavar="URI",
                       help="log every job's run to this MLflow server unless the job names another allowed one "
                            "(needs the tracking extra; credentials from this process's environment, e.g. "
                            "MLFLOW_TRACKING_TOKEN, never handed to jobs)")
    serve.add_argument("--mlflow-allow", metavar="URI", action="append",
                       help="a further MLflow server jobs may name in spec.tracking.mlflow_tracking_uri (repeatable)")
    serve.add_argument("--preemption-grace", type=seconds, default=120.0, metavar="SECONDS",
                       help="how long a preempted job has to checkpoint at its next step and stop before its ranks "
                            "are stopped (default 120)")
    serve.add_argument("--preemption-cooldown", type=seconds, default=600.0, metavar="SECONDS",
                       help="a job preempted less than this long ago is not preempted again (default 600)")
    serve.add_argument("--no-preemption", action="store_true",
                       help="never preempt running jobs: a queued job of higher priority waits for GPUs to free up")
    serve.add_argument("--warm-pool", action="store_true",
                       help="keep an engine-loaded rank process on every free GPU slot, so jobs start without the "
                            "imports (about 300 MB of host memory per slot)")
    serve.add_argument("--autoscaling", action="store_true",
                       help="ask Ray's autoscaler for the topology map's nodes Ray lacks when a queued job needs "
                            "them, and withdraw the request when none does (docs/deploy.md, Autoscaling)")


def run(args: argparse.Namespace) -> int:
    from trainctl.service.scheduling.relaunch import log_stop_notice
    from trainctl.service.scheduling.state import PreemptionPolicy
    from trainctl.service.server import Service, ServiceConfig, settle_heap_for_serving
    from trainctl.service.shutdown import install_stop_signals
    from trainctl.service.store import StoreError
    from trainctl.service.tracking.policy import TrackingUnavailable
    from trainctl.wire.tls import TlsConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert or args.tls_key else None
    sizes = (("embedded_nodes", args.nodes), ("embedded_gpus_per_node", args.gpus_per_node))
    embedded = {name: value for name, value in sizes if value is not None}  # unset: ServiceConfig's defaults
    config = ServiceConfig(
        address=args.address, data_dir=args.data_dir, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        store=args.store, ray_address=args.ray_address, **embedded,
        topology=args.topology, tokens_file=args.tokens_file, tls=tls, data_roots=args.data_root or [],
        allow_any_data_path=args.allow_any_data_path, warm_pool=args.warm_pool, health_address=args.health_address,
        mlflow_tracking_uri=args.mlflow_tracking_uri, mlflow_allow=args.mlflow_allow or [], autoscaling=args.autoscaling,
        preemption=PreemptionPolicy(
            enabled=not args.no_preemption, grace_seconds=args.preemption_grace, cooldown_seconds=args.preemption_cooldown,
        ),
    )
    try:
        service = Service(config).start()
    except StoreError as exc:  # an unreachable or newer database: nothing was started
        raise CliError(f"the job store: {exc}") from exc
    except TrackingUnavailable as exc:  # nothing was started
        raise CliError(str(exc)) from exc
    print(f"trainctl serving on {service.target}; data in {config.data_dir}; store {service.store.location}"
          + (f"; metrics on http://{config.metrics_host}:{service.metrics_port}/metrics" if service.metrics_port else ""),
          flush=True)

    def stop() -> None:
        log_stop_notice(service.store, args.ray_address)  # what happens to the running jobs, before they stop
        service.stop()

    install_stop_signals(stop)
    settle_heap_for_serving()
    service.wait()
    return EXIT_OK
