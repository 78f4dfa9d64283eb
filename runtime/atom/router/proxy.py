"""Prefill/decode router: one OpenAI endpoint in front of prefill and decode runtime instances.

For each generation request the router first sends the request to a prefill instance with
max_tokens=1 (the prompt's prefill runs there), then sends the original request to a decode
instance and streams its answer back unchanged. Instances of each role are picked round robin.

Honest limit: KV-cache transfer between instances is NOT implemented. The decode instance
recomputes the prompt itself; the prefill call only exercises the prefill role (and its errors
reach the client early). The topology and the wire contract are the product's; moving the KV
blocks (the runtime's --kv-port) is the missing piece.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
}


@dataclass
class Pool:
    """Instances of one role, picked round robin."""

    role: str
    urls: list[str]
    _cycle: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"at least one --{self.role} URL is required")
        self.urls = [u.rstrip("/") for u in self.urls]
        self._cycle = itertools.cycle(range(len(self.urls)))

    def order(self) -> list[str]:
        """All instances, starting at the next one in the rotation (the rest are fallbacks)."""
        start = next(self._cycle)
        return self.urls[start:] + self.urls[:start]


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "atom_router_requests",
            "Proxied requests",
            ["role", "backend", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "atom_router_backend_errors",
            "Backend connection failures",
            ["role", "backend"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "atom_router_prefill_seconds", "Duration of the prefill call", registry=self.registry
        )


ROUTER_KEY = web.AppKey("atom_router", dict)


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "router_error", "param": None, "code": code}},
        status=status,
    )


def create_router_app(
    prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0
) -> web.Application:
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app[ROUTER_KEY] = {
        "prefill": Pool("prefill", list(prefill)),
        "decode": Pool("decode", list(decode)),
        "metrics": RouterMetrics(),
    }

    async def open_session(app: web.Application) -> Any:
        # No overall timeout: a long generation streams for as long as it takes.
        app[ROUTER_KEY]["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s)
        )
        yield
        await app[ROUTER_KEY]["session"].close()

    app.cleanup_ctx.append(open_session)
    for path in GENERATE_PATHS:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {**body, "max_tokens": 1, "stream": False}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def _prefill(ctx: dict[str, Any], path: str, body: dict[str, Any]) -> web.Response | None:
    """Run the prompt on a prefill instance; a 4xx there is the client's error and is returned."""
    session: aiohttp.ClientSession = ctx["session"]
    m: RouterMetrics = ctx["metrics"]
    with m.prefill_seconds.time():
        for url in ctx["prefill"].order():
            try:
                async with session.post(url + path, json=_prefill_body(body)) as r:
                    data = await r.read()
                    m.requests.labels("prefill", url, str(r.status)).inc()
                    if 400 <= r.status < 500 and r.status != 429:
                        return web.Response(
                            body=data, status=r.status, content_type="application/json"
                        )
                    if r.status < 400:
                        return None
            except (TimeoutError, aiohttp.ClientError) as exc:
                m.errors.labels("prefill", url).inc()
                logger.warning("prefill instance %s failed: %s", url, exc)
    # Every prefill instance is down or busy: the decode instance can still do the whole request.
    logger.warning("no prefill instance answered; decode instance will prefill")
    return None


async def generate(request: web.Request) -> web.StreamResponse:
    ctx = request.app[ROUTER_KEY]
    raw = await request.read()
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
    except ValueError as exc:
        return _error(400, f"request body is not a valid JSON object: {exc}", "invalid_json")
    refused = await _prefill(ctx, request.path, body)
    if refused is not None:
        return refused
    session: aiohttp.ClientSession = ctx["session"]
    m: RouterMetrics = ctx["metrics"]
    for url in ctx["decode"].order():
        try:
            upstream = await session.post(
                url + request.path, data=raw, headers={"Content-Type": "application/json"}
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            m.errors.labels("decode", url).inc()
            logger.warning("decode instance %s failed: %s", url, exc)
            continue
        m.requests.labels("decode", url, str(upstream.status)).inc()
        # Cancelling this handler (client gone) closes `upstream`, so the decode instance aborts too.
        async with upstream:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
            resp = web.StreamResponse(status=upstream.status, headers=headers)
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    return _error(503, "no decode instance is reachable", "no_backend")


async def models(request: web.Request) -> web.Response:
    ctx = request.app[ROUTER_KEY]
    for url in ctx["decode"].order():
        try:
            async with ctx["session"].get(url + "/v1/models") as r:
                if r.status == 200:
                    return web.json_response(await r.json())
        except (TimeoutError, aiohttp.ClientError):
            continue
    return _error(503, "no decode instance is reachable", "no_backend")


async def _probe(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            try:
                detail = await r.json()
            except (aiohttp.ContentTypeError, ValueError):
                detail = {}
            return {
                "url": url,
                "healthy": r.status == 200,
                "status": r.status,
                "reason": detail.get("reason", detail.get("status")),
            }
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {
            "url": url,
            "healthy": False,
            "status": None,
            "reason": f"unreachable: {exc.__class__.__name__}",
        }


async def health(request: web.Request) -> web.Response:
    """200 when at least one instance of each role is healthy; the body lists every instance."""
    ctx = request.app[ROUTER_KEY]
    pools: dict[str, Pool] = {"prefill": ctx["prefill"], "decode": ctx["decode"]}
    results = {
        role: await asyncio.gather(*(_probe(ctx["session"], u) for u in pool.urls))
        for role, pool in pools.items()
    }
    ok = all(any(r["healthy"] for r in rs) for rs in results.values())
    missing = [role for role, rs in results.items() if not any(r["healthy"] for r in rs)]
    body = {"status": "ok" if ok else "unavailable", "backends": results}
    if missing:
        body["reason"] = f"no healthy {' or '.join(missing)} instance"
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER_KEY]["metrics"].registry)
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )
