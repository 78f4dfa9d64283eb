"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token logprob.

Greedy rows take the argmax of the raw logits, in the model's dtype (widening to fp32 is exact
and keeps the order, so the token is the same without the copy). Sampled rows, widened to fp32,
use the exponential-race trick (argmax of p / Exp(1) noise is a draw from p); a request with a
seed draws its noise from its own torch.Generator, so its tokens do not depend on what else is
in the batch.
Logprobs are of the model's raw distribution (before temperature / top-k / top-p).
"""

from __future__ import annotations

import torch

from atom.engine.sequence import Sequence


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

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _rows_tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Per-row parameters on the device without waiting for the GPU: a copy from pageable
        memory would synchronise the stream (and stall the step launched ahead)."""
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               host_tokens: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids [n] (int64) and, when any request asks, logprobs [n] (fp32) of the n
        rows, on the logits' device; nothing waits for the GPU. host_tokens (pinned int64
        [n], CUDA only): the token ids are also written there, on the stream."""
        n = len(seqs)
        logits = logits[:n]
        params = [s.params for s in seqs]
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
            return tokens, None
        lp = logits.log_softmax(dim=-1, dtype=torch.float32).gather(-1, tokens[:, None])
        return tokens, lp.squeeze(-1)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> tuple[list[int], list[float | None]]:
        """sample(), brought to the host: token ids, and logprobs where a request asks."""
        if not seqs:
            return [], []
        tokens, lp = self.sample(logits, seqs)
        return host_results(tokens.tolist(), None if lp is None else lp.tolist(), seqs)


def host_results(tokens: list[int], logprobs: list[float] | None, seqs: list[Sequence]
                 ) -> tuple[list[int], list[float | None]]:
    """Token ids and, per request, its logprob or None when it did not ask."""
    if logprobs is None:
        return tokens, [None] * len(tokens)
    return tokens, [v if s.params.logprobs else None for v, s in zip(logprobs, seqs, strict=True)]
