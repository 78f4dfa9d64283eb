"""Prefill/decode router: one OpenAI endpoint in front of prefill and decode runtime instances.

Each generation request goes to a prefill instance first, with a budget of one token and
`kv_transfer: {"mode": "prefill"}`: it runs the prompt, keeps the prompt's KV blocks and
answers with a KV handle. The router then sends the original request with the handle
(`kv_transfer: {"mode": "decode", ...}`) to a decode instance, which pulls the blocks from the
prefill instance's KV port and decodes; its answer (streamed or whole) is relayed unchanged.

Failures never hang a request: an instance that cannot be reached is skipped (the request has
not started there) and leaves rotation; one whose connection fails mid-request ends the request
with a 503 naming the instance and the cause (in-band, as an SSE error event, if the answer had
started streaming). A 503 names instances by the router's names for them (`prefill-1`), never
by address, and carries Retry-After; the log line and /status have the URLs. When every
instance of a role is busy (a prefill at its KV hold cap, an instance at --max-waiting) the
request waits for room within --queue-timeout instead of failing (capacity.py). An instance
that refuses the router's internal token (403 kv_transfer_forbidden, or its /health says so)
leaves rotation with that reason, and the client gets a 503. A failed health probe only stops new requests: in-flight ones end only if
their own connection fails. When the decode side fails or the client leaves after the prefill,
the prefill's hold is released at once (POST /internal/kv/release).

Trust: every backend request carries `X-Atom-Internal-Token` (ATOM_INTERNAL_TOKEN, required);
a client's own `kv_transfer` is always overwritten. With --api-key (ATOM_API_KEY) /v1/* needs
`Authorization: Bearer KEY`; the client's Authorization header is forwarded to the backends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from atom.router.answers import Unavailable, error_response
from atom.router.health import probe_pool
from atom.router.pool import Pool, Resolver, bounded, resolve_dns
from atom.router.routing import GENERATE_PATHS, MAX_BODY_BYTES, Router, RouterSettings
from atom.wire import errors as codes
from atom.wire.body import BodyError, parse_object, read_body
from atom.wire.middleware import json_errors

__all__ = ["ROUTER_KEY", "Router", "RouterSettings", "create_router_app"]

logger = logging.getLogger(__name__)


ROUTER_KEY = web.AppKey("atom_router", Router)


def create_router_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    settings: RouterSettings | None = None,
    resolver: Resolver = resolve_dns,
) -> web.Application:
    """ValueError for bad targets or a missing ATOM_INTERNAL_TOKEN."""
    router = Router(
        Pool("prefill", list(prefill), resolver), Pool("decode", list(decode), resolver), settings
    )
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=[json_errors(_count), api_key_check]
    )
    app[ROUTER_KEY] = router

    async def lifecycle(app: web.Application) -> Any:
        await router.start()
        yield
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    for path in GENERATE_PATHS:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    return app


def _count(request: web.Request, status: int) -> None:
    request.app[ROUTER_KEY].metrics.responses.labels(str(status)).inc()


@web.middleware
async def api_key_check(request: web.Request, handler: Any) -> web.StreamResponse:
    """/v1/* and /status (instance URLs) need the key when one is set; /health, /metrics not."""
    guarded = request.path.startswith("/v1/") or request.path == "/status"
    if guarded and not request.app[ROUTER_KEY].authorized(request):
        return error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                      "invalid_api_key")  # fmt: skip
    return await handler(request)


async def generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    t0 = time.monotonic()
    try:
        body = await parse_object(await read_body(request, MAX_BODY_BYTES))
    except BodyError as exc:
        return error_response(400, exc.message, exc.code)
    router.metrics.in_flight.inc()
    try:
        # No prompt runs (and holds blocks) while no decode instance could take it over.
        await router.await_rotation(router.decode)
        got = await router.run_prefill(request, body)
        if isinstance(got, web.Response):
            return got
        inst, handle = got
        return await router.run_decode(request, body, handle, inst, t0)
    except Unavailable as exc:
        logger.warning("503: %s", bounded(exc.detail, 500))
        router.metrics.unavailable.labels(exc.role).inc()
        return error_response(503, exc.message, exc.code)
    finally:
        router.metrics.in_flight.dec()


async def models(request: web.Request) -> web.Response:
    """/v1/models and /v1/models/{id}: a decode instance's answer (a 404 included)."""
    router = request.app[ROUTER_KEY]
    assert router.session is not None
    headers = router._headers(request)
    for inst in [i for i in router.decode.instances.values() if i.in_rotation]:
        try:
            async with router.session.get(inst.url + request.path, headers=headers) as r:
                if r.status < 500:
                    return web.json_response(await r.json(), status=r.status)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            continue
    reason = router.decode.unavailable_reason(router.public)
    return error_response(503, reason, codes.NO_BACKEND)


async def health(request: web.Request) -> web.Response:
    """200 when at least one instance of each role is healthy; the body lists every instance.
    Probing here also updates the rotation."""
    router = request.app[ROUTER_KEY]
    assert router.session is not None
    t, kw = router.settings.health_timeout, router.probe_options
    results = {
        role: await probe_pool(router.session, pool, t, **kw) for role, pool in router.pools.items()
    }
    missing = [role for role, rs in results.items() if not any(r["healthy"] for r in rs)]
    body: dict[str, Any] = {"status": "unavailable" if missing else "ok", "backends": results}
    if missing:
        body["reason"] = f"no healthy {' or '.join(missing)} instance"
    return web.json_response(body, status=503 if missing else 200)


async def status(request: web.Request) -> web.Response:
    """Every instance as the router sees it (URL, rotation, why), requests waiting for room,
    and the settings (secrets left out)."""
    router = request.app[ROUTER_KEY]
    pools = {
        role: [
            {
                "name": i.name,
                "url": i.url,
                "target": i.target,
                "healthy": i.healthy,
                "in_rotation": i.in_rotation,
                "reason": i.reason,
                "outstanding": i.outstanding,
            }
            for i in pool.instances.values()
        ]
        for role, pool in router.pools.items()
    }
    settings = {
        k: v for k, v in asdict(router.settings).items() if k not in ("internal_token", "api_key")
    }
    waiting = {role: room.waiting for role, room in router.room.items()}
    return web.json_response(
        {"instances": pools, "waiting_for_room": waiting, "settings": settings}
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER_KEY].metrics.registry)
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )
