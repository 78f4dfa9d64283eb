"""Request bodies as bytes and as JSON, refusing every malformed input with a JSON 400.

Shared by the runtime server and the router (torch-free). The HTTP runners are built with
`RUNNER_KWARGS` (aiohttp's own decompression off): aiohttp answers a body it cannot inflate with
a plain-text 400 or 500 before any middleware runs, so the body is inflated here instead, with
the same size bound as the raw body (no zip bombs). A body labelled gzip or deflate that already
is JSON (`{` first: neither format can start so) is taken as it is, so a runner that still
inflates (or a client that mislabels) works too. JSON that Python can parse but nothing
downstream can use is refused too: nesting deeper than `MAX_DEPTH`, lone UTF-16 surrogates
(`"\\ud800"`: not encodable as UTF-8, so the tokenizer or the response would fail), integers of
more than 4,300 digits. Large bodies are parsed on a worker thread so the event loop keeps
answering /health meanwhile.

JSON is decoded by msgspec where it can (a 4,096-token prompt of ids: 2.5x faster than
json.loads); whatever it refuses (NaN, a byte-order mark, 1e400, lone surrogates, UTF-16, more
than 4,300 digits, malformed JSON) goes to json.loads, whose value and errors are the ones
answered, so the fast path accepts nothing json.loads would not and decodes it the same.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

# web.AppRunner(app, **RUNNER_KWARGS): read_body() inflates gzip/deflate itself.
RUNNER_KWARGS: dict[str, Any] = {"auto_decompress": False}
MAX_DEPTH = 32  # OpenAI bodies nest 5 deep at most (messages[i].content[j].image_url.url)
OFF_LOOP_BYTES = 256 * 1024  # bodies above this are parsed on a worker thread
# A surrogate escape, or a surrogate's UTF-8 form in the bytes (json.loads decodes bytes with
# "surrogatepass", so that becomes a lone surrogate as well).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
_DECODER = msgspec.json.Decoder()


@dataclass
class BodyError(Exception):
    """The body is unusable; answered 400 with this message and code."""

    message: str
    code: str = "invalid_json"

    def __str__(self) -> str:
        return self.message


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The request body, inflated; BodyError for an encoding it cannot read."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    except (ConnectionError, OSError, ValueError, RequestPayloadError) as exc:
        raise BodyError(f"cannot read the request body: {exc}", "invalid_body") from None
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise BodyError(
            f"Content-Encoding {encoding[:40]!r} is not supported (gzip, deflate or identity)",
            "unsupported_content_encoding",
        )
    if raw.lstrip()[:1] == b"{":
        return raw
    wbits = 16 + zlib.MAX_WBITS if "gzip" in encoding else zlib.MAX_WBITS
    try:
        inflater = zlib.decompressobj(wbits)
        data = inflater.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise BodyError(
            f"the body is not valid {encoding} data: {exc}", "invalid_content_encoding"
        ) from None
    if len(data) > max_bytes or inflater.unconsumed_tail:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=len(data))
    return data


def loads_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from `raw`, checked as the module says; BodyError otherwise."""
    try:
        body = _decode(raw)
    except UnicodeDecodeError as exc:
        raise BodyError(f"request body is not UTF-8: {exc.reason}") from None
    except RecursionError:
        raise BodyError(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise BodyError(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {type(body).__name__}")
    # The regex walks every byte (0.15 ms for a 4,096-id body); a substring test does not,
    # and a surrogate needs a `\\u` escape or the 0xED lead byte.
    check_strings = (b"\\u" in raw or b"\xed" in raw) and _SURROGATE.search(raw) is not None
    # Every container of the body opens with a `[` or `{` byte (more of them may sit in
    # strings), so with no more than MAX_DEPTH of those bytes nothing nests too deep and, without
    # a surrogate escape, there is nothing to walk: a 4,096-token prompt is one list of ints.
    if check_strings or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
        _check_tree(body, check_strings)
    return body


def _decode(raw: bytes) -> Any:
    """msgspec's value, or json.loads' (value or error) for anything msgspec refuses."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(raw)


async def parse_object(raw: bytes) -> dict[str, Any]:
    """loads_object(), on a worker thread when the body is large."""
    if len(raw) <= OFF_LOOP_BYTES:
        return loads_object(raw)
    return await asyncio.get_running_loop().run_in_executor(None, loads_object, raw)


def _check_tree(body: dict[str, Any], check_strings: bool) -> None:
    """Depth bound, and (only when the raw bytes hold a surrogate) strings that are not valid
    Unicode. Iterative: a deep body must not overflow our own stack either."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BodyError(f"request body nests deeper than {MAX_DEPTH} levels")
        values = node.values() if isinstance(node, dict) else node
        if check_strings:
            keys = node.keys() if isinstance(node, dict) else ()
            for s in (*keys, *values):
                if isinstance(s, str) and not _encodable(s):
                    raise BodyError(
                        "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                        "which is not a character",
                        "invalid_unicode",
                    )
        stack.extend((v, depth + 1) for v in values if type(v) is dict or type(v) is list)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
