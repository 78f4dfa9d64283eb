"""The structured-output fields of a request body, parsed into one StructuredSpec.

Accepted spellings (one constraint per request):
- OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"} or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- vLLM's extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- vLLM's newer `structured_outputs`: {"json" | "regex" | "choice" | "grammar" |
  "json_object" | "structural_tag": ...}.
A schema that is not a JSON Schema is a 400 naming the field (`param`) and the path inside it;
one the backend cannot compile is a 400 with the backend's reason (atom.structured.grammar).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from atom.engine.params import SamplingParams
from atom.entrypoints.json_schema_check import check_schema
from atom.structured.grammar import GrammarError, build_grammar
from atom.structured.spec import StructuredKind, StructuredSpec
from atom.wire.api_error import bad_request

if TYPE_CHECKING:
    from atom.entrypoints.tool_request import ToolRequest

GUIDED = {
    "guided_json": StructuredKind.JSON,
    "guided_regex": StructuredKind.REGEX,
    "guided_choice": StructuredKind.CHOICE,
    "guided_grammar": StructuredKind.GRAMMAR,
}
STRUCTURED_OUTPUTS = {
    "json": StructuredKind.JSON,
    "regex": StructuredKind.REGEX,
    "choice": StructuredKind.CHOICE,
    "grammar": StructuredKind.GRAMMAR,
    "json_object": StructuredKind.JSON_OBJECT,
    "structural_tag": StructuredKind.STRUCTURAL_TAG,
}
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar of a megabyte is refused before compiling


def structured_spec(body: dict[str, Any]) -> tuple[StructuredSpec, str] | None:
    """The body's constraint and the field that gave it (None: free output). Checked: the
    schema's shape, then the backend's grammar."""
    found = [f for f in _candidates(body) if f is not None]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise bad_request(f"only one structured output constraint is allowed, got {names}",
                          param=found[1][1])
    spec, param = found[0]
    if len(spec.value) > MAX_SPEC_CHARS:
        raise bad_request(f"{param} is over {MAX_SPEC_CHARS} characters", param=param)
    try:
        build_grammar(spec)
    except GrammarError as exc:
        raise bad_request(f"{param} cannot be compiled: {exc}", param=param) from None
    return spec, param


def _candidates(body: dict[str, Any]) -> list[tuple[StructuredSpec, str] | None]:
    out = [_response_format(body.get("response_format"))]
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            out.append((_spec(kind, body[name], name), name))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        for key, kind in STRUCTURED_OUTPUTS.items():
            value = so.get(key)
            if value is None or value is False:
                continue
            out.append((_spec(kind, value, f"structured_outputs.{key}"), "structured_outputs"))
    return out


def _response_format(rf: Any) -> tuple[StructuredSpec, str] | None:
    param = "response_format"
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("response_format must be an object with a type", param=param)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(StructuredKind.JSON_OBJECT), param
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema must be an object", param=param)
        if not isinstance(js.get("name"), str) or not js["name"]:
            raise bad_request("response_format.json_schema.name must be a non-empty string",
                              param=param)
        schema = js.get("schema", {})
        return _spec(StructuredKind.JSON, schema, "response_format.json_schema.schema"), param
    raise bad_request(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param=param,
    )


def _spec(kind: StructuredKind, value: Any, where: str) -> StructuredSpec:
    param = where.split(".", 1)[0]
    if kind is StructuredKind.JSON:
        if isinstance(value, str):  # vLLM takes a schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise bad_request(f"{where} is not valid JSON: {exc}", param=param) from None
        check_schema(value, where, param)
        return StructuredSpec(kind, json.dumps(value, sort_keys=True))
    if kind is StructuredKind.JSON_OBJECT:
        return StructuredSpec(kind)
    if kind is StructuredKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{where} must be a non-empty list of strings", param=param)
        return StructuredSpec(kind, json.dumps(value))
    if kind is StructuredKind.STRUCTURAL_TAG:
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredSpec(kind, text)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string", param=param)
    return StructuredSpec(kind, value)


def constrain(params: SamplingParams, body: dict[str, Any],
              tools: ToolRequest | None = None) -> None:
    """Put the body's constraint on params: its structured output, or the tool choice's
    (required / named); both at once is a 400."""
    found = structured_spec(body)
    tool_spec = tools.constraint() if tools is not None else None
    if found is not None and tool_spec is not None:
        assert tools is not None
        raise bad_request(f"{found[1]} cannot be combined with tool_choice {tools.choice!r}",
                          param=found[1])
    params.structured = tool_spec if tool_spec is not None else (found[0] if found else None)
