"""atom-router under load and faults, against the recording backends of router_backends.py:
slow health under 600 streams, rotation while streams finish, bounded failure reasons, the API
key and the internal token, the prefill's hold cap and a 403 on kv_transfer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import httpx
import pytest
from router_backends import (
    FAST,
    TOKEN,
    Backend,
    Env,
    complete,
    record_failures,
    samples,
    with_router,
)

from atom.router.proxy import RouterSettings, create_router_app
from testutil import async_wait_for


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
        failed = record_failures(env, p)
        async with httpx.AsyncClient(timeout=30) as c:
            p.prefill_error, p.prefill_errors = HOLD_CAP, 5
            rs = await asyncio.gather(*(complete(c, router) for _ in range(20)))
            assert [r.status_code for r in rs] == [200] * 20
            assert p.prefill_errors == 0
            # refused, not failed: never taken out of rotation (a probe could put it back
            # before we look, so every failed() is recorded) and no backend error counted
            assert failed == []
            metrics = (await c.get(router + "/metrics")).text
            assert sum(samples(metrics, "atom_router_backend_errors_total").values()) == 0
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
