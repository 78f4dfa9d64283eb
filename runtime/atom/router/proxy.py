"""Prefill/decode router: one OpenAI endpoint in front of prefill and decode runtime instances.

Each generation request goes to a prefill instance first, with a budget of one token and
`kv_transfer: {"mode": "prefill"}`: it runs the prompt, keeps the prompt's KV blocks and
answers with a KV handle. The router then sends the original request with the handle
(`kv_transfer: {"mode": "decode", ...}`) to a decode instance, which pulls the blocks from the
prefill instance's KV port and decodes; its answer (streamed or whole) is relayed unchanged.

Failures never hang a request: an instance that cannot be reached is skipped (the request has
not started there) and leaves rotation; one that fails mid-request, or is found dead by the
health loop while the request waits on it, ends the request with a 503 naming the instance and
the cause (in-band, as an SSE error event, if the answer had started streaming).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from atom.router.health import health_loop, probe_pool
from atom.router.metrics import RouterMetrics
from atom.router.pool import Instance, Pool, Resolver, resolve_dns
from atom.wire import errors as codes
from atom.wire.errors import error_body
from atom.wire.kv_modes import KVMode

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
}
# Answers meaning "this instance did not take the request": another instance may.
DECLINED = {codes.NOT_READY, codes.SHUTTING_DOWN, codes.RATE_LIMIT_EXCEEDED}


@dataclass
class RouterSettings:
    health_interval: float = 2.0  # seconds between probes of every instance
    health_timeout: float = 2.0
    dead_after: int = 3  # probe timeouts in a row that mark a silent instance dead
    dns_interval: float = 5.0  # seconds between re-resolving DNS names
    queue_timeout: float = 5.0  # how long a request waits for an instance in rotation
    connect_timeout: float = 5.0
    prefill_timeout: float = 120.0  # the whole prefill call
    read_timeout: float = 600.0  # silence allowed while a decode instance generates


class Unavailable(Exception):
    """Answered 503 with `message` (which names the instance and the cause)."""

    def __init__(self, role: str, message: str, code: str) -> None:
        super().__init__(message)
        self.role, self.message, self.code = role, message, code


class InstanceLost(Exception):
    """The health loop found the instance dead while a request waited on it."""


class ClientGone(Exception):
    """Writing to our own client failed (it hung up): not the backend's fault."""


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(error_body(status, message, code), status=status)


def _parse(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {"error": {"message": data[:200].decode(errors="replace")}}
    return body if isinstance(body, dict) else {"error": {"message": str(body)[:200]}}


def _err_field(body: dict[str, Any], name: str) -> str:
    err = body.get("error")
    return str(err.get(name) or "") if isinstance(err, dict) else ""


def _cause(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer": {"mode": KVMode.PREFILL.value}}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class _Reply:
    """The client's response, started lazily so a failure before the first byte is still a 503."""

    def __init__(self, request: web.Request, t0: float, metrics: RouterMetrics) -> None:
        self.request, self.t0, self.metrics = request, t0, metrics
        self.resp: web.StreamResponse | None = None
        self.sse = False

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


class Router:
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        settings: RouterSettings | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.settings = settings or RouterSettings()
        self.metrics = RouterMetrics([prefill, decode])
        self.session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task | None = None

    @property
    def pools(self) -> dict[str, Pool]:
        return {"prefill": self.prefill, "decode": self.decode}

    async def start(self) -> None:
        s = self.settings
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout)
        )
        for pool in self.pools.values():
            await pool.resolve()
        self._health = asyncio.create_task(
            health_loop(
                self.session,
                list(self.pools.values()),
                s.health_interval,
                s.health_timeout,
                s.dns_interval,
            )
        )

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
        if self.session is not None:
            await self.session.close()

    # ---- picking --------------------------------------------------------------------------------
    async def await_rotation(self, pool: Pool) -> None:
        """Return once an instance of `pool` is in rotation; 503 after queue_timeout."""
        if any(i.in_rotation for i in pool.instances.values()):
            return
        deadline = time.monotonic() + self.settings.queue_timeout
        self.metrics.queue.inc()
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if any(i.in_rotation for i in pool.instances.values()):
                    return
        finally:
            self.metrics.queue.dec()
        raise Unavailable(pool.role, pool.unavailable_reason(), codes.NO_BACKEND)

    async def _pick(self, pool: Pool, tried: set[Instance]) -> Instance:
        """An instance in rotation not tried yet (waiting for one if none is in rotation)."""
        await self.await_rotation(pool)
        inst = pool.pick(tried)
        if inst is None:
            raise Unavailable(
                pool.role, f"every {pool.role} instance declined the request", codes.NO_BACKEND
            )
        return inst

    def _failed(self, pool: Pool, inst: Instance, reason: str, dead: bool = False) -> str:
        self.metrics.errors.labels(pool.role, inst.url).inc()
        inst.failed(reason, dead=dead)
        return reason

    async def _guarded(self, inst: Instance, coro: Awaitable[Any]) -> Any:
        """Run coro unless the instance is found dead first (then InstanceLost)."""
        task = asyncio.ensure_future(coro)
        lost = asyncio.ensure_future(inst.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # our handler was cancelled (client gone): drop the upstream too
            task.cancel()
            lost.cancel()
            raise
        lost.cancel()
        if task.done():
            return task.result()
        task.cancel()
        raise InstanceLost(inst.reason)

    # ---- prefill ----------------------------------------------------------------------------------
    async def run_prefill(
        self, path: str, body: dict[str, Any]
    ) -> tuple[Instance, dict[str, Any]] | web.Response:
        """(instance, KV handle), or the prefill's own 4xx answer (the client's error)."""
        pbody = _prefill_body(body)
        tried: set[Instance] = set()
        with self.metrics.prefill_seconds.time():
            while True:
                inst = await self._pick(self.prefill, tried)
                tried.add(inst)
                try:
                    with self.prefill.busy(inst):
                        status, data = await self._guarded(inst, self._post(inst, path, pbody))
                except aiohttp.ClientConnectorError as exc:
                    self._failed(self.prefill, inst, f"unreachable: {_cause(exc)}", dead=True)
                    continue  # the request never reached it: another instance may take it
                except (aiohttp.ClientError, TimeoutError, InstanceLost) as exc:
                    why = self._failed(self.prefill, inst, _cause(exc))
                    raise Unavailable(
                        "prefill",
                        f"prefill instance {inst.url} failed during the request: {why}",
                        codes.PREFILL_FAILED,
                    ) from None
                self.metrics.requests.labels("prefill", inst.url, str(status)).inc()
                code = _err_field(data, "code")
                if status == 200:
                    handle = data.get("kv_transfer")
                    if not isinstance(handle, dict):
                        raise Unavailable(
                            "prefill",
                            f"prefill instance {inst.url} answered without a KV handle "
                            "(is it running --role prefill?)",
                            codes.PREFILL_FAILED,
                        )
                    return inst, handle
                if status in (429, 503) and code in DECLINED:
                    if status == 503:
                        inst.failed(_err_field(data, "message") or code)
                    continue
                if 400 <= status < 500:
                    return web.json_response(data, status=status)
                raise Unavailable(
                    "prefill",
                    f"prefill instance {inst.url} answered {status}: "
                    f"{_err_field(data, 'message') or 'no reason given'}",
                    code or codes.PREFILL_FAILED,
                )

    async def _post(
        self, inst: Instance, path: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(
            total=self.settings.prefill_timeout, sock_connect=self.settings.connect_timeout
        )
        async with self.session.post(inst.url + path, json=body, timeout=timeout) as r:
            return r.status, _parse(await r.read())

    # ---- decode -----------------------------------------------------------------------------------
    async def run_decode(
        self,
        request: web.Request,
        body: dict[str, Any],
        handle: dict[str, Any],
        prefill: Instance,
        t0: float,
    ) -> web.StreamResponse:
        kv = {**handle, "mode": KVMode.DECODE.value}
        if not kv.get("kv_host"):  # the prefill does not know its address: use the one we reached
            kv["kv_host"] = prefill.host
        dbody = {**body, "kv_transfer": kv}
        tried: set[Instance] = set()
        while True:
            inst = await self._pick(self.decode, tried)
            tried.add(inst)
            reply = _Reply(request, t0, self.metrics)
            try:
                with self.decode.busy(inst):
                    resp = await self._guarded(inst, self._relay(inst, request.path, dbody, reply))
            except ClientGone:
                logger.info("client went away; its decode request on %s is dropped", inst.url)
                return reply.resp or web.Response(status=499)
            except aiohttp.ClientConnectorError as exc:
                self._failed(self.decode, inst, f"unreachable: {_cause(exc)}", dead=True)
                continue
            except (aiohttp.ClientError, TimeoutError, InstanceLost) as exc:
                why = self._failed(self.decode, inst, _cause(exc))
                message = f"decode instance {inst.url} failed during the request: {why}"
                if reply.resp is None:
                    raise Unavailable("decode", message, codes.DECODE_FAILED) from None
                self.metrics.unavailable.labels("decode").inc()
                await reply.fail_in_band(message, codes.DECODE_FAILED)
                return reply.resp
            if resp is not None:
                return resp

    async def _relay(
        self, inst: Instance, path: str, body: dict[str, Any], reply: _Reply
    ) -> web.StreamResponse | None:
        """Relay the decode's answer; None if it declined the request."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.settings.connect_timeout,
            sock_read=self.settings.read_timeout,
        )
        async with self.session.post(inst.url + path, json=body, timeout=timeout) as up:
            self.metrics.requests.labels("decode", inst.url, str(up.status)).inc()
            if up.status >= 500 or up.status == 429:
                data = _parse(await up.read())
                code = _err_field(data, "code")
                if code in DECLINED:
                    if up.status == 503:
                        inst.failed(_err_field(data, "message") or code)
                    return None
                # e.g. the KV pull failed (the prefill died): the decode's message says why
                raise Unavailable(
                    "decode",
                    f"decode instance {inst.url} answered {up.status}: "
                    f"{_err_field(data, 'message') or 'no reason given'}",
                    code or codes.DECODE_FAILED,
                )
            headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            await reply.start(up.status, headers)
            async for chunk in up.content.iter_any():
                await reply.write(chunk)
            await reply.finish()
            return reply.resp


ROUTER_KEY = web.AppKey("atom_router", Router)


def create_router_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    settings: RouterSettings | None = None,
    resolver: Resolver = resolve_dns,
) -> web.Application:
    router = Router(
        Pool("prefill", list(prefill), resolver), Pool("decode", list(decode), resolver), settings
    )
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app[ROUTER_KEY] = router

    async def lifecycle(app: web.Application) -> Any:
        await router.start()
        yield
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    for path in GENERATE_PATHS:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    t0 = time.monotonic()
    raw = await request.read()
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
    except ValueError as exc:
        return _error(400, f"request body is not a valid JSON object: {exc}", codes.INVALID_JSON)
    router.metrics.in_flight.inc()
    try:
        # No prompt runs (and holds blocks) while no decode instance could take it over.
        await router.await_rotation(router.decode)
        got = await router.run_prefill(request.path, body)
        if isinstance(got, web.Response):
            return got
        inst, handle = got
        return await router.run_decode(request, body, handle, inst, t0)
    except Unavailable as exc:
        logger.warning("503: %s", exc.message)
        router.metrics.unavailable.labels(exc.role).inc()
        return _error(503, exc.message, exc.code)
    finally:
        router.metrics.in_flight.dec()


async def models(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    assert router.session is not None
    for inst in [i for i in router.decode.instances.values() if i.in_rotation]:
        try:
            async with router.session.get(inst.url + "/v1/models") as r:
                if r.status == 200:
                    return web.json_response(await r.json())
        except (TimeoutError, aiohttp.ClientError):
            continue
    return _error(503, router.decode.unavailable_reason(), codes.NO_BACKEND)


async def health(request: web.Request) -> web.Response:
    """200 when at least one instance of each role is healthy; the body lists every instance.
    Probing here also updates the rotation."""
    router = request.app[ROUTER_KEY]
    assert router.session is not None
    t = router.settings.health_timeout
    results = {
        role: await probe_pool(router.session, pool, t) for role, pool in router.pools.items()
    }
    missing = [role for role, rs in results.items() if not any(r["healthy"] for r in rs)]
    body: dict[str, Any] = {"status": "unavailable" if missing else "ok", "backends": results}
    if missing:
        body["reason"] = f"no healthy {' or '.join(missing)} instance"
    return web.json_response(body, status=503 if missing else 200)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER_KEY].metrics.registry)
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )
