"""JSON Schemas as the grammar backends compile them: objects that list their properties
take no others (:func:`closed_objects`).

A leaf of the package: it imports nothing of pyxllm.
"""

from __future__ import annotations

from typing import Any

# keywords whose value is a schema, a list of schemas or a {name: schema} mapping
_SCHEMA_KEYWORDS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPPINGS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, closable: bool = True) -> Any:
    """A copy of the JSON Schema ``schema`` in which every object that lists ``properties``
    and says nothing of others (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``) takes no others, nested ones included.

    Why: JSON Schema lets an object hold properties it does not list, so a grammar built from
    a schema as written let SmolLM2, forced to call ``get_weather(city)``, follow ``"city":
    "Paris"`` with invented properties until ``max_tokens`` (8041 tokens of invalid JSON), and
    a ``response_format`` of ``name`` and ``age`` go on with ``"gender"``, ``"occupation"``...
    A schema's listed properties are what it asks for: xgrammar's strict mode (its default,
    and vLLM's default backend) and OpenAI's strict structured outputs read a schema so too.
    An object without ``properties`` (``{"type": "object"}``, a free-form dict) stays open,
    as does one that says ``"additionalProperties": true``. ``allOf``'s branches are combined
    with one another, so their own top level is left as written (``closable=False``).
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYWORDS:
        value = out.get(key)
        if isinstance(value, list):  # items as a list: draft 4's tuple form
            out[key] = [closed_objects(s) for s in value]
        elif isinstance(value, dict):
            out[key] = closed_objects(value)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, closable=False) for s in out["allOf"]]
    for key in _SCHEMA_MAPPINGS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    says_others = {
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    } & out.keys()
    if closable and isinstance(out.get("properties"), dict) and not says_others:
        out["additionalProperties"] = False
    return out
