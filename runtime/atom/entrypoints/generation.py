"""One request's life above the engine: submit, detokenize, apply stop strings, observe latencies.

`generate()` yields `Delta`s (text plus the token ids and logprobs behind it); the last one carries
the finish reason. It aborts the engine sequence whenever it stops early — a stop string matched,
or the consumer went away (the handler was cancelled on client disconnect) — so no sequence
outlives its request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from atom.entrypoints.async_engine import AsyncEngine
from atom.entrypoints.errors import APIError
from atom.entrypoints.metrics import ServerMetrics
from atom.entrypoints.protocol import GenerationRequest
from atom.tokenizer import BaseTokenizer, IncrementalDetokenizer, StopStringChecker


@dataclass
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def ends_at_first_token(params: dict[str, Any], first_token: int) -> bool:
    """Whether the engine will finish a request at its first token (a subset of its stop rule:
    when unsure, False, and the blocks are pulled anyway)."""
    return params["max_tokens"] <= 1 or first_token in params["stop_token_ids"]


def engine_params(req: GenerationRequest, tokenizer: BaseTokenizer) -> dict:
    """SamplingParams fields; the tokenizer's EOS ids stop generation unless ignore_eos."""
    stop_ids = list(req.stop_token_ids)
    if not req.ignore_eos:
        stop_ids += [i for i in tokenizer.eos_token_ids if i not in stop_ids]
    return {
        "temperature": req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "seed": req.seed,
        "max_tokens": req.max_tokens,
        "stop_token_ids": stop_ids,
        "ignore_eos": req.ignore_eos,
        "logprobs": req.logprobs,
    }


async def generate(
    engine: AsyncEngine,
    tokenizer: BaseTokenizer,
    metrics: ServerMetrics,
    req: GenerationRequest,
    request_id: str,
    endpoint: str,
    **submit: Any,
) -> AsyncIterator[Delta]:
    """submit: AsyncEngine.add_request options (hold_kv, prefilled) for disaggregated roles."""
    stream = engine.add_request(request_id, req.prompt_ids, engine_params(req, tokenizer), **submit)
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
            except ValueError as exc:  # the engine refused the request: the client's fault
                finish_reason = "error"
                raise APIError(400, str(exc), code="invalid_request") from None
            except RuntimeError as exc:  # EngineDead: the engine failed or is shutting down
                finish_reason = "error"
                raise APIError(503, str(exc), code="engine_unavailable") from None
            now = time.monotonic()
            if out.new_token_ids:
                if last_token_at is None:
                    metrics.ttft.observe(now - stream.arrival)
                else:
                    metrics.itl.observe(now - last_token_at)
                last_token_at = now
            completion_tokens += len(out.new_token_ids)
            text = detok.add(out.new_token_ids)
            if out.finished:
                text += detok.flush()
            text, stopped = stops.feed(text)
            if stopped:
                finish_reason = "stop"
                engine.abort(request_id)
            elif out.finished:
                finish_reason = out.finish_reason or "stop"
                text += stops.flush()
            yield Delta(
                text=text,
                token_ids=list(out.new_token_ids),
                logprobs=list(out.new_logprobs) if out.new_logprobs is not None else None,
                finish_reason=finish_reason,
                prompt_tokens=out.num_prompt_tokens or len(req.prompt_ids),
                completion_tokens=completion_tokens,
                cached_tokens=getattr(out, "num_cached_tokens", 0),
            )
        metrics.generation_tokens.inc(completion_tokens)
        metrics.e2e.observe(time.monotonic() - stream.arrival)
    finally:
        if finish_reason is None:  # cancelled (client gone) or failed: free the sequence
            engine.abort(request_id)
            finish_reason = "abort"
        metrics.requests.labels(endpoint=endpoint, finish_reason=finish_reason).inc()
