"""One request's life above the engine: submit, detokenize, apply stop strings, observe latencies.

`generate()` yields `Delta`s (text plus the token ids and logprobs behind it), one per read of
the request's stream: everything the engine produced since the last read, so a busy server
formats and writes fewer, larger events instead of one per token. The last one carries the
finish reason. It aborts the engine sequence whenever it stops early (a stop string matched,
or the consumer went away), so no sequence outlives its request.

`generate_choices()` runs a request's `n` (or `best_of`) choices as that many engine
sequences, each Delta tagged with its choice's index. The first runs alone until the engine has
its prompt's blocks in the prefix cache (its first token; a pulled prompt's second, the step
that placed the blocks); the others start then, and find every full block of the prompt there
(prefix-cache references, no recompute: their cached_tokens show it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec

from atom.engine.params import INT64_MAX, INT64_MIN, SamplingParams, TopLogprobs
from atom.entrypoints.admission import Slot
from atom.entrypoints.core.client import (
    CoreClient,
    EngineDead,
    EngineStalled,
    RequestRefused,
    RequestStream,
)
from atom.entrypoints.metrics import ServerMetrics
from atom.entrypoints.protocol import GenerationRequest
from atom.tokenizer import BaseTokenizer, IncrementalDetokenizer, StopStringChecker
from atom.wire.api_error import APIError
from atom.wire.errors import ENGINE_STALLED, ENGINE_UNAVAILABLE, INVALID_REQUEST


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    kv_secret: str | None = None  # a finished hold_kv request: its handle's secret (core-made)
    top_logprobs: list[TopLogprobs] | None = None  # per token, when the request asked
    index: int = 0  # the choice it belongs to (n > 1)


@dataclass
class Outcome:
    """How one request ended, for the request counters (set by generate() and the handler)."""

    finish_reason: str | None = None  # stop | length once finished
    error_status: int | None = None  # an error answered after the 200 went out


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def ends_at_first_token(
    params: SamplingParams, first_token: int, eos_token_ids: frozenset[int]
) -> bool:
    """Whether the engine will finish a request at its first token (a subset of its stop rule,
    LLMEngine._stop_reason: when unsure, False, and the blocks are pulled anyway).
    eos_token_ids: the engine's (EngineInfo), empty until it is ready."""
    return (
        params.max_tokens <= 1
        or first_token in params.stop_token_ids
        or (not params.ignore_eos and first_token in eos_token_ids)
    )


def submit(
    engine: CoreClient, req: GenerationRequest, request_id: str, **opts: Any
) -> RequestStream:
    """engine.add_request, with the failures a client can see as APIErrors."""
    try:
        return engine.add_request(request_id, req.prompt_ids, req.params, **opts)
    except EngineDead as exc:
        raise APIError(503, str(exc), code=ENGINE_UNAVAILABLE) from None
    except (OverflowError, TypeError, ValueError) as exc:  # not representable on the wire
        raise APIError(
            400, f"a request value is out of range: {exc}", code=INVALID_REQUEST
        ) from None


async def generate(
    engine: CoreClient,
    tokenizer: BaseTokenizer,
    metrics: ServerMetrics,
    req: GenerationRequest,
    request_id: str,
    outcome: Outcome,
    slot: Slot | None = None,
    sibling: bool = False,
    **opts: Any,
) -> AsyncGenerator[Delta, None]:
    """sibling: a later choice of an n > 1 request (its prompt is counted once, with the first).
    opts: CoreClient.add_request options (hold_kv, first_token, kv_pull, cached_tokens)
    for P/D roles. The tokenizer's EOS ids play no part here: the engine applies its own.
    slot: the request's --max-waiting slot, given back at its first token (or its end)."""
    stream = submit(engine, req, request_id, **opts)
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopStringChecker(req.stop)
    if not sibling:
        metrics.prompt_tokens.inc(len(req.prompt_ids))
    last_token_at: float | None = None
    completion_tokens = 0
    finish_reason: str | None = None
    try:
        while finish_reason is None:
            try:
                out = await stream.get()
            except RequestRefused as exc:  # the engine refused it: status and code from the core
                raise APIError(
                    exc.status,
                    exc.message,
                    code=exc.code,
                    param="kv_transfer" if exc.code.startswith("kv_") else None,
                ) from None
            except EngineStalled as exc:  # no progress for --stream-stall-timeout
                raise APIError(503, str(exc), code=ENGINE_STALLED) from None
            except EngineDead as exc:  # the engine failed, died or is shutting down
                raise APIError(503, str(exc), code=ENGINE_UNAVAILABLE) from None
            now = time.monotonic()
            n = len(out.tokens)
            if n:
                if slot is not None:
                    slot.release()  # no longer waiting
                if last_token_at is None:
                    metrics.ttft.observe(now - stream.arrival)
                    if n > 1:  # tokens that came together with the first
                        metrics.itl.observe_n(0.0, n - 1)
                else:
                    metrics.itl.observe_n((now - last_token_at) / n, n)
                last_token_at = now
            completion_tokens += n
            text = detok.add(out.tokens) if n else ""
            if out.finish_reason is not None:
                text += detok.flush()
            text, stopped = stops.feed(text)
            if stopped:
                finish_reason = "stop"
                engine.abort(request_id)
            elif out.finish_reason is not None:
                finish_reason = out.finish_reason
                text += stops.flush()
            yield Delta(
                text=text,
                token_ids=out.tokens,
                logprobs=out.logprobs,
                finish_reason=finish_reason,
                prompt_tokens=out.num_prompt_tokens or len(req.prompt_ids),
                completion_tokens=completion_tokens,
                cached_tokens=out.num_cached_tokens,
                kv_secret=out.kv_secret,
                top_logprobs=out.top_logprobs,
            )
        metrics.e2e.observe(time.monotonic() - stream.arrival)
        outcome.finish_reason = finish_reason if finish_reason != "abort" else None
    finally:
        # Every generated token is counted, a request's that was aborted or failed too.
        metrics.generation_tokens.inc(completion_tokens)
        if slot is not None:
            slot.release()
        if finish_reason is None:  # cancelled (client gone) or failed: free the sequence
            engine.abort(request_id)


async def generate_choices(
    engine: CoreClient,
    tokenizer: BaseTokenizer,
    metrics: ServerMetrics,
    req: GenerationRequest,
    request_id: str,
    outcome: Outcome,
    slot: Slot | None = None,
    **opts: Any,
) -> AsyncGenerator[Delta, None]:
    """generate() for each of the request's best_of choices (opts go to the first, the one a
    decode instance received the first token of). best_of == n: the deltas as they come;
    best_of > n: at the end, the n of highest cumulative logprob, best first."""
    if req.best_of == 1:
        async with aclosing(generate(engine, tokenizer, metrics, req, request_id, outcome,
                                     slot, **opts)) as gen:
            async for d in gen:
                yield d
        return
    choices = _Choices(engine, tokenizer, metrics, req, request_id, outcome, slot, opts)
    try:
        if req.best_of == req.n:
            while (delta := await choices.next()) is not None:
                yield delta
            return
        finished: dict[int, list[Delta]] = {}
        while (delta := await choices.next()) is not None:
            finished.setdefault(delta.index, []).append(delta)
        ranked = sorted(finished, key=lambda i: -sum(x for d in finished[i]
                                                    for x in d.logprobs or ()))
        for rank, i in enumerate(ranked[:req.n]):
            for d in finished[i]:
                yield dataclasses.replace(d, index=rank)
    finally:
        await choices.close()


def _sibling_seed(seed: int | None, index: int) -> int | None:
    """Choice i's seed: the request's + i (wrapped to int64), so each choice is reproducible."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % (INT64_MAX - INT64_MIN + 1) + INT64_MIN


class _Choices:
    """The choices' generators, pumped into one queue; the siblings start once the first
    choice's prompt blocks are cached."""

    def __init__(self, engine: CoreClient, tokenizer: BaseTokenizer, metrics: ServerMetrics,
                 req: GenerationRequest, request_id: str, outcome: Outcome, slot: Slot | None,
                 opts: dict[str, Any]) -> None:
        self._queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()
        self._left = req.best_of
        self._gate = asyncio.Event()
        # A decode instance reports the first token before it has placed the pulled blocks.
        self._gate_tokens = 2 if opts.get("first_token") is not None else 1
        self._lora_name: str | None = opts.get("lora_name")  # every choice runs its adapter
        first = generate(engine, tokenizer, metrics, req, request_id, outcome, slot, **opts)
        self._tasks = [asyncio.create_task(self._pump(0, first))]
        self._tasks.append(asyncio.create_task(self._siblings(engine, tokenizer, metrics, req,
                                                              request_id)))

    async def _siblings(self, engine: CoreClient, tokenizer: BaseTokenizer,
                        metrics: ServerMetrics, req: GenerationRequest, request_id: str) -> None:
        await self._gate.wait()
        for i in range(1, req.best_of):
            params = msgspec.structs.replace(req.params, seed=_sibling_seed(req.params.seed, i))
            sib = dataclasses.replace(req, params=params)
            gen = generate(engine, tokenizer, metrics, sib, f"{request_id}-{i}", Outcome(),
                           sibling=True, lora_name=self._lora_name)
            self._tasks.append(asyncio.create_task(self._pump(i, gen)))

    async def _pump(self, index: int, gen: AsyncGenerator[Delta, None]) -> None:
        tokens = 0
        try:
            async with aclosing(gen):
                async for d in gen:
                    tokens += len(d.token_ids)
                    if index == 0 and (tokens >= self._gate_tokens or d.finish_reason):
                        self._gate.set()
                    self._queue.put_nowait(dataclasses.replace(d, index=index))
            self._queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # an APIError of one choice fails the request
            self._queue.put_nowait(exc)
        finally:
            self._gate.set()

    async def next(self) -> Delta | None:
        """The next delta of any choice; None once every choice has finished."""
        while self._left:
            item = await self._queue.get()
            if item is None:
                self._left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return item
        return None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
