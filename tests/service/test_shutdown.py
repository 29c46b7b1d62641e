"""SIGTERM ends a serving process within the deadline even while an RPC handler never returns
(`trainctl.service.shutdown`, what `trainctl serve` installs). Python would otherwise join the stuck
handler thread at exit forever."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time

import grpc

SERVER = """
import sys, threading
from concurrent import futures
import grpc
from trainctl.service.shutdown import install_stop_signals

def stuck(request, context):
    print("handler running", flush=True)
    threading.Event().wait()  # a computation that never ends

handler = grpc.method_handlers_generic_handler("t", {"Stuck": grpc.unary_unary_rpc_method_handler(stuck)})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
server.add_generic_rpc_handlers((handler,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
install_stop_signals(lambda: server.stop(1).wait(), deadline=float(sys.argv[1]))
print(port, flush=True)
server.wait_for_termination()
"""
EXIT_BOUND_SECONDS = 10.0


def test_sigterm_exits_while_a_handler_is_stuck() -> None:
    process = subprocess.Popen([sys.executable, "-c", SERVER, "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t/Stuck")
            threading.Thread(target=lambda: _ignore_errors(call), daemon=True).start()
            assert process.stdout.readline().strip() == "handler running"
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=EXIT_BOUND_SECONDS)
        assert status == 0, process.stderr.read() if process.stderr else ""
        assert time.monotonic() - started < EXIT_BOUND_SECONDS
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _ignore_errors(call: grpc.UnaryUnaryMultiCallable) -> None:
    with contextlib.suppress(grpc.RpcError):  # the server went away: what this test causes
        call(b"", timeout=60)
