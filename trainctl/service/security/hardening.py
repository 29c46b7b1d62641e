"""Transport hardening for the gRPC server: message size limits, an exclusive port, malformed requests,
and a cap on the server-streaming calls one tenant holds open.

gRPC Python answers a request whose bytes do not decode as the method's message with INTERNAL
("Exception deserializing request!"). DESIGN.md decision 9 says nothing a client sends yields an
internal error, so `MalformedRequestInterceptor` decodes requests itself and answers undecodable
ones with INVALID_ARGUMENT naming the expected message type (the TrainingService's own handlers do
the same, trainctl.service.api.rpc_calls).

`check_text` bounds a string of a request that the store keeps (a request id, a cancel reason): its
length, and no NUL character, which PostgreSQL's text refuses (SQLite would keep it), so a request is
answered alike on either store.

`StreamLimiter` caps the server streams (following WatchJobs, WatchSweeps) one tenant holds open, so a
single tenant cannot hold an unbounded share of the server's memory and wake-ups.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from trainctl.wire.errors import bad_field

MiB = 1024 * 1024
MAX_REASON_LENGTH = 1000
"""The longest reason a client may give (CancelJob, CancelSweep)."""


@dataclass(frozen=True)
class MessageLimits:
    """Largest messages the server accepts and sends; larger ones fail with RESOURCE_EXHAUSTED."""

    max_receive_bytes: int = 4 * MiB
    """A job spec is a few KiB; 4 MiB leaves room for large label sets and nothing more."""
    max_send_bytes: int = 16 * MiB
    """Largest answer (a ListJobs page with full specs, a WatchJob event batch)."""

    def __post_init__(self) -> None:
        for name in ("max_receive_bytes", "max_send_bytes"):
            if getattr(self, name) < 1024:
                raise ValueError(f"{name} must be at least 1024 bytes, got {getattr(self, name)}")

    def server_options(self) -> list[tuple[str, int]]:
        """Options for `grpc.server(..., options=...)`: these limits, and an exclusive port.

        gRPC sets SO_REUSEPORT by default, so a second server (a stale instance, another user's
        process) could bind the same port and silently take half the connections; here binding fails.
        """
        return [
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            ("grpc.so_reuseport", 0),
        ]


class _Undecodable:
    """Marks a request whose bytes did not decode; carries the decoder's complaint."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's bad bytes
            return _Undecodable(exc)

    return decode


def message_name(message_class: Any) -> str:
    """The full protobuf name of a message class (or of a bound `FromString`'s class)."""
    owner = getattr(message_class, "__self__", message_class)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "the method's request message")


def undecodable_details(name: str, error: Exception) -> str:
    """The INVALID_ARGUMENT details for request bytes that are not a `name`."""
    return f"request is not a valid {name}: {error}"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers requests whose bytes do not decode with INVALID_ARGUMENT instead of UNKNOWN, for every
    asynchronous handler that decodes its requests through grpc (health, reflection; the TrainingService's
    handlers decode their own, trainctl.service.api.rpc_calls). The server registers no synchronous handler
    (trainctl.service.api.rpc_server); one would be passed through unchanged."""

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        streams = inspect.isasyncgenfunction(behaviour)
        if not streams and not inspect.iscoroutinefunction(behaviour):
            return handler
        name = message_name(handler.request_deserializer)
        checked = (_checked_stream if handler.request_streaming else _checked_unary)(behaviour, name, streams)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(checked, request_deserializer=_tolerant(handler.request_deserializer), response_serializer=handler.response_serializer)


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext, name: str) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, undecodable_details(name, request.error))


def _checked_unary(behaviour: Callable, name: str, streams: bool) -> Callable:
    """`behaviour` of a unary request (an async generator when `streams`, else a coroutine), first
    answering an undecodable request INVALID_ARGUMENT."""
    if streams:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _refuse_undecodable(request, context, name)
            async for item in behaviour(request, context):
                yield item

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_undecodable(request, context, name)
        return await behaviour(request, context)

    return unary


def _checked_stream(behaviour: Callable, name: str, streams: bool) -> Callable:
    """`behaviour` of a request stream, answering INVALID_ARGUMENT at the first undecodable request."""
    async def checked(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            await _refuse_undecodable(request, context, name)
            yield request

    if streams:
        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for item in behaviour(checked(requests, context), context):
                yield item

        return stream

    async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(checked(requests, context), context)

    return unary


def check_text(field: str, value: str, max_length: int) -> None:
    """INVALID_ARGUMENT naming `field` when `value` is longer than `max_length` or holds a NUL character."""
    if len(value) > max_length:
        raise bad_field(field, f"longer than {max_length} characters")
    if "\x00" in value:
        raise bad_field(field, "contains a NUL character")


class StreamLimiter:
    """At most `max_per_key` concurrent server-streaming calls per key (the caller's tenant)."""

    def __init__(self, max_per_key: int):
        if max_per_key < 1:
            raise ValueError(f"max_per_key must be at least 1, got {max_per_key}")
        self.max_per_key = max_per_key
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def open_streams(self, key: str) -> int:
        """Streams `key` holds open now."""
        with self._lock:
            return self._open.get(key, 0)

    def acquire(self, key: str) -> bool:
        """Count one more stream against `key`; False (nothing counted) while it holds `max_per_key`."""
        with self._lock:
            if self._open.get(key, 0) >= self.max_per_key:
                return False
            self._open[key] = self._open.get(key, 0) + 1
            return True

    def release(self, key: str) -> None:
        """Count one of `key`'s streams as closed."""
        with self._lock:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]
