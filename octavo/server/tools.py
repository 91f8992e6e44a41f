"""Tool calling for chat completions: the grammar that forces a call (tool_choice "required" or a
named function), and the parser of a model's own calls (Hermes' <tool_call> blocks, for "auto"),
whole or as a stream."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from octavo.sampling.params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_call_constraint(tools: list[Any], tool_choice: Any, parallel: bool) -> StructuredOutputsParams | None:
    """The output constraint of tool_choice "required" (a JSON array of {name, parameters}, one
    entry per call, each valid for its tool's schema) or of a named function (its arguments
    object); None when the model chooses ("auto", "none")."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        defs: dict[str, Any] = {}
        entries = []
        for i, t in enumerate(tools):
            parameters = _parameters(t)
            if _has_local_ref(parameters):  # its "#/..." pointers mean its own root: it moves under ours
                defs[f"tool{i}"] = _rebase_refs(parameters, f"#/$defs/tool{i}")
                parameters = {"$ref": f"#/$defs/tool{i}"}
            entries.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                             "parameters": parameters},
                            "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": entries}, "minItems": 1}
        if defs:
            schema["$defs"] = defs
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    tool = next(t for t in tools if t.function.name == tool_choice.function.name)
    return StructuredOutputsParams(json=_parameters(tool))


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of a schema whose local pointers ("#", "#/$defs/X", "#/properties/...") are relative
    to `base`, where the schema now sits inside another (tool_choice "required" wraps every tool's
    parameters in one array schema: a tool's own $defs then sit at `base`/$defs)."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def parse_forced_calls(text: str, tool_choice: Any, complete: bool = True) -> list[ParsedCall] | None:
    """The calls in a constrained output. `complete` False (the output was cut by max_tokens): for
    "required", the calls of the array that were written whole, None if there are none; for a
    named function, None. Never raises on what a model wrote (nesting too deep for the parser
    included)."""
    try:
        if tool_choice != "required":
            return [ParsedCall(tool_choice.function.name, _arguments_text(json.loads(text)))] if complete else None
        items = json.loads(text) if complete else _whole_array_items(text)
        calls = [ParsedCall(c["name"], _arguments_text(c["parameters"])) for c in items
                 if isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c]
    except (ValueError, RecursionError, TypeError):
        return None
    return calls or None


def _whole_array_items(text: str) -> list[Any]:
    """The items of a JSON array that was cut off, as far as they were written whole."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    items: list[Any] = []
    if pos == 0:
        return items
    while True:
        while pos < len(text) and text[pos] in " \t\n\r,":
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:  # the cut item (or the closing bracket)
            return items
        items.append(value)


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _hermes_call(body: str) -> ParsedCall | None:
    """The call a <tool_call> block holds, or None if it is not one (invalid or too deeply nested JSON)."""
    try:
        value = json.loads(body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return ParsedCall(value["name"], _arguments_text(value.get("arguments", value.get("parameters", {}))))
    except (ValueError, RecursionError):
        return None


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content outside the calls or None, calls) of a whole output. A block that is not valid
    JSON with a "name" stays in the content, as the model wrote it."""
    content, calls, pos = [], [], 0
    while (start := text.find(HERMES_OPEN, pos)) != -1:
        end = text.find(HERMES_CLOSE, start)
        body_end = end if end != -1 else len(text)
        call = _hermes_call(text[start + len(HERMES_OPEN): body_end].strip())
        if call is None:
            break
        content.append(text[pos:start])
        calls.append(call)
        pos = body_end + len(HERMES_CLOSE) if end != -1 else len(text)
    content.append(text[pos:])
    rest = "".join(content).strip()
    return (rest or None), calls


class HermesStream:
    """Feeds streamed text; returns content to show now and calls completed now. Text that could
    be the start of a <tool_call> tag is held back until it is clearly not one."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls: list[ParsedCall] = []

    def feed(self, text: str, finished: bool = False) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        shown, new_calls = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(HERMES_CLOSE)
                if end == -1 and not finished:
                    break
                body = self._buffer[: end if end != -1 else len(self._buffer)]
                call = _hermes_call(body.strip())
                if call is None:  # not a call after all: show it as written
                    shown.append(HERMES_OPEN + body + (HERMES_CLOSE if end != -1 else ""))
                else:
                    new_calls.append(call)
                self._buffer = self._buffer[end + len(HERMES_CLOSE):] if end != -1 else ""
                self._in_call = False
                continue
            start = self._buffer.find(HERMES_OPEN)
            if start != -1:
                shown.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(HERMES_OPEN):]
                self._in_call = True
                continue
            keep = 0 if finished else _partial_tag_len(self._buffer)
            shown.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        self.calls.extend(new_calls)
        return "".join(shown), new_calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of <tool_call>."""
    for n in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0


def tools_system_prompt(tools: list[Any]) -> str:
    """Hermes' tool instructions, for chat templates that do not render `tools` themselves."""
    specs = "\n".join(json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)},
                                 ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are:\n<tools>\n"
            f"{specs}\n</tools>\nFor each call, return a JSON object with the function name and arguments "
            f"within {HERMES_OPEN}{HERMES_CLOSE} tags:\n{HERMES_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + HERMES_CLOSE)


def render_tool_calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool_calls written into its content as Hermes blocks (for templates
    that do not know tool_calls)."""
    blocks = [f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                ensure_ascii=False) + f"\n{HERMES_CLOSE}" for c in message["tool_calls"]]
    content = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
