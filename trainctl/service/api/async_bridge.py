"""Crossing between the service's threads and the RPC server's event loop (trainctl.service.api.rpc_server).

`LoopSignal` is an asyncio event that any thread may set (a watch reader, a committing writer);
`wait_for_store_change` waits on the loop for the store's next commit (`JobStore.on_commit`); `store_read` runs a store
read on the loop when the store's reads are file reads in this process (SQLite), else on the loop's
executor (PostgreSQL: a round trip to the server).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol, TypeVar

R = TypeVar("R")


class LoopSignal:
    """An asyncio.Event of the loop that created it, settable from any thread; wake-ups that arrive
    before the waiter has taken the previous one are merged into it."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self._scheduled = False

    def set(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        self._scheduled = False
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        """Wait until set or `timeout` seconds pass; whether it was set. Clears it."""
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return False
        self._event.clear()
        return True


class CommitSource(Protocol):
    """What `wait_for_store_change` needs of a store (trainctl.service.store.JobStore)."""

    def on_commit(self, callback: Callable[[], None], job_id: str | None = None) -> Callable[[], None]: ...


class ReadSource(Protocol):
    """What `store_read` needs of a store (trainctl.service.store.JobStore)."""

    @property
    def reads_are_local(self) -> bool: ...


async def wait_for_store_change(store: CommitSource, timeout: float, job_id: str | None = None) -> None:
    """Return once this process commits to `store` (with `job_id`: commits an event of that job), or
    after `timeout` seconds (a commit of another process, such as another replica's on a shared
    PostgreSQL, is seen at the next poll)."""
    signal = LoopSignal()
    unsubscribe = store.on_commit(signal.set, job_id)
    try:
        await signal.wait(timeout)
    finally:
        unsubscribe()


async def store_read(store: ReadSource, read: Callable[[], R]) -> R:
    """`read()` (a call of `store`'s read methods) without blocking the loop (module docstring)."""
    if store.reads_are_local:
        return read()
    return await asyncio.get_running_loop().run_in_executor(None, read)
