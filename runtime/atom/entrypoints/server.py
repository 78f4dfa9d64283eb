"""The aiohttp application: OpenAI-compatible routes, /health, /metrics, /status.

Handlers are thin: validate (protocol), run `generate()`, format the OpenAI wire format. Every
client-caused failure is an APIError answered with its status and an OpenAI error body.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from atom.disagg.handle import KVHandle
from atom.disagg.holds import HoldCapExceeded
from atom.disagg.trust import is_internal
from atom.entrypoints.async_engine import AsyncEngine, Prefilled
from atom.entrypoints.body import parse_object, read_body
from atom.entrypoints.errors import APIError
from atom.entrypoints.generation import (
    Delta,
    ends_at_first_token,
    engine_params,
    generate,
    new_request_id,
)
from atom.entrypoints.info import config_info, graph_info, prefix_cache_info
from atom.entrypoints.kv_release import RELEASE_PATH, release_handler
from atom.entrypoints.metrics import CONTENT_TYPE, ServerMetrics, captured_buckets
from atom.entrypoints.middleware import json_errors
from atom.entrypoints.protocol import GenerationRequest, chat_request, completion_request
from atom.tokenizer import BaseTokenizer

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    model: str
    max_waiting: int = 1024
    role: str = "unified"
    config: Any = None  # the resolved atom.config.Config, for /status
    tokenizer: BaseTokenizer | None = None  # set once the engine is built
    max_model_len: int = 0
    vocab_size: int = 0
    draining: bool = False
    started: float = field(default_factory=time.time)
    kv: Any = None  # atom.disagg.service.KVService: KV transfers (prefill serves, decode pulls)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        from atom.utils.counters import counters

        self.metrics = ServerMetrics(
            stats=lambda: self.engine.last_stats,
            counters=counters.snapshot,
            warmup=lambda: self.engine.warmup_summary,
            kv_holds=lambda: getattr(self.engine.engine, "kv_holds", None),
        )
        if self.kv is not None:
            self.kv.metrics = self.metrics.kv


STATE_KEY = web.AppKey("atom_state", ServerState)


def create_app(state: ServerState) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors(_count)])
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.router.add_post(RELEASE_PATH, release_handler(lambda r: r.app[STATE_KEY].kv))
    return app


def _count(request: web.Request, status: int) -> None:
    metrics = request.app[STATE_KEY].metrics
    metrics.responses.labels(status=str(status)).inc()
    if status in (429, 503) and request.method == "POST":
        metrics.rejected.labels(status=str(status)).inc()


# ---- probes and introspection -------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.draining:
        return web.json_response(
            {"status": "draining", "reason": "server is shutting down"}, status=503
        )
    if not state.engine.is_ready:
        return web.json_response(
            {"status": state.engine.state, "reason": state.engine.reason}, status=503
        )
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "atom",
        "root": state.model,
    }
    if state.max_model_len:
        card["max_model_len"] = state.max_model_len
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def status(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engine = state.engine
    summary = engine.warmup_summary
    from atom.utils.counters import counters

    body: dict[str, Any] = {
        "model": state.model,
        "served_model_name": state.served_model_name,
        "role": state.role,
        "state": engine.state,
        "reason": engine.reason,
        "ready": engine.is_ready,
        "draining": state.draining,
        "max_model_len": state.max_model_len,
        **(config_info(state.config) if state.config is not None else {}),
        **(graph_info(engine.engine) if engine.engine is not None else {}),
        "captured_buckets": captured_buckets(summary),
        "warmup": summary,
        "stats": engine.last_stats,
        "prefix_cache": prefix_cache_info(engine.last_stats),
        "counters": counters.snapshot(),
        "in_flight": len(engine.streams),
        "steps": engine.steps,
    }
    if state.kv is not None:
        body["kv"] = state.kv.describe()
    if body.get("cache_key") is None and summary.get("cache_key"):
        body["cache_key"] = summary["cache_key"]
    return web.json_response(body, dumps=lambda o: json.dumps(o, default=str))


# ---- generation ---------------------------------------------------------------------------------
def _admit(state: ServerState) -> None:
    if state.draining:
        raise APIError(503, "server is shutting down", code="shutting_down")
    if not state.engine.is_ready:
        raise APIError(503, f"not ready: {state.engine.reason}", code="not_ready")
    waiting = state.engine.num_waiting()
    if waiting >= state.max_waiting:
        raise APIError(
            429,
            f"too many waiting requests ({waiting} >= --max-waiting {state.max_waiting}); retry later",
            code="rate_limit_exceeded",
        )


async def _body(request: web.Request) -> dict[str, Any]:
    return await parse_object(await read_body(request, MAX_BODY_BYTES))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, chat=True)


async def _generation(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    _admit(state)
    body = await _body(request)
    if "kv_transfer" in body and not is_internal(request.headers):  # atom.disagg.trust
        raise APIError(
            403,
            "kv_transfer is only accepted from the router (X-Atom-Internal-Token)",
            param="kv_transfer",
            code="kv_transfer_forbidden",
        )
    kv = body.get("kv_transfer")  # disaggregation (docs/architecture.md); absent: unified
    mode = kv.get("mode") if isinstance(kv, dict) else None
    try:
        if chat:
            req = chat_request(
                body,
                state.tokenizer,
                state.served_model_name,
                state.max_model_len,
                state.vocab_size,
            )
        else:
            req = completion_request(
                body,
                state.tokenizer,
                state.served_model_name,
                state.max_model_len,
                state.vocab_size,
            )
    except APIError:
        if mode == "decode":  # the prompt already ran elsewhere: free its blocks there
            _release_quietly(state, kv)
        raise
    if kv is None:
        return await _serve(request, state, req, chat)
    if mode == "prefill":
        return await _serve_prefill(state, req, chat)
    if mode == "decode":
        return await _serve_decode(request, state, req, chat, kv)
    raise APIError(
        400,
        "kv_transfer.mode must be 'prefill' or 'decode'",
        param="kv_transfer",
        code="kv_bad_request",
    )


async def _serve_prefill(state: ServerState, req: GenerationRequest, chat: bool) -> web.Response:
    """Run the prompt, sample its first token, keep its blocks; answer with the KV handle."""
    kv = state.kv
    if kv is None or not kv.serves:
        raise APIError(
            400,
            "this instance serves no KV blocks: start it with --role prefill (or --kv-port)",
            param="kv_transfer",
            code="kv_not_enabled",
        )
    req.max_tokens, req.stream = 1, False
    request_id = new_request_id("chatcmpl" if chat else "cmpl")
    assert state.tokenizer is not None
    try:
        reservation = kv.reserve(len(req.prompt_ids))  # --max-held-kv-fraction
    except HoldCapExceeded as exc:
        raise APIError(503, str(exc), param="kv_transfer", code="kv_hold_cap") from None
    gen = generate(
        state.engine, state.tokenizer, state.metrics, req, request_id, "prefill", hold_kv=True
    )
    try:
        with reservation:
            async with aclosing(gen):
                deltas = [d async for d in gen]
    except BaseException:  # the router left (or the engine failed): nobody will pull
        kv.release_local(request_id)
        raise
    first = next((d for d in deltas if d.token_ids), None)
    if first is None:  # aborted before sampling (shutting down): nothing is held
        raise APIError(503, "the prefill produced no token", code="engine_unavailable")
    logprob = first.logprobs[0] if first.logprobs else None
    handle = kv.make_handle(request_id, req.prompt_ids, first.token_ids[0], logprob)
    handle.cached_tokens = deltas[-1].cached_tokens
    body = _Formatter(state.tokenizer, request_id, req, chat).full(deltas)
    body["kv_transfer"] = handle.to_dict()
    return web.json_response(body)


async def _serve_decode(
    request: web.Request, state: ServerState, req: GenerationRequest, chat: bool, kv: dict
) -> web.StreamResponse:
    """Pull the prompt's blocks from the prefill instance, then decode from its first token."""
    try:
        handle = KVHandle.from_dict(kv)
        if not handle.kv_host:
            raise ValueError("kv_transfer.kv_host is required to pull the blocks")
    except ValueError as exc:
        raise APIError(400, str(exc), param="kv_transfer", code="kv_bad_request") from None
    why = state.kv.layout.identity_mismatch(
        handle.identity, handle.model, theirs="the prefill instance"
    )
    if why:  # known from the handle already; the wire checks it again with the cache shape
        raise APIError(409, f"refusing KV blocks: {why}", param="kv_transfer", code="kv_mismatch")
    if req.prompt_ids != handle.prompt_token_ids:
        state.kv.release_soon(handle)
        raise APIError(
            409,
            f"the prompt tokenizes to {len(req.prompt_ids)} tokens here but the prefill instance "
            f"ran {len(handle.prompt_token_ids)} different ones (another tokenizer or template?)",
            param="kv_transfer",
            code="kv_mismatch",
        )
    assert state.tokenizer is not None
    blocks = None
    if ends_at_first_token(engine_params(req, state.tokenizer), handle.first_token_id):
        state.kv.release_soon(handle)  # nothing left to decode: the blocks are not needed
    else:
        from atom.disagg.client import KVTransferError

        try:
            blocks = (await state.kv.pull(handle)).blocks
        except KVTransferError as exc:
            state.kv.release_soon(handle)
            status = 409 if exc.code == "kv_mismatch" else 503
            raise APIError(status, exc.message, param="kv_transfer", code=exc.code) from None
        except BaseException:  # our client left mid-pull: free the blocks on the prefill now
            state.kv.release_soon(handle)
            raise
    pre = Prefilled(handle.first_token_id, blocks, handle.first_logprob, handle.cached_tokens)
    return await _serve(request, state, req, chat, prefilled=pre)


def _release_quietly(state: ServerState, kv: dict) -> None:
    if state.kv is None:
        return
    try:
        state.kv.release_soon(KVHandle.from_dict(kv))
    except ValueError:
        pass


async def _serve(
    request: web.Request, state: ServerState, req: GenerationRequest, chat: bool, **submit: Any
) -> web.StreamResponse:
    request_id = new_request_id("chatcmpl" if chat else "cmpl")
    endpoint = "chat" if chat else "completions"
    assert state.tokenizer is not None
    gen = generate(
        state.engine, state.tokenizer, state.metrics, req, request_id, endpoint, **submit
    )
    fmt = _Formatter(state.tokenizer, request_id, req, chat)
    async with aclosing(gen):
        if not req.stream:
            deltas = [d async for d in gen]
            return web.json_response(fmt.full(deltas))
        # Pull the first delta before committing to 200, so an engine refusal is still a 4xx.
        first = await anext(gen)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            if chat:
                await resp.write(_sse(fmt.chunk(Delta(text=""), role=True)))
            delta: Delta | None = first
            last = first
            while delta is not None:
                last = delta
                if delta.text or delta.finish_reason or (req.logprobs and delta.token_ids):
                    await resp.write(_sse(fmt.chunk(delta)))
                delta = await anext(gen, None)
            if req.include_usage:
                await resp.write(_sse(fmt.usage_chunk(last)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            logger.info("client of %s went away; its sequence is aborted", request_id)
        except APIError as exc:  # after the 200 went out: report in-band, as OpenAI does
            await resp.write(_sse(exc.body()) + b"data: [DONE]\n\n")
        return resp


def _sse(obj: dict[str, Any]) -> bytes:
    # ASCII-escaped: a raw U+0085 or U+2028 in generated text is legal SSE, but clients that
    # split lines with str.splitlines() (httpx's aiter_lines) would cut the event there.
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _Formatter:
    """OpenAI response objects for completions and chat, streamed or whole."""

    def __init__(
        self, tokenizer: BaseTokenizer, request_id: str, req: GenerationRequest, chat: bool
    ) -> None:
        self.tok, self.id, self.req, self.chat = tokenizer, request_id, req, chat
        self.created = int(time.time())

    def _usage(self, d: Delta) -> dict[str, Any]:
        return {
            "prompt_tokens": d.prompt_tokens,
            "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
        }

    def _logprobs(
        self, ids: list[int], lps: list[float] | None, offset: int = 0
    ) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        lps = lps if lps is not None else [0.0] * len(ids)
        tokens = [self.tok.decode([i], skip_special_tokens=False) for i in ids]
        if self.chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(tokens, lps, strict=False)
                ]
            }
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=False)],
            "text_offset": offsets,
        }

    def full(self, deltas: list[Delta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        ids = [i for d in deltas for i in d.token_ids]
        lps = (
            [x for d in deltas for x in (d.logprobs or [])]
            if any(d.logprobs for d in deltas)
            else None
        )
        base = {
            "id": self.id,
            "created": self.created,
            "model": self.req.model,
            "usage": self._usage(last),
        }
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(ids, lps),
                "finish_reason": last.finish_reason,
            }
            return {**base, "object": "chat.completion", "choices": [choice]}
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(ids, lps),
            "finish_reason": last.finish_reason,
        }
        return {**base, "object": "text_completion", "choices": [choice]}

    def chunk(self, d: Delta, role: bool = False) -> dict[str, Any]:
        base = {"id": self.id, "created": self.created, "model": self.req.model}
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": d.text} if d.text else {})
            )
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None if role else self._logprobs(d.token_ids, d.logprobs),
                "finish_reason": d.finish_reason,
            }
            return {**base, "object": "chat.completion.chunk", "choices": [choice]}
        choice = {
            "index": 0,
            "text": d.text,
            "logprobs": self._logprobs(d.token_ids, d.logprobs),
            "finish_reason": d.finish_reason,
        }
        return {**base, "object": "text_completion", "choices": [choice]}

    def usage_chunk(self, last: Delta) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "choices": [],
            "usage": self._usage(last),
        }
