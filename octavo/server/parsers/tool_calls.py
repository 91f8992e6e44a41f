"""Tool-call parsers: a model's own calls, in its family's format, read from its output whole or as
a stream (for tool_choice "auto").

Every format is a *section* that opens with a marker and holds one or more calls:

| parser        | section                                                        | models                 |
| ------------- | -------------------------------------------------------------- | ---------------------- |
| hermes        | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`     | Hermes, Qwen2.5/3, SmolLM |
| qwen3_coder   | `<tool_call><function=NAME><parameter=K>V</parameter>...`      | Qwen3-Coder, Qwen3.5   |
| llama3_json   | the output is `{"name": ..., "parameters": {...}}` (`;`-joined)| Llama 3.1-3.3          |
| mistral       | `[TOOL_CALLS][{...}]` or `[TOOL_CALLS]NAME[ARGS]{...}`          | Mistral, Ministral     |
| pythonic      | the output is `[f(a=1), g(b="x")]`                             | Llama 3.2/4 (pythonic) |

`CallStream` is the one reader: it shows text outside sections at once, holds back text that could
still be the start of a marker, and parses a section when it closes (at its close marker, or at the
end of the output for formats whose section runs to the end). A section that does not parse is
shown as the model wrote it: nothing is lost. Whole-output parsing is the stream fed at once, so
streamed and whole answers agree by construction (and tests check it for every split).
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_SECTION_CHARS = 1 << 20  # a section longer than this is shown as text, never parsed


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text (as far as it was written, when `complete` is False)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    complete: bool = True  # False: a forced call cut by max_tokens (finish_reason "length")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def arguments_text(value: Any) -> str:
    """A call's arguments as JSON text (strings are taken as already JSON)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False)


# ---- section bodies: text -> calls, or None when it is not a call --------------------------------

Schemas = dict[str, dict[str, Any]]  # tool name -> its parameters' JSON schema


def _json_call(value: Any) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], arguments_text(args))


def _hermes(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    call = _json_call(json.loads(body))
    return None if call is None else [call]


def _llama3_json(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """One or more JSON objects, joined by ';' (Llama 3.1's parallel calls) or whitespace."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos == len(body):
            return calls or None
        value, pos = decoder.raw_decode(body, pos)
        call = _json_call(value)
        if call is None:
            return None
        calls.append(call)


def _mistral(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """After [TOOL_CALLS]: a JSON list of {name, arguments} (tokenizer v3-v7), or NAME[ARGS]{...}
    (v11+, with an optional [CALL_ID]ID), each call after its own [TOOL_CALLS]."""
    calls: list[ParsedCall] = []
    for part in body.split("[TOOL_CALLS]"):
        part = part.strip()
        if "[ARGS]" in part:
            name, args = part.split("[ARGS]", 1)
            name = name.split("[CALL_ID]", 1)[0].strip()
            value = json.loads(args)
            if not name or not isinstance(value, dict):
                return None
            calls.append(ParsedCall(name, arguments_text(value)))
            continue
        value = json.loads(part)
        for item in value if isinstance(value, list) else [value]:
            call = _json_call(item)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def _tagged(body: str, tag: str) -> list[tuple[str, str]] | None:
    """The `<TAG=KEY>VALUE</TAG>` pieces of `body` in order, or None when anything but whitespace
    lies outside them or one does not close. One pass: each find starts where the last ended, so
    a text of unclosed tags costs its length, not its length squared (a regex's lazy `(.*?)`
    rescanned to the end for each: 58 s for 10,000 unclosed `<parameter=`)."""
    opening, closing = f"<{tag}=", f"</{tag}>"
    pieces, pos = [], 0
    while True:
        start = body.find(opening, pos)
        if start == -1:
            return None if body[pos:].strip() else pieces
        if body[pos:start].strip():
            return None
        key_end = body.find(">", start + len(opening))
        key = body[start + len(opening):key_end] if key_end != -1 else ""
        if not key or "\n" in key:
            return None
        end = body.find(closing, key_end + 1)
        if end == -1:
            return None
        pieces.append((key, body[key_end + 1:end]))
        pos = end + len(closing)


def _qwen3_coder(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """<function=NAME><parameter=KEY>VALUE</parameter>...</function>: values are text, read as the
    tool's schema types them (a string stays text; numbers, booleans, objects and arrays as JSON)."""
    functions = _tagged(body, "function")
    if not functions:
        return None
    calls = []
    for name, inner in functions:
        name = name.strip()
        properties = (schemas.get(name) or {}).get("properties") or {}
        parameters = _tagged(inner, "parameter")
        if parameters is None:
            return None
        args: dict[str, Any] = {}
        for key, raw in parameters:
            key = key.strip()
            args[key] = _qwen_value(raw[1:] if raw.startswith("\n") else raw, properties.get(key))
        calls.append(ParsedCall(name, arguments_text(args)))
    return calls


def _qwen_value(raw: str, schema: Any) -> Any:
    text = raw[:-1] if raw.endswith("\n") else raw
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return text
    try:
        return json.loads(text)
    except ValueError:
        lowered = text.strip().lower()
        if kind == "boolean" and lowered in ("true", "false"):
            return lowered == "true"
        return text


def _pythonic(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """A Python list of calls with keyword arguments of literal values: [f(a=1), g(b=[1, "x"])]."""
    tree = ast.parse(body.strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            args[kw.arg] = _literal(kw.value)
        calls.append(ParsedCall(ast.unparse(node.func), arguments_text(args)))
    return calls


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):  # JSON's spellings, as models write them
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a literal dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(v) for v in node.elts]
    value = ast.literal_eval(node)
    if isinstance(value, (complex, bytes, set)):
        raise ValueError("not a JSON value")
    return value


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How one model family writes its calls (see the module's table)."""

    name: str
    opens: tuple[tuple[str, bool], ...]  # (marker, whether the marker is part of the section's text)
    close: str | None  # None: the section runs to the end of the output
    at_start: bool  # a section opens only at the start of the output (after whitespace)
    body: Callable[[str, Schemas], list[ParsedCall] | None]
    keeps_special_tokens: bool = False  # its markers are special tokens: decode them


FORMATS: dict[str, CallFormat] = {f.name: f for f in (
    CallFormat("hermes", (("<tool_call>", False),), "</tool_call>", False, _hermes),
    CallFormat("qwen3_coder", (("<tool_call>", False),), "</tool_call>", False, _qwen3_coder),
    CallFormat("llama3_json", (("<|python_tag|>", False), ("{", True)), None, True, _llama3_json),
    CallFormat("mistral", (("[TOOL_CALLS]", False),), None, False, _mistral, keeps_special_tokens=True),
    CallFormat("pythonic", (("[", True),), None, True, _pythonic),
)}
# the names vLLM users pass for the same formats
ALIASES = {"qwen3_xml": "qwen3_coder", "qwen3": "hermes", "qwen2_5": "hermes", "llama4_pythonic": "pythonic",
           "llama4_json": "llama3_json"}
TOOL_CALL_PARSERS = tuple(sorted([*FORMATS, *ALIASES]))


def call_format(name: str) -> CallFormat:
    """The format a --tool-call-parser name selects; ValueError naming the choices."""
    resolved = ALIASES.get(name, name)
    if resolved not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return FORMATS[resolved]


def _parse_body(fmt: CallFormat, body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """The section's calls, or None for anything else: never raises on model output."""
    if len(body) > MAX_SECTION_CHARS:
        return None
    try:
        return fmt.body(body, schemas)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, KeyError, IndexError, AttributeError):
        return None


class CallStream:
    """Feeds a model's output piece by piece; `feed` returns the text to show now and the calls
    completed now (`calls` keeps them all). Partial markers are held until they are clearly not."""

    def __init__(self, fmt: CallFormat, schemas: Schemas | None = None) -> None:
        self.fmt, self.schemas = fmt, schemas or {}
        self.calls: list[ParsedCall] = []
        self._buffer = ""
        self._marker: str | None = None  # the open section's marker (None: outside a section)
        self._marker_in_body = False
        self._shown_text = False  # for at_start formats: text shown, so no section can open now
        # an open section's text while its close is not in it: pieces, joined when the close comes
        # (or the output ends), so a long section costs its length once, not once per piece
        self._section: list[str] | None = None
        self._section_tail = ""  # its last len(close) - 1 characters: a close split across pieces
        self._lead: list[str] = []  # at_start formats: whitespace-only pieces before anything else

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[ParsedCall]]:
        if self._section is not None:  # inside a section whose close has not come
            close = self.fmt.close
            window = self._section_tail + text
            if not finished and (close is None or close not in window):
                self._section.append(text)
                self._section_tail = window[-(len(close) - 1):] if close and len(close) > 1 else ""
                return "", []
            text, self._section = "".join(self._section) + text, None  # joined once, when it can end
        if self.fmt.at_start and not self._shown_text and not self._buffer and not finished and not text.strip():
            self._lead.append(text)  # whitespace before the output's start: held aside, not rescanned
            return "", []
        if self._lead:
            text, self._lead = "".join(self._lead) + text, []
        self._buffer += text
        shown: list[str] = []
        new_calls: list[ParsedCall] = []
        while self._step(shown, new_calls, finished):
            pass
        out = "".join(shown)
        if out.strip():
            self._shown_text = True
        self.calls.extend(new_calls)
        return out, new_calls

    def _step(self, shown: list[str], new_calls: list[ParsedCall], finished: bool) -> bool:
        """One move of the reader; True while there is more to do now."""
        fmt, buf = self.fmt, self._buffer
        if self._marker is not None:
            end = buf.find(fmt.close) if fmt.close else -1
            if end == -1 and not finished:
                self._section, self._buffer = [buf], ""
                self._section_tail = buf[-(len(fmt.close) - 1):] if fmt.close and len(fmt.close) > 1 else ""
                return False
            body = buf if end == -1 else buf[:end]
            calls = _parse_body(fmt, body, self.schemas)
            closing = fmt.close if end != -1 else ""
            if calls is None:  # not a call after all: shown as the model wrote it
                shown.append(("" if self._marker_in_body else self._marker) + body + (closing or ""))
            else:
                new_calls.extend(calls)
            self._buffer = buf[len(body) + len(closing or ""):]
            self._marker = None
            return bool(self._buffer)
        opened = self._find_open(buf)
        if opened is not None:
            start, marker, in_body = opened
            shown.append(buf[:start])
            self._marker, self._marker_in_body = marker, in_body
            self._buffer = buf[start:] if in_body else buf[start + len(marker):]
            return True
        keep = 0 if finished else self._held_len(buf)
        shown.append(buf[: len(buf) - keep])
        self._buffer = buf[len(buf) - keep:]
        return False

    def _find_open(self, buf: str) -> tuple[int, str, bool] | None:
        if self.fmt.at_start:
            if self._shown_text:
                return None
            stripped = buf.lstrip()
            start = len(buf) - len(stripped)
            for marker, in_body in self.fmt.opens:
                if stripped.startswith(marker):
                    return start, marker, in_body
            return None
        found = [(buf.find(m), m, b) for m, b in self.fmt.opens if m in buf]
        return min(found) if found else None

    def _held_len(self, buf: str) -> int:
        """How much of the buffer's end to hold: what could still become a marker."""
        if self.fmt.at_start:
            if self._shown_text:
                return 0
            stripped = buf.lstrip()
            if not stripped or any(m.startswith(stripped) for m, _ in self.fmt.opens):
                return len(buf)
            return 0
        for n in range(min(len(buf), max(len(m) for m, _ in self.fmt.opens) - 1), 0, -1):
            if any(m.startswith(buf[-n:]) for m, _ in self.fmt.opens):
                return n
        return 0


def parse_calls(fmt: CallFormat, text: str, schemas: Schemas | None = None) -> tuple[str | None, list[ParsedCall]]:
    """(content outside the calls, stripped, or None if empty; calls) of a whole output."""
    stream = CallStream(fmt, schemas)
    content, calls = stream.feed(text, finished=True)
    return (content.strip() or None), calls


def tool_schemas(tools: list[Any] | None) -> Schemas:
    """Each tool's parameters schema by name (what qwen3_coder reads its values by)."""
    return {t.function.name: t.function.parameters or {} for t in tools or []}
