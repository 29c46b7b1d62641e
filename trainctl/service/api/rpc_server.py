"""The gRPC server: an asyncio (`grpc.aio`) server on an event loop of its own thread, behind a blocking
facade (`RpcServer`) that the service, the tests and the benchmarks drive from ordinary threads.

One loop serves every call: a unary read runs on it from start to finish and a following stream is a
coroutine, so no call holds a thread and no answer crosses threads (the thread-per-call server spent
most of its time handing the GIL between 64 handler threads; docs/benchmarks.md, Load). Work that
blocks (a write's commit, a call to Ray, a read on a store whose reads wait behind writes) runs on
`blocking`, a thread pool of `workers` threads (the loop's default executor). Every handler is
asynchronous (health and reflection are grpc's asyncio servicers): grpc would run a synchronous one on
`blocking` too, where an open stream of it would hold a thread the calls need.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")


class RpcServer:
    """A `grpc.aio` server on its own event loop thread (module docstring). Add handlers and ports before
    `start()`; `stop(grace)` returns an Event set once the server has stopped."""

    def __init__(
        self,
        *,
        workers: int,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        name: str = "trainctl-rpc",
        beside: RpcServer | None = None,
    ):
        """`beside`: serve on that server's loop and thread pool (a second port with other services,
        such as the plaintext health port) instead of starting a loop of its own."""
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._owner = beside is None
        if beside is None:
            self.blocking = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-blocking")
            """Threads for the calls' blocking work (see the module docstring)."""
            self.loop = asyncio.new_event_loop()
            self.loop.set_default_executor(self.blocking)
            self._thread = threading.Thread(target=self._run_loop, name=f"{name}-loop", daemon=True)
            self._thread.start()
        else:
            self.blocking, self.loop, self._thread = beside.blocking, beside.loop, beside._thread
        self._server: grpc.aio.Server = self.call(self._create(list(options), list(interceptors)))
        self._stopped = threading.Event()
        self._started = False

    async def _create(self, options: list[tuple[str, Any]], interceptors: list[grpc.aio.ServerInterceptor]) -> grpc.aio.Server:
        return grpc.aio.server(migration_thread_pool=self.blocking, options=options, interceptors=interceptors)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coroutine` on the server's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def aio(self) -> grpc.aio.Server:
        """The underlying server, for registering servicers (grpc's add_*_to_server, reflection)."""
        return self._server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(handlers))

    def add_insecure_port(self, address: str) -> int:
        return self.call(_on_loop(self._server.add_insecure_port, address))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self.call(_on_loop(self._server.add_secure_port, address, credentials))

    def start(self) -> None:
        self.call(self._server.start())
        self._started = True

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls, give the calls in flight `grace` seconds (None: none), then cancel the rest
        and, unless it serves `beside` another, end the loop; safe to call twice. The returned Event is
        set once all of that is done. Stop a server `beside` this one first."""
        if self._stopped.is_set() or not self._thread.is_alive():
            self._stopped.set()
            return self._stopped
        try:
            if self._started:
                self.call(self._server.stop(grace))
        finally:
            if self._owner:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join()
                self.loop.close()
                self.blocking.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()
        return self._stopped

    def wait_for_termination(self) -> None:
        """Block until `stop` has finished."""
        self._stopped.wait()


async def _on_loop(function: Callable[..., T], *args: Any) -> T:
    return function(*args)
