"""atom-router against small recording backends in-process: prefill (KV handle) then decode,
balancing by outstanding requests, health rotation, DNS names, and bounded failures.

test_disagg.py runs the router process in front of real runtime processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from atom.entrypoints.kv_release import RELEASE_PATH
from atom.router.pool import Pool, parse_target
from atom.router.proxy import ROUTER_KEY, Router, RouterSettings, create_router_app
from atom.wire.trust import TOKEN_HEADER
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
        assert self.router is not None
        url = self.urls[backend]
        return next(i.healthy for pool in self.router.pools.values()
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


def test_prefill_handle_goes_to_decode_round_robin() -> None:
    p, d1, d2 = Backend("p"), Backend("d1"), Backend("d2")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient() as c:
            texts = []
            for i in range(4):
                r = await complete(c, router, prompt=f"q{i}", max_tokens=50)
                texts.append(r.json()["choices"][0]["text"])
            assert texts == ["d1", "d2", "d1", "d2"]  # idle instances: least recently picked
            chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            r = await c.post(
                router + "/v1/chat/completions", json={**chat, "max_completion_tokens": 9}
            )
            assert r.status_code == 200

    with_router([p], [d1, d2], check)
    # every prompt ran on prefill first: one token, no streaming, asking for a KV handle
    assert [b["prompt"] for b in p.bodies[:4]] == ["q0", "q1", "q2", "q3"]
    assert all(b["max_tokens"] == 1 and b["stream"] is False for b in p.bodies)
    assert all(b["kv_transfer"] == {"mode": "prefill"} for b in p.bodies)
    assert p.bodies[4]["max_completion_tokens"] == 1
    # decode got the original request plus the handle; the router filled in the prefill's host
    first = d1.bodies[0]
    assert {k: v for k, v in first.items() if k != "kv_transfer"} == {
        "model": "m",
        "prompt": "q0",
        "max_tokens": 50,
    }
    assert first["kv_transfer"] == {
        "handle": "p-1",
        "kv_host": "127.0.0.1",
        "kv_port": 9,
        "secret": "s3cret",
        "mode": "decode",
    }
    # every backend request carried the internal token; no hold needed releasing
    assert all(h.get(TOKEN_HEADER) == TOKEN for b in (p, d1, d2) for h in b.headers)
    assert p.released == []
    assert d1.bodies[-1]["max_completion_tokens"] == 9  # the fifth request: d1 again


def test_balances_by_outstanding_requests() -> None:
    p, d1, d2 = Backend("p"), Backend("d1"), Backend("d2")
    d1.step_s = d2.step_s = 0.05

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            long = asyncio.ensure_future(complete(c, router, max_tokens=20, stream=True))
            while not (d1.bodies or d2.bodies):
                await asyncio.sleep(0.01)
            busy = d1 if d1.bodies else d2
            idle = d2 if busy is d1 else d1
            texts = [
                (await complete(c, router, max_tokens=2)).json()["choices"][0]["text"]
                for _ in range(3)
            ]
            assert texts == [idle.name] * 3  # the busy instance has one outstanding request
            metrics = samples(
                (await c.get(router + "/metrics")).text, "atom_router_outstanding_requests"
            )
            assert metrics[(("instance", env.urls[busy]), ("role", "decode"))] == 1.0
            assert metrics[(("instance", env.urls[idle]), ("role", "decode"))] == 0.0
            assert (await long).status_code == 200

    with_router([p], [d1, d2], check)


def test_streaming_passthrough_and_disconnect() -> None:
    p, d = Backend("p"), Backend("d")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient() as c:
            r = await complete(c, router, max_tokens=3, stream=True)
            assert r.headers["content-type"].startswith("text/event-stream")
            want = "".join(
                f"data: {json.dumps({'choices': [{'text': f'd{i} '}]})}\n\n" for i in range(3)
            )
            assert r.text == want + "data: [DONE]\n\n"
            # hang up mid-stream: the router's upstream request is dropped too
            body = {"model": "m", "prompt": "x", "max_tokens": 500, "stream": True}
            async with c.stream("POST", router + "/v1/completions", json=body) as s:
                async for _ in s.aiter_lines():
                    break
        for _ in range(100):
            if d.disconnects and p.released:
                break
            await asyncio.sleep(0.02)
        assert d.disconnects == 1
        # the client left after its prefill: the hold is released at once, with its secret
        assert p.released == [{"handle": "p-2", "secret": "s3cret"}]

    with_router([p], [d], check)


def test_prefill_client_error_is_returned_without_decode() -> None:
    p, d = Backend("p", reject=True), Backend("d")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient() as c:
            r = await complete(c, router)
            assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
            for content, headers in (
                (b"{oops", {}),
                (b'{"model": "m", "prompt": "\\ud800"}', {}),  # a lone surrogate
                (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}),
                (b"\x1f\x8b not gzip", {"Content-Encoding": "gzip"}),
                (b'{"model": "m"}', {"Content-Encoding": "bogus"}),
            ):
                bad = await c.post(
                    router + "/v1/completions",
                    content=content,
                    headers={"content-type": "application/json", **headers},
                )
                assert bad.status_code == 400, bad.text
                assert bad.json()["error"]["type"] == "invalid_request_error"
            assert len(p.bodies) == 1  # none of them reached a backend

    with_router([p], [d], check)
    assert d.bodies == []


def test_unreachable_decode_is_skipped_and_leaves_rotation() -> None:
    p, d, gone = Backend("p"), Backend("d"), Backend("gone")
    no_probes = RouterSettings(health_interval=60, queue_timeout=0.5, internal_token=TOKEN)

    async def check(router: str, env: Env) -> None:
        await env.until_healthy({p: True, d: True, gone: True})  # the start-up probe pass
        await env.stop(gone)  # its port now refuses connections
        async with httpx.AsyncClient() as c:
            texts = [(await complete(c, router)).json()["choices"][0]["text"] for _ in range(3)]
            assert texts == ["d", "d", "d"]  # the request that picked `gone` moved on to `d`
            text = (await c.get(router + "/metrics")).text
            assert samples(text, "atom_router_backend_errors_total") == {
                (("backend", env.urls[gone]), ("role", "decode")): 1.0
            }
            healthy = samples(text, "atom_router_instance_healthy")
            assert healthy[(("instance", env.urls[gone]), ("role", "decode"))] == 0.0

    with_router([p], [d, gone], check, settings=no_probes)


def test_health_aggregates_roles_and_rotation_follows_it() -> None:
    p1, p2, d = Backend("p1"), Backend("p2", healthy=False), Backend("d", healthy=False)

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.get(router + "/health")
            assert r.status_code == 503
            body = r.json()
            assert body["reason"] == "no healthy decode instance"
            assert [b["healthy"] for b in body["backends"]["prefill"]] == [True, False]
            assert body["backends"]["prefill"][1]["reason"] == "compiling"
            r = await complete(c, router)  # no decode in rotation: waits queue_timeout, then 503
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend"
            assert "no healthy decode instance" in r.json()["error"]["message"]
            assert "compiling" in r.json()["error"]["message"]
            d.healthy = True
            assert (await c.get(router + "/health")).status_code == 200
            assert (await c.get(router + "/v1/models")).json()["data"][0]["id"] == "d"
            for _ in range(4):  # p2 stays out of rotation while it is not healthy
                assert (await complete(c, router)).status_code == 200
            assert len(p2.bodies) == 0
            p2.healthy = True
            await env.until_healthy({p2: True})  # a probe pass brings it back
            for _ in range(4):
                assert (await complete(c, router)).status_code == 200
            assert len(p2.bodies) == 2

    with_router([p1, p2], [d], check)


def test_prefill_dying_mid_request_is_503_and_the_next_go_elsewhere() -> None:
    p1, p2, d = Backend("p1"), Backend("p2"), Backend("d")
    p1.drop = True  # crashes with the request in hand

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient() as c:
            first = await complete(c, router)
            assert first.status_code == 503
            err = first.json()["error"]
            assert err["code"] == "prefill_failed" and err["type"] == "service_unavailable"
            # named as the router names it, never by its address (issue 48)
            assert "prefill-1 failed during the request" in err["message"]
            assert env.urls[p1] not in err["message"] and "127.0.0.1" not in err["message"]
            for _ in range(3):
                assert (await complete(c, router)).status_code == 200
        assert len(p1.bodies) == 1 and len(p2.bodies) == 3

    with_router(
        [p1, p2], [d], check, settings=RouterSettings(health_interval=60, internal_token=TOKEN)
    )


def test_silent_instance_leaves_rotation_and_its_request_ends_by_its_own_timeout() -> None:
    p, d, d2 = Backend("p"), Backend("d"), Backend("d2")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            d.hang = d.hang_health = True  # alive socket, no answers: a frozen or cut-off pod
            d2.healthy = False
            await env.until_healthy({d: False, d2: False})  # d: its probes timed out twice
            t0 = time.monotonic()
            r = await complete(c, router)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend"
            assert "/health timed out" in r.json()["error"]["message"]
            assert d.bodies == [] and time.monotonic() - t0 < 2.0
            # a request already on it when it froze ends when its own read times out
            d.hang_health, d2.healthy = False, True
            await env.until_healthy({d: True, d2: True})
            late = asyncio.ensure_future(complete(c, router))  # both idle: d is first
            while len(d.bodies) < 1:
                await asyncio.sleep(0.01)
            d.hang_health = True
            t0 = time.monotonic()
            r = await late
            assert 0.5 < time.monotonic() - t0 < 3.0
            assert r.status_code == 503 and r.json()["error"]["code"] == "decode_failed"
            assert "timed out" in r.json()["error"]["message"]
            r = await complete(c, router)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d2"
        assert len(p.released) == 1  # the failed decode freed its prefill hold at once

    settings = dataclasses.replace(FAST, health_timeout=0.2, read_timeout=1.0)
    with_router([p], [d, d2], check, settings=settings)


def test_decode_failure_before_and_after_the_first_byte() -> None:
    p, d = Backend("p"), Backend("d")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            d.decode_error = (
                503,
                {"message": "KV transfer from 1.2.3.4:8001 failed", "code": "kv_transfer_failed"},
            )
            r = await complete(c, router)
            assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed"
            # the decode's reason, without the prefill's KV address (internal topology)
            assert "KV transfer from <internal> failed" in r.json()["error"]["message"]
            assert "1.2.3.4" not in r.json()["error"]["message"]
            assert r.headers["Retry-After"] == "1"
            d.decode_error = (409, {"message": "model identity differs", "code": "kv_mismatch"})
            r = await complete(c, router)
            assert r.status_code == 409 and r.json()["error"]["code"] == "kv_mismatch"
            d.decode_error = None
            # the stream started, then the decode instance vanished: an in-band error event
            body = {"model": "m", "prompt": "x", "max_tokens": 200, "stream": True}
            lines = []
            async with c.stream("POST", router + "/v1/completions", json=body) as s:
                async for line in s.aiter_lines():
                    lines.append(line)
                    if len(lines) == 2:
                        d.hang_health = True
                        d.step_s = 30
            events = [line for line in lines if line]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2].removeprefix("data: "))["error"]
            assert err["code"] == "decode_failed" and "decode-1 failed" in err["message"]
            assert env.urls[d] not in err["message"]

    settings = RouterSettings(
        health_interval=0.1, health_timeout=0.2, read_timeout=1.0, internal_token=TOKEN
    )
    with_router([p], [d], check, settings=settings)


def test_prefill_without_a_handle_is_refused_clearly() -> None:
    p, d = Backend("p"), Backend("d")

    class OldPrefill(Backend):
        async def complete(self, request: web.Request) -> web.StreamResponse:
            await request.read()
            return web.json_response({"choices": [{"text": "x"}]})

    old = OldPrefill("old")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient() as c:
            r = await complete(c, router)
            assert r.status_code == 503 and "without a KV handle" in r.json()["error"]["message"]

    with_router([old], [d], check)
    assert d.bodies == [] and p.bodies == []


def test_targets_are_urls_or_dns_names() -> None:
    assert parse_target("http://10.0.0.5:8000/") == ("http://10.0.0.5:8000", "", 0)
    assert parse_target("demo-prefill-abc.ns.svc:8000") == (None, "demo-prefill-abc.ns.svc", 8000)
    assert parse_target("svc.ns") == (None, "svc.ns", 8000)
    with pytest.raises(ValueError, match="neither a URL nor a DNS name"):
        parse_target("svc/path")

    records = {"svc.ns": ["10.0.0.1", "10.0.0.2"]}

    async def resolver(host: str, port: int) -> list[str]:
        if host not in records:
            raise OSError("NXDOMAIN")
        return records[host]

    async def main() -> None:
        pool = Pool("decode", ["svc.ns:8000", "http://10.9.9.9:8000"], resolver)
        await pool.resolve()
        assert sorted(pool.instances) == [
            "http://10.0.0.1:8000",
            "http://10.0.0.2:8000",
            "http://10.9.9.9:8000",
        ]
        records["svc.ns"] = ["10.0.0.2", "fd00::3"]  # a pod left, another joined
        await pool.resolve()
        assert sorted(pool.instances) == [
            "http://10.0.0.2:8000",
            "http://10.9.9.9:8000",
            "http://[fd00::3]:8000",
        ]
        del records["svc.ns"]  # a failed lookup keeps what was known
        await pool.resolve()
        assert len(pool.instances) == 3

    asyncio.run(main())


def test_router_follows_a_dns_name() -> None:
    p, d1, d2 = Backend("p"), Backend("d1"), Backend("d2")
    records: dict[str, list[str]] = {}

    async def resolver(host: str, port: int) -> list[str]:
        return records.get(host, [])

    def targets(urls: dict[Backend, str]) -> tuple[list[str], list[str]]:
        # Each backend listens on its own port; a headless Service maps one name to several
        # pod IPs on one port. Here the name picks which backend ports exist.
        ports = {b: int(u.rsplit(":", 1)[1]) for b, u in urls.items()}
        records["p.ns"] = ["127.0.0.1"]
        return [f"p.ns:{ports[p]}"], [f"d.ns:{ports[d1]}", f"d.ns:{ports[d2]}"]

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient() as c:
            r = await complete(c, router)  # no decode address yet: waits, then 503
            assert (
                r.status_code == 503
                and "no decode instance is known" in r.json()["error"]["message"]
            )
            records["d.ns"] = ["127.0.0.1"]
            await env.until_known("decode", 2)  # re-resolved
            texts = {(await complete(c, router)).json()["choices"][0]["text"] for _ in range(4)}
            assert texts == {"d1", "d2"}
            records["d.ns"] = []
            await env.until_known("decode", 0)
            assert (await complete(c, router)).status_code == 503

    with_router([p], [d1, d2], check, targets=targets, resolver=resolver)


def sse_ok(r: httpx.Response, tokens: int) -> bool:
    """A whole stream from one backend: the text of every token, then [DONE]. The content is
    checked, not the number of events (a proxy may join them)."""
    data = [line.removeprefix("data: ") for line in r.text.split("\n") if line.startswith("data: ")]
    if r.status_code != 200 or not data or data[-1] != "[DONE]":
        return False
    text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    name = text.split("0 ", 1)[0]  # Backend.complete sends f"{name}{i} " for each token i
    return text == "".join(f"{name}{i} " for i in range(tokens))


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_600_concurrent_requests_survive_a_backend_whose_health_turns_slow() -> None:
    """Busy is not dead: once d2 is loaded its /health takes longer than the probe timeout,
    but its streams progress, so it stays in rotation and none of its requests is aborted."""
    p, d1, d2 = Backend("p"), Backend("d1"), Backend("d2")
    d1.step_s = d2.step_s = 0.1

    async def check(router: str, env: Env) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:

            async def one(i: int) -> httpx.Response:
                return await complete(c, router, prompt=f"q{i}", max_tokens=4, stream=True)

            calls = [asyncio.ensure_future(one(i)) for i in range(600)]
            while len(d2.bodies) < 50:
                await asyncio.sleep(0.01)
            d2.health_delay = 2.0  # > health_timeout: every probe of d2 times out from now
            rs = await asyncio.gather(*calls)
            health = (await c.get(router + "/metrics")).text
            probed = (await c.get(router + "/health")).json()["backends"]["decode"][1]
        # d2's probes really timed out, in a row (2 takes a silent instance out: out_after),
        # while its streams ran; how many more fit depends on the machine's speed
        timeouts = int(probed["reason"].split("timed out (")[1].split("x")[0])
        assert probed["status"] is None and timeouts >= 2, probed
        assert [r.status_code for r in rs] == [200] * 600
        assert all(sse_ok(r, 4) for r in rs)
        assert len(d1.bodies) + len(d2.bodies) == 600 and len(d2.bodies) > 100
        assert d1.disconnects == d2.disconnects == 0 and p.released == []
        errors = samples(health, "atom_router_backend_errors_total")
        assert sum(errors.values()) == 0

    settings = RouterSettings(
        health_interval=0.2, health_timeout=0.5, queue_timeout=10.0, internal_token=TOKEN
    )
    with_router([p], [d1, d2], check, settings=settings)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("draining", "server is shutting down"), ("health_reset", "/health unreachable")],
)
def test_a_backend_out_of_rotation_gets_no_new_work_and_its_streams_finish(
    fault: str, reason: str
) -> None:
    """draining: SIGTERM, /health 503 `draining`; health_reset: probes cut at the connection
    (as refused). Either takes d1 out for new requests; its streams in flight go on."""
    p, d1, d2 = Backend("p"), Backend("d1"), Backend("d2")
    d1.step_s = d2.step_s = 0.1

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            streams = [
                asyncio.ensure_future(complete(c, router, max_tokens=15, stream=True))
                for _ in range(10)
            ]
            while len(d1.bodies) + len(d2.bodies) < 10:
                await asyncio.sleep(0.01)
            on_d1 = len(d1.bodies)
            assert on_d1 >= 3  # least outstanding: the streams are spread over d1 and d2
            setattr(d1, fault, True)
            await env.until_healthy({d1: False})
            later = [(await complete(c, router)).json()["choices"][0]["text"] for _ in range(5)]
            assert later == ["d2"] * 5 and len(d1.bodies) == on_d1
            rs = await asyncio.gather(*streams)
            assert all(sse_ok(r, 15) for r in rs)
            health = (await c.get(router + "/health")).json()["backends"]["decode"]
            assert health[0]["reason"].startswith(reason) and health[1]["reason"] == "ok"
        assert d1.disconnects == 0 and p.released == []

    with_router([p], [d1, d2], check)


def test_failure_reasons_are_bounded_and_do_not_nest() -> None:
    p, d = Backend("p"), Backend("d")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            d.decode_error = (500, {"message": "decode exploded: " + "x" * 5000})
            for _ in range(3):
                r = await complete(c, router)
                err = r.json()["error"]
                assert r.status_code == 503 and len(err["message"]) < 400
                assert err["message"].count("decode-1") == 1
            d.decode_error = None
            d.drop = True
            r = await complete(c, router)
            msg = r.json()["error"]["message"]
            assert r.status_code == 503 and "InstanceLost" not in msg and len(msg) < 400
            for _ in range(100):  # releases run in the background
                if len(p.released) == 4:
                    break
                await asyncio.sleep(0.02)
        assert len(p.released) == 4

    with_router([p], [d], check)


def test_api_key_is_checked_and_forwarded_and_client_kv_transfer_is_replaced() -> None:
    p, d = Backend("p"), Backend("d")
    settings = dataclasses.replace(FAST, api_key="sk-test")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await complete(c, router)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            bad = {"Authorization": "Bearer nope"}
            assert (await c.get(router + "/v1/models", headers=bad)).status_code == 401
            assert (await c.get(router + "/health")).status_code == 200  # probes stay open
            assert p.bodies == [] and d.bodies == []
            good = {"Authorization": "Bearer sk-test"}
            evil = {"mode": "decode", "kv_host": "10.9.9.9", "kv_port": 22, "handle": "x"}
            r = await c.post(
                router + "/v1/completions",
                json={"model": "m", "prompt": "x", "kv_transfer": evil},
                headers=good,
            )
            assert r.status_code == 200
            assert (await c.get(router + "/v1/models", headers=good)).status_code == 200
            p.kv_host = "169.254.169.254"
            assert (await complete(c, router, prompt="y")).status_code == 401
            r = await c.post(
                router + "/v1/completions", json={"model": "m", "prompt": "y"}, headers=good
            )
            assert r.status_code == 200
        assert p.bodies[0]["kv_transfer"] == {"mode": "prefill"}
        assert d.bodies[0]["kv_transfer"]["kv_host"] == "127.0.0.1"
        assert d.bodies[0]["kv_transfer"]["handle"] == "p-1"
        # a prefill advertising an address that is no prefill instance is not believed
        assert d.bodies[1]["kv_transfer"]["kv_host"] == "127.0.0.1"
        sent = [h for b in (p, d) for h in b.headers if "Authorization" in h]
        assert len(sent) == 5 and all(h["Authorization"] == "Bearer sk-test" for h in sent)

    with_router([p], [d], check, settings=settings)


def test_router_refuses_to_start_without_the_internal_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from atom.router.main import main

    monkeypatch.delenv("ATOM_INTERNAL_TOKEN", raising=False)
    with pytest.raises(ValueError, match="ATOM_INTERNAL_TOKEN must be set"):
        create_router_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    assert main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]) == 2
    assert "ATOM_INTERNAL_TOKEN must be set" in capsys.readouterr().err


HOLD_CAP = (503, {"message": "KV blocks held for transfers are at their cap", "code": "kv_hold_cap"})


def test_a_prefill_at_its_hold_cap_holds_requests_until_room_is_freed() -> None:
    """Issue 48: every prefill declining with kv_hold_cap is busy, not unwell: the router
    waits for room (within --queue-timeout) and retries, rather than answering 503."""
    p, d = Backend("p"), Backend("d")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            p.prefill_error, p.prefill_errors = HOLD_CAP, 5
            rs = await asyncio.gather(*(complete(c, router) for _ in range(20)))
            assert [r.status_code for r in rs] == [200] * 20
            assert p.prefill_errors == 0 and env.healthy(p) is True  # refused, still in rotation
            # room never comes: the prefill's own reason, after the queue timeout, Retry-After
            p.prefill_errors = 10**6
            r = await complete(c, router)
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == "kv_hold_cap"
            assert "held for transfers are at their cap" in err["message"]
            assert r.headers["Retry-After"] == "1" and "127.0.0.1" not in r.text

    with_router([p], [d], check, settings=dataclasses.replace(FAST, queue_timeout=3.0))


def test_a_403_on_kv_transfer_is_a_503_naming_no_address(caplog: pytest.LogCaptureFixture) -> None:
    """A decode that refuses the router's internal token: the client's request is not at fault
    (503, not the 403), the instance leaves rotation, and the log line names it."""
    p, d = Backend("p"), Backend("d")
    forbidden = {"message": "kv_transfer is only accepted from the router",
                 "code": "kv_transfer_forbidden"}  # fmt: skip

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            d.decode_error = (403, forbidden)
            r = await complete(c, router)
            err = r.json()["error"]
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "decode-1: refuses the router's internal token" in err["message"]
            assert env.urls[d] not in r.text
            assert env.healthy(d) is False
            # the prefill's hold is freed at once
            await async_wait_for("the hold released", lambda: len(p.released) == 1)

    with caplog.at_level(logging.ERROR, logger="atom.router"):
        with_router([p], [d], check, settings=dataclasses.replace(FAST, health_interval=60))
    assert any("kv_transfer_forbidden" in m and "http://127.0.0.1:" in m for m in caplog.messages)
