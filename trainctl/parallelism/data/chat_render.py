"""A tokenizer's chat template rendered under bounds: the size of what it makes, and time.

A chat template is code from the tokenizer's files, which the job's submitter chose: ``{{ m.content *
100000000 }}`` would take gigabytes of host memory. The template is rendered as transformers renders it
(`apply_chat_template`: the same compiled configuration, its `{% generation %}` tracking, `tojson`,
`raise_exception`, ...; the same variables), but compiled in `BoundedEnvironment`, a subclass of the
immutable sandbox jinja2 and transformers use, whose hooks check every value against the rendering's
limit before it is made where they can, and after otherwise:

- the operators that make large values (``*``, ``+``, ``%``, ``**``) are intercepted (jinja2's
  ``intercepted_binops``) and refused before computing a result over the limit;
- every call (methods, globals, macros) and filter: arguments over the limit are refused, the expanding
  ones (``replace``, ``center``/``ljust``/``rjust``/``zfill``, ``expandtabs``, ``join``, ``format`` and
  ``%`` widths, the ``indent`` filter) are refused when their result would be over it, every result is
  checked;
- every attribute or item read (``ns.x``, ``m['content']``) is checked, which bounds a value grown in a
  namespace with ``~``; block and macro bodies (``concat``) and the output (streamed) are checked;
- the clock is checked at each of these; ``lipsum`` is not there.

The limit of one rendering is `BASE_CHARS` (1 Mi characters) plus `CONTENT_FACTOR` times the characters
of the conversation's strings: a real rendering is the conversation once plus per-message headers and a
preamble (a system prompt, tool schemas), so this fits every real template and a record of any size,
and still stops an expansion at a few MiB. The renderings of one conversation (the prefix method renders
it several times) share `SECONDS`; real templates take milliseconds. A template past either is a
`TemplateLimitExceeded` (a configuration error: the job fails at once). Where no hook runs (a ``~`` in a
buffered loop body, a loop over a long string that calls nothing) values can still grow or time pass: the
rank's host-memory limit (trainctl.workers.host_memory) and the job's step timeouts are the backstop.
"""

from __future__ import annotations

import functools
import inspect
import re
import string
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment, Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainctl.parallelism.errors import ConfigurationError

BASE_CHARS = 2**20
CONTENT_FACTOR = 4
SECONDS = 10.0
COMPILED_TEMPLATES = 16
"""Bounded templates kept compiled (a job uses one; tests use a few)."""
PERCENT_WIDTH = re.compile(r"%[#0\- +]*(\d+)?(?:\.(\d+))?")
STR_EXPANDERS = frozenset({"replace", "ljust", "rjust", "center", "zfill", "expandtabs", "join", "format", "format_map"})
"""str methods whose result can be far longer than their receiver and arguments."""


class TemplateLimitExceeded(ConfigurationError):
    """A chat template's rendering went past its size or time limit (names the limit)."""


@dataclass
class RenderBudget:
    """The limits of one conversation's renderings: characters per value and per rendering, and a deadline."""

    chars: int
    seconds: float
    where: str
    """The record (file and line), for errors."""
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def tick(self) -> None:
        """TemplateLimitExceeded once the deadline has passed."""
        if time.monotonic() > self.deadline:
            raise TemplateLimitExceeded(
                f"spec.data.tokenizer: {self.where}: the chat template ran past its time limit of {self.seconds:g} s "
                "for one conversation"
            )

    def allow(self, size: int, what: str) -> None:
        """TemplateLimitExceeded when ``size`` (characters, items) is over the limit."""
        if size > self.chars:
            raise TemplateLimitExceeded(
                f"spec.data.tokenizer: {self.where}: the chat template's {what} would make {size:,} characters, over "
                f"its limit of {self.chars:,} per rendering ({BASE_CHARS:,} plus {CONTENT_FACTOR} x the conversation's "
                f"{(self.chars - BASE_CHARS) // CONTENT_FACTOR:,} characters)"
            )

    def checked(self, value: Any, what: str) -> Any:
        """``value``, once its size is within the limit."""
        self.allow(_size(value), what)
        return value


_BUDGET: ContextVar[RenderBudget] = ContextVar("chat_template_budget")
"""The budget of the rendering running in this thread (set by `render`), read by the environment's hooks."""


def conversation_budget(messages: Iterable[Any], where: str) -> RenderBudget:
    """The budget of a conversation's renderings: `BASE_CHARS` + `CONTENT_FACTOR` x its characters, `SECONDS`."""
    return RenderBudget(BASE_CHARS + CONTENT_FACTOR * _text_chars(messages), SECONDS, where)


def render(
    hf_tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    generation_prompt: bool,
    budget: RenderBudget,
    generation_spans: list[tuple[int, int]] | None = None,
) -> str:
    """The tokenizer's chat template rendered over ``messages`` as `apply_chat_template` renders it, within
    ``budget``; with ``generation_spans`` given, the character spans of its `{% generation %}` blocks
    are appended to it."""
    from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data

    template = _bounded_template(hf_tokenizer.get_chat_template())
    conversation = [{key: value for key, value in m.items() if value is not None} for m in messages]
    variables = {
        "messages": _alias_reasoning_fields(_plain_template_data(conversation)),
        "tools": None,
        "documents": None,
        "add_generation_prompt": generation_prompt,
        **_plain_template_data(dict(hf_tokenizer.special_tokens_map)),
    }
    token = _BUDGET.set(budget)
    try:
        parts: list[str] = []
        if generation_spans is None:
            _stream(template, variables, parts, budget)
        else:
            with template.environment.activate_tracker(parts, generation_spans):  # type: ignore[attr-defined]
                _stream(template, variables, parts, budget)
        return "".join(parts)
    finally:
        _BUDGET.reset(token)


def _stream(template: Template, variables: dict[str, Any], parts: list[str], budget: RenderBudget) -> None:
    size = 0
    for chunk in template.generate(**variables):
        size += len(chunk)
        budget.tick()
        budget.allow(size, "output")
        parts.append(chunk)


@functools.lru_cache(maxsize=COMPILED_TEMPLATES)
def _bounded_template(source: str) -> Template:
    """``source`` compiled in a `BoundedEnvironment` configured as transformers configures its own (read
    from transformers' compilation of an empty template: compiling ``source`` in an environment that does
    not intercept operators would fold its constant expressions, ``{{ 'x' * 10**9 }}``, at compile time).
    No budget is set while compiling, so no filter is folded at compile time either: each runs under the hooks."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return BoundedEnvironment(_compile_jinja_template("").environment).from_string(source)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (``base``: its extensions, filters, tests and globals),
    with every value checked against the budget of the rendering in progress (`render`)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, base: Environment) -> None:
        super().__init__(
            trim_blocks=base.trim_blocks,
            lstrip_blocks=base.lstrip_blocks,
            keep_trailing_newline=base.keep_trailing_newline,
            extensions=[type(extension) for extension in base.extensions.values()],
        )
        self.filters.update({name: _bounded_filter(name, f) for name, f in base.filters.items()})
        self.tests.update(base.tests)
        self.globals.update(base.globals)
        self.globals.pop("lipsum", None)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        budget.tick()
        budget.allow(_binop_size(operator, left, right), f"`{operator}`")
        return budget.checked(super().call_binop(context, operator, left, right), f"`{operator}`")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's signature
        budget = _BUDGET.get()
        budget.tick()
        name = f"call of {getattr(__obj, '__name__', type(__obj).__name__)}"
        for value in (*args, *kwargs.values()):
            budget.allow(_size(value), f"argument to a {name}")
        receiver = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # str.format comes wrapped
        if isinstance(receiver, str) and getattr(__obj, "__name__", "") in STR_EXPANDERS:
            budget.allow(_str_method_size(__obj.__name__, receiver, args, kwargs), name)
        return budget.checked(super().call(__context, __obj, *args, **kwargs), f"result of a {name}")

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = _BUDGET.get()
        budget.tick()
        return budget.checked(super().getattr(obj, attribute), f"value of .{attribute}")

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _BUDGET.get()
        budget.tick()
        return budget.checked(super().getitem(obj, argument), "item")

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override] - a block or macro body
        budget = _BUDGET.get()
        budget.tick()
        pieces = list(parts)
        budget.allow(sum(len(piece) for piece in pieces), "block")
        return "".join(pieces)


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (the filter ``name``) with its arguments, its expected size and its result checked."""
    signature = inspect.signature(function)

    @functools.wraps(function)  # keeps jinja2's pass_context / pass_eval_context mark
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        budget.tick()
        what = f"`{name}` filter"
        for value in (*args, *kwargs.values()):
            budget.allow(_size(value), f"argument to the {what}")
        budget.allow(_filter_size(name, signature, args, kwargs), what)
        return budget.checked(function(*args, **kwargs), f"result of the {what}")

    return bounded


def _size(value: Any) -> int:
    """Characters (or items) of a value; bytes of an integer; 0 for anything else."""
    if isinstance(value, str | bytes | list | tuple | dict | set | frozenset):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 8
    return 0


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """The size of ``left operator right`` (an upper bound), computed without computing it."""
    sequence = (str, bytes, list, tuple)
    integer = isinstance(left, int) and isinstance(right, int)
    if operator == "*":
        if isinstance(left, sequence) and isinstance(right, int):
            return len(left) * max(right, 0)
        if isinstance(right, sequence) and isinstance(left, int):
            return len(right) * max(left, 0)
        return (_size(left) + _size(right)) if integer else 0
    if operator == "+":
        return _size(left) + _size(right)
    if operator == "**":
        return (left.bit_length() * max(right, 0)) // 8 if integer else 0
    if operator == "%" and isinstance(left, str):
        values = right if isinstance(right, tuple) else (right,)
        return len(left) + _percent_widths(left) + sum(_size(v) for v in values)
    return 0


def _percent_widths(text: str) -> int:
    """The widths and precisions of the ``%`` conversions of ``text``, summed (``%*d`` counts 0: its width is
    an argument, checked as one)."""
    return sum(int(group) for match in PERCENT_WIDTH.finditer(text) for group in match.groups() if group)


def _format_widths(text: str) -> int:
    """The widths and precisions in the replacement fields of a ``str.format`` string, summed."""
    try:
        fields = list(string.Formatter().parse(text))
    except ValueError:  # not a format string: format itself will say so
        return 0
    return sum(int(run) for _, _, spec, _ in fields if spec for run in re.findall(r"\d+", spec))


def _str_method_size(name: str, receiver: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The length of ``receiver.name(*args)`` for the `STR_EXPANDERS` (an upper bound), without calling it."""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return _replaced_size(receiver, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        return max(len(receiver), args[0])
    if name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        return len(receiver) + receiver.count("\t") * max(tabsize, 0) if isinstance(tabsize, int) else 0
    if name == "join" and args and isinstance(args[0], list | tuple):
        return sum(_size(item) for item in args[0]) + len(receiver) * max(len(args[0]) - 1, 0)
    if name in ("format", "format_map"):
        values = [*args, *kwargs.values()]
        if name == "format_map" and args and isinstance(args[0], dict):
            values = list(args[0].values())
        return len(receiver) + _format_widths(receiver) + sum(_size(v) for v in values)
    return 0


def _replaced_size(text: str, old: str, new: str, count: Any) -> int:
    occurrences = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * max(len(new) - len(old), 0)


def _filter_size(name: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The size of the expanding filters' results (center, indent, replace, format, join), before calling them."""
    if name not in ("center", "indent", "replace", "format", "join"):
        return 0
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # the filter itself will say what is wrong
        return 0
    bound.apply_defaults()
    given = bound.arguments
    if name == "center" and isinstance(given["width"], int):
        return max(_size(given["value"]), given["width"])
    if name == "indent" and isinstance(given["s"], str):
        width = given["width"]
        per_line = width if isinstance(width, int) else _size(width)
        return len(given["s"]) + (given["s"].count("\n") + 1) * max(per_line, 0)
    if name == "replace" and all(isinstance(given[key], str) for key in ("s", "old", "new")):
        return _replaced_size(given["s"], given["old"], given["new"], given["count"])
    if name == "format" and isinstance(given["value"], str):
        return len(given["value"]) + _percent_widths(given["value"]) + sum(_size(v) for v in given["args"])
    if name == "join" and isinstance(given["value"], list | tuple):
        items = given["value"]
        return sum(_size(item) for item in items) + _size(given["d"]) * max(len(items) - 1, 0)
    return 0


def _text_chars(value: Any) -> int:
    """Characters of every string in a conversation (keys and values, nested), without recursion."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
