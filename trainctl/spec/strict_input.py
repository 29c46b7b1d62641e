"""What a spec field accepts as written: no coercion between booleans, numbers and text, and no text the
store cannot hold.

pydantic's lax mode reads `steps: true` as 1, `lr: "1e-3"` as 0.001 and `compile: "yes"` as True; its
strict mode refuses those, but also what a YAML or proto document can only give as text or lists
(enums, tuples) and a float with no fraction for an integer. The rule here sits between them, as in
Kubernetes and JSON Schema: a value is accepted only where its kind is one the field's type names:

- a boolean where the type names `bool` (or a boolean literal);
- a number (int or float) where it names `int`, `float` or a numeric literal; an int is a valid float,
  and a float with no fraction a valid int, exactly as pydantic checks;
- a string where it names `str` or that string as a literal (`micro_batch_size: "3"` is refused, `auto`
  accepted);
- a field with no scalar type (a section, a list, a map) gets pydantic's own error for a scalar.

Lists and maps are walked item by item with their item type; a section's fields are checked by its own
model. Every string met on the way, map keys included, must be storable (trainctl.spec.text). Each
problem is a pydantic error at the offending item's location, so `violations_from_pydantic` names it like
any other (`spec.command.args[0]`, `spec.command.env.LR`). `StrictModel` (trainctl.spec.strict_model) applies
`input_errors` to every field of every spec model before pydantic validates it.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic_core import InitErrorDetails, PydanticCustomError

from trainctl.spec.text import unstorable_problem

_SCALARS = (bool, int, float, str)
_KINDS = {bool: bool, int: int, float: int, str: str}
"""The kind of value each scalar type takes as it is (int: any number)."""
_KIND_NAMES = {bool: "a boolean", int: "a number", str: "a string"}
_EXPECTED = {bool: "a valid boolean", int: "a valid integer", float: "a valid number", str: "a valid string"}
_ERROR_TYPES = {bool: "bool_type", int: "int_type", float: "float_type", str: "string_type"}


def input_errors(members: tuple[Any, ...], value: Any) -> list[InitErrorDetails]:
    """The problems of `value` as input of a field whose type has `members` (`type_members`); empty: none.
    Locations are relative to the field."""
    out: list[InitErrorDetails] = []
    _check(members, value, (), out)
    return out


def type_members(annotation: Any) -> tuple[Any, ...]:
    """The types a value of `annotation` may have: unions flattened, Annotated unwrapped, None left out."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return type_members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return tuple(member for arg in get_args(annotation) for member in type_members(arg))
    return () if annotation is type(None) else (annotation,)


def _kind(value: Any) -> type:
    """bool, int (any number) or str: what a scalar is, as far as coercion goes."""
    if isinstance(value, bool):
        return bool
    return int if isinstance(value, int | float) else str


def _check(members: tuple[Any, ...], value: Any, loc: tuple[str | int, ...], out: list[InitErrorDetails]) -> None:
    if isinstance(value, str) and (problem := unstorable_problem(value)):
        out.append(_error("string_unstorable", problem, loc, value))
    elif isinstance(value, _SCALARS):
        problem = _scalar_problem(members, value)
        if problem is not None:
            out.append(_error(*problem, loc, value))
    elif isinstance(value, list | tuple):
        item_types = _container_args(members, (list, tuple, set, frozenset))
        if item_types is None:
            return  # a type that takes no list: pydantic says so
        for index, item in enumerate(value):
            _check(type_members(_item_type(item_types, index)), item, (*loc, index), out)
    elif isinstance(value, dict):
        map_types = _container_args(members, (dict,))
        if map_types is None:
            return  # a section (its model checks its own fields) or a type that takes no mapping
        key_type, value_type = map_types or (Any, Any)
        for key, item in value.items():
            if isinstance(key, str) and (problem := unstorable_problem(key)):
                out.append(_error("string_unstorable", f"the key {problem}", (*loc, key), key))
            elif key_type is not Any and (key_problem := _scalar_problem(type_members(key_type), key)) is not None:
                out.append(_error(key_problem[0], f"the key: {key_problem[1]}", (*loc, str(key)), key))
            _check(type_members(value_type), item, (*loc, str(key)), out)


def _container_args(members: tuple[Any, ...], origins: tuple[type, ...]) -> tuple[Any, ...] | None:
    """The type arguments of the first member that is one of `origins` (() for Any), or None: no member
    takes such a container."""
    for member in members:
        if member is Any or member is object:
            return ()
        if get_origin(member) in origins:
            return get_args(member)
    return None


def _item_type(args: tuple[Any, ...], index: int) -> Any:
    """The type of item `index` of a sequence typed with `args` (list[X], tuple[X, ...], tuple[X, Y])."""
    if len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis):
        return args[0]
    return args[index] if index < len(args) else Any  # () (Any): any item


def _scalar_problem(members: tuple[Any, ...], value: Any) -> tuple[str, str] | None:
    """(error type, message) when no member type takes `value` as it is, or None."""
    if not isinstance(value, _SCALARS):
        return None
    kind = _kind(value)
    expected: list[str] = []
    literals: list[Any] = []
    error_type = ""
    for member in members:
        if member is Any or member is object:
            return None
        if get_origin(member) is Literal:
            for literal in get_args(member):
                if _kind(literal) is kind and literal == value:
                    return None
                literals.append(literal)
            error_type = error_type or "literal_error"
        elif member in _SCALARS:
            if _KINDS[member] is kind:
                return None
            if not (member is int and float in members):  # "a valid number" says it
                expected.append(_EXPECTED[member])
            error_type = error_type or _ERROR_TYPES[member]
    if not error_type:
        return None  # no scalar type: pydantic names what the field takes
    if literals:
        shown = [repr(v) if isinstance(v, str) else str(v) for v in literals]
        expected.append(shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}")
    return error_type, f"Input should be {' or '.join(dict.fromkeys(expected))}, got {_KIND_NAMES[kind]}"


def _error(error_type: str, message: str, loc: tuple[str | int, ...], value: Any) -> InitErrorDetails:
    """One pydantic error (its message is used as it is: a template without context is not formatted)."""
    return InitErrorDetails(type=PydanticCustomError(error_type, message), loc=loc, input=value)
