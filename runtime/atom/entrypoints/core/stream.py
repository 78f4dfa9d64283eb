"""One request's outputs on the API server's side, between the core's messages and its handler.

`RequestStream.push` appends what a step produced and wakes the handler once; `get` hands over
everything new as one `Chunk`, so a handler that lags behind takes several steps at once.
"""

from __future__ import annotations

import asyncio
import time

from atom.engine.params import TopLogprobs
from atom.entrypoints.core import messages as msgs


class Chunk:
    """What a request produced since its handler last looked (one or more engine steps)."""

    __slots__ = (
        "finish_reason",
        "kv_secret",
        "logprobs",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "tokens",
        "top_logprobs",
    )

    def __init__(
        self,
        tokens: list[int],
        logprobs: list[float] | None,
        finish: str | None,
        num_prompt: int,
        num_output: int,
        num_cached: int = 0,
        kv_secret: str | None = None,
        top_logprobs: list[TopLogprobs] | None = None,
    ) -> None:
        self.tokens, self.logprobs, self.finish_reason = tokens, logprobs, finish
        self.num_prompt_tokens, self.num_output_tokens = num_prompt, num_output
        self.num_cached_tokens, self.kv_secret = num_cached, kv_secret
        self.top_logprobs = top_logprobs


class RequestStream:
    """One request's outputs, accumulated between its handler's reads."""

    __slots__ = (
        "_logprobs",
        "_tokens",
        "_top",
        "_waiter",
        "arrival",
        "error",
        "finish_reason",
        "first_output_at",
        "kv_secret",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "request_id",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.first_output_at: float | None = None
        self._tokens: list[int] = []
        self._logprobs: list[float] | None = None
        self._top: list[TopLogprobs] | None = None
        self.finish_reason: str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.kv_secret: str | None = None
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def push(self, out: msgs.ReqOut, now: float) -> None:
        if self.first_output_at is None:
            self.first_output_at = now
        self._tokens += out.tokens
        if out.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs += out.logprobs
        if out.top_logprobs is not None:
            if self._top is None:
                self._top = []
            self._top += out.top_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.kv_secret is not None:
            self.kv_secret = out.kv_secret
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if self.error is None and self.finish_reason is None:
            self.error = exc
            self._wake()

    async def get(self) -> Chunk:
        """Everything new (waits for at least one token or the end); raises the failure, after
        the tokens that came before it."""
        while not self._tokens and self.finish_reason is None and self.error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if not self._tokens and self.error is not None:
            raise self.error
        tokens, self._tokens = self._tokens, []
        lps, self._logprobs = self._logprobs, None
        top, self._top = self._top, None
        finish = self.finish_reason if self.error is None else None
        return Chunk(
            tokens,
            lps,
            finish,
            self.num_prompt_tokens,
            self.num_output_tokens,
            self.num_cached_tokens,
            self.kv_secret,
            top,
        )
