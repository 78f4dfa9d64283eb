"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token logprob.

Greedy rows take the argmax of the raw logits, in the model's dtype (widening to fp32 is exact
and keeps the order, so the token is the same without the copy). Sampled rows, widened to fp32,
use the exponential-race trick (argmax of p / Exp(1) noise is a draw from p); a request with a
seed draws its noise from its own torch.Generator, so its tokens do not depend on what else is
in the batch.
Logprobs are of the model's raw distribution (before penalties, logit_bias, temperature,
top-k and top-p), as vLLM's default; a row's top_logprobs alternatives are a top-k on the device,
so only [n, k] values travel to the host.
Rows with penalties or a logit_bias are processed first (atom.engine.logits_processors); a
batch without any takes the plain path with no extra work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import msgspec
import torch

from atom.engine.logits_processors import LogitsProcessors, device_tensor
from atom.engine.sequence import Sequence

if TYPE_CHECKING:
    from atom.structured.bitmask import StepMask


class TopK(NamedTuple):
    """The k most likely tokens of each row of a step (k: the most any row asked for)."""

    ids: torch.Tensor  # int64 [n, k]
    logprobs: torch.Tensor  # fp32 [n, k]


class Sampled(msgspec.Struct, gc=False):
    """One step's sampling, on the logits' device; nothing waited for the GPU. (A Struct: one
    is made every step, and its constructor, in C, costs a third of a NamedTuple's.)"""

    tokens: torch.Tensor  # int64 [n]
    logprobs: torch.Tensor | None  # fp32 [n]: the chosen tokens' (None: no row asked)
    top: TopK | None  # None: no row asked for alternatives
    processed: bool  # a row went through the logits processors (they read its output tokens)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. top_k <= 0: no limit."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, masked)


def argmax(x: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
    """x.argmax(dim=-1) of 2-D x; on CUDA through atom.kernels.triton_argmax (a vocabulary
    row in one torch reduction costs 35 us on the H200, there about 3), which also writes
    host (pinned) when given."""
    if x.is_cuda:
        from atom.kernels.triton_argmax import argmax_rows

        return argmax_rows(x, host)
    return x.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.processors = LogitsProcessors(self.device)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _rows_tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return device_tensor(values, dtype, self.device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               host_tokens: torch.Tensor | None = None, mask: StepMask | None = None
               ) -> Sampled:
        """The n rows' tokens (and logprobs where asked). host_tokens (pinned int64 [n], CUDA
        only): the token ids are also written there, on the stream."""
        n = len(seqs)
        raw = logits = logits[:n]
        params = [s.params for s in seqs]
        processed = any([p.processed for p in params])
        if processed:
            logits = self.processors.apply(logits, seqs)
        if mask is not None:  # structured output: disallowed tokens to -inf (raw kept for logprobs)
            logits = mask.apply(logits if logits is not raw else logits.clone())
        sample_rows = [i for i, p in enumerate(params) if p.temperature != 0]  # not p.greedy
        # An all-greedy step's argmax writes the host copy itself (no copy kernel after it).
        tokens = argmax(logits, None if sample_rows else host_tokens)
        if sample_rows:
            rows = self._rows_tensor(sample_rows, torch.long)
            sub = logits[rows].float()
            temp = self._rows_tensor([params[i].temperature for i in sample_rows], torch.float32)
            sub = sub / temp[:, None]
            if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in sample_rows):
                top_k = self._rows_tensor([params[i].top_k for i in sample_rows], torch.long)
                top_p = self._rows_tensor([params[i].top_p for i in sample_rows], torch.float32)
                sub = apply_top_k_top_p(sub, top_k, top_p)
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(sample_rows):
                gen = seqs[i].generator or self.generator
                noise[j].exponential_(generator=gen)
            drawn = argmax(probs / noise)
            tokens = tokens.clone()
            tokens[rows] = drawn
            if host_tokens is not None:
                from atom.kernels.triton_copy import copy_to_host

                copy_to_host(tokens, host_tokens)
        if not any([p.logprobs for p in params]):
            return Sampled(tokens, None, None, processed)
        logp = raw.log_softmax(dim=-1, dtype=torch.float32)
        lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
        k = max(p.top_logprobs if p.logprobs else 0 for p in params)
        top = None
        if k:
            values, ids = logp.topk(k, dim=-1)
            top = TopK(ids, values)
        return Sampled(tokens, lp, top, processed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> tuple[list[int], list[float | None]]:
        """sample(), brought to the host: token ids, and logprobs where a request asks."""
        if not seqs:
            return [], []
        out = self.sample(logits, seqs)
        lp = out.logprobs
        return host_results(out.tokens.tolist(), None if lp is None else lp.tolist(), seqs)


def host_results(tokens: list[int], logprobs: list[float] | None, seqs: list[Sequence]
                 ) -> tuple[list[int], list[float | None]]:
    """Token ids and, per request, its logprob or None when it did not ask."""
    if logprobs is None:
        return tokens, [None] * len(tokens)
    return tokens, [v if s.params.logprobs else None for v, s in zip(logprobs, seqs, strict=True)]
