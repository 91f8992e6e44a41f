"""Checks a JSON schema before it is compiled: valid (Draft 2020-12) and using only keywords the
grammar enforces, so a request is refused with a message rather than half-constrained."""

from __future__ import annotations

from typing import Any

# Keywords xgrammar 0.2 ignores while compiling (probed: a value violating them was accepted), and
# keywords whose meaning depends on documents or state we do not have. Refused, with the path.
UNSUPPORTED_KEYWORDS = {
    "not": "`not` is not enforced",
    "if": "`if`/`then`/`else` are not enforced",
    "then": "`if`/`then`/`else` are not enforced",
    "else": "`if`/`then`/`else` are not enforced",
    "uniqueItems": "`uniqueItems` is not enforced",
    "contains": "`contains` is not enforced",
    "minContains": "`contains` is not enforced",
    "maxContains": "`contains` is not enforced",
    "dependentRequired": "`dependentRequired` is not enforced",
    "dependentSchemas": "`dependentSchemas` is not enforced",
    "dependencies": "`dependencies` is not enforced",
    "unevaluatedProperties": "`unevaluatedProperties` is not enforced (use additionalProperties)",
    "contentEncoding": "`contentEncoding` is not enforced",
    "contentMediaType": "`contentMediaType` is not enforced",
    "contentSchema": "`contentSchema` is not enforced",
    "$dynamicRef": "`$dynamicRef` is not supported",
    "$recursiveRef": "`$recursiveRef` is not supported",
}
# String formats the grammar spells out (probed); any other format would be an unchecked string.
SUPPORTED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# Keywords whose value is a map of name -> subschema, or a list of subschemas, or one subschema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "unevaluatedItems", "additionalItems")
MAX_SCHEMA_DEPTH = 64


class SchemaError(ValueError):
    """The schema cannot be used; the message names the keyword and where it is."""


def check_json_schema(schema: Any) -> None:
    """Raise SchemaError if `schema` is not a valid JSON schema or uses a keyword the grammar would
    not enforce. Unknown keywords are ignored, as JSON Schema validators ignore them."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaError("a JSON schema must be an object")
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError as _Invalid
    except ImportError:  # the keyword walk below still runs
        Draft202012Validator = None
    if Draft202012Validator is not None:
        try:
            Draft202012Validator.check_schema(schema)
        except _Invalid as exc:
            where = "/".join(str(p) for p in exc.path) or "(root)"
            raise SchemaError(f"invalid JSON schema at {where}: {exc.message}") from None
    _walk(schema, "#", 0)


def _walk(node: Any, path: str, depth: int) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise SchemaError(f"invalid JSON schema at {path}: a subschema must be an object or a boolean")
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    for key, why in UNSUPPORTED_KEYWORDS.items():
        if key in node:
            raise SchemaError(f"unsupported JSON schema keyword at {path}: {why} by structured outputs")
    fmt = node.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise SchemaError(f"unsupported JSON schema keyword at {path}: format {fmt!r} is not enforced "
                          f"(supported: {', '.join(sorted(SUPPORTED_FORMATS))})")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise SchemaError(f"unsupported JSON schema keyword at {path}: only local $ref (\"#/...\") is supported, got {ref!r}")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise SchemaError(f"unsupported JSON schema keyword at {path}: `allOf` with more than one subschema is not enforced")
    if isinstance(node.get("items"), list):
        raise SchemaError(f"unsupported JSON schema keyword at {path}: `items` as a list (use prefixItems)")
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items():
            _walk(sub, f"{path}/{key}/{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or []):
            _walk(sub, f"{path}/{key}/{i}", depth + 1)
    for key in _SCHEMA_VALUES:
        if key in node:
            _walk(node[key], f"{path}/{key}", depth + 1)
