"""The OpenAI wire format of responses: whole objects, stream chunks and SSE events.

The request side (parsing and validation) is protocol.py; this is its mirror for answers.
SSE payloads are encoded with orjson; the three characters that str.splitlines() treats as
line breaks but JSON does not escape are escaped here, so clients that split events that way
(httpx's aiter_lines) never see an event cut in two.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import orjson

from atom.entrypoints.generation import Delta
from atom.entrypoints.protocol import GenerationRequest
from atom.tokenizer import BaseTokenizer

DONE = b"data: [DONE]\n\n"
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


# id -> its text alone, per tokenizer: logprobs name every token, so decode each id once.
_PIECES: weakref.WeakKeyDictionary[BaseTokenizer, dict[int, str]] = weakref.WeakKeyDictionary()


def token_pieces(tok: BaseTokenizer, ids: list[int]) -> list[str]:
    cache = _PIECES.get(tok)
    if cache is None:
        cache = _PIECES[tok] = {}
    out = []
    for i in ids:
        piece = cache.get(i)
        if piece is None:
            piece = cache[i] = tok.decode([i], skip_special_tokens=False)
        out.append(piece)
    return out


def sse(obj: dict[str, Any]) -> bytes:
    data = orjson.dumps(obj)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, default=str)


class OpenAIFormatter:
    """OpenAI response objects for completions and chat, streamed or whole."""

    def __init__(
        self, tokenizer: BaseTokenizer, request_id: str, req: GenerationRequest, chat: bool
    ) -> None:
        self.tok, self.id, self.req, self.chat = tokenizer, request_id, req, chat
        self.created = int(time.time())
        self._object = "chat.completion.chunk" if chat else "text_completion"

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
        if not self.req.params.logprobs:
            return None
        lps = lps if lps is not None else [0.0] * len(ids)
        tokens = token_pieces(self.tok, ids)
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
        else:
            choice = {
                "index": 0,
                "text": d.text,
                "logprobs": self._logprobs(d.token_ids, d.logprobs),
                "finish_reason": d.finish_reason,
            }
        return {
            "id": self.id,
            "object": self._object,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        }

    def usage_chunk(self, last: Delta) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self._object,
            "created": self.created,
            "model": self.req.model,
            "choices": [],
            "usage": self._usage(last),
        }
