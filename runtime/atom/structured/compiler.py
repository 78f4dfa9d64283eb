"""Compiled grammars, cached by the spec's hash (StructuredSpec.key).

Compiling a JSON schema against a 49k vocabulary takes tens of milliseconds and an agent sends
the same schema on every call, so each distinct spec compiles once per engine. The cache is a
bounded LRU (a compiled grammar holds its adaptive token masks: up to megabytes).
"""

from __future__ import annotations

from collections import OrderedDict

import xgrammar as xgr

from atom.structured.grammar import GrammarError, backend_reason, build_grammar
from atom.structured.spec import StructuredSpec

DEFAULT_CAPACITY = 256


class GrammarCache:
    def __init__(self, info: xgr.TokenizerInfo, capacity: int = DEFAULT_CAPACITY) -> None:
        self.info = info
        # xgrammar's own cache would key by the grammar's text again: ours is enough.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.capacity = capacity
        self.hits = 0
        self.misses = 0

    def get(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The spec's compiled grammar; GrammarError (the backend's reason) if it has none."""
        key = spec.key()
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        grammar = build_grammar(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"{spec.kind.value}: {backend_reason(exc)}") from None
        self._compiled[key] = compiled
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)
