"""Strict JSON schemas (OpenAI's `"strict": true`, vLLM's disable_additional_properties): no property the
schema does not declare may appear anywhere in the output.

JSON Schema allows undeclared properties unless `additionalProperties` says otherwise, and llguidance
follows it, so a small model asked for `{"city": ...}` may go on inventing keys until max_tokens. Here
every object schema that leaves `additionalProperties` unset gets `false`; an explicit value (true, false
or a schema) is the author's choice and stays. Only schema positions are walked: `properties` of
`default`, `enum`, `const` or `examples` data are values, not schemas, and are left as written.
"""
from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of subschemas, or a name -> subschema map.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def forbid_additional_properties(node: Any) -> Any:
    """A copy of the schema `node` in which every object without an explicit `additionalProperties` gets false."""
    if not isinstance(node, dict):
        return node  # a boolean schema, or a malformed value the grammar compiler will name
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = forbid_additional_properties(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [forbid_additional_properties(item) for item in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: forbid_additional_properties(sub) for name, sub in out[key].items()}
    if "additionalProperties" not in out and _is_object(out):
        out["additionalProperties"] = False
    return out


def _is_object(node: dict[str, Any]) -> bool:
    """A schema that describes objects: it declares properties, or its type is (or includes) object."""
    kind = node.get("type")
    return ("properties" in node or "patternProperties" in node or kind == "object"
            or (isinstance(kind, list) and "object" in kind))
