"""N-gram (prompt lookup) drafter: continue the latest earlier occurrence of the suffix.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are looked up among
the earlier tokens (prompt and output); the k tokens that followed the latest match are the
draft. The copy may run into the tokens it is proposing (a repeating pattern), so it reads from
tokens + draft. Without a match the draft is the last token repeated: a step keeps the uniform
k + 1 rows its graph bucket holds, and the target still yields its one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Tokens(Protocol):
    token_ids: list[int]


class NgramDrafter:
    def __init__(self, k: int, lookup_min: int, lookup_max: int) -> None:
        self.k = k
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def find(self, tokens: Sequence[int]) -> int | None:
        """Index just past the latest earlier match of the longest suffix that has one."""
        n_tok = len(tokens)
        for n in range(min(self.lookup_max, n_tok - 1), self.lookup_min - 1, -1):
            suffix = list(tokens[n_tok - n :])
            # Latest start first; the suffix itself (start n_tok - n) is not a match.
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                    return start + n
        return None

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """k draft tokens to follow `tokens` (host ids, none pending)."""
        src = self.find(tokens)
        if src is None:
            return [tokens[-1]] * self.k
        ctx = list(tokens)
        draft = []
        for j in range(self.k):
            tok = ctx[src + j]  # src + j < len(ctx): src < len(tokens), ctx grows by one each time
            draft.append(tok)
            ctx.append(tok)
        return draft

    def propose_batch(self, seqs: Sequence[_Tokens]) -> list[list[int]]:
        return [self.propose(s.token_ids) for s in seqs]
