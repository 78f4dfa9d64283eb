"""One request's life above the engine: submit, detokenize, apply stop strings, observe latencies.

`generate()` yields `Delta`s (text plus the token ids and logprobs behind it), one per read of
the request's stream: everything the engine produced since the last read, so a busy server
formats and writes fewer, larger events instead of one per token. The last one carries the
finish reason. It aborts the engine sequence whenever it stops early (a stop string matched,
or the consumer went away), so no sequence outlives its request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from atom.engine.params import SamplingParams
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
    **opts: Any,
) -> AsyncGenerator[Delta, None]:
    """opts: CoreClient.add_request options (hold_kv, first_token, kv_pull, cached_tokens)
    for P/D roles. The tokenizer's EOS ids play no part here: the engine applies its own.
    slot: the request's --max-waiting slot, given back at its first token (or its end)."""
    stream = submit(engine, req, request_id, **opts)
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopStringChecker(req.stop)
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
