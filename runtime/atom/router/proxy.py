"""Prefill/decode router: one OpenAI endpoint in front of prefill and decode runtime instances.

Each generation request goes to a prefill instance first, with a budget of one token and
`kv_transfer: {"mode": "prefill"}`: it runs the prompt, keeps the prompt's KV blocks and
answers with a KV handle. The router then sends the original request with the handle
(`kv_transfer: {"mode": "decode", ...}`) to a decode instance, which pulls the blocks from the
prefill instance's KV port and decodes; its answer (streamed or whole) is relayed unchanged.

Failures never hang a request: an instance that cannot be reached is skipped (the request has
not started there) and leaves rotation; one whose connection fails mid-request ends the request
with a 503 naming the instance and the cause (in-band, as an SSE error event, if the answer had
started streaming). A failed health probe only stops new requests: in-flight ones end only if
their own connection fails. When the decode side fails or the client leaves after the prefill,
the prefill's hold is released at once (POST /internal/kv/release).

Trust: every backend request carries `X-Atom-Internal-Token` (ATOM_INTERNAL_TOKEN, required);
a client's own `kv_transfer` is always overwritten. With --api-key (ATOM_API_KEY) /v1/* needs
`Authorization: Bearer KEY`; the client's Authorization header is forwarded to the backends.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from atom.router.health import health_loop, probe_pool
from atom.router.metrics import RouterMetrics
from atom.router.policy import Picker, prefix_keys
from atom.router.pool import Instance, Pool, Resolver, bounded, resolve_dns
from atom.wire import errors as codes
from atom.wire.body import BodyError, parse_object, read_body
from atom.wire.errors import error_body
from atom.wire.kv_modes import RELEASE_PATH, KVMode
from atom.wire.middleware import json_errors
from atom.wire.trust import TOKEN_ENV, internal_headers, internal_token

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
DECLINED = {codes.NOT_READY, codes.SHUTTING_DOWN, codes.RATE_LIMIT_EXCEEDED, codes.KV_HOLD_CAP}
# ...of which these say the instance is busy, not unwell: it stays in rotation.
BUSY = {codes.RATE_LIMIT_EXCEEDED, codes.KV_HOLD_CAP}
MAX_BODY_BYTES = 32 * 1024 * 1024
API_KEY_ENV = "ATOM_API_KEY"


@dataclass
class RouterSettings:
    health_interval: float = 2.0  # seconds between probes of every instance
    health_timeout: float = 2.0
    out_after: int = 2  # probe timeouts in a row that take an idle, silent instance out
    dns_interval: float = 5.0  # seconds between re-resolving DNS names
    queue_timeout: float = 5.0  # how long a request waits for an instance in rotation
    connect_timeout: float = 5.0
    prefill_timeout: float = 120.0  # the whole prefill call
    read_timeout: float = 600.0  # silence allowed while a decode instance generates
    internal_token: str | None = None  # default: $ATOM_INTERNAL_TOKEN (required)
    api_key: str | None = None  # default: $ATOM_API_KEY; None: /v1/* is open
    routing_policy: str = "prefix"  # prefill instances: prefix | least-outstanding (policy.py)

    @property
    def busy_window(self) -> float:
        """Bytes from an instance this recently prove it alive, whatever /health says."""
        return self.health_interval + 2 * self.health_timeout


class Unavailable(Exception):
    """Answered 503 with `message` (which names the instance and the cause)."""

    def __init__(self, role: str, message: str, code: str) -> None:
        super().__init__(message)
        self.role, self.message, self.code = role, message, code


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
    text = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
    return bounded(text)


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


class Router:
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        settings: RouterSettings | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.settings = settings or RouterSettings()
        token = self.settings.internal_token or internal_token()
        if not token:
            raise ValueError(
                f"{TOKEN_ENV} must be set: the router authenticates itself to the prefill and "
                "decode instances with it (the operator mounts it from the "
                "<deployment>-internal-token Secret)"
            )
        self.token = token
        self.api_key = self.settings.api_key or os.environ.get(API_KEY_ENV, "").strip() or None
        self.metrics = RouterMetrics([prefill, decode])
        self.picker = Picker(self.settings.routing_policy, self.metrics.registry)
        self.session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()

    @property
    def pools(self) -> dict[str, Pool]:
        return {"prefill": self.prefill, "decode": self.decode}

    @property
    def probe_options(self) -> dict[str, Any]:
        s = self.settings
        return {"out_after": s.out_after, "busy_window": s.busy_window}

    async def start(self) -> None:
        s = self.settings
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout),
            connector=aiohttp.TCPConnector(limit=0),  # one connection per request in flight
            headers=internal_headers(self.token),
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
                **self.probe_options,
            )
        )

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
        for task in list(self._releases):
            task.cancel()
        if self.session is not None:
            await self.session.close()

    def authorized(self, request: web.Request) -> bool:
        if self.api_key is None:
            return True
        sent = request.headers.get("Authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode())

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

    async def _pick(
        self, pool: Pool, tried: set[Instance], keys: list[bytes] | None = None
    ) -> Instance:
        """An instance in rotation not tried yet (waiting for one if none is in rotation);
        keys: the request's prefix keys (the routing policy, policy.py)."""
        await self.await_rotation(pool)
        inst = self.picker.pick(pool, tried, keys)
        if inst is None:
            raise Unavailable(
                pool.role, f"every {pool.role} instance declined the request", codes.NO_BACKEND
            )
        return inst

    def _failed(self, pool: Pool, inst: Instance, reason: str) -> str:
        self.metrics.errors.labels(pool.role, inst.url).inc()
        inst.failed(reason)
        return inst.reason

    def _declined(self, inst: Instance, status: int, data: dict[str, Any]) -> bool:
        """Whether the answer means "not taken here, try another"; an unwell one leaves rotation."""
        code = _err_field(data, "code")
        if code not in DECLINED:
            return False
        if status == 503 and code not in BUSY:
            inst.failed(_err_field(data, "message") or code)
        return True

    # ---- prefill ----------------------------------------------------------------------------------
    async def run_prefill(
        self, request: web.Request, body: dict[str, Any]
    ) -> tuple[Instance, dict[str, Any]] | web.Response:
        """(instance, KV handle), or the prefill's own 4xx answer (the client's error)."""
        pbody = _prefill_body(body)
        keys = prefix_keys(body)
        tried: set[Instance] = set()
        with self.metrics.prefill_seconds.time():
            while True:
                inst = await self._pick(self.prefill, tried, keys)
                tried.add(inst)
                try:
                    with self.prefill.busy(inst):
                        status, data = await self._post(inst, request, pbody)
                except aiohttp.ClientConnectorError as exc:
                    self._failed(self.prefill, inst, f"unreachable: {_cause(exc)}")
                    continue  # the request never reached it: another instance may take it
                except (aiohttp.ClientError, TimeoutError) as exc:
                    why = self._failed(self.prefill, inst, _cause(exc))
                    raise Unavailable(
                        "prefill",
                        f"prefill instance {inst.url} failed during the request: {why}",
                        codes.PREFILL_FAILED,
                    ) from None
                self.metrics.requests.labels("prefill", inst.url, str(status)).inc()
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
                if status in (429, 503) and self._declined(inst, status, data):
                    continue
                if 400 <= status < 500:
                    return web.json_response(data, status=status)
                raise Unavailable(
                    "prefill",
                    f"prefill instance {inst.url} answered {status}: "
                    f"{bounded(_err_field(data, 'message') or 'no reason given')}",
                    _err_field(data, "code") or codes.PREFILL_FAILED,
                )

    def _headers(self, request: web.Request) -> dict[str, str]:
        auth = request.headers.get("Authorization")
        return {"Authorization": auth} if auth else {}

    async def _post(
        self, inst: Instance, request: web.Request, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(
            total=self.settings.prefill_timeout, sock_connect=self.settings.connect_timeout
        )
        url, headers = inst.url + request.path, self._headers(request)
        async with self.session.post(url, json=body, timeout=timeout, headers=headers) as r:
            data = await r.read()
            inst.progressed()
            return r.status, _parse(data)

    # ---- releasing a hold -------------------------------------------------------------------------
    def release_soon(self, prefill: Instance, handle: dict[str, Any]) -> None:
        """The decode side failed or the client left: free the prefill's blocks now (best
        effort; the hold's deadline frees them otherwise)."""
        task = asyncio.create_task(self._release(prefill, handle))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, prefill: Instance, handle: dict[str, Any]) -> None:
        assert self.session is not None
        body = {"handle": handle.get("handle"), "secret": handle.get("secret")}
        timeout = aiohttp.ClientTimeout(total=5.0)
        try:
            async with self.session.post(
                prefill.url + RELEASE_PATH, json=body, timeout=timeout
            ) as r:
                released = r.status == 200 and (await r.json()).get("released") is True
            self.metrics.releases.labels("released" if released else "not_held").inc()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.metrics.releases.labels("failed").inc()
            logger.info("releasing a KV hold on %s failed: %s", prefill.url, _cause(exc))

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
        # Decode instances dial only prefill instances we know: the advertised address if it is
        # one of theirs, else (unset, or anything else) the one we reached this prefill at.
        known = {i.host for i in self.prefill.instances.values()}
        if kv.get("kv_host") not in known:
            if kv.get("kv_host"):
                logger.warning("prefill %s advertised KV host %s, not a prefill instance; using "
                               "%s", prefill.url, bounded(str(kv["kv_host"]), 80), prefill.host)  # fmt: skip
            kv["kv_host"] = prefill.host
        reply = _Reply(request, t0, self.metrics)
        try:
            resp = await self._decode(request, {**body, "kv_transfer": kv}, reply)
        except BaseException:  # Unavailable, or our handler cancelled (the client left)
            self.release_soon(prefill, handle)
            raise
        if not reply.complete:  # refused, failed in band, or the client left mid-answer
            self.release_soon(prefill, handle)
        return resp

    async def _decode(
        self, request: web.Request, dbody: dict[str, Any], reply: _Reply
    ) -> web.StreamResponse:
        tried: set[Instance] = set()
        while True:
            inst = await self._pick(self.decode, tried)
            tried.add(inst)
            try:
                with self.decode.busy(inst):
                    resp = await self._relay(inst, request, dbody, reply)
            except ClientGone:
                logger.info("client went away; its decode request on %s is dropped", inst.url)
                return reply.resp or web.Response(status=499)
            except aiohttp.ClientConnectorError as exc:
                self._failed(self.decode, inst, f"unreachable: {_cause(exc)}")
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
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
        self, inst: Instance, request: web.Request, body: dict[str, Any], reply: _Reply
    ) -> web.StreamResponse | None:
        """Relay the decode's answer; None if it declined the request."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.settings.connect_timeout,
            sock_read=self.settings.read_timeout,
        )
        url, headers = inst.url + request.path, self._headers(request)
        async with self.session.post(url, json=body, timeout=timeout, headers=headers) as up:
            inst.progressed()
            self.metrics.requests.labels("decode", inst.url, str(up.status)).inc()
            if up.status >= 500 or up.status == 429:
                data = _parse(await up.read())
                if self._declined(inst, up.status, data):
                    return None
                # e.g. the KV pull failed (the prefill died): the decode's message says why
                raise Unavailable(
                    "decode",
                    f"decode instance {inst.url} answered {up.status}: "
                    f"{bounded(_err_field(data, 'message') or 'no reason given')}",
                    _err_field(data, "code") or codes.DECODE_FAILED,
                )
            headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            await reply.start(up.status, headers)
            async for chunk in up.content.iter_any():
                inst.progressed()
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
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def _count(request: web.Request, status: int) -> None:
    request.app[ROUTER_KEY].metrics.responses.labels(str(status)).inc()


@web.middleware
async def api_key_check(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path.startswith("/v1/") and not request.app[ROUTER_KEY].authorized(request):
        return _error(401, "invalid or missing API key (Authorization: Bearer ...)",
                      "invalid_api_key")  # fmt: skip
    return await handler(request)


async def generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    t0 = time.monotonic()
    try:
        body = await parse_object(await read_body(request, MAX_BODY_BYTES))
    except BodyError as exc:
        return _error(400, exc.message, exc.code)
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
        logger.warning("503: %s", bounded(exc.message, 500))
        router.metrics.unavailable.labels(exc.role).inc()
        return _error(503, exc.message, exc.code)
    finally:
        router.metrics.in_flight.dec()


async def models(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    assert router.session is not None
    headers = router._headers(request)
    for inst in [i for i in router.decode.instances.values() if i.in_rotation]:
        try:
            async with router.session.get(inst.url + "/v1/models", headers=headers) as r:
                if r.status == 200:
                    return web.json_response(await r.json())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            continue
    return _error(503, router.decode.unavailable_reason(), codes.NO_BACKEND)


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


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER_KEY].metrics.registry)
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )
