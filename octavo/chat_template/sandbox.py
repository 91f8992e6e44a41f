"""Rendering a chat template in jinja2's sandbox, under a budget of time, steps and size.

Templates come from model files and, with --trust-request-chat-template, from requests: untrusted
code, run in jinja2's immutable sandbox. What they may call is what transformers gives them
(utils/chat_template_utils.py in transformers 5.x): blocks trimmed and lstripped,
`break`/`continue`, a `{% generation %}` block (rendered as its body), `tojson` without HTML
escaping, `raise_exception`, `strftime_now`, `dict` and `namespace` without underscore names.
Inputs are rebuilt from plain JSON types; None-valued message keys are dropped and reasoning is
passed under each name templates read, as transformers does before rendering.

The sandbox alone bounds `range()` and nothing else: `'x' * 30000000` took a server from 831 MiB
to 6.6 GiB, and a loop of 10^10 steps that writes nothing held a thread for hours. So every render
here runs under a `RenderBudget`, checked while it renders, not after:
- steps: each loop iteration and each call a template makes counts one; past `max_steps`, or past
  the wall-clock `deadline_s` (read at every step), the render stops;
- size: the text written so far, and every string or list an operator (`*`, `+`, `%`, `~`), a
  method or a filter makes, at most `max_chars`; `*` and `**` are checked before they allocate, a
  method or filter given a number above `max_chars` (a width, a count) is refused before it runs.
A render past any bound raises `TemplateBudgetError` naming it. What no check here can bound (a
single C-level call that allocates before returning) is bounded by the worker process the server
renders in (isolated.py: a memory limit, and a kill at the deadline).
"""

from __future__ import annotations

import contextvars
import functools
import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_BIG_INT_BITS = 4096  # a number a template makes with * or ** stays below 2**4096


@dataclass(frozen=True, slots=True)
class RenderBudget:
    """What one render may spend. The defaults are far above what a real template needs (a
    1,000-message conversation with tools renders in ~10^4 steps, a few ms)."""

    deadline_s: float = 10.0
    max_steps: int = 2_000_000
    max_chars: int = 16 << 20

    def __post_init__(self) -> None:
        if not 0.01 <= self.deadline_s <= 3600:  # NaN fails too
            raise ValueError(f"--chat-template-timeout must be in [0.01, 3600] seconds, got {self.deadline_s}")
        if self.max_steps < 1 or self.max_chars < 1:
            raise ValueError("a render budget needs at least one step and one character")


class TemplateBudgetError(ValueError):
    """A render went past one of its budget's bounds (`bound`: "deadline", "steps", "size" or
    "memory"); the message names it and the limit."""

    def __init__(self, bound: str, message: str) -> None:
        super().__init__(message)
        self.bound = bound


class _Meter:
    """One render's spending against its budget."""

    __slots__ = ("budget", "steps", "deadline")

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.deadline = time.monotonic() + budget.deadline_s

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.budget.max_steps:
            raise TemplateBudgetError("steps", f"the chat template ran more than {self.budget.max_steps:,} loop steps "
                                               "and calls (its step bound)")
        if time.monotonic() > self.deadline:
            raise self.late()

    def late(self) -> TemplateBudgetError:
        return TemplateBudgetError("deadline", f"the chat template did not render within {self.budget.deadline_s:g} s "
                                               "(--chat-template-timeout)")

    def check_size(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, list, tuple, bytes)) and len(value) > self.budget.max_chars:
            raise self.too_big(what)
        return value

    def too_big(self, what: str) -> TemplateBudgetError:
        return TemplateBudgetError("size", f"the chat template made {what} longer than {self.budget.max_chars:,} "
                                           "characters (its size bound)")


_METER: contextvars.ContextVar[_Meter | None] = contextvars.ContextVar("octavo_template_meter", default=None)


def _meter() -> _Meter | None:
    return _METER.get()


def _size_of_product(left: Any, right: Any) -> int | None:
    """The length `left * right` would have, for a sequence times a count (None otherwise)."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            return len(seq) * max(count, 0)
    return None


def _bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_numbers(meter: _Meter, args: tuple, kwargs: dict, what: str) -> None:
    """A method or filter given a count or width above the size bound is refused before it runs
    ("x".ljust(10**9), center, zfill, indent, tojson's indent)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > meter.budget.max_chars:
            raise meter.too_big(what)


def compile_chat_template(source: str) -> Any:
    """`source` compiled in the sandbox; render it with `render_chat` (which meters it)."""
    import jinja2.ext

    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True,
                           extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _metered_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["octavo_steps"] = _steps
    env.filters["octavo_sized"] = _sized
    env.globals.update(_template_globals())
    return env.from_string(source)


@functools.cache
def _generation_extension() -> type:
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks an assistant's span for training masks;
        here it renders its body."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation


@functools.cache
def _sandbox_class() -> type:
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class MeteredSandbox(ImmutableSandboxedEnvironment):
        """The sandbox with every loop, call, operator and filter metered (see the module's text)."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for loop in list(tree.find_all(nodes.For)):  # each iteration of every loop is a step
                loop.iter = nodes.Filter(loop.iter, "octavo_steps", [], [], None, None, lineno=loop.lineno)
            for concat in list(tree.find_all(nodes.Concat)):  # `a ~ b`: its result's size is checked
                concat.nodes = [nodes.Filter(nodes.Concat(concat.nodes, lineno=concat.lineno), "octavo_sized",
                                             [], [], None, None, lineno=concat.lineno)]
            return tree

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            meter = _meter()
            if meter is not None:
                _check_operands(meter, operator, left, right)
            result = super().call_binop(context, operator, left, right)
            return result if meter is None else meter.check_size(result, f"a value with {operator}")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's)
            meter = _meter()
            if meter is None:
                return super().call(__context, __obj, *args, **kwargs)
            meter.step()
            if isinstance(getattr(__obj, "__self__", None), (str, list, tuple)):  # a method of a value
                _check_numbers(meter, args, kwargs, f"a string with .{getattr(__obj, '__name__', 'method')}()")
            return meter.check_size(super().call(__context, __obj, *args, **kwargs), "a value with a call")

    return MeteredSandbox


def _check_operands(meter: _Meter, operator: str, left: Any, right: Any) -> None:
    """`*` and `**` refused before they allocate past the size bound."""
    if operator == "*":
        size = _size_of_product(left, right)
        if size is not None and size > meter.budget.max_chars:
            raise meter.too_big("a string or list with *")
        if _bits(left) + _bits(right) > _BIG_INT_BITS:
            raise meter.too_big("a number with *")
    elif operator == "**" and isinstance(right, int) and _bits(left) * max(right, 0) > _BIG_INT_BITS:
        raise meter.too_big("a number with **")


def _template_globals() -> dict[str, Any]:
    """What transformers gives templates: raise_exception, strftime_now, dict, namespace."""
    import jinja2

    def check_attribute(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class SafeNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                check_attribute(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_attribute(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class DictMaker:
        """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    return {"raise_exception": raise_exception, "strftime_now": lambda fmt: datetime.now().strftime(fmt),
            "dict": DictMaker(), "namespace": SafeNamespace}


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _steps(iterable: Any) -> Any:
    meter = _meter()
    if meter is None:
        yield from iterable
        return
    for item in iterable:
        meter.step()
        yield item


def _sized(value: Any) -> Any:
    meter = _meter()
    return value if meter is None else meter.check_size(value, "a string with ~")


def _metered_filter(name: str, fn: Any) -> Any:
    """`fn` metered: a step, its numbers and its result's size checked. Marked as taking the
    render's context: jinja then never calls it while compiling (it folds constant filter calls
    into the code, {{ 'x' | center(10**9) }} included, outside any render's meter); the filter
    gets what it asked for."""
    import jinja2
    from jinja2.utils import _PassArg

    wants = _PassArg.from_obj(fn)

    @jinja2.pass_context
    def run(context: Any, *args: Any, **kwargs: Any) -> Any:
        if wants is _PassArg.context:
            args = (context, *args)
        elif wants is _PassArg.eval_context:
            args = (context.eval_ctx, *args)
        elif wants is _PassArg.environment:
            args = (context.environment, *args)
        meter = _meter()
        if meter is None:
            return fn(*args, **kwargs)
        meter.step()
        _check_numbers(meter, args[1:] if wants is None else args[2:], kwargs, f"a value with |{name}")
        return meter.check_size(fn(*args, **kwargs), f"a value with |{name}")

    return run


def chat_template_source(value: str) -> str:
    """--chat-template's value as a template's source: a file's text when `value` names a file (or
    looks like a path: ends in .jinja / .j2), else `value` itself; ValueError for a file that is
    not there or a template that does not compile."""
    from pathlib import Path

    looks_like_path = "{" not in value and (value.endswith((".jinja", ".j2", ".jinja2")) or "/" in value)
    path = Path(value).expanduser()
    if looks_like_path or (len(value) < 4096 and "{" not in value and path.is_file()):
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {str(path)!r}: {exc}") from None
    try:
        compile_chat_template(value)
    except Exception as exc:  # jinja's TemplateSyntaxError and the like
        raise ValueError(f"--chat-template: the template does not compile: {exc}") from None
    return value


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON types (a template sees no object's methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def template_messages(conversation: list[Any]) -> list[dict[str, Any]]:
    """The messages as a template sees them: plain JSON, None-valued keys dropped, reasoning
    under each name templates read."""
    messages = []
    for message in conversation:
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def render_chat(compiled: Any, conversation: list[Any], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, variables: dict[str, Any], budget: RenderBudget | None = None,
                continue_final_message: bool = False) -> str:
    """The conversation through a compiled template, as transformers renders it, within `budget`
    (the default budget when None; TemplateBudgetError past it). `variables`: special tokens and
    the template's other variables (`documents` among them)."""
    messages = template_messages(conversation)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError("tools must be JSON schemas (dicts)")
    variables = {"documents": None, **_plain(variables)}
    meter = _Meter(budget or RenderBudget())
    token = _METER.set(meter)
    try:
        pieces, num_chars = [], 0
        for piece in compiled.generate(messages=messages, tools=_plain(tools),
                                       add_generation_prompt=add_generation_prompt, **variables):
            num_chars += len(piece)
            if num_chars > meter.budget.max_chars:
                raise meter.too_big("a text")
            if time.monotonic() > meter.deadline:
                raise meter.late()
            pieces.append(piece)
    except RecursionError:
        raise TemplateBudgetError("steps", "the chat template recursed too deeply") from None
    finally:
        _METER.reset(token)
    text = "".join(pieces)
    return cut_after_final_message(text, conversation[-1]) if continue_final_message else text


def cut_after_final_message(rendered: str, final: Any) -> str:
    """transformers' continue_final_message: the text up to the end of the last message's
    content, so the model continues it (the template's end-of-turn markup cut off)."""
    content = final.get("content") if isinstance(final, dict) else getattr(final, "content", None)
    if isinstance(content, (list, tuple)):
        texts = [block["text"] for block in content if isinstance(block, dict) and "text" in block]
        if not texts:
            raise ValueError("continue_final_message is set but the final message has no text to continue")
        content = texts[-1]
    if not isinstance(content, str) or content.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                         "after applying the chat template")
    start = rendered.rindex(content.strip())
    if rendered[start:start + len(content.lstrip())] == content:
        return rendered[:start + len(content.lstrip())]
    return rendered[:start + len(content.strip())]
