"""A token-chain model of a Llama shape, for a copy-heavy speculative-decoding workload.

Dummy (random) weights cannot copy: on the H200 a random llama-3.2-1b's greedy answers had
127 distinct tokens of 128, so an n-gram drafter reading the prompt accepted nothing. Here a
loaded model's weights are rewritten, in place, so that its greedy continuation of any token
of a chain S (n tokens, one cycle, succ its successor map) is succ of that token, whatever
the context: a prompt holding a span of the chain, a break, then the span's first tokens
again is answered by the rest of the span, which is what prompt lookup copies.

The construction (`apply_chain`, on the live parameters with copy_ / slice writes, so
compiled code and CUDA graphs keep reading the same tensors):
- every layer's o_proj and every MLP's down_proj is zero (biases too), except layer 0's MLP:
  the residual stream stays the token's embedding E[s] through attention (which still runs,
  at full cost: its output meets a zero o_proj);
- layer 0's MLP (its norm weight set to ones): for the chain's j-th token s_j, with
  e_j = RMSNorm(E[s_j]), gate row j = A * e_j, up row j = e_j and down column
  j = C * E[succ(s_j)] / act_j, act_j = silu(A e_j.e_j) * (e_j.e_j); the other channels zero.
  silu(gate.x) * up.x is ~A (e_j.x)^2 for e_j.x > 0 and ~0 below, so at x = e_i channel i
  carries act_i and channel j != i a share ~(e_j.e_i / d)^2 ~ 1/d: the stream leaves layer 0
  as E[s] + C * E[succ(s)] + (small noise);
- the final norm weight is ones and the logits read E (the tied embedding; an untied lm_head
  is set to E), so succ(s)'s logit is ~sqrt(d) |E[succ(s)]| and any other token's a random
  cosine of that (E[s]'s is 1/C of it).
`margin` checks the result numerically in the model's dtype (every s of S, over the whole
vocabulary): the worst gap between succ(s)'s logit and the best other logit; `apply_chain`
raises when any s does not map to succ(s). Only the weights change: the engine, its shapes,
kernels and graphs are those of the model served.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from atom.layers.norm_linear import reference_projection
from atom.layers.rmsnorm import rms_norm

A = 1.0  # gate scale: channel j's gate is A * e_j.x, A * d at its own token (d: hidden size)
C = 8.0  # the successor's embedding against the residual's own (E[s]: 1/C of the signal)


@dataclass(frozen=True)
class Chain:
    """tokens[i]'s successor is tokens[(i + 1) % n]: one cycle over n distinct ids."""

    tokens: tuple[int, ...]

    @classmethod
    def draw(cls, vocab: int, n: int, seed: int, avoid: set[int]) -> Chain:
        ids = [t for t in range(vocab) if t not in avoid]
        if n > len(ids):
            raise ValueError(f"a chain of {n} tokens needs {n} ids, the vocabulary has {len(ids)}")
        return cls(tuple(random.Random(seed).sample(ids, n)))

    def succ(self, token: int) -> int:
        return self.tokens[(self._pos[token] + 1) % len(self.tokens)]

    @cached_property
    def _pos(self) -> dict[int, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def walk(self, start: int, length: int) -> list[int]:
        """`length` tokens of the cycle from position `start`."""
        n = len(self.tokens)
        return [self.tokens[(start + i) % n] for i in range(length)]

    def continuation(self, token: int, length: int) -> list[int]:
        """The `length` tokens the chain model generates after `token`."""
        return self.walk(self._pos[token] + 1, length)


@dataclass
class ChainWeights:
    """What the chain model's next token depends on: E, the logits' matrix, layer 0's MLP
    norm and its n chain channels (gate [n, d], up [n, d], down [d, n]), the final norm."""

    embed: torch.Tensor
    head: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    final_norm: torch.Tensor
    eps: float

    @classmethod
    def build(
        cls, embed: torch.Tensor, chain: Chain, eps: float, a: float = A, c: float = C
    ) -> ChainWeights:
        """The construction for embedding E (the module docstring), in E's dtype."""
        ones = torch.ones(embed.shape[1], dtype=embed.dtype, device=embed.device)
        ids = torch.tensor(chain.tokens, device=embed.device)
        nxt = torch.roll(ids, -1)
        x = rms_norm(embed[ids], ones, eps)  # the MLP's input at token s_j
        gate, up = (a * x.float()).to(embed.dtype), x
        dot_g, dot_u = (x.float() * gate.float()).sum(-1), (x.float() * up.float()).sum(-1)
        act = F.silu(dot_g) * dot_u  # channel j's activation at its own token
        down = (c * embed[nxt].float() / act[:, None]).t().contiguous().to(embed.dtype)
        return cls(embed, embed, ones, gate, up, down, ones.clone(), eps)

    @classmethod
    def of_model(cls, model: Any, n: int) -> ChainWeights:
        """The live model's tensors (views), its first n MLP channels of layer 0."""
        llama = model.model
        layer = llama.layers[0]
        mlp = layer.mlp.gate_up_proj
        head = llama.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
        return cls(
            llama.embed_tokens.weight.data,
            head.data,
            layer.post_attention_layernorm.weight.data,
            mlp.shard_views("gate")["weight"][:n],
            mlp.shard_views("up")["weight"][:n],
            layer.mlp.down_proj.weight.data[:, :n],
            llama.norm.weight.data,
            float(llama.norm.eps),
        )


@torch.inference_mode()
def margin(w: ChainWeights, chain: Chain, rows: int = 256) -> dict[str, Any]:
    """Each chain token's logits through the chain model's path, in its dtype (the model's
    unfused math: atom.layers.norm_linear.reference_projection): the worst gap between
    succ(s)'s logit and the best other token's over all s, and the tokens that miss."""
    ids = torch.tensor(chain.tokens, device=w.embed.device)
    nxt = torch.roll(ids, -1)
    gate_up = torch.cat([w.gate, w.up])
    gaps, succ_logits, wrong = [], [], []
    for lo in range(0, len(ids), rows):
        s, t = ids[lo : lo + rows], nxt[lo : lo + rows]
        h = w.embed[s]
        act = reference_projection(h, gate_up, None, norm_weight=w.mlp_norm, eps=w.eps, gated=True)
        h = reference_projection(act, w.down, None, residual=h)
        logits = reference_projection(h, w.head, None, norm_weight=w.final_norm, eps=w.eps).float()
        right = logits.gather(1, t[:, None]).squeeze(1)
        logits.scatter_(1, t[:, None], float("-inf"))
        gap = right - logits.max(1).values
        gaps.append(gap)
        succ_logits.append(right)
        wrong += s[gap <= 0].tolist()
    gap, right = torch.cat(gaps), torch.cat(succ_logits)
    return {
        "n": len(ids),
        "min_gap": float(gap.min()),
        "median_gap": float(gap.median()),
        "min_succ_logit": float(right.min()),
        "wrong": wrong,
        "dtype": str(w.embed.dtype).removeprefix("torch."),
    }


@torch.no_grad()
def apply_chain(model: Any, chain: Chain, a: float = A, c: float = C) -> dict[str, Any]:
    """Make `model` (a LlamaForCausalLM at TP 1) the chain model, in place on its parameters;
    the margin of the result (read back from the model), raising if any s misses succ(s)."""
    if model.tp.world_size != 1:
        raise ValueError("the chain construction writes a whole model: tensor parallel size 1")
    llama = model.model
    n, inter = len(chain.tokens), llama.layers[0].mlp.down_proj.weight.shape[1]
    if n > inter:
        raise ValueError(f"a chain of {n} tokens needs {n} MLP channels, the model has {inter}")
    eps = float(llama.layers[0].post_attention_layernorm.eps)
    built = ChainWeights.build(llama.embed_tokens.weight.data, chain, eps, a, c)
    for layer in llama.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight.data.zero_()
            if proj.bias is not None:
                proj.bias.data.zero_()
    layer = llama.layers[0]
    layer.post_attention_layernorm.weight.data.fill_(1.0)
    mlp = layer.mlp.gate_up_proj
    mlp.weight.data.zero_()
    if mlp.bias is not None:
        mlp.bias.data.zero_()
    live = ChainWeights.of_model(model, n)
    live.gate.copy_(built.gate)
    live.up.copy_(built.up)
    live.down.copy_(built.down)
    live.final_norm.fill_(1.0)
    if not model.tie_word_embeddings:
        live.head.copy_(live.embed)
        if model.lm_head.bias is not None:
            model.lm_head.bias.data.zero_()
    report = margin(live, chain)
    if report["wrong"]:
        raise RuntimeError(
            f"chain model: {len(report['wrong'])} of {n} chain tokens do not "
            f"map to their successor ({report})"
        )
    return {**report, "a": a, "c": c}


def copy_prompts(
    chain: Chain,
    batch: int,
    max_tokens: int,
    seed: int,
    slack: int = 32,
    filler: int = 8,
    repeat: int = 4,
) -> tuple[list[list[int]], list[list[int]]]:
    """Per request: a chain span of max_tokens + slack tokens from a random position, `filler`
    random chain tokens none followed by its successor (the break), then the span's first
    `repeat` tokens again. The expected answer, the chain after the last token, is the span's
    continuation of that repeat: a span of the prompt."""
    span_len, n = max_tokens + slack, len(chain.tokens)
    if span_len > n:
        raise ValueError(f"a span of {span_len} tokens does not fit a chain of {n}")
    rng = random.Random(seed)
    prompts, expected = [], []
    for _ in range(batch):
        span = chain.walk(rng.randrange(n), span_len)
        brk: list[int] = []
        while len(brk) < filler:
            prev = brk[-1] if brk else span[-1]
            tok = rng.choice(chain.tokens)
            last = len(brk) == filler - 1
            if tok != chain.succ(prev) and not (last and chain.succ(tok) == span[0]):
                brk.append(tok)
        prompt = span + brk + span[:repeat]
        prompts.append(prompt)
        expected.append(chain.continuation(prompt[-1], max_tokens))
    return prompts, expected
