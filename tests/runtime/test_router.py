"""atom-router: prefill then decode, round robin, streaming passthrough, aggregated health.

Routing logic is checked against small recording backends in-process; one end-to-end test runs
the router process in front of real runtime servers with the openai client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from server_proc import free_port, start_router, start_server

from atom.router.proxy import create_router_app


class Backend:
    """Records what it was sent; answers like a runtime instance, tagging text with its name."""

    def __init__(self, name: str, healthy: bool = True, reject: bool = False) -> None:
        self.name, self.healthy, self.reject = name, healthy, reject
        self.bodies: list[dict[str, Any]] = []
        self.disconnects = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.healthy:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "warming", "reason": "compiling"}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.reject:
            return web.json_response(
                {
                    "error": {
                        "message": "prompt too long",
                        "type": "invalid_request_error",
                        "param": "prompt",
                        "code": None,
                    }
                },
                status=400,
            )
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": self.name, "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(body.get("max_tokens", 3)):
                await resp.write(
                    f"data: {json.dumps({'choices': [{'text': f'{self.name}{i} '}]})}\n\n".encode()
                )
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def with_router(
    prefill: list[Backend],
    decode: list[Backend],
    fn: Callable[[str], Awaitable[None]],
    extra_decode: list[str] = (),
) -> None:
    async def main() -> None:
        urls: dict[Backend, str] = {}
        cms = []
        for b in prefill + decode:
            cm = serving(b.app())
            urls[b] = await cm.__aenter__()
            cms.append(cm)
        try:
            app = create_router_app(
                [urls[b] for b in prefill], [urls[b] for b in decode] + list(extra_decode)
            )
            async with serving(app) as router:
                await fn(router)
        finally:
            for cm in cms:
                await cm.__aexit__(None, None, None)

    asyncio.run(main())


def test_prefill_then_decode_round_robin() -> None:
    p, d1, d2 = Backend("p"), Backend("d1"), Backend("d2")

    async def check(router: str) -> None:
        async with httpx.AsyncClient() as c:
            texts = []
            for i in range(4):
                body = {"model": "m", "prompt": f"q{i}", "max_tokens": 50, "stream": False}
                texts.append(
                    (await c.post(router + "/v1/completions", json=body)).json()["choices"][0][
                        "text"
                    ]
                )
            assert texts == ["d1", "d2", "d1", "d2"]  # decode answers, alternating
            chat = {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 9,
            }
            assert (await c.post(router + "/v1/chat/completions", json=chat)).status_code == 200

    with_router([p], [d1, d2], check)
    # every request's prompt went to prefill first, with a one-token budget and no streaming
    assert [b["prompt"] for b in p.bodies[:4]] == ["q0", "q1", "q2", "q3"]
    assert all(b["max_tokens"] == 1 and b["stream"] is False for b in p.bodies)
    assert p.bodies[4]["max_completion_tokens"] == 1
    # decode got the original request untouched
    assert d1.bodies[0] == {"model": "m", "prompt": "q0", "max_tokens": 50, "stream": False}
    assert d1.bodies[-1]["max_completion_tokens"] == 9  # the fifth request: d1 again


def test_streaming_passthrough_and_disconnect() -> None:
    p, d = Backend("p"), Backend("d")

    async def check(router: str) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.post(
                router + "/v1/completions",
                json={"model": "m", "prompt": "x", "max_tokens": 3, "stream": True},
            )
            assert r.headers["content-type"].startswith("text/event-stream")
            assert (
                r.text
                == "".join(
                    f"data: {json.dumps({'choices': [{'text': f'd{i} '}]})}\n\n" for i in range(3)
                )
                + "data: [DONE]\n\n"
            )
            # hang up mid-stream: the router's upstream request is dropped too
            async with c.stream(
                "POST",
                router + "/v1/completions",
                json={"model": "m", "prompt": "x", "max_tokens": 500, "stream": True},
            ) as s:
                async for _ in s.aiter_lines():
                    break
        for _ in range(100):
            if d.disconnects:
                break
            await asyncio.sleep(0.02)
        assert d.disconnects == 1

    with_router([p], [d], check)


def test_prefill_client_error_is_returned_without_decode() -> None:
    p, d = Backend("p", reject=True), Backend("d")

    async def check(router: str) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.post(router + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
            bad = await c.post(
                router + "/v1/completions",
                content=b"{oops",
                headers={"content-type": "application/json"},
            )
            assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]

    with_router([p], [d], check)
    assert d.bodies == []


def test_unreachable_decode_falls_back_to_the_next() -> None:
    p, d = Backend("p"), Backend("d")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here

    async def check(router: str) -> None:
        async with httpx.AsyncClient() as c:
            texts = [
                (
                    await c.post(router + "/v1/completions", json={"model": "m", "prompt": "x"})
                ).json()["choices"][0]["text"]
                for _ in range(2)
            ]
            assert texts == ["d", "d"]
            metrics = (await c.get(router + "/metrics")).text
            assert (
                f'atom_router_backend_errors_total{{backend="{dead}",role="decode"}} 1.0' in metrics
            )

    with_router([p], [d], check, extra_decode=[dead])


def test_health_aggregates_roles() -> None:
    p1, p2, d = Backend("p1"), Backend("p2", healthy=False), Backend("d", healthy=False)

    async def check(router: str) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.get(router + "/health")
            assert r.status_code == 503
            body = r.json()
            assert body["reason"] == "no healthy decode instance"
            assert [b["healthy"] for b in body["backends"]["prefill"]] == [True, False]
            assert body["backends"]["prefill"][1]["reason"] == "compiling"
            d.healthy = True
            assert (await c.get(router + "/health")).status_code == 200
            assert (await c.get(router + "/v1/models")).json()["data"][0]["id"] == "d"

    with_router([p1, p2], [d], check)


@pytest.mark.slow
def test_router_process_in_front_of_real_servers() -> None:
    prefill, decode = start_server(), start_server()
    router = None
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        router = start_router([prefill.url], [decode.url])
        router.wait_healthy()
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        kw = {
            "model": "tiny-llama",
            "prompt": "hello",
            "max_tokens": 6,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        whole = client.completions.create(**kw)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
        assert whole.usage.completion_tokens == 6 and streamed == whole.choices[0].text
        # the same weights (seed 0) and greedy decoding: the router adds nothing to the answer
        direct = openai.OpenAI(base_url=decode.url + "/v1", api_key="x").completions.create(**kw)
        assert direct.choices[0].text == whole.choices[0].text
        prefill_status = httpx.get(prefill.url + "/status").json()
        assert prefill_status["steps"] >= 2  # the prefill instance really ran the prompts
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-llama", prompt="x", max_tokens=-1)
        assert router.terminate() == 0
    finally:
        for proc in (router, prefill, decode):
            if proc is not None:
                proc.stop()
