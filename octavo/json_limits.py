"""JSON nesting limits, for bodies and for JSON parsed from strings inside them (tool-call
arguments, schema text): past MAX_JSON_DEPTH levels Python's json and jinja's recursion fail
(RecursionError, a 500 before), so deeper text is refused by name before it is parsed. Pure Python."""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON schema may nest 64 subschemas (structured/schema.py), two JSON levels each through
# "properties", inside a few levels of request; nothing legitimate comes near 160.
MAX_JSON_DEPTH = 160
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string (skipped whole) or a bracket


def json_nesting_error(body: bytes, limit: int = MAX_JSON_DEPTH) -> str | None:
    """None if the JSON text `body` nests at most `limit` arrays/objects deep, else a message naming
    the top-level field that nests deeper. Reads brackets outside strings only (no parsing), and
    stops at the first level over the limit."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None
    depth, last_top_string, field = 0, None, None
    for match in _JSON_TOKENS.finditer(body):
        first = match.group()[0]
        if first == 0x22:  # '"': at depth 1 the last string before a bracket is that value's key
            if depth == 1:
                last_top_string = match.group()
        elif first in (0x5B, 0x7B):  # '[' '{'
            depth += 1
            if depth == 2:
                field = last_top_string
            if depth > limit:
                try:
                    name = json.loads(field) if field is not None else "body"
                except ValueError:
                    name = "body"
                return f"{name}: JSON nested deeper than {limit} levels"
        else:
            depth -= 1
    return None


def is_nested_too_deeply(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON text nests more than `limit` arrays/objects deep (whether or not it parses)."""
    return json_nesting_error(text.encode("utf-8", errors="replace"), limit) is not None


def loads_bounded(text: str, what: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """json.loads(text), refusing text nested deeper than `limit` first: ValueError naming `what`
    (json.JSONDecodeError, a ValueError, for text that is not JSON)."""
    if is_nested_too_deeply(text, limit):
        raise ValueError(f"{what}: JSON nested deeper than {limit} levels")
    return json.loads(text)
