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
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

# web.AppRunner(app, **RUNNER_KWARGS): read_body() inflates gzip/deflate itself.
RUNNER_KWARGS: dict[str, Any] = {"auto_decompress": False}
MAX_DEPTH = 32  # OpenAI bodies nest 5 deep at most (messages[i].content[j].image_url.url)
OFF_LOOP_BYTES = 256 * 1024  # bodies above this are parsed on a worker thread
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


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
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise BodyError(f"request body is not UTF-8: {exc.reason}") from None
    except RecursionError:
        raise BodyError(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise BodyError(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {type(body).__name__}")
    _check_tree(body, check_strings=_SURROGATE.search(raw) is not None)
    return body


async def parse_object(raw: bytes) -> dict[str, Any]:
    """loads_object(), on a worker thread when the body is large."""
    if len(raw) <= OFF_LOOP_BYTES:
        return loads_object(raw)
    return await asyncio.get_running_loop().run_in_executor(None, loads_object, raw)


def _check_tree(body: dict[str, Any], check_strings: bool) -> None:
    """Depth bound, and (only when the raw bytes hold a surrogate escape) strings that are not
    valid Unicode. Iterative: a deep body must not overflow our own stack either."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BodyError(f"request body nests deeper than {MAX_DEPTH} levels")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if check_strings:
                for s in (key, value):
                    if isinstance(s, str) and not _encodable(s):
                        raise BodyError(
                            "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            "which is not a character",
                            "invalid_unicode",
                        )
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
