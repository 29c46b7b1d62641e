"""Server interceptors for the TrainingService: per-RPC metrics (outermost) and error mapping (innermost).

`RpcMetricsInterceptor` sees the final handler of the whole chain, so every call is counted by method
and status code with its duration (streams: until closed), including calls that authentication
(trainctl.service.auth.AuthInterceptor), the stream limit or undecodable-request handling
(trainctl.service.hardening) answer before the servicer runs. `ErrorInterceptor` turns an `ApiError`
raised by the servicer into its google.rpc.Status; any other exception is logged with its traceback
and answered INTERNAL without internals, so no request can take the server down; a store that cannot
reach its database (`StoreUnavailable`) is answered UNAVAILABLE, which clients retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from trainctl.service.errors import ApiError
from trainctl.service.store import StoreUnavailable

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/trainctl.v1.TrainingService/"


class RpcObserver(Protocol):
    """Receives (method, status code name, seconds) per finished RPC (ServiceMetrics.observe_rpc)."""

    def observe_rpc(self, method: str, code: str, seconds: float) -> None: ...


def _wrap(handler: grpc.RpcMethodHandler | None, details: grpc.HandlerCallDetails,
          unary: Callable[[Callable, str], Callable], stream: Callable[[Callable, str], Callable]) -> grpc.RpcMethodHandler | None:
    """`handler` with its unary-request behaviour wrapped, for TrainingService methods only."""
    method = details.method
    if handler is None or not method.startswith(SERVICE_PREFIX) or handler.request_streaming:
        return handler  # the API has no client-streaming methods
    name = method.removeprefix(SERVICE_PREFIX)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            stream(handler.unary_stream, name),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        unary(handler.unary_unary, name),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps the servicer's exceptions to statuses (see the module docstring)."""

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        return _wrap(continuation(handler_call_details), handler_call_details, self._unary, self._stream)

    @staticmethod
    def _unary(behavior: Callable, name: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return behavior(request, context)
            except ApiError as exc:
                context.abort_with_status(exc.to_status())
            except StoreUnavailable as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except Exception:
                log.exception("%s failed", name)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log")

        return wrapped

    @staticmethod
    def _stream(behavior: Callable, name: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from behavior(request, context)
            except ApiError as exc:
                context.abort_with_status(exc.to_status())
            except StoreUnavailable as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except GeneratorExit:  # the client went away
                raise
            except Exception:
                log.exception("%s failed", name)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log")

        return wrapped


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Records every TrainingService call's method, final status code and duration (see the module docstring)."""

    def __init__(self, observer: RpcObserver):
        self._observer = observer

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        return _wrap(continuation(handler_call_details), handler_call_details, self._unary, self._stream)

    def _observe(self, name: str, context: grpc.ServicerContext, started: float, failed: bool) -> None:
        code = context.code() or (grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
        self._observer.observe_rpc(name, code.name, time.perf_counter() - started)

    def _unary(self, behavior: Callable, name: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                response = behavior(request, context)
            except BaseException:
                self._observe(name, context, started, failed=True)
                raise
            self._observe(name, context, started, failed=False)
            return response

        return wrapped

    def _stream(self, behavior: Callable, name: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.perf_counter()
            try:
                yield from behavior(request, context)
            except GeneratorExit:  # the client went away
                self._observer.observe_rpc(name, grpc.StatusCode.CANCELLED.name, time.perf_counter() - started)
                raise
            except BaseException:
                self._observe(name, context, started, failed=True)
                raise
            self._observe(name, context, started, failed=False)

        return wrapped
