"""One request's grammar matcher, kept in step with the tokens the request has.

The engine never feeds it token by token: before a step's mask is filled, `advance` takes the
output tokens the matcher has not seen (the host knows them by then; under asynchronous
scheduling the step in flight's token comes from its copy). A verify step walks the drafts
(`fill_drafts`), filling one mask row per position, and rolls the matcher back to where it
was: the emitted tokens reach it through `advance` like any others.
"""

from __future__ import annotations

import logging

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)

ALL_ALLOWED = -1  # an int32 word with every bit set


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.consumed = 0  # output tokens the matcher has accepted (or skipped once broken)
        self.broken = False  # a token the grammar refused reached it: constrain no further

    def advance(self, tokens: list[int]) -> None:
        for t in tokens:
            self.consumed += 1
            if self.broken or self.matcher.is_terminated():
                continue  # past the end (ignore_eos): the grammar has nothing more to say
            if not self.matcher.accept_token(t):
                # Only a token sampled without this mask can do it (a P/D peer's first token).
                logger.warning("token %d is outside the grammar; no longer constraining", t)
                self.broken = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.broken or self.matcher.is_terminated():
            bitmask[row].fill_(ALL_ALLOWED)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Rows first_row .. first_row + len(drafts): the mask after each prefix of the drafts.
        A draft the grammar refuses is masked out of its own row (so it is rejected there);
        the rows after it are left all-allowed (never read). The matcher ends where it began."""
        self.fill(bitmask, first_row)
        walked = 0
        for i, d in enumerate(drafts):
            row = first_row + i + 1
            if self.broken or self.matcher.is_terminated() or not self.matcher.accept_token(d):
                bitmask[row : first_row + len(drafts) + 1].fill_(ALL_ALLOWED)
                break
            walked += 1
            self.fill(bitmask, row)
        if walked:
            self.matcher.rollback(walked)
