"""The pydantic TrainingJob <-> the typed proto `Job`, lossless both ways.

Field names are the same on both sides (`apiVersion` is `api_version` in the proto), so the walk is
driven by the pydantic models; the few shapes proto3 cannot say directly have one rule each:

- scalars are proto `optional`: unset means "the spec's default", and pydantic -> proto sets every one;
- string `Literal`s are enums named `<ENUM>_<VALUE>` (`"1f1b"` -> `PIPELINE_SCHEDULE_1F1B`);
  the zero value (UNSPECIFIED) means the default;
- `data.paths` is a `StringList` message, so an explicitly empty list differs from "unset";
- `data.max_files: None` ("read every file") is the oneof member `all_files: true`;
- `training.micro_batch_size: auto` is the oneof member `micro_batch_auto: true`.

proto -> pydantic builds the mapping of the fields that are present and validates it with the spec's
own model, so a bad value raises SpecError naming the same dotted path the YAML would.
"""

from __future__ import annotations

import hashlib
import typing
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from pydantic import BaseModel

from trainctl.spec.job import JobSpecBody, TrainingJob
from trainctl.spec.validate import FieldViolation, SpecError, parse_object
from trainctl.v1 import training_pb2 as pb

_INT64 = (-(2**63), 2**63 - 1)
_RENAMES = {"apiVersion": "api_version"}


def job_to_proto(job: TrainingJob, out: pb.Job | None = None) -> pb.Job:
    """Fill (a new or the given) proto Job's api_version, kind, metadata and spec from `job`.

    Raises SpecError when a value has no proto form (an integer beyond int64)."""
    message = out if out is not None else pb.Job()
    _model_to_message(job, message, "")
    return message


def job_from_proto(message: pb.Job) -> TrainingJob:
    """The TrainingJob a proto Job describes; SpecError names every bad field."""
    document = _message_to_dict(message, TrainingJob, "")
    return parse_object(document)


def spec_body_to_proto(body: JobSpecBody, out: pb.JobSpec, path: str) -> None:
    """Fill a proto JobSpec from a job's `spec` (a Sweep's template); `path` prefixes SpecError's fields."""
    _model_to_message(body, out, path)


def spec_body_document(message: pb.JobSpec, path: str) -> dict[str, Any]:
    """The mapping a proto JobSpec describes (unvalidated; the caller validates the enclosing document)."""
    return _message_to_dict(message, JobSpecBody, path)


def timestamp(target: Any, value: float | None) -> None:
    """Set a google.protobuf.Timestamp from epoch seconds; None leaves it unset."""
    if value is not None:
        target.FromNanoseconds(int(value * 1e9))


# ---- pydantic -> proto ------------------------------------------------------------------------------


def _model_to_message(model: BaseModel, message: Message, path: str) -> None:
    descriptor = message.DESCRIPTOR
    for name in type(model).model_fields:
        value = getattr(model, name)
        field_path = f"{path}{name}"
        proto_name = _RENAMES.get(name, name)
        if name == "max_files":
            if value is None:
                message.all_files = True
            else:
                message.max_files = _int64(value, field_path)
            continue
        if name == "micro_batch_size" and value == "auto":
            message.micro_batch_auto = True
            continue
        field = descriptor.fields_by_name[proto_name]
        if value is None:
            continue
        if isinstance(value, BaseModel):
            _model_to_message(value, getattr(message, proto_name), field_path + ".")
        elif field.message_type is not None and field.message_type.name == "StringList":
            getattr(message, proto_name).values.extend(value)
            getattr(message, proto_name).SetInParent()
        elif _is_map(field):
            getattr(message, proto_name).update(value)
        elif field.enum_type is not None:
            setattr(message, proto_name, field.enum_type.values_by_name[_enum_name(field, value)].number)
        elif field.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_INT32):
            setattr(message, proto_name, _int64(value, field_path))
        else:
            setattr(message, proto_name, value)


def _int64(value: int, path: str) -> int:
    if not _INT64[0] <= value <= _INT64[1]:
        raise SpecError([FieldViolation(path, f"{value} does not fit a 64-bit integer")])
    return value


def _enum_prefix(field: FieldDescriptor) -> str:
    """The enum's value prefix: PIPELINE_SCHEDULE_ from its zero value PIPELINE_SCHEDULE_UNSPECIFIED."""
    return field.enum_type.values_by_number[0].name.removesuffix("UNSPECIFIED")


def _enum_name(field: FieldDescriptor, value: str) -> str:
    return _enum_prefix(field) + str(value).upper()


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


# ---- proto -> pydantic ------------------------------------------------------------------------------


def _message_to_dict(message: Message, model: type[BaseModel], path: str) -> dict[str, Any]:
    """The fields present in `message`, keyed by the pydantic names of `model`."""
    descriptor = message.DESCRIPTOR
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        proto_name = _RENAMES.get(name, name)
        field_path = f"{path}{name}"
        if name == "max_files":
            which = message.WhichOneof("file_limit")
            if which == "all_files" and message.all_files:
                out[name] = None
            elif which == "max_files":
                out[name] = message.max_files
            continue
        if name == "micro_batch_size":
            which = message.WhichOneof("micro_batch")
            if which == "micro_batch_auto" and message.micro_batch_auto:
                out[name] = "auto"
            elif which == "micro_batch_size":
                out[name] = message.micro_batch_size
            continue
        field = descriptor.fields_by_name[proto_name]
        if _is_map(field):
            if name == "labels" or len(getattr(message, proto_name)):
                out[name] = dict(getattr(message, proto_name))
            continue
        if field.message_type is not None:
            if not message.HasField(proto_name):
                continue
            sub = getattr(message, proto_name)
            if field.message_type.name == "StringList":
                out[name] = list(sub.values)
            else:
                out[name] = _message_to_dict(sub, _submodel(info.annotation), field_path + ".")
        elif field.enum_type is not None:
            number = getattr(message, proto_name)
            if number == 0:
                continue
            value = field.enum_type.values_by_number.get(number)
            if value is None:
                raise SpecError([FieldViolation(field_path, f"unknown {field.enum_type.name} value {number}")])
            literal = value.name.removeprefix(_enum_prefix(field)).lower()
            out[name] = literal
        elif field.has_presence:
            if message.HasField(proto_name):
                out[name] = getattr(message, proto_name)
        else:  # proto3 implicit presence (metadata.name, api_version, kind): empty means unset
            value = getattr(message, proto_name)
            if value != field.default_value or name == "name":
                out[name] = value
    return out


def _submodel(annotation: Any) -> type[BaseModel]:
    """The BaseModel class inside `X` or `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise TypeError(f"no model in {annotation!r}")


def request_digest(message: Message) -> str:
    """What identifies a create request's content (a job, a sweep): the SHA-256 of the message,
    serialized deterministically, so a retry of the same request has the same digest."""
    return hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()
