"""The pydantic Sweep <-> the proto `Sweep`, and a stored sweep as the API's answer.

The template is a JobSpec converted by trainctl.wire.convert's rules; parameters, objective and
early stopping are converted here field by field (string literals are enums `<ENUM>_<VALUE>`, a value
of the search space is a `SweepValue` oneof so ints, floats, strings and booleans survive the wire).
proto -> pydantic validates with the Sweep model, so a bad value raises SpecError naming the path.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from trainctl.spec.sweep import Sweep, parse_sweep_object
from trainctl.spec.validate import FieldViolation, SpecError
from trainctl.v1 import training_pb2 as pb
from trainctl.wire.convert import spec_body_document, spec_body_to_proto

_OPTIONAL_SCALARS = {
    "SweepSpec": ("trials", "parallel_trials", "startup_trials", "seed"),
    "SweepObjective": ("metric", "step"),
    "EarlyStopping": ("min_steps", "startup_trials", "reduction_factor"),
}
_ENUMS = {  # (message, field) -> the enum's value prefix
    ("SweepParameter", "type"): "PARAMETER_TYPE_",
    ("SweepObjective", "direction"): "OBJECTIVE_DIRECTION_",
    ("SweepSpec", "algorithm"): "SWEEP_ALGORITHM_",
    ("EarlyStopping", "rule"): "EARLY_STOPPING_RULE_",
}


def value_to_proto(value: Any, out: pb.SweepValue) -> pb.SweepValue:
    """One search-space value as a SweepValue (bool before int: a bool is an int in Python)."""
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.float_value = value
    else:
        out.string_value = str(value)
    return out


def value_from_proto(message: pb.SweepValue) -> Any:
    """The Python value a SweepValue holds (None when unset)."""
    which = message.WhichOneof("value")
    return getattr(message, which) if which else None


def sweep_to_proto(sweep: Sweep, out: pb.Sweep | None = None) -> pb.Sweep:
    """Fill (a new or the given) proto Sweep's api_version, kind, metadata and spec from `sweep`."""
    message = out if out is not None else pb.Sweep()
    message.api_version, message.kind = sweep.apiVersion, sweep.kind
    message.metadata.name = sweep.metadata.name
    message.metadata.labels.update(sweep.metadata.labels)
    spec, target = sweep.spec, message.spec
    spec_body_to_proto(spec.template, target.template, "spec.template.")
    target.template.SetInParent()
    for parameter in spec.parameters:
        item = target.parameters.add(path=parameter.path, log=parameter.log)
        _set_enum(item, "type", parameter.type)
        for bound in ("low", "high"):
            if getattr(parameter, bound) is not None:
                value_to_proto(getattr(parameter, bound), getattr(item, bound))
        for value in parameter.values or ():
            value_to_proto(value, item.values.add())
    for name in _OPTIONAL_SCALARS["SweepSpec"]:
        setattr(target, name, getattr(spec, name))
    _set_enum(target, "algorithm", spec.algorithm)
    objective = spec.objective
    target.objective.metric = objective.metric
    _set_enum(target.objective, "direction", objective.direction)
    if objective.step is not None:
        target.objective.step = objective.step
    stopping = spec.early_stopping
    _set_enum(target.early_stopping, "rule", stopping.rule)
    for name in _OPTIONAL_SCALARS["EarlyStopping"]:
        setattr(target.early_stopping, name, getattr(stopping, name))
    return message


def sweep_from_proto(message: pb.Sweep) -> Sweep:
    """The Sweep a proto Sweep describes; SpecError names every bad field."""
    document: dict[str, Any] = {"metadata": {"name": message.metadata.name, "labels": dict(message.metadata.labels)}}
    if message.api_version:
        document["apiVersion"] = message.api_version
    if message.kind:
        document["kind"] = message.kind
    spec, source = {}, message.spec
    if source.HasField("template"):
        spec["template"] = spec_body_document(source.template, "spec.template.")
    spec["parameters"] = []
    for i, item in enumerate(source.parameters):
        parameter: dict[str, Any] = {"path": item.path}
        parameter.update(_enums(item, f"spec.parameters[{i}]."))
        for bound in ("low", "high"):
            if item.HasField(bound):
                parameter[bound] = value_from_proto(getattr(item, bound))
        if item.HasField("log"):
            parameter["log"] = item.log
        if item.values:
            parameter["values"] = [value_from_proto(v) for v in item.values]
        spec["parameters"].append(parameter)
    spec.update(_scalars(source) | _enums(source, "spec."))
    for name in ("objective", "early_stopping"):
        if source.HasField(name):
            sub = getattr(source, name)
            spec[name] = _scalars(sub) | _enums(sub, f"spec.{name}.")
    document["spec"] = spec
    return parse_sweep_object(document)


def _set_enum(message: Message, name: str, value: str) -> None:
    prefix = _ENUMS[(type(message).DESCRIPTOR.name, name)]
    field = message.DESCRIPTOR.fields_by_name[name]
    setattr(message, name, field.enum_type.values_by_name[prefix + value.upper()].number)


def _enums(message: Message, path: str) -> dict[str, str]:
    out = {}
    for (kind, name), prefix in _ENUMS.items():
        if kind != message.DESCRIPTOR.name or getattr(message, name) == 0:
            continue
        value = message.DESCRIPTOR.fields_by_name[name].enum_type.values_by_number.get(getattr(message, name))
        if value is None:
            raise SpecError([FieldViolation(path + name, f"unknown value {getattr(message, name)}")])
        out[name] = value.name.removeprefix(prefix).lower()
    return out


def _scalars(message: Message) -> dict[str, Any]:
    names = _OPTIONAL_SCALARS[message.DESCRIPTOR.name]
    return {name: getattr(message, name) for name in names if message.HasField(name)}
