"""The router's request path: pick a prefill instance, run the prompt there, relay the decode.

The overview (P/D flow, failures, trust) is atom.router.proxy's docstring; the app and its
routes are there too. Requests that meet a busy role wait for room (capacity.py); messages a
client reads carry no internal address (answers.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from atom.router.answers import (
    ClientGone,
    Reply,
    Unavailable,
    cause,
    err_field,
    parse,
    public_cause,
    scrub,
)
from atom.router.capacity import Capacity
from atom.router.health import health_loop
from atom.router.metrics import RouterMetrics
from atom.router.policy import Picker, prefix_keys
from atom.router.pool import Instance, Pool, bounded
from atom.wire import errors as codes
from atom.wire.auth import bearer_matches
from atom.wire.kv_modes import RELEASE_PATH, KVMode
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
DECLINED = {
    codes.NOT_READY,
    codes.SHUTTING_DOWN,
    codes.ENGINE_STALLED,
    codes.RATE_LIMIT_EXCEEDED,
    codes.KV_HOLD_CAP,
}
# ...of which these say the instance is busy, not unwell: it stays in rotation, and the request
# waits for room (capacity.py) rather than failing.
BUSY = {codes.RATE_LIMIT_EXCEEDED, codes.KV_HOLD_CAP}
MAX_BODY_BYTES = 32 * 1024 * 1024
BACKEND_KEEPALIVE_S = 2.0
API_KEY_ENV = "ATOM_API_KEY"


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer": {"mode": KVMode.PREFILL.value}}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


@dataclass
class Attempt:
    """One request's tries at one role."""

    tried: set[Instance] = field(default_factory=set)
    busy: bool = False  # an instance declined it as busy: room may come
    refused: str = ""  # why the last unwell instance was skipped (for the client)
    deadline: float | None = None  # when waiting for room gives up
    woken: bool = False  # it had its turn: refused again, it waits at the head of the line


@dataclass
class RouterSettings:
    health_interval: float = 2.0  # seconds between probes of every instance
    health_timeout: float = 2.0
    out_after: int = 2  # probe timeouts in a row that take an idle, silent instance out
    dns_interval: float = 5.0  # seconds between re-resolving DNS names
    # how long a request waits for an instance in rotation, and for room on a busy role
    queue_timeout: float = 5.0
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
        self.room = {"prefill": Capacity("prefill"), "decode": Capacity("decode")}
        self.metrics = RouterMetrics([prefill, decode], list(self.room.values()))
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
            # One connection per request in flight. An idle one is dropped well before the
            # instances' --keepalive-timeout (5 s) closes it: reusing a connection the server
            # is closing at that moment fails the request (seen under bursts).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=BACKEND_KEEPALIVE_S),
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
        for room in self.room.values():
            room.close()
        for task in list(self._releases):
            task.cancel()
        if self.session is not None:
            await self.session.close()

    def authorized(self, request: web.Request) -> bool:
        if self.api_key is None:
            return True
        return bearer_matches(request.headers.get("Authorization", ""), self.api_key)

    def public(self, text: str) -> str:
        """`text` fit for a client: no instance address (answers.scrub)."""
        return scrub(text, self.prefill.hosts | self.decode.hosts)

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
        names = ", ".join(f"{i.name}={i.url}" for i in pool.instances.values())
        raise Unavailable(
            pool.role,
            pool.unavailable_reason(self.public),
            codes.NO_BACKEND,
            detail=f"{pool.unavailable_reason()} [{names}]",
        )

    async def _pick(self, pool: Pool, attempt: Attempt, keys: list[bytes] | None = None) -> Instance:
        """An instance in rotation not tried yet (waiting for one if none is in rotation, and
        for room while every instance is busy); keys: the request's prefix keys (policy.py)."""
        await self.await_rotation(pool)
        if self.room[pool.role].waiting and not attempt.woken:  # queue behind those waiting
            await self._wait_room(pool, attempt)
        while True:
            inst = self.picker.pick(pool, attempt.tried, keys)
            if inst is not None:
                return inst
            if not attempt.busy:
                why = f": {attempt.refused}" if attempt.refused else ""
                raise Unavailable(
                    pool.role,
                    f"every {pool.role} instance declined the request{why}",
                    codes.NO_BACKEND,
                )
            await self._wait_room(pool, attempt)
            attempt.tried.clear()
            attempt.busy = False
            await self.await_rotation(pool)

    async def _wait_room(self, pool: Pool, attempt: Attempt) -> None:
        """Until room may be free on the role (then retry), up to queue_timeout in all; then
        503 with the busy instance's own reason."""
        room = self.room[pool.role]
        now = time.monotonic()
        if attempt.deadline is None:
            attempt.deadline = now + self.settings.queue_timeout
        try:
            await room.wait(max(0.0, attempt.deadline - now), first=attempt.woken)
        except TimeoutError:
            reason = room.reason or f"every {pool.role} instance is busy"
            raise Unavailable(
                pool.role,
                f"{reason} (the router waited {self.settings.queue_timeout:g}s for room)",
                room.code or codes.NO_BACKEND,
            ) from None
        attempt.woken = True

    def _failed(self, pool: Pool, inst: Instance, reason: str) -> str:
        self.metrics.errors.labels(pool.role, inst.url).inc()
        inst.failed(reason)
        return inst.reason

    def _declined(
        self, pool: Pool, inst: Instance, status: int, data: dict[str, Any], attempt: Attempt
    ) -> bool:
        """Whether the answer means "not taken here, try another": a busy instance stays in
        rotation (room will come), an unwell one leaves it."""
        code = err_field(data, "code")
        if code not in DECLINED:
            return False
        message = err_field(data, "message") or code
        if code in BUSY:
            attempt.busy = True
            self.room[pool.role].declined(bounded(self.public(message)), code)
        elif status == 503:
            inst.failed(message)
            attempt.refused = f"{inst.name}: {bounded(self.public(message))}"
        return True

    def _token_refused(
        self, pool: Pool, inst: Instance, status: int, data: dict[str, Any], attempt: Attempt
    ) -> bool:
        """A 403 kv_transfer_forbidden: the instance refuses our internal token. Not the
        client's fault: the instance leaves rotation (the probe keeps it out while /health
        says so) and another one is tried."""
        if status != 403 or err_field(data, "code") != codes.KV_TRANSFER_FORBIDDEN:
            return False
        logger.error(
            "%s instance %s (%s) answered 403 kv_transfer_forbidden: it refuses the router's "
            "internal token; check ATOM_INTERNAL_TOKEN on both", pool.role, inst.name, inst.url,
        )  # fmt: skip
        self._failed(pool, inst, "refuses the router's internal token (403 kv_transfer_forbidden)")
        attempt.refused = f"{inst.name} refuses the router's internal token (misconfigured)"
        return True

    def _answered(
        self, inst: Instance, status: int, data: dict[str, Any], default_code: str
    ) -> Unavailable:
        """A backend's own failure, relayed: its message (bounded, without addresses)."""
        message = bounded(err_field(data, "message") or "no reason given")
        return Unavailable(
            inst.role,
            f"{inst.name} answered {status}: {self.public(message)}",
            err_field(data, "code") or default_code,
            detail=f"{inst.role} instance {inst.url} answered {status}: {message}",
        )

    # ---- prefill ----------------------------------------------------------------------------------
    async def run_prefill(
        self, request: web.Request, body: dict[str, Any]
    ) -> tuple[Instance, dict[str, Any]] | web.Response:
        """(instance, KV handle), or the prefill's own 4xx answer (the client's error)."""
        pbody = _prefill_body(body)
        keys = prefix_keys(body)
        attempt = Attempt()
        with self.metrics.prefill_seconds.time():
            while True:
                inst = await self._pick(self.prefill, attempt, keys)
                attempt.tried.add(inst)
                try:
                    with self.prefill.busy(inst):
                        status, data = await self._post(inst, request, pbody)
                except aiohttp.ClientConnectorError as exc:
                    self._failed(self.prefill, inst, f"unreachable: {cause(exc)}")
                    attempt.refused = f"{inst.name} unreachable ({public_cause(exc)})"
                    continue  # the request never reached it: another instance may take it
                except (aiohttp.ClientError, TimeoutError) as exc:
                    why = self._failed(self.prefill, inst, cause(exc))
                    raise Unavailable(
                        "prefill",
                        f"{inst.name} failed during the request: {public_cause(exc)}",
                        codes.PREFILL_FAILED,
                        detail=f"prefill instance {inst.url} failed during the request: {why}",
                    ) from None
                self.metrics.requests.labels("prefill", inst.url, str(status)).inc()
                if status == 200:
                    handle = data.get("kv_transfer")
                    if not isinstance(handle, dict):
                        raise Unavailable(
                            "prefill",
                            f"{inst.name} answered without a KV handle "
                            "(is it running --role prefill?)",
                            codes.PREFILL_FAILED,
                            detail=f"prefill instance {inst.url} answered without a KV handle",
                        )
                    self.room["prefill"].got_in()
                    return inst, handle
                if status in (429, 503) and self._declined(
                    self.prefill, inst, status, data, attempt
                ):
                    continue
                if self._token_refused(self.prefill, inst, status, data, attempt):
                    continue
                if 400 <= status < 500:
                    return web.json_response(data, status=status)
                raise self._answered(inst, status, data, codes.PREFILL_FAILED)

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
            return r.status, parse(data)

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
            self.room["prefill"].freed(1)  # a hold drained
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.metrics.releases.labels("failed").inc()
            logger.info("releasing a KV hold on %s failed: %s", prefill.url, cause(exc))

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
        known = self.prefill.hosts
        if kv.get("kv_host") not in known:
            if kv.get("kv_host"):
                logger.warning("prefill %s advertised KV host %s, not a prefill instance; using "
                               "%s", prefill.url, bounded(str(kv["kv_host"]), 80), prefill.host)  # fmt: skip
            kv["kv_host"] = prefill.host
        reply = Reply(request, t0, self.metrics)
        try:
            resp = await self._decode(request, {**body, "kv_transfer": kv}, reply)
        except BaseException:  # Unavailable, or our handler cancelled (the client left)
            self.release_soon(prefill, handle)
            raise
        if not reply.complete:  # refused, failed in band, or the client left mid-answer
            self.release_soon(prefill, handle)
        return resp

    async def _decode(
        self, request: web.Request, dbody: dict[str, Any], reply: Reply
    ) -> web.StreamResponse:
        attempt = Attempt()
        while True:
            inst = await self._pick(self.decode, attempt)
            attempt.tried.add(inst)
            try:
                with self.decode.busy(inst):
                    resp = await self._relay(inst, request, dbody, reply, attempt)
            except ClientGone:
                logger.info("client went away; its decode request on %s is dropped", inst.url)
                return reply.resp or web.Response(status=499)
            except aiohttp.ClientConnectorError as exc:
                self._failed(self.decode, inst, f"unreachable: {cause(exc)}")
                attempt.refused = f"{inst.name} unreachable ({public_cause(exc)})"
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                why = self._failed(self.decode, inst, cause(exc))
                message = f"{inst.name} failed during the request: {public_cause(exc)}"
                detail = f"decode instance {inst.url} failed during the request: {why}"
                if reply.resp is None:
                    raise Unavailable("decode", message, codes.DECODE_FAILED, detail) from None
                logger.warning("503 in band: %s", detail)
                self.metrics.unavailable.labels("decode").inc()
                await reply.fail_in_band(message, codes.DECODE_FAILED)
                return reply.resp
            if resp is not None:
                return resp

    async def _relay(
        self,
        inst: Instance,
        request: web.Request,
        body: dict[str, Any],
        reply: Reply,
        attempt: Attempt,
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
            if up.status >= 500 or up.status in (403, 429):
                data = parse(await up.read())
                if up.status in (429, 503) and self._declined(
                    self.decode, inst, up.status, data, attempt
                ):
                    return None
                if self._token_refused(self.decode, inst, up.status, data, attempt):
                    return None
                if up.status == 403:  # the client's own (e.g. its API key): relayed
                    return web.json_response(data, status=403)
                # e.g. the KV pull failed (the prefill died): the decode's message says why
                raise self._answered(inst, up.status, data, codes.DECODE_FAILED)
            # It pulled the prompt's blocks (or needed none): a prefill hold drained.
            self.room["prefill"].freed(1)
            self.room["decode"].got_in()
            headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            try:
                await reply.start(up.status, headers)
                async for chunk in up.content.iter_any():
                    inst.progressed()
                    await reply.write(chunk)
                await reply.finish()
            finally:
                self.room["decode"].freed(1)
            return reply.resp


