"""The server's prefill/decode branches (docs/architecture.md, "Disaggregation").

A prefill-role request runs its prompt, samples the first token and keeps the prompt's blocks
in the engine core, answering with a KV handle. A decode-role request hands the core that
handle; the core pulls the blocks over the KV port and decodes from the first token. The
blocks never cross into the API server; it only checks what it can check cheaply first (the
handle's model identity, the prompt's tokens).
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from aiohttp import web

from atom.disagg.handle import KVHandle
from atom.entrypoints.admission import Slot
from atom.entrypoints.generation import Outcome, ends_at_first_token, generate, new_request_id
from atom.entrypoints.openai_format import OpenAIFormatter, dumps
from atom.entrypoints.protocol import GenerationRequest
from atom.entrypoints.state import ServerState
from atom.wire import errors as codes
from atom.wire.api_error import APIError


def release_quietly(state: ServerState, kv: Any) -> None:
    """A decode request that will not run: free its blocks on the prefill instance."""
    try:
        state.engine.release_kv(KVHandle.from_dict(kv))
    except ValueError:
        pass


async def serve_prefill(
    state: ServerState, req: GenerationRequest, chat: bool, outcome: Outcome, slot: Slot
) -> web.Response:
    """Run the prompt, sample its first token, keep its blocks; answer with the KV handle."""
    kv = state.kv
    if kv is None or not kv.serves:
        raise APIError(
            400,
            "this instance serves no KV blocks: start it with --role prefill (or --kv-port)",
            param="kv_transfer",
            code=codes.KV_NOT_ENABLED,
        )
    req.params.max_tokens, req.stream = 1, False
    request_id = new_request_id("chatcmpl" if chat else "cmpl")
    assert state.tokenizer is not None
    gen = generate(
        state.engine, state.tokenizer, state.metrics, req, request_id, outcome, slot, hold_kv=True
    )
    try:  # the hold cap is the core's: a refusal comes back as 503 kv_hold_cap
        async with aclosing(gen):
            deltas = [d async for d in gen]
    except BaseException:  # the router left (or the engine failed): nobody will pull
        state.engine.drop_hold(request_id)
        raise
    first = next((d for d in deltas if d.token_ids), None)
    if first is None:  # aborted before sampling (shutting down): nothing is held
        raise APIError(503, "the prefill produced no token", code=codes.ENGINE_UNAVAILABLE)
    logprob = first.logprobs[0] if first.logprobs else None
    secret = next((d.kv_secret for d in reversed(deltas) if d.kv_secret), None)
    handle = kv.make_handle(request_id, req.prompt_ids, first.token_ids[0], logprob, secret)
    handle.cached_tokens = deltas[-1].cached_tokens
    handle.first_top_logprobs = first.top_logprobs[0] if first.top_logprobs else None
    body = OpenAIFormatter(state.tokenizer, request_id, req, chat).full(deltas)
    body["kv_transfer"] = handle.to_dict()
    return web.Response(body=dumps(body), content_type="application/json")


def decode_options(state: ServerState, req: GenerationRequest, kv: Any) -> dict[str, Any]:
    """AddRequest options of a decode-role request (the core pulls the blocks), after the
    checks that need no transfer."""
    try:
        handle = KVHandle.from_dict(kv)
        if not handle.kv_host:
            raise ValueError("kv_transfer.kv_host is required to pull the blocks")
    except ValueError as exc:
        raise APIError(400, str(exc), param="kv_transfer", code=codes.KV_BAD_REQUEST) from None
    layout = state.kv.layout if state.kv is not None else None
    why = (
        layout.identity_mismatch(handle.identity, handle.model, theirs="the prefill instance")
        if layout is not None
        else None
    )
    if why:  # known from the handle already; the wire checks it again with the cache shape
        raise APIError(
            409, f"refusing KV blocks: {why}", param="kv_transfer", code=codes.KV_MISMATCH
        )
    if req.prompt_ids != handle.prompt_token_ids:
        state.engine.release_kv(handle)
        raise APIError(
            409,
            f"the prompt tokenizes to {len(req.prompt_ids)} tokens here but the prefill instance "
            f"ran {len(handle.prompt_token_ids)} different ones (another tokenizer or template?)",
            param="kv_transfer",
            code=codes.KV_MISMATCH,
        )
    assert state.tokenizer is not None
    opts: dict[str, Any] = {
        "first_token": handle.first_token_id,
        "first_logprob": handle.first_logprob,
        "first_top_logprobs": handle.first_top_logprobs,
        "cached_tokens": handle.cached_tokens,
    }
    if ends_at_first_token(req.params, handle.first_token_id, state.eos_token_ids):
        state.engine.release_kv(handle)  # nothing left to decode: the blocks are not needed
    else:
        opts["kv_pull"] = handle
    return opts
