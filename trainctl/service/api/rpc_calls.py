"""The TrainingService's calls on the asyncio server (trainctl.service.api.rpc_server), one handler per method.

Each call goes through the same steps, in this order:

1. metrics: every call is counted by method and final status code, with its duration (streams: until
   closed), including the calls refused by a later step;
2. authentication: the bearer token of the call's metadata, before its payload is even decoded
   (UNAUTHENTICATED otherwise);
3. for server streams, the per-tenant cap on open streams (RESOURCE_EXHAUSTED);
4. decoding: bytes that are not the method's request message get INVALID_ARGUMENT naming it (gRPC
   would answer INTERNAL, and DESIGN.md decision 9 says no request yields an internal error);
5. the servicer's method (trainctl.service.api.servicer): a plain method in `servicer.BLOCKING`, and every plain
   method while the store's reads wait for its writes, on the server's thread pool; the other plain
   methods on the event loop itself (they only read and compute); coroutines (CreateJob) and streams
   (async generators) on the loop, handing their blocking parts to the pool themselves. A method may
   answer with its response message already serialized (ListJobs: `bytes`), which goes out as it is;
6. its exceptions as statuses: `ApiError` its own (with the google.rpc details), `StoreUnavailable`
   UNAVAILABLE (clients retry), anything else INTERNAL without internals, logged with its traceback.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from trainctl.service.api.servicer import TrainingServicer
from trainctl.service.security.auth import AuthenticationError, Authenticator
from trainctl.service.security.hardening import StreamLimiter, undecodable_details
from trainctl.service.security.tenancy import Principal
from trainctl.service.store import StoreUnavailable
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.errors import ApiError

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["TrainingService"]


class RpcObserver(Protocol):
    """Receives (method, status code name, seconds) per finished RPC (ServiceMetrics.observe_rpc)."""

    def observe_rpc(self, method: str, code: str, seconds: float) -> None: ...


class _Refusal(Exception):
    """A call answered with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()):
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


def _refusal(exc: Exception, method: str) -> _Refusal:
    """The status a servicer exception is answered with (module docstring, step 6)."""
    if isinstance(exc, _Refusal):
        return exc
    if isinstance(exc, ApiError):
        status = exc.to_status()
        return _Refusal(status.code, status.details, tuple(status.trailing_metadata))
    if isinstance(exc, StoreUnavailable):
        return _Refusal(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.error("%s failed", method, exc_info=exc)
    return _Refusal(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")


def _ended_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """How a call the server task was cancelled in ended: past its deadline, or cancelled by the client."""
    remaining = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED


def _serializer(response_class: type[Message]) -> Callable[[Message | bytes], bytes]:
    """The method's response serializer, passing an answer that is already serialized through."""
    serialize = response_class.SerializeToString

    def serialized(response: Message | bytes) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return serialized


class TrainingServiceCalls(grpc.GenericRpcHandler):
    """Serves every TrainingService method from `servicer` (module docstring); `observer` None: no metrics."""

    def __init__(
        self,
        servicer: TrainingServicer,
        authenticator: Authenticator,
        observer: RpcObserver | None,
        streams: StreamLimiter,
    ):
        self._servicer = servicer
        self._auth = authenticator
        self._observer = observer
        self._streams = streams
        self._handlers = {f"/{SERVICE.full_name}/{m.name}": self._handler(m) for m in SERVICE.methods}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._handlers.get(handler_call_details.method)

    def _handler(self, method: Any) -> grpc.RpcMethodHandler:
        request_class: type[Message] = getattr(pb, method.input_type.name)
        response_class: type[Message] = getattr(pb, method.output_type.name)
        behaviour = getattr(self._servicer, method.name)
        if method.server_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method.name, request_class, behaviour), response_serializer=_serializer(response_class)
            )
        if inspect.iscoroutinefunction(behaviour):
            run = "await"
        elif method.name in self._servicer.BLOCKING or not self._servicer.store.reads_are_local:
            run = "pool"
        else:
            run = "loop"
        return grpc.unary_unary_rpc_method_handler(
            self._unary(method.name, request_class, behaviour, run), response_serializer=_serializer(response_class)
        )

    # ---- the steps ---------------------------------------------------------------------------------
    def _observe(self, method: str, code: grpc.StatusCode, started: float) -> None:
        if self._observer is not None:
            self._observer.observe_rpc(method, code.name, time.perf_counter() - started)

    def _principal(self, method: str, context: grpc.aio.ServicerContext) -> Principal:
        try:
            principal = self._auth.authenticate(context.invocation_metadata())
        except AuthenticationError as exc:
            log.warning("refused /%s/%s: %s", SERVICE.full_name, method, exc)
            raise _Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        log.debug("/%s/%s called by %s (tenant %s, %s)", SERVICE.full_name, method, principal.name, principal.tenant, principal.role)
        return principal

    async def _answer_failure(self, name: str, exc: Exception, context: grpc.aio.ServicerContext, started: float) -> None:
        """Answer the call with the status of `exc` (step 6), counted; raises grpc's abort."""
        refusal = _refusal(exc, name)
        self._observe(name, refusal.code, started)
        await context.abort(refusal.code, refusal.details, refusal.trailing_metadata)

    @staticmethod
    def _decode(request_class: type[Message], data: bytes) -> Message:
        try:
            return request_class.FromString(data)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's bad bytes
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, undecodable_details(request_class.DESCRIPTOR.full_name, exc)) from None

    def _unary(self, name: str, request_class: type[Message], behaviour: Callable[[Any, Principal], Any],
               run: str) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
        """`run`: "loop" (call it on the loop), "pool" (on the thread pool) or "await" (a coroutine)."""
        async def call(data: bytes, context: grpc.aio.ServicerContext) -> Message:
            started = time.perf_counter()
            try:
                principal = self._principal(name, context)
                request = self._decode(request_class, data)
                if run == "loop":
                    response = behaviour(request, principal)
                elif run == "await":
                    response = await behaviour(request, principal)
                else:
                    response = await asyncio.get_running_loop().run_in_executor(None, behaviour, request, principal)
            except asyncio.CancelledError:
                self._observe(name, _ended_code(context), started)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is answered (step 6)
                await self._answer_failure(name, exc, context, started)
            self._observe(name, grpc.StatusCode.OK, started)
            return response

        return call

    def _stream(self, name: str, request_class: type[Message],
                behaviour: Callable[[Any, Principal], AsyncIterator[Message]]) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
        async def call(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            started = time.perf_counter()
            tenant = None
            try:
                principal = self._principal(name, context)
                if not self._streams.acquire(principal.tenant):
                    raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                        f"{principal.tenant!r} already holds {self._streams.max_per_key} open streams "
                        "(the most per tenant); close one and retry"
                    ))
                tenant = principal.tenant
                request = self._decode(request_class, data)
                async for item in behaviour(request, principal):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):  # cancelled, past its deadline, or the client left
                self._observe(name, _ended_code(context), started)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is answered (step 6)
                await self._answer_failure(name, exc, context, started)
            else:
                self._observe(name, grpc.StatusCode.OK, started)
            finally:
                if tenant is not None:
                    self._streams.release(tenant)

        return call
