"""Watch fan-out benchmark: N following WatchJob streams on one running job whose events are appended
at a steady rate; per-event delivery lag, completeness and order, and the server's memory per watcher.

The server (bench/api/watch_fanout_server.py) is the TrainingService's gRPC server with its whole
call chain over a SQLite store, in its own process; a writer thread in it appends the job's
events (as the scheduler does while a job trains), then ends the job. The watchers are asyncio gRPC
clients spread over `--processes` processes, on `--channels` connections each; each opens
`WatchJob(follow=True)` from sequence 0 and reads until the stream ends.

Measured: the lag of every (watcher, event) pair, receipt time minus the event's time (the writer's
clock just before its append's transaction; same machine); whether every watcher got exactly the job's
event sequences in order; the server's RSS (VmRSS) before the watchers connect and once all are open
and served their first event, hence memory per watcher; server CPU time. `--baseline COMMIT` runs the
same measurement first over that commit's `trainctl` (extracted with `git archive`) for a ratio. The
machine's 1-minute load average at the end of each run is recorded with it (the figures depend on it).

    .venv/bin/python bench/api/bench_watch_fanout.py --watchers 1000 --rate 10 --count 300 \
        --baseline 525666c --out results.json   (docs/benchmarks.md, Watch fan-out)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import grpc

from trainctl.v1 import training_pb2 as pb
from trainctl.v1 import training_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OPEN_TIMEOUT = 300.0
"""Seconds all watchers may take to connect and receive their first event."""


async def _watch_all(target: str, job_id: str, watchers: int, channels: int, ready: Any) -> list[tuple[list[int], list[float]]]:
    opened = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1), ("trainctl.bench.channel", i)])
        for i in range(channels)
    ]
    stubs = [pb_grpc.TrainingServiceStub(c) for c in opened]
    first = asyncio.Semaphore(0)

    async def watch(index: int) -> tuple[list[int], list[float]]:
        sequences: list[int] = []
        lags: list[float] = []
        call = stubs[index % channels].WatchJob(pb.WatchJobRequest(id=job_id, follow=True))
        async for event in call:
            lags.append(time.time() - (event.time.seconds + event.time.nanos / 1e9))
            if not sequences:
                first.release()
            sequences.append(event.sequence)
        return sequences, lags

    tasks = [asyncio.create_task(watch(i)) for i in range(watchers)]
    for _ in range(watchers):
        await first.acquire()
    ready.put(watchers)
    results = await asyncio.gather(*tasks)
    for channel in opened:
        await channel.close()
    return results


def _client_process(target: str, job_id: str, watchers: int, channels: int, ready: Any, results: Any) -> None:
    out = asyncio.run(_watch_all(target, job_id, watchers, channels, ready))
    results.put(out)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(pythonpath: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """One run of the server (`trainctl` from `pythonpath`) with `args.watchers` followers."""
    with tempfile.TemporaryDirectory(prefix="watch-fanout-") as tmp:
        sequences_file = Path(tmp) / "sequences.json"
        env = {**os.environ, "PYTHONPATH": pythonpath}
        server = subprocess.Popen(
            [sys.executable, str(HERE / "watch_fanout_server.py"), "--data-dir", f"{tmp}/data",
             "--streams", str(args.watchers), "--sequences", str(sequences_file)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        assert server.stdout is not None and server.stdin is not None
        words = server.stdout.readline().split()
        if words[:2] != ["serving", "on"]:
            raise RuntimeError(f"{label}: the server did not start: {words}")
        target, job_id = f"127.0.0.1:{words[2]}", words[4]
        time.sleep(1.0)
        rss_before = _rss_bytes(server.pid)
        context = multiprocessing.get_context("spawn")
        ready, results = context.Queue(), context.Queue()
        shares = [args.watchers // args.processes + (i < args.watchers % args.processes) for i in range(args.processes)]
        clients = [
            context.Process(target=_client_process, args=(target, job_id, share, args.channels, ready, results))
            for share in shares
        ]
        opened_at = time.monotonic()
        for client in clients:
            client.start()
        for _ in clients:
            ready.get(timeout=OPEN_TIMEOUT)
        open_seconds = time.monotonic() - opened_at
        time.sleep(1.0)
        rss_open = _rss_bytes(server.pid)
        cpu_before = _cpu_seconds(server.pid)
        started = time.monotonic()
        server.stdin.write(f"go {args.rate} {args.count}\n")
        server.stdin.flush()
        collected = [item for _ in clients for item in results.get(timeout=args.count / args.rate + OPEN_TIMEOUT)]
        elapsed = time.monotonic() - started
        cpu = _cpu_seconds(server.pid) - cpu_before
        for client in clients:
            client.join()
        server.stdin.close()
        server.wait(timeout=60)
        expected = json.loads(sequences_file.read_text())
    lags = [lag for _, watcher_lags in collected for lag in watcher_lags[2:]]  # the live events (not QUEUED, RUNNING)
    per_watcher_p99 = [_percentile(watcher_lags[2:], 0.99) for _, watcher_lags in collected]
    return {
        "label": label,
        "watchers": args.watchers,
        "events_appended": args.count,
        "rate_per_second": args.rate,
        "complete_and_in_order": sum(sequences == expected for sequences, _ in collected),
        "lag_ms": {
            "p50": round(1000 * statistics.median(lags), 1),
            "p99": round(1000 * _percentile(lags, 0.99), 1),
            "max": round(1000 * max(lags), 1),
            "worst_watcher_p99": round(1000 * max(per_watcher_p99), 1),
        },
        "seconds_to_open_all_watchers": round(open_seconds, 1),
        "seconds_until_every_watcher_drained": round(elapsed, 1),
        "server_rss_mib_before": round(rss_before / 2**20, 1),
        "server_rss_mib_with_watchers": round(rss_open / 2**20, 1),
        "server_kib_per_watcher": round((rss_open - rss_before) / 1024 / args.watchers, 1),
        "server_cpu_seconds_while_appending": round(cpu, 1),
        "machine_load_average_1min_at_end": round(os.getloadavg()[0], 1),
    }


def _extract(commit: str, into: Path) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "trainctl"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=10.0, help="events appended per second")
    parser.add_argument("--count", type=int, default=300, help="events appended")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--channels", type=int, default=10, help="connections per client process")
    parser.add_argument("--baseline", help="also measure this commit's trainctl first, for a ratio")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="watch-fanout-baseline-") as tree:
            _extract(args.baseline, Path(tree))
            runs.append(measure(tree, args, f"baseline {args.baseline}"))
            print(json.dumps(runs[-1], indent=2), flush=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    runs.append(measure(str(REPO), args, f"this tree ({head})"))
    print(json.dumps(runs[-1], indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "machine": os.uname().nodename, "cpus": os.cpu_count()}, indent=2) + "\n")
    return 0 if all(run["complete_and_in_order"] == run["watchers"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
