"""The JSON schema the structured-output tests and tools/structured_overhead.py share: a pet with
a nested object, enums and an array, every string bounded so sampled outputs end."""

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "species": {"enum": ["cat", "dog", "parrot"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 12},
                                                   "city": {"type": "string", "maxLength": 12}},
                  "required": ["first", "city"], "additionalProperties": False},
        "toys": {"type": "array", "items": {"enum": ["ball", "rope", "bell"]}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "owner", "toys"],
    "additionalProperties": False,
}

# A 136-character regex that xgrammar takes ~15 CPU-seconds to compile (each "(a|b)[^x]{0,9000}"
# adds ~2 s on a 2-core EPYC: four took 7.4 s): what a compile deadline must stop (issue 20).
SLOW_REGEX = "".join(f"({a}|{b})[^{c}]{{0,9000}}" for a, b, c in
                     ("abx", "cdy", "efz", "ghw", "ijv", "klu", "mnt", "ops"))
