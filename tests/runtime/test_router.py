"""atom-router against small recording backends in-process: prefill (KV handle) then decode,
balancing by outstanding requests, health rotation and DNS names. test_router_faults.py holds
load, failure reasons, trust and hold caps; test_disagg.py runs the router process in front of
real runtime processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest
from aiohttp import web
from router_backends import FAST, TOKEN, Backend, Env, complete, samples, with_router

from atom.router.pool import Pool, parse_target
from atom.router.proxy import RouterSettings
from atom.wire.trust import TOKEN_HEADER


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
