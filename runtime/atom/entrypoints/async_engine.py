"""Runs LLMEngine.step in one worker thread and hands its outputs to asyncio request streams.

The engine is not thread-safe, so only the worker thread touches it: handlers enqueue add/abort
commands, the worker drains them before every step (which is how requests arriving together join
one batch), steps while anything is unfinished, and posts each step's outputs back to the event
loop in a single callback. Building the engine and its warm-up (compile + capture) run in the same
thread, so the HTTP server is up and answering /health 503 during them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


@dataclass
class Prefilled:
    """A request whose prompt ran on a prefill instance: its first token and pulled KV blocks."""

    first_token: int
    kv_blocks: Any  # host tensor (atom.disagg.kv_blocks) or None when the first token ends it
    first_logprob: float | None = None
    cached_tokens: int = 0  # prompt tokens the prefill instance found in its prefix cache


class EngineDead(RuntimeError):
    """The engine raised inside step(); in-flight requests fail with this."""


@dataclass
class RequestStream:
    """One request's outputs, as they arrive from the worker thread."""

    request_id: str
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_output_at: float | None = None
    finished: bool = False

    async def get(self) -> Any:
        """The next RequestOutput; raises what the worker posted as an error (ValueError, EngineDead)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncEngine:
    """Owns the worker thread; everything public is called from the event loop."""

    def __init__(self, build: Callable[[], Any], params_cls: type | None = None) -> None:
        self._build = build
        self._params_cls = params_cls
        self.engine: Any = None
        self.state = "starting"  # starting -> warming -> ready | failed; stopping at shutdown
        self.reason = "engine is starting"
        self.warmup_summary: dict[str, Any] = {}
        self.streams: dict[str, RequestStream] = {}
        self.last_stats: dict[str, Any] = {}
        self.steps = 0
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="atom-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the worker; unfinished streams get an abort."""
        self._stop.set()
        self._wake.set()
        # A thread still building or warming up cannot be interrupted; it is a daemon, so the
        # process exits without waiting for a compile nobody will use.
        if self._thread is not None and self.state == "ready":
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(EngineDead("server is shutting down"))
        self.streams.clear()

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    def num_waiting(self) -> int:
        """Requests admitted that have not produced a token yet (queued or in prefill)."""
        return sum(1 for s in self.streams.values() if s.first_output_at is None)

    # ---- requests (event loop side) ---------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], **opts: Any
    ) -> RequestStream:
        """opts (disaggregation): hold_kv=True on a prefill instance; prefilled=Prefilled(...)
        for a request whose prompt ran on a prefill instance."""
        stream = RequestStream(request_id)
        self.streams[request_id] = stream
        self._commands.append(("add", request_id, prompt_ids, params, opts))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Free the sequence (client gone, stop string hit); safe to call twice."""
        if self.streams.pop(request_id, None) is not None:
            self._commands.append(("abort", request_id))
            self._wake.set()

    def _deliver(self, outputs: list[Any], errors: list[tuple[str, BaseException]]) -> None:
        now = time.monotonic()
        for request_id, exc in errors:
            stream = self.streams.pop(request_id, None)
            if stream is not None:
                stream.queue.put_nowait(exc)
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if stream.first_output_at is None:
                stream.first_output_at = now
            if out.finished:
                stream.finished = True
                del self.streams[out.request_id]
            stream.queue.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(exc)
        self.streams.clear()

    # ---- worker thread ------------------------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop already closed at exit
            pass

    def _set_state(self, state: str, reason: str) -> None:
        self.state, self.reason = state, reason
        if state == "ready":
            self._post(self.ready.set)

    def _run(self) -> None:
        try:
            self._set_state("starting", "building the engine (model, KV cache)")
            self.engine = self._build()
            if self._params_cls is None:
                from atom.engine import SamplingParams

                self._params_cls = SamplingParams
            self._set_state("warming", "warming up: compiling and capturing CUDA graphs")
            self.warmup_summary = dict(self.engine.warmup() or {})
            self.last_stats = self._stats()
            self._set_state("ready", "ready")
        except Exception as exc:
            logger.exception("engine start-up failed")
            self._set_state("failed", f"engine start-up failed: {exc}")
            return
        reclaim = getattr(self.engine, "reclaim_kv", None)
        while not self._stop.is_set():
            errors = self._drain_commands()
            outputs: list[Any] = []
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()  # reclaims freed KV holds itself
                except Exception as exc:
                    logger.error("engine step failed:\n%s", traceback.format_exc())
                    self._set_state("failed", f"engine step failed: {exc}")
                    self._post(self._fail_all, EngineDead(f"engine step failed: {exc}"))
                    return
                self.steps += 1
            elif reclaim is not None:
                reclaim()  # held KV blocks that were pulled or timed out, while idle too
            self.last_stats = self._stats()
            if outputs or errors:
                self._post(self._deliver, outputs, errors)
            if not outputs and not self.engine.has_unfinished_requests():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()

    def _drain_commands(self) -> list[tuple[str, BaseException]]:
        errors: list[tuple[str, BaseException]] = []
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                _, request_id, prompt_ids, params, opts = cmd
                try:
                    self._add(request_id, prompt_ids, self._params_cls(**params), opts)
                except (ValueError, TypeError) as exc:  # the engine names the limit
                    errors.append((request_id, ValueError(str(exc))))
            else:
                try:
                    self.engine.abort_request(cmd[1])
                except (KeyError, ValueError):
                    pass  # already finished
        return errors

    def _add(self, request_id: str, prompt_ids: list[int], params: Any, opts: dict) -> None:
        pre = opts.get("prefilled")
        if pre is not None:
            self.engine.add_prefilled_request(
                request_id,
                prompt_ids,
                pre.first_token,
                params,
                pre.kv_blocks,
                pre.first_logprob,
                cached_tokens=pre.cached_tokens,
            )
        elif opts.get("hold_kv"):
            self.engine.add_request(request_id, prompt_ids, params, hold_kv=True)
        else:
            self.engine.add_request(request_id, prompt_ids, params)

    def _stats(self) -> dict[str, Any]:
        try:
            return dict(self.engine.stats())
        except Exception:  # stats are best effort; never kill the loop for them
            logger.debug("engine.stats() failed", exc_info=True)
            return self.last_stats
