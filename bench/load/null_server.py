"""A TrainingService that does no work: the load mix's ceiling on this machine (bench_ceiling.py).

An asyncio gRPC server (the same `grpc.aio` the service runs on, one process, one event loop) whose
every method answers bytes serialized once at start, without deserializing the request: CreateJob a
QUEUED job, GetJob the same job, ListJobs an empty last page, WatchJob no event, CancelJob the job
CANCELLED, PlanJob a valid plan, GetCluster the load bench's held pool. No authentication, store,
validation, scheduler or metrics: what is left is gRPC's own cost of a call on the server side, so a
client mix run against it shows the most calls per second any server in Python could answer here.
Prints `serving on HOST:PORT` when ready; SIGTERM stops it.

    .venv/bin/python bench/load/null_server.py
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from trainctl.v1 import training_pb2 as pb

SERVICE = "trainctl.v1.TrainingService"
JOB_ID = "null-job"
POOL_GPUS = 4


def answers() -> dict[str, bytes]:
    """Each unary method's answer, serialized."""
    job = pb.Job(id=JOB_ID)
    job.status.state = pb.QUEUED
    cancelled = pb.Job(id=JOB_ID)
    cancelled.status.state = pb.CANCELLED
    return {
        "CreateJob": job.SerializeToString(),
        "GetJob": job.SerializeToString(),
        "ListJobs": pb.ListJobsResponse().SerializeToString(),
        "CancelJob": cancelled.SerializeToString(),
        "PlanJob": pb.PlanJobResponse(valid=True).SerializeToString(),
        "GetCluster": pb.Cluster(total_gpus=POOL_GPUS, free_gpus=0).SerializeToString(),
    }


def handlers() -> grpc.GenericRpcHandler:
    """Raw-bytes handlers (no serializers): each unary method returns its fixed answer, WatchJob ends at once."""
    def unary(answer: bytes) -> grpc.RpcMethodHandler:
        async def handle(request: bytes, context: Any) -> bytes:
            return answer
        return grpc.unary_unary_rpc_method_handler(handle)

    async def watch(request: bytes, context: Any) -> AsyncIterator[bytes]:
        return
        yield b""  # an async generator that yields nothing

    methods = {name: unary(answer) for name, answer in answers().items()}
    methods["WatchJob"] = grpc.unary_stream_rpc_method_handler(watch)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


async def serve() -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await stopped.wait()
    await server.stop(grace=1.0)


if __name__ == "__main__":
    asyncio.run(serve())
    sys.exit(0)
