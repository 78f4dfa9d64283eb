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


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> tuple[list[int], list[float | None]]:
        n = len(seqs)
        if n == 0:
            return [], []
        logits = logits[:n]
        params = [s.params for s in seqs]
        greedy_tok = logits.argmax(dim=-1)
        tokens = greedy_tok
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sample_rows:
            rows = torch.tensor(sample_rows, device=logits.device)
            sub = logits[rows].float()
            temp = torch.tensor([params[i].temperature for i in sample_rows], device=logits.device)
            sub = sub / temp[:, None]
            if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in sample_rows):
                top_k = torch.tensor([params[i].top_k for i in sample_rows], device=logits.device)
                top_p = torch.tensor([params[i].top_p for i in sample_rows], device=logits.device,
                                     dtype=torch.float32)
                sub = apply_top_k_top_p(sub, top_k, top_p)
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(sample_rows):
                gen = seqs[i].generator or self.generator
                noise[j].exponential_(generator=gen)
            drawn = (probs / noise).argmax(dim=-1)
            tokens = greedy_tok.clone()
            tokens[rows] = drawn
        want_lp = [p.logprobs for p in params]
        token_list = tokens.tolist()
        if not any(want_lp):
            return token_list, [None] * n
        lp = (logits.log_softmax(dim=-1, dtype=torch.float32)
              .gather(-1, tokens[:, None]).squeeze(-1).tolist())
        return token_list, [v if w else None for v, w in zip(lp, want_lp, strict=True)]
