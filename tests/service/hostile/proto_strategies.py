"""Hypothesis strategies for proto messages built from their descriptors: a random subset of the fields
set to random values (int64 extremes, NaN, unknown enum numbers, the caller's strings), so new fields are
covered as the API grows. Shared by the hostile-request tests."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

MAX_DEPTH = 4

INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def scalar(field: FieldDescriptor, strings: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in INT_RANGES:
        low, high = INT_RANGES[kind]
        return st.one_of(st.integers(low, high), st.sampled_from([low, high, 0, 1, -1 if low < 0 else 2]), st.integers(-3, 70))
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return strings
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if kind == FieldDescriptor.TYPE_ENUM:
        known = st.sampled_from([v.number for v in field.enum_type.values])
        return st.one_of(known, known, known, st.integers(-3, 50))
    raise AssertionError(f"unhandled field type {kind} of {field.full_name}")


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, strings: st.SearchStrategy[str], depth: int = 0) -> Any:
    """A message of `descriptor` with a random subset of its fields set to random values."""
    message = GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if is_message and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            target = getattr(message, field.name)
            for _ in range(draw(st.integers(0, 3))):
                key = draw(scalar(key_field, strings))
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    if depth < MAX_DEPTH:
                        target[key].CopyFrom(draw(messages(value_field.message_type, strings, depth + 1)))
                else:
                    target[key] = draw(scalar(value_field, strings))
        elif is_message:
            if depth >= MAX_DEPTH:
                continue
            if field.is_repeated:
                for _ in range(draw(st.integers(0, 2))):
                    getattr(message, field.name).add().CopyFrom(draw(messages(field.message_type, strings, depth + 1)))
            else:
                getattr(message, field.name).CopyFrom(draw(messages(field.message_type, strings, depth + 1)))
        elif field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(scalar(field, strings), max_size=3)))
        else:
            setattr(message, field.name, draw(scalar(field, strings)))
    return message
