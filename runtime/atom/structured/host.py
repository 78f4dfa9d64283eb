"""The engine's side of structured output: a matcher per constrained sequence, a mask per step.

`attach` compiles (through the cache) when a request arrives; a grammar the backend refuses is
a ValueError, which the engine core answers with a 400. `step_mask` brings each constrained
sequence's matcher up to its tokens and fills the step's mask while the GPU runs the forward
(the engine calls it after launching the forward, before sampling); `verify_mask` does the same
for a speculative verify's k + 1 rows per request. A step with no constrained row costs one
pass over the batch and returns None: the sampler then does exactly what it did before.
The tokenizer (for the vocabulary) is read in a thread started with the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import xgrammar as xgr

from atom.engine.sequence import PENDING_TOKEN, Sequence
from atom.structured.bitmask import MaskBuffers, StepMask
from atom.structured.compiler import GrammarCache
from atom.structured.matcher import GrammarState
from atom.structured.spec import StructuredSpec
from atom.structured.vocab import tokenizer_info


class StructuredHost:
    def __init__(self, model: str, vocab_size: int, stop_ids: list[int], max_rows: int,
                 device: torch.device,
                 special_ids: tuple[int | None, int | list[int] | None] = (None, None)) -> None:
        """special_ids: the model's BOS and EOS ids as its config has them (the byte
        tokenizer's, when it is the one: atom.tokenizer.load_tokenizer)."""
        self.model = model
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.max_rows = max_rows
        self.device = device
        self.special_ids = special_ids
        self._cache: GrammarCache | None = None
        self._buffers: MaskBuffers | None = None
        self._failure: Exception | None = None
        # The vocabulary is read beside the engine's start (a GGUF tokenizer takes seconds), so
        # the first constrained request does not stall the step loop for it.
        self._loading = threading.Thread(target=self._load, name="structured-vocab", daemon=True)
        self._loading.start()

    def _load(self) -> None:
        from atom.tokenizer import load_tokenizer

        try:
            bos, eos = self.special_ids
            tok = load_tokenizer(self.model, self.vocab_size, bos,
                                 [eos] if isinstance(eos, int) else eos)
            info = tokenizer_info(tok, self.vocab_size, self.stop_ids)
        except Exception as exc:  # reported to the first constrained request, not at start
            self._failure = exc
            return
        if self._cache is None:
            self._cache = GrammarCache(info)

    @property
    def cache(self) -> GrammarCache:
        self._loading.join()
        if self._cache is None:
            raise ValueError(f"structured output is not available for {self.model}: "
                             f"{self._failure}")
        return self._cache

    def set_tokenizer_info(self, info: xgr.TokenizerInfo) -> None:
        """Use this vocabulary (tests, and servers that already hold one)."""
        self._loading.join()
        self._cache = GrammarCache(info)

    def attach(self, seq: Sequence, spec: StructuredSpec) -> None:
        seq.grammar = GrammarState(self.cache.get(spec))

    def _take(self, n: int) -> tuple[torch.Tensor, int]:
        if self._buffers is None:
            self._buffers = MaskBuffers(self.max_rows, self.vocab_size, self.device)
        return self._buffers.take(n)

    def _mask(self, host: torch.Tensor, turn: int, rows: list[int]) -> StepMask:
        assert self._buffers is not None
        return self._buffers.mask(host, turn, rows)

    def step_mask(self, seqs: list[Sequence],
                  in_flight: Callable[[], list[int]] | None = None) -> StepMask | None:
        """The mask of a step sampling one row per sequence (None: no row is constrained).
        in_flight(): the host tokens of the step in flight (asynchronous scheduling), for
        sequences whose last token is still pending."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        host, turn = self._take(len(seqs))
        pending: list[int] | None = None
        for i in rows:
            seq = seqs[i]
            grammar = seq.grammar
            assert grammar is not None
            if seq.token_ids[-1] == PENDING_TOKEN and pending is None and in_flight is not None:
                pending = in_flight()
            _catch_up(seq, grammar, pending)
            grammar.fill(host, i)
        return self._mask(host, turn, rows)

    def verify_mask(self, seqs: list[Sequence], drafts: list[list[int]]) -> StepMask | None:
        """The mask of a verify step: k + 1 rows per sequence, in order."""
        rows_per = len(drafts[0]) + 1 if drafts else 1
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not constrained:
            return None
        host, turn = self._take(len(seqs) * rows_per)
        rows: list[int] = []
        for i in constrained:
            grammar = seqs[i].grammar
            assert grammar is not None
            _catch_up(seqs[i], grammar, None)
            grammar.fill_drafts(host, i * rows_per, drafts[i])
            rows.extend(range(i * rows_per, (i + 1) * rows_per))
        return self._mask(host, turn, rows)


def _catch_up(seq: Sequence, grammar: GrammarState, in_flight: list[int] | None) -> None:
    """Feed the matcher the output tokens it has not seen; a pending one from in_flight."""
    start = seq.num_prompt_tokens + grammar.consumed
    new = seq.token_ids[start:]
    if new and new[-1] == PENDING_TOKEN:
        if in_flight is None or seq.pending_src is None:
            raise RuntimeError(f"{seq.request_id}: a pending token without the step in flight")
        new = [*new[:-1], in_flight[seq.pending_src]]
    grammar.advance(new)
