"""The shape JSON Schema requires of the keywords our grammar reads, checked before the
backend sees a schema: structured output (response_format, guided_json) and tool parameters both
use it, so it is its own module rather than one of theirs."""

from __future__ import annotations

from typing import Any

from atom.wire.api_error import bad_request

JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_schema(schema: Any, where: str, param: str) -> None:
    """The shape JSON Schema requires of the keywords the grammar reads (the backend checks
    the rest): a 400 naming the path of the first that is wrong."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON Schema object", param=param)
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    for one in types:
        if one not in JSON_TYPES:
            raise bad_request(f"{where}.type: {one!r} is not a JSON Schema type", param=param)
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise bad_request(f"{where}.properties must be an object", param=param)
        for name, sub in props.items():
            check_schema(sub, f"{where}.properties.{name}", param)
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise bad_request(f"{where}.required must be a list of strings", param=param)
    for key in ("items", "additionalProperties", "not"):
        if key in schema and schema[key] is not None:
            check_schema(schema[key], f"{where}.{key}", param)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        subs = schema.get(key)
        if subs is None:
            continue
        if not isinstance(subs, list) or not subs:
            raise bad_request(f"{where}.{key} must be a non-empty list", param=param)
        for i, sub in enumerate(subs):
            check_schema(sub, f"{where}.{key}.{i}", param)
    enum = schema.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        raise bad_request(f"{where}.enum must be a non-empty list", param=param)
    for key in ("$defs", "definitions"):
        defs = schema.get(key)
        if defs is not None:
            if not isinstance(defs, dict):
                raise bad_request(f"{where}.{key} must be an object", param=param)
            for name, sub in defs.items():
                check_schema(sub, f"{where}.{key}.{name}", param)
