"""The API server's side of the engine core: request streams in, one StepOutputs per step out.

`CoreClient` sends AddRequest/AbortRequests and reads the core's messages on the event loop;
each request's tokens are appended to its `RequestStream` (stream.py) and its handler is woken once, so a
handler that lags behind takes several steps' tokens at once (coalescing under load, not one
wake-up per token). Subclasses say where the core runs: `ProcessCore` spawns it (production),
`ThreadCore` runs it in a thread of this process (tests with scripted engines), `AttachedCore`
joins one another process spawned (extra API servers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from atom.disagg.handle import KVHandle
from atom.engine.api import EngineAPI
from atom.engine.params import SamplingParams, TopLogprobs
from atom.entrypoints.core import messages as msgs
from atom.entrypoints.core.channel import AsyncOutbox, serve_inbox
from atom.entrypoints.core.engine_core import CoreEndpoints, EngineCore
from atom.entrypoints.core.stream import RequestStream

if TYPE_CHECKING:
    from atom.entrypoints.core.process import KVSettings

logger = logging.getLogger(__name__)

MONITOR_S = 0.1


class EngineDead(RuntimeError):
    """The engine core failed, died or is shutting down; in-flight requests fail with this."""


class EngineStalled(EngineDead):
    """The core made no progress for the stream stall timeout while this request waited."""


class RequestRefused(Exception):
    """The core refused one request (its status, OpenAI code and message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class CoreClient:
    """Everything public is called from the event loop."""

    owns_core = True  # this API server starts and stops the core

    def __init__(self, endpoints: CoreEndpoints, client_index: int = 0) -> None:
        self.endpoints = endpoints
        self.client_index = client_index
        self.state = "starting"  # starting -> warming -> ready | failed; stopped at shutdown
        self.reason = "engine is starting"
        self.core_pid: int | None = None
        self.info: msgs.EngineInfo | None = None
        self.warmup_summary: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self.steps = 0
        self.busy = False
        self.last_seen = time.monotonic()  # the core's last message: its loop moved
        # Open streams end with EngineStalled once the core has been silent this long while
        # they wait (None: never); set by the server (--stream-stall-timeout).
        self.stream_stall_timeout: float | None = None
        self._stalled_at: float | None = None  # last_seen when a stall was declared
        self.streams: dict[str, RequestStream] = {}
        self.ready = asyncio.Event()
        self.failed = asyncio.Event()
        self.on_ready: list[Callable[[msgs.EngineInfo], None]] = []
        self._aborts: list[str] = []
        self._scrapes: dict[int, asyncio.Future] = {}
        self._scrape_seq = 0
        self._releases: dict[int, asyncio.Future] = {}
        self._lora_replies: dict[int, asyncio.Future] = {}
        # Loaded LoRA adapters, name -> directory (None: the engine serves none): from the
        # engine's facts, then every change the core announces.
        self.lora_adapters: dict[str, str] | None = None
        self._tasks: list[asyncio.Task] = []
        self._enc = msgs.encoder()

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        dec = msgs.output_decoder()
        # Each message is dispatched as it arrives, in the loop's own read callback.
        self._rx = await serve_inbox(
            self.endpoints.outputs[self.client_index], lambda raw: self._dispatch(dec.decode(raw))
        )
        self._tx = AsyncOutbox(self.endpoints.input)
        self._launch()
        self._send(msgs.Hello(self.client_index, os.getpid()))  # sent once connected
        self._tasks = [
            asyncio.create_task(
                self._tx.connect(lambda: self.core_exit() is None), name="atom-core-connect"
            ),
            asyncio.create_task(self._monitor(), name="atom-core-monitor"),
        ]

    def _launch(self) -> None:
        """Start the core (subclasses); the output socket is bound already."""

    def core_exit(self) -> str | None:
        """Why the core is gone (None while it runs)."""
        return None

    async def _wait_core(self, timeout: float) -> None:
        """Wait for the core to exit after Shutdown (subclasses)."""

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the core (if ours); unfinished streams fail."""
        if self.owns_core and self.core_exit() is None:
            self._send(msgs.Shutdown())
            await self._wait_core(timeout)
        for t in self._tasks:
            t.cancel()
        self._fail_all(EngineDead("server is shutting down"))
        if self.state != "failed":
            self.state, self.reason = "stopped", "shut down"
        self._rx.close()
        self._tx.close()

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    def liveness(self, timeout_s: float) -> str | None:
        """None when the core is alive and its loop moved in the last timeout_s (or it is
        still building/warming, which startup probes gate); else why not."""
        gone = self.core_exit()
        if gone is not None:
            return gone
        if self.state == "failed":
            return self.reason
        quiet = time.monotonic() - self.last_seen
        if self.state == "ready" and quiet > timeout_s:
            return f"the engine loop sent nothing for {quiet:.0f}s (hung?)"
        return None

    def stalled_for(self, timeout_s: float) -> float | None:
        """None while the core is not stalled; else how long our oldest waiting request has
        waited on it (0 when none waits). Stalled: silent for timeout_s while a request of
        ours waited, and silent ever since (a SIGSTOPped or wedged core). Silence before the
        request arrived does not count: an idle core may be stopped unseen."""
        if self.state != "ready":
            return None
        now = time.monotonic()
        quiet = now - self.last_seen
        sticky = self._stalled_at == self.last_seen  # declared, and nothing came since
        if not sticky and (quiet < timeout_s or not self.streams):
            return None
        oldest = min((s.arrival for s in self.streams.values()), default=now)
        waited = now - max(self.last_seen, oldest)
        if sticky:
            return waited
        if waited < timeout_s:
            return None
        self._stalled_at = self.last_seen
        logger.error("the engine core has sent nothing for %.0fs while requests wait", quiet)
        return waited

    # ---- requests -------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        self._tx.send(self._enc.encode(msg))

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        hold_kv: bool = False,
        first_token: int | None = None,
        first_logprob: float | None = None,
        kv_pull: KVHandle | None = None,
        cached_tokens: int = 0,
        lora_name: str | None = None,
        first_top_logprobs: TopLogprobs | None = None,
    ) -> RequestStream:
        if self.state != "ready":
            raise EngineDead(f"the engine is {self.state}: {self.reason}")
        msg = msgs.AddRequest(
            request_id,
            self.client_index,
            prompt_ids,
            sampling,
            hold_kv,
            first_token,
            first_logprob,
            kv_pull,
            cached_tokens,
            lora_name,
            first_top_logprobs,
        )
        data = self._enc.encode(msg)  # an unrepresentable value fails here, before any state
        stream = RequestStream(request_id)
        self.streams[request_id] = stream
        self._tx.send(data)
        return stream

    def abort(self, request_id: str) -> None:
        """Free the sequence (client gone, stop string hit); safe to call twice. Aborts made
        in one event-loop turn go to the core in one message."""
        if self.streams.pop(request_id, None) is None:
            return
        if not self._aborts:
            asyncio.get_running_loop().call_soon(self._flush_aborts)
        self._aborts.append(request_id)

    def _flush_aborts(self) -> None:
        ids, self._aborts = self._aborts, []
        if ids and self.core_exit() is None:
            self._send(msgs.AbortRequests(ids))

    def release_kv(self, handle: KVHandle) -> None:
        """A decode request that will not run: the core frees the blocks on their prefill."""
        self._send(msgs.ReleaseKV(handle))

    def drop_hold(self, request_id: str) -> None:
        """A prefill-role request whose handler was cancelled: nobody will pull its blocks."""
        if self.core_exit() is None:
            self._send(msgs.DropHold(request_id))

    async def release_hold(self, handle: str, secret: str, timeout: float = 5.0) -> bool:
        """POST /internal/kv/release: the core checks the secret and drops the hold."""
        if self.state != "ready" or self.core_exit() is not None:
            return False
        self._scrape_seq += 1
        seq = self._scrape_seq
        fut = asyncio.get_running_loop().create_future()
        self._releases[seq] = fut
        self._send(msgs.ReleaseHold(self.client_index, seq, handle, secret))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return False
        finally:
            self._releases.pop(seq, None)

    async def change_lora(self, load: bool, name: str, path: str = "",
                          timeout: float = 60.0) -> msgs.LoRAReply:
        """Load (load=True, from path) or unload a LoRA adapter in the core; its answer (a
        503 reply when the core is not ready or does not answer in time)."""
        if self.state != "ready" or self.core_exit() is not None:
            return msgs.LoRAReply(0, 503, "engine_not_ready", f"the engine is {self.state}")
        self._scrape_seq += 1
        seq = self._scrape_seq
        fut = asyncio.get_running_loop().create_future()
        self._lora_replies[seq] = fut
        self._send(msgs.LoadLoRA(self.client_index, seq, name, path) if load
                   else msgs.UnloadLoRA(self.client_index, seq, name))
        try:
            reply: msgs.LoRAReply = await asyncio.wait_for(fut, timeout)
            return reply
        except TimeoutError:
            return msgs.LoRAReply(seq, 503, "engine_timeout", "the engine core did not answer")
        finally:
            self._lora_replies.pop(seq, None)

    async def scrape(self, snapshot: bytes = b"", timeout: float = 2.0) -> msgs.MetricsText | None:
        """The core's own Prometheus series (KV transfers; and the engine's and the other API
        servers' with --api-server-count > 1: snapshot is ours, atom.entrypoints.metrics_merge);
        None when it does not answer."""
        if self.state != "ready" or self.core_exit() is not None:
            return None  # building or warming: the core answers nothing until its loop runs
        self._scrape_seq += 1
        seq = self._scrape_seq
        fut = asyncio.get_running_loop().create_future()
        self._scrapes[seq] = fut
        self._send(msgs.Scrape(self.client_index, seq, snapshot))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return None
        finally:
            self._scrapes.pop(seq, None)

    def push_metrics(self, snapshot: bytes) -> None:
        """This API server's series, for the others' scrapes (--api-server-count > 1)."""
        if self.state == "ready" and self.core_exit() is None:
            self._send(msgs.ApiMetrics(self.client_index, snapshot))

    def cut_all(self, exc: BaseException) -> None:
        """End every stream with `exc` and free their sequences (the drain deadline passed)."""
        ids = list(self.streams)
        self._fail_all(exc)
        if ids and self.core_exit() is None:
            self._send(msgs.AbortRequests(ids))

    def _fail_all(self, exc: BaseException) -> None:
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.fail(exc)

    # ---- core -> API ----------------------------------------------------------------------
    def _dispatch(self, msg: Any) -> None:
        now = self.last_seen = time.monotonic()
        if isinstance(msg, msgs.StepOutputs):
            self.steps = msg.steps
            streams = self.streams
            for out in msg.outputs:
                stream = streams.get(out.request_id)
                if stream is None:  # aborted meanwhile
                    continue
                if out.finish_reason is not None:
                    del streams[out.request_id]
                stream.push(out, now)
        elif isinstance(msg, msgs.Stats):
            self.last_stats, self.steps, self.busy = msg.stats, msg.steps, msg.busy
        elif isinstance(msg, msgs.RequestFailed):
            stream = self.streams.pop(msg.request_id, None)
            if stream is not None:
                stream.fail(RequestRefused(msg.status, msg.code, msg.message))
        elif isinstance(msg, msgs.EngineStatus):
            self._status(msg)
        elif isinstance(msg, msgs.MetricsText):
            fut = self._scrapes.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, msgs.LoRAAdapters):
            self.lora_adapters = dict(msg.adapters)
        elif isinstance(msg, msgs.LoRAReply):
            lora = self._lora_replies.get(msg.seq)
            if lora is not None and not lora.done():
                lora.set_result(msg)
        elif isinstance(msg, msgs.HoldReleased):
            fut = self._releases.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg.released)

    def _status(self, msg: msgs.EngineStatus) -> None:
        self.core_pid = msg.pid
        if self.state in ("failed", "stopped"):
            return
        self.state, self.reason = msg.state, msg.reason
        if msg.info is not None and self.info is None:
            self.info = msg.info
            self.warmup_summary = msg.info.warmup
            if self.lora_adapters is None and msg.info.lora_adapters is not None:
                self.lora_adapters = dict(msg.info.lora_adapters)
            for fn in self.on_ready:
                fn(msg.info)
        if msg.state == "ready":
            self.ready.set()
        elif msg.state == "failed":
            logger.error("%s", msg.reason)
            self._fail_all(EngineDead(msg.reason))
            self.failed.set()

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_S)
            self._cut_if_stalled()
            gone = self.core_exit()
            if gone is not None and self.state != "stopped":
                if self.state != "failed":
                    self.state, self.reason = "failed", gone
                    logger.error("%s", gone)
                self._fail_all(EngineDead(self.reason))
                self.failed.set()
                return


    def _cut_if_stalled(self) -> None:
        limit = self.stream_stall_timeout
        waited = self.stalled_for(limit) if limit is not None and self.streams else None
        if limit is None or waited is None or waited < limit:
            return
        logger.error("ending %d open request(s): the engine made no progress", len(self.streams))
        self.cut_all(EngineStalled(
            f"the engine made no progress for {waited:.0f}s (stalled); the request was ended"
        ))  # fmt: skip


class ProcessCore(CoreClient):
    """Spawns the engine core process (atom.entrypoints.core.process)."""

    def __init__(self, spec: Any, client_index: int = 0) -> None:
        super().__init__(spec.endpoints, client_index)
        self.spec = spec
        self.proc: Any = None

    def _launch(self) -> None:
        from atom.entrypoints.core.process import spawn_core

        self.proc = spawn_core(self.spec)
        self.core_pid = self.proc.pid

    def core_exit(self) -> str | None:
        if self.proc is None or self.proc.is_alive():
            return None
        return f"the engine core (pid {self.proc.pid}) exited with code {self.proc.exitcode}"

    async def _wait_core(self, timeout: float) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, timeout)
        if self.proc.is_alive():
            logger.warning("the engine core did not stop in %.0fs: killing it", timeout)
            self.proc.kill()
            self.proc.join(5)


class AttachedCore(CoreClient):
    """An extra API server: the core belongs to the first one (our parent)."""

    owns_core = False

    def __init__(
        self, endpoints: CoreEndpoints, client_index: int, core_pid: int, parent_pid: int
    ) -> None:
        super().__init__(endpoints, client_index)
        self.core_pid, self.parent_pid = core_pid, parent_pid

    def core_exit(self) -> str | None:
        if os.getppid() != self.parent_pid:
            return "the first API server (which owns the engine core) is gone"
        try:
            os.kill(self.core_pid or 0, 0)
        except ProcessLookupError:
            return f"the engine core (pid {self.core_pid}) is gone"
        except PermissionError:
            pass
        return None


class ThreadCore(CoreClient):
    """The engine core in a thread of this process (tests, tools), over sockets in a private
    directory."""

    def __init__(self, build: Callable[[], EngineAPI], kv: KVSettings | None = None) -> None:
        from atom.entrypoints.core.process import new_endpoints

        super().__init__(new_endpoints(1), 0)
        self._build, self._kv = build, kv
        self._thread: threading.Thread | None = None
        self.core: EngineCore | None = None
        self._code: int | None = None

    def _launch(self) -> None:
        bound = threading.Event()  # the core binds its input before we connect
        self.core = EngineCore(self._build, self.endpoints, bound=bound)
        if self._kv is not None:
            from atom.entrypoints.core.kv import CoreKV

            self.core.kv = CoreKV(self._kv.service(), self.core.wake)
        core = self.core

        def run() -> None:
            try:
                self._code = core.run()
            except BaseException:
                logger.exception("engine core thread failed")
                self._code = 1
            bound.set()

        self._thread = threading.Thread(target=run, name="atom-engine-core", daemon=True)
        self._thread.start()
        bound.wait(10)
        self.core_pid = os.getpid()

    @property
    def engine(self) -> EngineAPI | None:
        return self.core.engine if self.core is not None else None

    def core_exit(self) -> str | None:
        if self._thread is None or self._thread.is_alive():
            return None
        return f"the engine core thread ended (code {self._code})"

    async def _wait_core(self, timeout: float) -> None:
        # A core still building or warming up cannot be interrupted; its thread is a daemon.
        if self._thread is not None and self.state == "ready":
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    async def stop(self, timeout: float = 10.0) -> None:
        await super().stop(timeout)
        from atom.entrypoints.core.process import remove_endpoints

        remove_endpoints(self.endpoints)
