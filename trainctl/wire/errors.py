"""API errors as google.rpc.Status (DESIGN.md decision 9).

Servicer code raises `ApiError`; the server's call chain (trainctl.service.api.rpc_calls) turns it into the
call's status with its details. INVALID_ARGUMENT carries a google.rpc.BadRequest whose field
violations name dotted spec paths, so every client (CLI, other languages) can point at the field.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from trainctl.spec.validate import FieldViolation


class ApiError(Exception):
    """An error the API returns to the client as a google.rpc.Status."""

    def __init__(self, code: grpc.StatusCode, message: str, violations: Iterable[FieldViolation] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = list(violations)

    def to_status(self) -> grpc.Status:
        """The grpc.Status (code, message and the google.rpc details trailer) for this error."""
        status = status_pb2.Status(code=_RPC_CODES[self.code], message=self.message)
        if self.violations:
            detail = any_pb2.Any()
            detail.Pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                        for v in self.violations
                    ]
                )
            )
            status.details.append(detail)
        return rpc_status.to_status(status)


def invalid_argument(violations: list[FieldViolation], message: str | None = None) -> ApiError:
    """INVALID_ARGUMENT naming every offending field."""
    text = message or "invalid job: " + "; ".join(str(v) for v in violations)
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, text, violations)


def bad_field(field: str, description: str) -> ApiError:
    """INVALID_ARGUMENT for one request field."""
    return invalid_argument([FieldViolation(field, description)], f"{field}: {description}")


def not_found(what: str) -> ApiError:
    return ApiError(grpc.StatusCode.NOT_FOUND, f"{what} not found")


def failed_precondition(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.FAILED_PRECONDITION, message)



def reused_request_id(created: str) -> ApiError:
    """INVALID_ARGUMENT naming request_id: it came again with another request than the one that
    created `created` (a retry must resend the same request; a new one needs a new id)."""
    return bad_field("request_id", f"already used for {created}, created by a different request; a new request needs a new request_id")


def service_stopping(what: str) -> ApiError:
    """UNAVAILABLE for a stream the service ends because it stops while `what` goes on: the client
    resumes it (on another replica), as after any broken connection."""
    return ApiError(grpc.StatusCode.UNAVAILABLE, f"the service is stopping; {what}")


def field_violations(error: grpc.RpcError) -> list[FieldViolation]:
    """Client side: the BadRequest field violations of a failed call (empty when it has none)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return []
    out = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            request = error_details_pb2.BadRequest()
            detail.Unpack(request)
            out.extend(FieldViolation(v.field, v.description) for v in request.field_violations)
    return out


_RPC_CODES = {code: getattr(code_pb2, code.name) for code in grpc.StatusCode}
