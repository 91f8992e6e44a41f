"""Tool calling for chat completions: the grammar that forces a call (tool_choice "required" or a
named function), reading the forced calls back, and the Hermes instructions written for templates
that do not render tools. A model's own calls (tool_choice "auto") are read by parsers/tool_calls.py."""

from __future__ import annotations

import json
import re
from typing import Any

from octavo.sampling.params import StructuredOutputsParams
from octavo.server.parsers.tool_calls import ParsedCall, arguments_text

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


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
    """The calls in a constrained output. `complete` False (the output was cut by max_tokens): the
    calls written whole, then the cut one as far as it was written (`ParsedCall.complete` False,
    its arguments a JSON text cut short, as OpenAI answers a call cut by length) when its name was
    written; a named call always has its name. None when there is no call. Never raises on what a
    model wrote (nesting too deep for the parser included)."""
    try:
        if tool_choice != "required":
            name = tool_choice.function.name
            if not complete:
                return [ParsedCall(name, text.strip(), complete=False)]
            return [ParsedCall(name, arguments_text(json.loads(text)))]
        items, rest = (json.loads(text), "") if complete else _whole_array_items(text)
        calls = [ParsedCall(c["name"], arguments_text(c["parameters"])) for c in items
                 if isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c]
    except (ValueError, RecursionError, TypeError):
        return None
    cut = None if complete else _cut_call(rest)
    return [*calls, *([cut] if cut else [])] or None


# a call of "required"'s array cut short: its name written whole, its parameters as far as they go
_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"parameters"\s*:\s*)?', re.S)


def _cut_call(rest: str) -> ParsedCall | None:
    match = _CUT_CALL.match(rest)
    if match is None:
        return None
    try:
        name = json.loads(f'"{match.group(1)}"')
    except ValueError:
        return None
    return ParsedCall(name, rest[match.end():].rstrip(), complete=False) if name else None


def _whole_array_items(text: str) -> tuple[list[Any], str]:
    """The items of a JSON array that was cut off, as far as they were written whole, and the
    text after them (the cut item)."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    items: list[Any] = []
    if pos == 0:
        return items, ""
    while True:
        while pos < len(text) and text[pos] in " \t\n\r,":
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:  # the cut item (or the closing bracket)
            return items, text[pos:]
        items.append(value)


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
