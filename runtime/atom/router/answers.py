"""What the router answers its client: errors (OpenAI shape, Retry-After on 429/503, no
internal address), and the decode's answer relayed as it comes (`Reply`).

Messages a client reads name instances by their router-given name (`prefill-1`), never by
URL or address; the router's log lines and its /status carry the URLs.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from aiohttp import web

from atom.router.metrics import RouterMetrics
from atom.router.pool import bounded
from atom.wire.errors import error_body, retry_headers

# host:port, IPv4 and bracketed IPv6 addresses, and URLs: internal topology a client must not see
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://\S+"  # a URL
    r"|\[[0-9a-fA-F:.]+\](?::\d+)?"  # [v6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # v4:port
    r"|\(\s*'[^']*'\s*,\s*\d+\s*\)"  # ('host', port), as socket errors print it
)


def scrub(text: str, hosts: set[str] | frozenset[str] = frozenset()) -> str:
    """`text` without internal addresses (and without the given host names)."""
    text = _ADDRESS.sub("<internal>", text)
    for host in hosts:
        if host:
            text = text.replace(host, "<internal>")
    return text


class Unavailable(Exception):
    """Answered 503 (with Retry-After) with `message`: the cause, for the client (no internal
    address); `detail` is the log line's version (with URLs)."""

    def __init__(self, role: str, message: str, code: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.role, self.message, self.code = role, message, code
        self.detail = detail or message


class ClientGone(Exception):
    """Writing to our own client failed (it hung up): not the backend's fault."""


def error_response(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        error_body(status, message, code), status=status, headers=retry_headers(status)
    )


def parse(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {"error": {"message": data[:200].decode(errors="replace")}}
    return body if isinstance(body, dict) else {"error": {"message": str(body)[:200]}}


def err_field(body: dict[str, Any], name: str) -> str:
    err = body.get("error")
    return str(err.get(name) or "") if isinstance(err, dict) else ""


def cause(exc: BaseException) -> str:
    """For logs and /status: the exception and its text."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
    return bounded(text)


def public_cause(exc: BaseException) -> str:
    """For a client: what went wrong, without the addresses socket errors print."""
    return "timed out" if isinstance(exc, TimeoutError) else exc.__class__.__name__


class Reply:
    """The client's response, started lazily so a failure before the first byte is still a 503."""

    def __init__(self, request: web.Request, t0: float, metrics: RouterMetrics) -> None:
        self.request, self.t0, self.metrics = request, t0, metrics
        self.resp: web.StreamResponse | None = None
        self.sse = False
        self.complete = False  # the decode's whole answer reached the client

    async def start(self, status: int, headers: dict[str, str]) -> None:
        self.resp = web.StreamResponse(status=status, headers=headers)
        self.sse = headers.get("Content-Type", "").startswith("text/event-stream")
        try:
            await self.resp.prepare(self.request)
        except ConnectionError as exc:
            raise ClientGone() from exc

    async def write(self, chunk: bytes) -> None:
        assert self.resp is not None
        if self.t0:
            self.metrics.first_byte_seconds.observe(time.monotonic() - self.t0)
            self.t0 = 0.0
        try:
            await self.resp.write(chunk)
        except ConnectionError as exc:
            raise ClientGone() from exc

    async def finish(self) -> None:
        assert self.resp is not None
        try:
            await self.resp.write_eof()
        except ConnectionError as exc:
            raise ClientGone() from exc
        self.complete = self.resp.status == 200

    async def fail_in_band(self, message: str, code: str) -> None:
        """After the status went out: an OpenAI-style error event (SSE), then the end."""
        if self.resp is None:
            return
        err = error_body(503, message, code)
        try:
            if self.sse:
                await self.resp.write(
                    b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
                )
            await self.resp.write_eof()
        except ConnectionError:
            pass
