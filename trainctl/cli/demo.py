"""`trainctl demo`: the whole path on this machine, started and stopped by one command.

Starts an embedded multi-node Ray on loopback (labelled nodes with simulated GPUs), the service in
this process on a free loopback port with a fresh data directory, submits the demo spec over gRPC,
shows live progress, prints a summary, and stops everything it started. The data directory is kept:
it holds the store, the run's checkpoints and a final scrape of the Prometheus endpoint.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

from trainctl.cli.client import TrainctlClient
from trainctl.cli.progress import follow, state_name
from trainctl.parallelism.run_directory import RunDirectory
from trainctl.v1 import training_pb2 as pb

DEMO_SPEC = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default=str(DEMO_SPEC))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=4)


def run(args: argparse.Namespace) -> int:
    """`trainctl demo [--spec FILE] [--nodes N] [--gpus-per-node G]`."""
    return run_demo(Path(args.spec), nodes=args.nodes, gpus_per_node=args.gpus_per_node)


def run_demo(spec_path: Path, *, nodes: int = 2, gpus_per_node: int = 4) -> int:
    """Run the demo; exit status 0 when the job succeeded with a falling loss."""
    import urllib.request

    from trainctl.service.server import Service, ServiceConfig
    from trainctl.spec.validate import load_job_file
    from trainctl.workers.embedded import start_embedded

    job = load_job_file(spec_path)
    data_dir = Path(tempfile.mkdtemp(prefix="trainctl-demo-"))
    started = time.monotonic()
    print(f"starting an embedded Ray: {nodes} nodes x {gpus_per_node} simulated GPUs on 127.0.0.1 ...", flush=True)
    embedded = start_embedded(nodes, gpus_per_node)
    try:
        config = ServiceConfig(
            address=f"127.0.0.1:{free_port()}", data_dir=data_dir, metrics_port=free_port(), ray_address=embedded.address
        )
        with Service(config, topology=embedded.topology) as service, TrainctlClient(service.target) as client:
            metrics_url = f"http://127.0.0.1:{service.metrics_port}/metrics"
            print(f"service on {service.target}, data in {data_dir}, metrics on {metrics_url}", flush=True)
            created = client.create_job(job)
            par = job.spec.parallelism
            layout = " x ".join(f"{d}{getattr(par, d)}" for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if getattr(par, d) > 1)
            print(f"submitted {spec_path.name} as {created.id}: {par.world_size} ranks ({layout or 'one rank'}), "
                  f"model {job.spec.model.preset}, {job.spec.training.steps} steps", flush=True)
            follow(client.watch(created.id), created.status.total_steps, sys.stdout)
            final = client.get_job(created.id, full=True)
            scrape = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
            (data_dir / "metrics.prom").write_text(scrape)
        return _summary(final, data_dir, time.monotonic() - started)
    finally:
        embedded.shutdown()


def _summary(job: pb.Job, data_dir: Path, seconds: float) -> int:
    s = job.status
    metrics = list(job.metrics)
    (data_dir / "job-metrics.json").write_text(json.dumps(
        [{"step": m.step, "loss": m.loss, "tokens_per_second": m.tokens_per_second} for m in metrics], indent=1))
    print()
    print(f"job {job.id}: {state_name(s.state)}" + (f" ({s.reason})" if s.state != pb.SUCCEEDED and s.reason else ""))
    if metrics:
        tps = sorted(m.tokens_per_second for m in metrics)[len(metrics) // 2]
        print(f"  loss            {metrics[0].loss:.4f} (step {metrics[0].step}) -> {metrics[-1].loss:.4f} (step {metrics[-1].step})")
        print(f"  throughput      {tps:,.0f} tokens/s (median over {len(metrics)} steps)")
    print(f"  restarts        {s.restarts}")
    print(f"  checkpoints     {RunDirectory(Path(s.run_dir)).checkpoints}")
    print(f"  step metrics    {data_dir / 'job-metrics.json'} (and `trainctl get -o json` while serving)")
    print(f"  prometheus      {data_dir / 'metrics.prom'} (final scrape of the service's /metrics)")
    print(f"  wall time       {seconds:.0f} s, everything started has been stopped")
    falling = len(metrics) >= 2 and metrics[-1].loss < metrics[0].loss
    return 0 if s.state == pb.SUCCEEDED and falling else 1
