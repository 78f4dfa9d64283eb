"""Small recording backends that answer like runtime instances, and a router in front of them
in-process: shared by test_router.py and test_router_faults.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from atom.entrypoints.kv_release import RELEASE_PATH
from atom.router.pool import Instance
from atom.router.proxy import ROUTER_KEY, Router, RouterSettings, create_router_app
from testutil import async_wait_for

TOKEN = "router-test-token"
FAST = RouterSettings(
    health_interval=0.1,
    health_timeout=0.5,
    dns_interval=0.1,
    queue_timeout=0.5,
    internal_token=TOKEN,
)


class Backend:
    """Answers like a runtime instance: a prefill-mode request gets a KV handle, anything else
    text tagged with the backend's name. Records every body it was sent."""

    def __init__(self, name: str, healthy: bool = True, reject: bool = False) -> None:
        self.name, self.healthy, self.reject = name, healthy, reject
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # of every request, /health included
        self.released: list[dict[str, Any]] = []  # bodies of POST /internal/kv/release
        self.health_delay = 0.0
        self.draining = False  # /health 503 "draining", generation still served
        self.health_reset = False  # /health probes get their connection cut (like refused)
        self.disconnects = 0
        self.step_s = 0.01
        self.hang = False  # accept requests and never answer
        self.hang_health = False
        self.drop = False  # close the connection without answering (a crash mid-request)
        self.decode_error: tuple[int, dict[str, Any]] | None = None
        self.prefill_error: tuple[int, dict[str, Any]] | None = None  # what prefills get...
        self.prefill_errors = 0  # ...this many more times
        self.kv_host: str | None = None  # what a prefill handle advertises

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post(RELEASE_PATH, self.release)
        return app

    async def release(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        self.released.append(await request.json())
        return web.json_response({"released": True})

    async def health(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        await asyncio.sleep(self.health_delay)
        if self.health_reset:
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(1)
        if self.hang_health:
            await asyncio.sleep(30)
        if self.draining:
            body = {"status": "draining", "reason": "server is shutting down"}
            return web.json_response(body, status=503)
        if self.healthy:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "warming", "reason": "compiling"}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.hang:
            await asyncio.sleep(30)
        if self.drop:
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(1)
        if self.reject:
            err = {"message": "prompt too long", "type": "invalid_request_error", "param": "prompt"}
            return web.json_response({"error": {**err, "code": None}}, status=400)
        kv = body.get("kv_transfer") or {}
        if kv.get("mode") == "prefill" and self.prefill_error and self.prefill_errors > 0:
            self.prefill_errors -= 1
            status, err = self.prefill_error
            return web.json_response({"error": err}, status=status)
        if kv.get("mode") == "prefill":
            handle = {
                "handle": f"{self.name}-{len(self.bodies)}",
                "kv_host": self.kv_host,
                "kv_port": 9,
                "secret": "s3cret",
            }
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer": handle})
        if self.decode_error is not None:
            status, err = self.decode_error
            return web.json_response({"error": err}, status=status)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": self.name, "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(body.get("max_tokens", 3)):
                chunk = {"choices": [{"text": f"{self.name}{i} "}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.step_s)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)  # 600 connect at once
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class Env:
    """What a check gets beside the router URL: backend URLs, a way to stop a backend, and the
    router's view of each (what its probes last found)."""

    def __init__(self) -> None:
        self.urls: dict[Backend, str] = {}
        self.stoppers: dict[Backend, Any] = {}
        self.router: Router | None = None

    async def stop(self, backend: Backend) -> None:
        await self.stoppers.pop(backend).__aexit__(None, None, None)

    def healthy(self, backend: Backend) -> bool | None:
        """The router's verdict on the backend: None until a probe has answered."""
        return self.instance(backend).healthy

    def instance(self, backend: Backend) -> Instance:
        """The router's Instance for the backend."""
        assert self.router is not None
        url = self.urls[backend]
        return next(i for pool in self.router.pools.values()
                    for i in pool.instances.values() if i.url == url)

    async def until_known(self, role: str, count: int) -> None:
        """Until the router's DNS pass has found `count` instances of the role."""
        assert self.router is not None
        pool = self.router.pools[role]
        await async_wait_for(f"{count} {role} instances", lambda: len(pool.instances) == count)

    async def until_healthy(self, want: dict[Backend, bool]) -> None:
        """Until the router's probes have found each backend as wanted."""
        await async_wait_for(
            f"probes to find {[(b.name, h) for b, h in want.items()]}",
            lambda: all(self.healthy(b) is h for b, h in want.items()),
            timeout=10,
        )


def with_router(
    prefill: list[Backend],
    decode: list[Backend],
    fn: Callable[[str, Env], Awaitable[None]],
    settings: RouterSettings = FAST,
    targets: Callable[[dict[Backend, str]], tuple[list[str], list[str]]] | None = None,
    resolver: Any = None,
) -> None:
    async def main() -> None:
        env = Env()
        for b in prefill + decode:
            cm = serving(b.app())
            env.urls[b] = await cm.__aenter__()
            env.stoppers[b] = cm
        try:
            p, d = [env.urls[b] for b in prefill], [env.urls[b] for b in decode]
            if targets is not None:
                p, d = targets(env.urls)
            kw = {"resolver": resolver} if resolver else {}
            app = create_router_app(p, d, settings, **kw)
            env.router = app[ROUTER_KEY]
            async with serving(app) as router:
                await fn(router, env)
        finally:
            for b in list(env.stoppers):
                await env.stop(b)

    asyncio.run(main())


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


async def complete(c: httpx.AsyncClient, router: str, **body: Any) -> httpx.Response:
    return await c.post(router + "/v1/completions", json={"model": "m", "prompt": "x", **body})


def record_failures(env: Env, backend: Backend) -> list[str]:
    """Every reason the router takes the backend out of rotation for, from now on (a later
    probe may put it back before a test looks at `healthy`)."""
    inst, reasons = env.instance(backend), []
    failed = inst.failed

    def recording(reason: str, slow: bool = False) -> None:
        reasons.append(reason)
        failed(reason, slow)

    inst.failed = recording  # type: ignore[method-assign]
    return reasons
