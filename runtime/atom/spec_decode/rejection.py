"""Acceptance of k draft tokens against the target's k + 1 rows of logits.

Greedy requests: a draft is accepted while it equals the target's argmax; the first
mismatching row's argmax (or the bonus row's) follows, so the tokens are exactly those of
decoding without speculation. Sampled requests: standard rejection sampling with a point-mass
proposal (both drafters propose deterministically): draft d at row i is accepted with
probability min(1, p_i(d) / 1) = p_i(d); on rejection the token is drawn from
norm(max(0, p_i - q_i)) = p_i with d removed; after k acceptances the bonus row is sampled
from p_k. Every emitted token is then distributed as the target's (Leviathan et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.engine.params import SamplingParams
from atom.engine.sampler import apply_top_k_top_p, argmax


@dataclass(frozen=True)
class Verdict:
    """One request's outcome: the tokens it emits (accepted drafts + one) and their logprobs."""

    tokens: list[int]
    logprobs: list[float] | None
    num_accepted: int  # drafts accepted (len(tokens) - 1)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for these rows: temperature, top-k, top-p."""
    x = logits.float() / float(params.temperature)
    if params.top_k > 0 or params.top_p < 1.0:
        rows = x.shape[0]
        top_k = torch.full((rows,), params.top_k, dtype=torch.long, device=x.device)
        top_p = torch.full((rows,), float(params.top_p), device=x.device)
        x = apply_top_k_top_p(x, top_k, top_p)
    return x.softmax(dim=-1)


def accept_point_mass(
    probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None
) -> list[int]:
    """probs [k + 1, vocab] (host fp32); the emitted tokens under rejection sampling."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        if u < float(probs[i, d]):
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p_i was the point mass on d: u < 1 always accepts
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


def verify(
    logits: torch.Tensor,
    drafts: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_gen: torch.Generator,
) -> list[Verdict]:
    """logits [n * (k + 1), vocab] in request order; drafts: n lists of k ids."""
    n = len(drafts)
    k = len(drafts[0]) if n else 0
    rows = logits[: n * (k + 1)]
    greedy_ids = argmax(rows).view(n, k + 1).tolist()
    want_lp = any(p.logprobs for p in params)
    logp = rows.log_softmax(dim=-1, dtype=torch.float32).view(n, k + 1, -1) if want_lp else None
    verdicts = []
    for i in range(n):
        if params[i].greedy:
            ids = greedy_ids[i]
            a = 0
            while a < k and drafts[i][a] == ids[a]:
                a += 1
            tokens = drafts[i][:a] + [ids[a]]
        else:
            probs = target_probs(rows[i * (k + 1) : (i + 1) * (k + 1)], params[i]).cpu()
            tokens = accept_point_mass(probs, drafts[i], generators[i] or default_gen)
        lps = None
        if logp is not None and params[i].logprobs:
            idx = torch.tensor(tokens, device=logp.device)
            lps = logp[i, torch.arange(len(tokens), device=logp.device), idx].tolist()
        verdicts.append(Verdict(tokens, lps, len(tokens) - 1))
    return verdicts
