"""Penalties and logit_bias on the sampler's path, as tensor ops on the logits' device.

Order (vLLM's): logit_bias is added first, then repetition_penalty (transformers'
RepetitionPenaltyLogitsProcessor: over the prompt and the output, a positive logit divided by
the penalty, a negative one multiplied), then OpenAI's frequency and presence penalties
(logit -= frequency * count + presence * [count > 0], over the output only).

Each processed sequence keeps its own device state, built once and grown by the tokens it
generated since the last step: a [vocab] count of its output tokens and a [vocab] mask of its
prompt's tokens. So a step costs a stack of the rows' state, not a copy of their token lists.
The output tokens must be on the host when a step is sampled: the engine reads a step that
sampled processed rows before it schedules the next (LLMEngine.step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from atom.engine.batch import PENDING_TOKEN
from atom.engine.sequence import Sequence


@dataclass
class _RowState:
    prompt_mask: torch.Tensor  # bool [vocab]: tokens of the prompt (repetition_penalty)
    counts: torch.Tensor  # int32 [vocab]: how often each token was generated
    bias_ids: torch.Tensor | None  # logit_bias as two device tensors (None: no bias)
    bias_values: torch.Tensor | None
    seen: int = 0  # output tokens already counted


class LogitsProcessors:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rows: weakref.WeakKeyDictionary[Sequence, _RowState] = weakref.WeakKeyDictionary()

    def _state(self, seq: Sequence, vocab: int) -> _RowState:
        state = self._rows.get(seq)
        if state is None:
            prompt = device_tensor(seq.token_ids[:seq.num_prompt_tokens], torch.long,
                                   self.device)
            mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            mask.index_fill_(0, prompt, True)  # the engine checked the ids against the vocab
            bias = seq.params.logit_bias
            ids = vals = None
            if bias:
                ids = device_tensor(list(bias.keys()), torch.long, self.device)
                vals = device_tensor(list(bias.values()), torch.float32, self.device)
            counts = torch.zeros(vocab, dtype=torch.int32, device=self.device)
            state = _RowState(mask, counts, ids, vals)
            self._rows[seq] = state
        new = seq.token_ids[seq.num_prompt_tokens + state.seen:]
        if new:
            if PENDING_TOKEN in new:
                raise RuntimeError(f"{seq.request_id}: a penalty needs every output token on "
                                   "the host (the engine reads such a step before the next)")
            ids = device_tensor(new, torch.long, self.device)
            state.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            state.seen += len(new)
        return state

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """fp32 logits [n, vocab] with each processed row's processors applied (a new tensor;
        the other rows are the widened input)."""
        out = logits.float()
        if out is logits:
            out = logits.clone()
        rows = [i for i, s in enumerate(seqs) if s.params.processed]
        if not rows:
            return out
        vocab = out.shape[-1]
        states = [self._state(seqs[i], vocab) for i in rows]
        params = [seqs[i].params for i in rows]
        idx = device_tensor(rows, torch.long, self.device)
        sub = out[idx]
        for j, st in enumerate(states):
            if st.bias_ids is not None and st.bias_values is not None:
                sub[j].index_add_(0, st.bias_ids, st.bias_values)
        counts = torch.stack([st.counts for st in states])
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.stack([st.prompt_mask for st in states]) | (counts > 0)
            rep = _column([p.repetition_penalty for p in params], self.device)
            penalized = torch.where(sub < 0, sub * rep, sub / rep)
            sub = torch.where(seen, penalized, sub)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            freq = _column([p.frequency_penalty for p in params], self.device)
            pres = _column([p.presence_penalty for p in params], self.device)
            sub = sub - freq * counts - pres * (counts > 0)
        out[idx] = sub
        return out


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return device_tensor(values, torch.float32, device)[:, None]


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without waiting for the GPU: a copy from pageable memory
    would synchronise the stream (and stall the step launched ahead)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
