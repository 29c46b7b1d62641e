"""The innermost server interceptor: error mapping and per-RPC metrics.

An `ApiError` raised by the servicer becomes its google.rpc.Status; any other exception is logged
with its traceback and answered INTERNAL without internals, so no request can take the server down.
Every finished call is counted by method and status code, with its duration (streams: until closed).
Authentication (trainctl.service.auth.AuthInterceptor) and undecodable requests
(trainctl.service.hardening) are handled by interceptors that run before this one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from trainctl.service.errors import ApiError

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/trainctl.v1.TrainingService/"


class RpcObserver(Protocol):
    """Receives (method, status code name, seconds) per finished RPC (ServiceMetrics.observe_rpc)."""

    def observe_rpc(self, method: str, code: str, seconds: float) -> None: ...


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions to statuses and records each TrainingService call (see the module docstring)."""

    def __init__(self, observer: RpcObserver | None = None):
        self._observer = observer

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        name = method.removeprefix(SERVICE_PREFIX)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, name),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, name),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # the API has no client-streaming methods

    def _observe(self, name: str, code: grpc.StatusCode, started: float) -> None:
        if self._observer is not None:
            self._observer.observe_rpc(name, code.name, time.perf_counter() - started)

    def _unary(self, behavior: Callable, name: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                response = behavior(request, context)
            except ApiError as exc:
                self._observe(name, exc.code, started)
                context.abort_with_status(exc.to_status())
            except Exception:
                log.exception("%s failed", name)
                self._observe(name, grpc.StatusCode.INTERNAL, started)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log")
            self._observe(name, grpc.StatusCode.OK, started)
            return response

        return wrapped

    def _stream(self, behavior: Callable, name: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.perf_counter()
            try:
                yield from behavior(request, context)
            except ApiError as exc:
                self._observe(name, exc.code, started)
                context.abort_with_status(exc.to_status())
            except GeneratorExit:  # the client went away
                self._observe(name, grpc.StatusCode.CANCELLED, started)
                raise
            except Exception:
                log.exception("%s failed", name)
                self._observe(name, grpc.StatusCode.INTERNAL, started)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log")
            self._observe(name, grpc.StatusCode.OK, started)

        return wrapped
