"""The one middleware (atom.wire.middleware): failures become OpenAI-shaped JSON, and a
cancellation that leaked out of an awaited future is answered 500 instead of a dropped
connection, while a real cancellation of the handler still propagates."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from atom.wire.middleware import json_errors


async def _call(handler) -> web.StreamResponse:
    seen: list[int] = []
    middleware = json_errors(lambda _req, status: seen.append(status))
    resp = await middleware(make_mocked_request("POST", "/v1/completions"), handler)
    assert seen == [resp.status]  # every answer is counted
    return resp


def _error(resp: web.StreamResponse) -> dict:
    assert isinstance(resp, web.Response) and resp.body is not None
    return json.loads(resp.body)["error"]


def test_an_unexpected_exception_is_a_json_500() -> None:
    async def handler(_req: web.Request) -> web.StreamResponse:
        raise RuntimeError("boom")

    resp = asyncio.run(_call(handler))
    assert resp.status == 500
    err = _error(resp)
    assert err["code"] == "internal_error" and "RuntimeError" in err["message"]


def test_a_leaked_cancellation_is_a_json_500_not_a_dropped_connection() -> None:
    async def handler(_req: web.Request) -> web.StreamResponse:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.cancel()  # someone else cancelled what we awaited; our own task was not cancelled
        await fut
        return web.Response(text="unreachable")

    resp = asyncio.run(_call(handler))
    assert resp.status == 500
    assert "CancelledError" in _error(resp)["message"]


def test_cancelling_the_handler_still_propagates() -> None:
    started = asyncio.Event()

    async def handler(_req: web.Request) -> web.StreamResponse:
        started.set()
        await asyncio.sleep(30)
        return web.Response(text="unreachable")

    async def main() -> None:
        task = asyncio.create_task(_call(handler))
        await started.wait()
        task.cancel()  # what aiohttp does when the client hangs up (handler_cancellation)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
