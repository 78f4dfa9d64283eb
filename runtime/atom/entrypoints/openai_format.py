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

from atom.engine.params import TopLogprobs
from atom.entrypoints.generation import Delta
from atom.entrypoints.protocol import GenerationRequest
from atom.entrypoints.tool_parsers import ToolStreams, tool_message
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
        # Streaming: each choice's tokens so far (usage sums them) and whose role was sent.
        self._completion: dict[int, int] = {}
        self._announced = {0}
        # Chat with tools: the text becomes tool_calls (atom.entrypoints.tool_parsers).
        self._tools = ToolStreams(req.tools) if chat and req.tools is not None else None

    def _usage(self, d: Delta, completion_tokens: int | None = None) -> dict[str, Any]:
        """d: the first choice's last delta (prompt and cached tokens); completion_tokens: all
        choices' (default: d's)."""
        completion = d.completion_tokens if completion_tokens is None else completion_tokens
        return {
            "prompt_tokens": d.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": d.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
        }

    def _logprobs(
        self, ids: list[int], lps: list[float] | None, top: list[TopLogprobs] | None = None,
        offset: int = 0,
    ) -> dict[str, Any] | None:
        """OpenAI's shapes: chat's content list (top_logprobs: the k alternatives), the legacy
        completions' parallel lists (top_logprobs: per token, the k alternatives and the
        chosen token, by text)."""
        k = self.req.logprobs
        if k is None:
            return None
        lps = lps if lps is not None else [0.0] * len(ids)
        alts = top if top is not None and k else [[] for _ in ids]
        tokens = token_pieces(self.tok, ids)
        if self.chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()),
                     "top_logprobs": self._alternatives(alt[:k])}
                    for t, lp, alt in zip(tokens, lps, alts, strict=False)
                ]
            }
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = []
        for t, lp, alt in zip(tokens, lps, alts, strict=False):
            entry: dict[str, float] = {}
            pieces = token_pieces(self.tok, [i for i, _ in alt[:k]])
            for piece, (_, v) in zip([*pieces, t], [*alt[:k], (0, lp)], strict=True):
                entry.setdefault(piece, v)  # tokens that decode alike: the likeliest's
            tops.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _alternatives(self, alt: TopLogprobs) -> list[dict[str, Any]]:
        pieces = token_pieces(self.tok, [i for i, _ in alt])
        return [{"token": t, "logprob": v, "bytes": list(t.encode())}
                for t, (_, v) in zip(pieces, alt, strict=True)]

    def full(self, deltas: list[Delta]) -> dict[str, Any]:
        """The whole answer: one choice per index among the deltas, in index order."""
        by_index: dict[int, list[Delta]] = {}
        for d in deltas:
            by_index.setdefault(d.index, []).append(d)
        choices = [self._choice(i, by_index[i]) for i in sorted(by_index)]
        first = by_index[min(by_index)][-1]
        completion = sum(ds[-1].completion_tokens for ds in by_index.values())
        base = {
            "id": self.id,
            "created": self.created,
            "model": self.req.model,
            "usage": self._usage(first, completion),
        }
        kind = "chat.completion" if self.chat else "text_completion"
        return {**base, "object": kind, "choices": choices}

    def _choice(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        ids = [i for d in deltas for i in d.token_ids]
        lps = (
            [x for d in deltas for x in (d.logprobs or [])]
            if any(d.logprobs for d in deltas)
            else None
        )
        top = (
            [x for d in deltas for x in (d.top_logprobs or [])]
            if any(d.top_logprobs for d in deltas)
            else None
        )
        logprobs = self._logprobs(ids, lps, top)
        if self.chat:
            message, finish = tool_message(text, last.finish_reason, self.req.tools)
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": last.finish_reason,
        }

    def chunk(self, d: Delta, role: bool = False) -> dict[str, Any]:
        self._completion[d.index] = d.completion_tokens
        logprobs = None if role else self._logprobs(d.token_ids, d.logprobs, d.top_logprobs)
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": d.text} if d.text else {})
            )
            finish = d.finish_reason
            if self._tools is not None and not role:
                delta, finish = self._tools.delta(d.index, d.text, finish)
            if d.index not in self._announced:  # a later choice's first chunk names the role
                self._announced.add(d.index)
                delta = {"role": "assistant", **delta}
            choice = {
                "index": d.index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": d.index,
                "text": d.text,
                "logprobs": logprobs,
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
            "usage": self._usage(last, sum(self._completion.values()) or None),
        }
