"""The constraint a request puts on its output, as it travels to the engine.

One small Struct in SamplingParams (field `structured`), built by the API's parser
(atom.entrypoints.structured_request) and compiled by the engine (atom.structured.compiler).
`value` is text in every kind (a JSON schema or structural tag as JSON, a regex, EBNF, the
choices as a JSON list), so the spec hashes and crosses the wire as it is.
"""

from __future__ import annotations

import enum
import hashlib

import msgspec


class StructuredKind(enum.StrEnum):
    JSON = "json"  # value: a JSON schema (JSON text)
    JSON_OBJECT = "json_object"  # any JSON object (value unused)
    REGEX = "regex"
    CHOICE = "choice"  # value: a JSON list of strings, one of which is the output
    GRAMMAR = "grammar"  # value: EBNF (GBNF-style, root rule `root`)
    STRUCTURAL_TAG = "structural_tag"  # value: an xgrammar StructuralTag (JSON): tool calls


class StructuredSpec(msgspec.Struct, frozen=True, array_like=True):
    kind: StructuredKind
    value: str = ""

    def key(self) -> str:
        """The compiled-grammar cache key: a hash of the kind and the text."""
        return hashlib.sha256(f"{self.kind.value}\0{self.value}".encode()).hexdigest()
