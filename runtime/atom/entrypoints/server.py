"""The aiohttp application: OpenAI-compatible routes, /health, /livez, /metrics, /status.

With an API key set, /v1/* and /status need it; the probes (/health, /livez) and /metrics
stay open. Every 429 and 503 carries Retry-After.

Handlers are thin: validate (protocol), run `generate()` against the engine core's client,
format the OpenAI wire format (openai_format). Every client-caused failure is an APIError
answered with its status and an OpenAI error body. P/D branches live in disagg_routes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from atom.entrypoints import metrics_merge as merge_metrics
from atom.entrypoints.admission import Slot
from atom.entrypoints.disagg_routes import decode_options, release_quietly, serve_prefill
from atom.entrypoints.generation import Delta, Outcome, generate_choices, new_request_id
from atom.entrypoints.info import prefix_cache_info
from atom.entrypoints.kv_release import RELEASE_PATH, release_handler
from atom.entrypoints.lora_routes import adapter_cards, add_lora_routes, served_model
from atom.entrypoints.metrics import CONTENT_TYPE, captured_buckets
from atom.entrypoints.openai_format import DONE, OpenAIFormatter, dumps, sse
from atom.entrypoints.protocol import GenerationRequest, chat_request, completion_request
from atom.entrypoints.state import ServerState
from atom.wire import errors as codes
from atom.wire.api_error import APIError
from atom.wire.auth import bearer_matches
from atom.wire.body import parse_object, read_body
from atom.wire.kv_modes import KVMode, parse_mode
from atom.wire.middleware import json_errors
from atom.wire.trust import is_internal, token_verdict

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
PID_HEADER = "X-Atom-Api-Pid"  # which API server process answered (--api-server-count)
__all__ = ["STATE_KEY", "ServerState", "create_app"]  # ServerState's home: atom.entrypoints.state


STATE_KEY = web.AppKey("atom_state", ServerState)


def create_app(state: ServerState) -> web.Application:
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=[json_errors(_count), api_key_middleware]
    )
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/livez", livez)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    # The hold registry and the secrets' key are the core's: the route asks it.
    app.router.add_post(RELEASE_PATH, release_handler(_hold_release))
    add_lora_routes(app, STATE_KEY)
    return app


def _hold_release(request: web.Request) -> Callable[[str, str], Awaitable[bool]] | None:
    state = request.app[STATE_KEY]
    if state.kv is None or not state.kv.serves:
        return None
    return state.engine.release_hold


def _count(request: web.Request, status: int) -> None:
    metrics = request.app[STATE_KEY].metrics
    metrics.responses.labels(status=str(status)).inc()
    if status in (429, 503) and request.method == "POST":
        metrics.rejected.labels(status=str(status)).inc()


@web.middleware
async def api_key_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """OpenAI endpoints and /status (the whole config) need the key; the probes and /metrics
    stay open."""
    key = request.app[STATE_KEY].api_key
    if key and (request.path.startswith("/v1/") or request.path == "/status"):
        if not bearer_matches(request.headers.get("Authorization", ""), key):
            raise APIError(
                401,
                "invalid or missing API key (Authorization: Bearer <key>)",
                code=codes.INVALID_API_KEY,
            )
    return await handler(request)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=dumps(body),
        status=status,
        content_type="application/json",
        headers=codes.retry_headers(status),
    )


# ---- probes and introspection -------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    """Readiness. A prober that sends X-Atom-Internal-Token (the router) is told whether it
    matches this instance's ATOM_INTERNAL_TOKEN ("internal_token")."""
    state = request.app[STATE_KEY]
    body = _readiness(state)
    verdict = token_verdict(request.headers)
    if verdict is not None:
        body["internal_token"] = verdict
    return _json(body, 200 if body["status"] == "ok" else 503)


def _readiness(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    if engine.state == "failed":  # why, while the server exits (e.g. which TP rank died)
        return {"status": "failed", "reason": engine.reason}
    if state.draining:
        return {"status": "draining", "reason": "server is shutting down"}
    if not engine.is_ready:
        return {"status": engine.state, "reason": engine.reason}
    if state.tokenizer is None:
        return {"status": "starting", "reason": "loading the tokenizer"}
    stalled = _stall_reason(state)
    if stalled is not None:
        return {"status": codes.ENGINE_STALLED, "reason": stalled}
    return {"status": "ok"}


def _stall_reason(state: ServerState) -> str | None:
    """Why the engine counts as stalled (--stall-timeout), or None."""
    engine = state.engine
    if engine.stalled_for(state.stall_timeout) is None:
        return None
    quiet = max(0.0, time.monotonic() - engine.last_seen)
    return f"the engine core made no progress for {quiet:.0f}s while requests wait"


async def livez(request: web.Request) -> web.Response:
    """Liveness (not readiness): the core is alive and its loop moves, compiling included."""
    state = request.app[STATE_KEY]
    why = state.engine.liveness(state.liveness_timeout)
    if why is not None:
        return _json({"status": "dead", "reason": why}, 503)
    return _json({"status": "alive", "state": state.engine.state})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return _json({"object": "list", "data": [_model_card(state), *adapter_cards(state)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model's card; 404 model_not_found for any other."""
    state = request.app[STATE_KEY]
    model_id = request.match_info["model_id"]
    if model_id != state.served_model_name:
        raise APIError(
            404,
            f"The model '{model_id[:200]}' does not exist (this server serves "
            f"'{state.served_model_name}')",
            param="model",
            code=codes.MODEL_NOT_FOUND,
        )
    return _json(_model_card(state))


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.served_model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "atom",
        "root": state.model,
    }
    if state.max_model_len:
        card["max_model_len"] = state.max_model_len
    return card


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.api_server_count > 1:
        return await _merged_metrics(state)
    core = await state.engine.scrape()
    body = state.metrics.render(core.text if core is not None else None)
    return web.Response(body=body, headers=_metrics_headers())


async def _merged_metrics(state: ServerState) -> web.Response:
    """--api-server-count > 1: every API server's series, summed (metrics_merge), and the
    engine's, both through the core. Without the core's answer (warming up, stalled) there is
    no consistent view to give: 503, and Prometheus records a failed scrape, not a reset."""
    own = merge_metrics.snapshot(state.metrics.registry, state.api_server_index)
    core = await state.engine.scrape(own)
    if core is None:
        raise APIError(
            503,
            "with several API servers /metrics is gathered through the engine core, which is "
            f"not answering ({state.engine.state}: {state.engine.reason})",
            code=codes.ENGINE_UNAVAILABLE,
        )
    body = merge_metrics.render([own, *core.peers]) + core.text
    return web.Response(body=body, headers=_metrics_headers())


def _metrics_headers() -> dict[str, str]:
    return {"Content-Type": CONTENT_TYPE, PID_HEADER: str(os.getpid())}


async def status(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engine = state.engine
    summary = engine.warmup_summary
    info = engine.info
    body: dict[str, Any] = {
        "model": state.model,
        "served_model_name": state.served_model_name,
        "role": state.role,
        "state": engine.state,
        "reason": engine.reason,
        "ready": state.ready,
        "draining": state.draining,
        "max_model_len": state.max_model_len,
        "pid": os.getpid(),
        "core_pid": engine.core_pid,
        "api_server_index": state.api_server_index,
        "api_server_count": state.api_server_count,
        **(info.config if info is not None else {}),
        **(info.graphs if info is not None else {}),
        "captured_buckets": captured_buckets(summary),
        "warmup": summary,
        "stats": engine.last_stats,
        "prefix_cache": prefix_cache_info(engine.last_stats),
        "counters": engine.last_stats.get("counters", {}),
        "in_flight": len(engine.streams),
        "waiting_admitted": state.admission.waiting,  # slots taken under --max-waiting
        "max_waiting": state.max_waiting,
        "stalled": _stall_reason(state),
        "steps": engine.steps,
    }
    if state.kv is not None:
        body["kv"] = state.kv.describe(engine.last_stats)
    if body.get("cache_key") is None and summary.get("cache_key"):
        body["cache_key"] = summary["cache_key"]
    return _json(body)


# ---- generation ---------------------------------------------------------------------------------
def _admit(state: ServerState) -> Slot:
    """A --max-waiting slot (taken before the first await), or why not: 503 or 429."""
    if state.draining:
        raise APIError(503, "server is shutting down", code=codes.SHUTTING_DOWN)
    if not state.ready:
        raise APIError(503, f"not ready: {state.engine.reason}", code=codes.NOT_READY)
    stalled = _stall_reason(state)
    if stalled is not None:
        raise APIError(503, stalled, code=codes.ENGINE_STALLED)
    return state.admission.admit()


async def _body(request: web.Request, timeout: float) -> dict[str, Any]:
    """Size-bounded (inflated too) and parsed off-loop when large (atom.wire.body)."""
    try:
        raw = await asyncio.wait_for(read_body(request, MAX_BODY_BYTES), timeout)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g}s",
            code=codes.REQUEST_TIMEOUT,
        ) from None
    return await parse_object(raw)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, chat=True)


async def _generation(request: web.Request, chat: bool) -> web.StreamResponse:
    """Counts every request exactly once: finished, aborted (client gone) or failed."""
    state = request.app[STATE_KEY]
    m = state.metrics
    m.received.inc()
    outcome = Outcome()
    slot: Slot | None = None
    try:
        slot = _admit(state)
        resp = await _generate(request, state, chat, outcome, slot)
    except APIError as exc:
        m.failed.labels(status=str(exc.status)).inc()
        raise
    except BaseException:  # cancelled: the client went away
        m.requests.labels(endpoint=_endpoint(chat), finish_reason="abort").inc()
        raise
    finally:
        if slot is not None:  # finished, failed or aborted before its first token
            slot.release()
    if outcome.error_status is not None:
        m.failed.labels(status=str(outcome.error_status)).inc()
    else:
        m.requests.labels(
            endpoint=_endpoint(chat), finish_reason=outcome.finish_reason or "abort"
        ).inc()
    return resp


def _endpoint(chat: bool) -> str:
    return "chat" if chat else "completions"


async def _generate(
    request: web.Request, state: ServerState, chat: bool, outcome: Outcome, slot: Slot
) -> web.StreamResponse:
    body = await _body(request, state.body_timeout)
    if "kv_transfer" in body and not is_internal(request.headers):  # atom.wire.trust
        raise APIError(
            403,
            "kv_transfer is only accepted from the router (X-Atom-Internal-Token)",
            param="kv_transfer",
            code=codes.KV_TRANSFER_FORBIDDEN,
        )
    kv = body.get("kv_transfer")  # disaggregation (docs/architecture.md); absent: unified
    mode = parse_mode(kv.get("mode")) if isinstance(kv, dict) else None
    served, lora_name = served_model(state, body)  # a LoRA adapter's name selects it
    if lora_name is not None and kv is not None:
        raise APIError(400, "LoRA adapters are not served with kv_transfer", param="model")
    try:
        if chat:
            req = chat_request(
                body,
                state.tokenizer,
                served,
                state.max_model_len,
                state.vocab_size,
            )
        else:
            req = completion_request(
                body,
                state.tokenizer,
                served,
                state.max_model_len,
                state.vocab_size,
            )
    except APIError:
        if mode is KVMode.DECODE:  # the prompt already ran elsewhere: free its blocks there
            release_quietly(state, kv)
        raise
    if kv is None:
        return await _serve(request, state, req, chat, outcome, slot, lora_name=lora_name)
    if mode is KVMode.PREFILL:
        return await serve_prefill(state, req, chat, outcome, slot)
    if mode is KVMode.DECODE:
        opts = decode_options(state, req, kv)
        return await _serve(request, state, req, chat, outcome, slot, **opts)
    raise APIError(
        400,
        "kv_transfer.mode must be 'prefill' or 'decode'",
        param="kv_transfer",
        code=codes.KV_BAD_REQUEST,
    )


async def _serve(
    request: web.Request,
    state: ServerState,
    req: GenerationRequest,
    chat: bool,
    outcome: Outcome,
    slot: Slot,
    **opts: Any,
) -> web.StreamResponse:
    request_id = new_request_id("chatcmpl" if chat else "cmpl")
    assert state.tokenizer is not None
    gen = generate_choices(
        state.engine, state.tokenizer, state.metrics, req, request_id, outcome, slot, **opts
    )
    fmt = OpenAIFormatter(state.tokenizer, request_id, req, chat)
    pid = {PID_HEADER: str(os.getpid())}
    async with aclosing(gen):
        if not req.stream:
            deltas = [d async for d in gen]
            return web.Response(
                body=dumps(fmt.full(deltas)), content_type="application/json", headers=pid
            )
        # Pull the first delta before committing to 200, so an engine refusal is still a 4xx.
        first = await anext(gen)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **pid}
        )
        await resp.prepare(request)
        try:
            if chat:
                await resp.write(sse(fmt.chunk(Delta(text=""), role=True)))
            delta: Delta | None = first
            last = first
            logprobs = req.logprobs is not None
            while delta is not None:
                last = delta
                if delta.text or delta.finish_reason or (logprobs and delta.token_ids):
                    await resp.write(sse(fmt.chunk(delta)))
                delta = await anext(gen, None)
            if req.include_usage:
                await resp.write(sse(fmt.usage_chunk(last)))
            await resp.write(DONE)
            await resp.write_eof()
        except ConnectionResetError:
            logger.info("client of %s went away; its sequence is aborted", request_id)
        except APIError as exc:  # after the 200 went out: report in-band, as OpenAI does
            outcome.error_status = exc.status
            try:
                await resp.write(sse(exc.body()) + DONE)
                await resp.write_eof()
            except ConnectionResetError:
                pass
        return resp
