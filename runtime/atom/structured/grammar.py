"""A StructuredSpec to an xgrammar Grammar, with the backend's reason when it cannot be built.

Used twice: by the API server, so a schema or grammar the backend cannot compile is a 400
before the request costs the engine anything, and by the engine's compiler. JSON is generated
with fixed separators (", " and ": ") and no other whitespace: a small model otherwise loops
on whitespace, and the output stays parseable by any client.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from atom.structured.spec import StructuredKind, StructuredSpec

SEPARATORS = (", ", ": ")
# "[06:00:25] /project/cpp/regex_converter.cc:83: " before xgrammar's own words
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """The backend refused the spec; the message is its reason."""


def build_grammar(spec: StructuredSpec) -> xgr.Grammar:
    try:
        return _build(spec)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from these
        raise GrammarError(f"{spec.kind.value}: {backend_reason(exc)}") from None


def _build(spec: StructuredSpec) -> xgr.Grammar:
    kind = spec.kind
    if kind is StructuredKind.JSON:
        return _strict_strings(xgr.Grammar.from_json_schema(
            spec.value, any_whitespace=False, separators=SEPARATORS, strict_mode=True
        ))
    if kind is StructuredKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, separators=SEPARATORS
        )
    if kind is StructuredKind.REGEX:
        return xgr.Grammar.from_regex(spec.value)
    if kind is StructuredKind.CHOICE:
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.value)))
    if kind is StructuredKind.GRAMMAR:
        return xgr.Grammar.from_ebnf(spec.value)
    if kind is StructuredKind.STRUCTURAL_TAG:
        return _strict_strings(xgr.Grammar.from_structural_tag(spec.value))
    raise GrammarError(f"unknown structured output kind {kind!r}")


# xgrammar 0.2.8 spells a length-bounded string's character as any byte but a quote, a
# backslash, CR or LF: raw control characters (invalid JSON) and no escapes. Its unbounded
# strings have it right; give the bounded ones the same character (an escape is one character).
_LOOSE_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'([^\0-\x1f\"\\] | "\\" basic_escape)'


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    if _LOOSE_CHAR not in text:
        return grammar
    if "basic_escape ::=" not in text:
        return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHAR, r'[^\0-\x1f\"\\]'))
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHAR, _JSON_CHAR))


def choice_ebnf(choices: list[str]) -> str:
    """root ::= one of the strings exactly (JSON string escapes are EBNF's too)."""
    if not choices:
        raise GrammarError("choice: at least one choice is needed")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def backend_reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix (time and C++ source line)."""
    return _LOG_PREFIX.sub("", str(exc).strip())
