"""The JSON-schema check before compiling: invalid schemas and unenforced keywords are refused by
name, the keywords the grammar enforces pass. Pure Python (jsonschema only)."""

import pytest

from octavo.sampling.params import StructuredOutputsParams
from octavo.structured.schema import SchemaError, check_json_schema

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "kind": {"enum": ["cat", "dog"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}},
                    "required": ["city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1, "maxItems": 3},
        "score": {"anyOf": [{"type": "integer", "minimum": 0, "multipleOf": 2}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/item"},
    },
    "required": ["name"],
    "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}}}},
}


def test_enforced_keywords_pass():
    check_json_schema(NESTED)
    check_json_schema(True)


@pytest.mark.parametrize("schema, words", [
    ({"type": "strin"}, ["invalid JSON schema", "strin"]),
    ({"type": "object", "properties": {"a": {"minLength": -1}}}, ["invalid JSON schema", "properties/a/minLength"]),
    ({"type": "object", "required": "a"}, ["invalid JSON schema", "required"]),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, ["`not`", "#/properties/a"]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ["uniqueItems"]),
    ({"if": {"type": "integer"}, "then": {"minimum": 1}}, ["`if`"]),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, ["allOf"]),
    ({"type": "string", "format": "credit-card"}, ["format 'credit-card'"]),
    ({"$ref": "https://example.com/s.json"}, ["local $ref"]),
    ({"type": "object", "properties": {"x": {"type": "array", "contains": {"type": "integer"}}}}, ["contains", "#/properties/x"]),
])
def test_invalid_or_unenforced_schemas_are_named(schema, words):
    with pytest.raises(SchemaError) as err:
        check_json_schema(schema)
    for word in words:
        assert word in str(err.value)


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="list of strings"):
        StructuredOutputsParams(choice="yes")
    p = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert p.kind == "json" and list(__import__("json").loads(p.spec)["properties"]) == ["b", "a"]  # order kept
    assert p.key == StructuredOutputsParams(json=p.json).key
    assert StructuredOutputsParams(choice=["x", "y"]).choice == ("x", "y")
