"""Transport hardening for the gRPC server: message size limits, an exclusive port, malformed requests,
and a cap on the server-streaming calls one tenant holds open.

gRPC Python answers a request whose bytes do not decode as the method's message with INTERNAL
("Exception deserializing request!"). DESIGN.md decision 9 says nothing a client sends yields an
internal error, so `MalformedRequestInterceptor` decodes requests itself and answers undecodable
ones with INVALID_ARGUMENT naming the expected message type. `rejecting_handler` is also how the
auth interceptor refuses a call without ever decoding its payload.

Each open server stream (a following WatchJob) holds one of the server's handler threads until it
ends. `StreamLimiter` caps how many one tenant holds, so a single tenant cannot take every thread and
starve the others (and the health checks) of the server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

MiB = 1024 * 1024


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


def _abort(code: grpc.StatusCode, details: str) -> Callable[[Any, grpc.ServicerContext], Any]:
    def behaviour(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return behaviour


def rejecting_handler(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler | None:
    """A handler of the same streaming shape as `handler` that answers `code` without decoding the request."""
    if handler is None:
        return None
    abort = _abort(code, details)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, response_serializer=handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(abort, response_serializer=handler.response_serializer)


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's bad bytes
            return _Undecodable(exc)

    return decode


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "the method's request message")


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Answers requests whose bytes do not decode with INVALID_ARGUMENT instead of INTERNAL."""

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        name = _message_name(handler.request_deserializer)
        decode = _tolerant(handler.request_deserializer)

        def bad(request: _Undecodable, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {name}: {request.error}")

        if handler.request_streaming:
            behaviour = handler.stream_stream or handler.stream_unary

            def checked_stream(requests: Any, context: grpc.ServicerContext) -> Any:
                def messages() -> Any:
                    for request in requests:
                        if isinstance(request, _Undecodable):
                            bad(request, context)
                        yield request

                return behaviour(messages(), context)

            make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
            return make(checked_stream, request_deserializer=decode, response_serializer=handler.response_serializer)

        behaviour = handler.unary_stream or handler.unary_unary

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                bad(request, context)
            return behaviour(request, context)

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        return make(checked, request_deserializer=decode, response_serializer=handler.response_serializer)


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

    def _acquire(self, key: str) -> bool:
        with self._lock:
            if self._open.get(key, 0) >= self.max_per_key:
                return False
            self._open[key] = self._open.get(key, 0) + 1
            return True

    def _release(self, key: str) -> None:
        with self._lock:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]

    def limit(self, handler: grpc.RpcMethodHandler | None, key: str) -> grpc.RpcMethodHandler | None:
        """`handler` unchanged unless it is unary-request, server-streaming; then counted against `key`
        and answered RESOURCE_EXHAUSTED while `key` already holds `max_per_key` streams."""
        if handler is None or handler.request_streaming or not handler.response_streaming:
            return handler
        behaviour = handler.unary_stream

        def limited(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._acquire(key):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{key!r} already holds {self.max_per_key} open streams (the most per tenant); close one and retry",
                )
            try:
                yield from behaviour(request, context)
            finally:
                self._release(key)

        return grpc.unary_stream_rpc_method_handler(
            limited, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
