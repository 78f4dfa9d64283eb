"""N-gram (prompt lookup) drafter: continue the latest earlier occurrence of the suffix.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are looked up among
the earlier tokens (prompt and output); the k tokens that followed the latest match are the
draft. The copy may run into the tokens it is proposing (a repeating pattern), so it reads from
tokens + draft. When no request of a step has a match there is nothing to verify: has_drafts()
says so and the engine runs a plain decode step (a verify of made-up drafts costs k + 1 rows
for one token). When only some have one, the others' draft is their last token repeated: the
step keeps the uniform k + 1 rows its graph bucket holds, and the target still yields their
one token.

Each sequence keeps an index of its n-grams (latest start of each, among those followed by a
token), extended by the tokens it gained since the last step: a lookup costs O(n), not a scan
of the context.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol


class _Tokens(Protocol):
    token_ids: list[int]


class NgramIndex:
    """n -> {n-gram: latest start s with s + n < len(tokens)} over the tokens seen so far."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.sizes = range(lookup_min, lookup_max + 1)
        self.grams: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.seen = 0

    def extend(self, tokens: Sequence[int]) -> None:
        total = len(tokens)
        if total < self.seen:  # tokens never shrink while a sequence runs; rebuild if they did
            self.grams = {n: {} for n in self.sizes}
            self.seen = 0
        for n in self.sizes:
            table = self.grams[n]
            # New n-grams: followed by a token now (s + n <= total - 1), not before.
            for s in range(max(0, self.seen - n), total - n):
                table[tuple(tokens[s : s + n])] = s
        self.seen = total

    def find(self, tokens: Sequence[int]) -> int | None:
        total = len(tokens)
        for n in reversed(self.sizes):
            if n >= total:
                continue
            s = self.grams[n].get(tuple(tokens[total - n :]))
            if s is not None:
                return s + n
        return None


class NgramDrafter:
    def __init__(self, k: int, lookup_min: int, lookup_max: int) -> None:
        self.k = k
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._index: weakref.WeakKeyDictionary[object, NgramIndex] = weakref.WeakKeyDictionary()

    def find(self, tokens: Sequence[int]) -> int | None:
        """Index just past the latest earlier match of the longest suffix that has one (a
        scan: the reference the per-sequence index is tested against)."""
        n_tok = len(tokens)
        for n in range(min(self.lookup_max, n_tok - 1), self.lookup_min - 1, -1):
            suffix = list(tokens[n_tok - n :])
            # Latest start first; the suffix itself (start n_tok - n) is not a match.
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                    return start + n
        return None

    def propose(self, tokens: Sequence[int], src: int | None = None) -> list[int]:
        """k draft tokens to follow `tokens` (host ids, none pending); src: a known match end."""
        if src is None:
            src = self.find(tokens)
        if src is None:
            return [tokens[-1]] * self.k
        ctx = list(tokens[src:])
        draft = []
        for j in range(self.k):
            tok = ctx[j]  # src + j < len(tokens) + j: ctx grows by one each time
            draft.append(tok)
            ctx.append(tok)
        return draft

    def _match(self, s: _Tokens) -> int | None:
        index = self._index.get(s)
        if index is None:
            index = self._index[s] = NgramIndex(self.lookup_min, self.lookup_max)
        index.extend(s.token_ids)  # a second call within a step adds nothing
        return index.find(s.token_ids)

    def has_drafts(self, seqs: Sequence[_Tokens]) -> bool:
        """Whether any sequence's suffix has an earlier match (else the step decodes plainly)."""
        return any(self._match(s) is not None for s in seqs)

    def propose_batch(self, seqs: Sequence[_Tokens]) -> list[list[int]]:
        out = []
        for s in seqs:
            src = self._match(s)
            out.append(
                self.propose(s.token_ids, src) if src is not None else [s.token_ids[-1]] * self.k
            )
        return out
