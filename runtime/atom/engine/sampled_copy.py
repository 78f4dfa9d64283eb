"""A launched step's sampled tokens on their way to the host (asynchronous scheduling).

The engine launches a step and reads the step before it while the GPU runs (docs/architecture.md,
"Asynchronous scheduling"), so the tokens of a step are written into pinned host memory by a
kernel (atom.kernels.triton_copy) without waiting, and read once the event after it has
passed. Two buffers serve in turn: the step being read and the step launched after it never
share one, and a buffer's next use comes only after the engine has read it.
"""

from __future__ import annotations

import torch

from atom.engine.params import MAX_TOP_LOGPROBS, TopLogprobs
from atom.engine.sampler import Sampled


class SampledCopy:
    """One step's token ids (and logprobs) being copied to the host."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor | None,
                 event: torch.cuda.Event | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.tokens = tokens  # host (pinned) or, on the CPU, the sampler's own tensors
        self.logprobs = logprobs
        self.top = top  # ids and logprobs [n, k] of each row's most likely tokens
        self._event = event

    def result(self) -> tuple[list[int], list[float] | None]:
        """The values, once the copies have run."""
        if self._event is not None:
            self._event.synchronize()
        lps = None if self.logprobs is None else self.logprobs.tolist()
        return self.tokens.tolist(), lps

    def top_logprobs(self) -> list[TopLogprobs] | None:
        """Per row, its alternatives best first (after result())."""
        if self.top is None:
            return None
        ids, lps = self.top
        return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), lps.tolist(),
                                                               strict=True)]


class SampledCopier:
    """Starts the copies of a step's sampled tokens into one of two pinned host buffers."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._turn = 0
        if self._cuda:
            self._tokens = [torch.empty(capacity, dtype=torch.long, pin_memory=True)
                            for _ in range(2)]
            self._logprobs = [torch.empty(capacity, dtype=torch.float32, pin_memory=True)
                              for _ in range(2)]
            top = capacity * MAX_TOP_LOGPROBS
            self._top_ids = [torch.empty(top, dtype=torch.long, pin_memory=True)
                             for _ in range(2)]
            self._top_lps = [torch.empty(top, dtype=torch.float32, pin_memory=True)
                             for _ in range(2)]

    def next_tokens(self, n: int) -> torch.Tensor | None:
        """The pinned buffer [n] the next start() reads the token ids from, for the sampler to
        write into directly (None on the CPU)."""
        return self._tokens[self._turn][:n] if self._cuda else None

    def start(self, sampled: Sampled, tokens_on_host: bool = False) -> SampledCopy:
        """Queue the copies of the tokens [n] (and logprobs [n], alternatives [n, k]) on the
        current stream; tokens_on_host: the token ids are already queued into next_tokens(n)."""
        tokens, logprobs, top = sampled.tokens, sampled.logprobs, sampled.top
        if not self._cuda:
            return SampledCopy(tokens, logprobs, None,
                               None if top is None else (top.ids, top.logprobs))
        from atom.kernels.triton_copy import copy_to_host

        n, turn = tokens.shape[0], self._turn
        self._turn ^= 1
        host_tokens = self._tokens[turn][:n]
        if not tokens_on_host:
            copy_to_host(tokens, host_tokens)  # by the SMs: a copy engine's turn idled the GPU
        host_lps = None
        if logprobs is not None:
            host_lps = self._logprobs[turn][:n]
            copy_to_host(logprobs.contiguous(), host_lps)
        host_top = None
        if top is not None:
            size = top.ids.numel()
            ids, lps = self._top_ids[turn][:size], self._top_lps[turn][:size]
            copy_to_host(top.ids.reshape(-1), ids)
            copy_to_host(top.logprobs.reshape(-1), lps)
            host_top = (ids.view(top.ids.shape), lps.view(top.ids.shape))
        event = torch.cuda.Event()
        event.record()
        return SampledCopy(host_tokens, host_lps, event, host_top)
