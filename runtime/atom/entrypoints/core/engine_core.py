"""The engine core: builds and warms the engine, then loops over steps, alone in its process.

Each turn drains the input socket without blocking (adds and aborts that arrived together join
one batch), runs one `LLMEngine.step()`, and sends one StepOutputs message with every request
that moved. Sends never block (what a socket does not take waits for a later turn): the loop
never waits on an API server.
When idle it sleeps in a poll, waking for input, for a finished KV pull, or to send the
heartbeat (Stats) that /livez reads. The sockets are atom.entrypoints.core.channel's.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from atom.disagg.holds import HoldCapExceeded, Reservation
from atom.engine.api import EngineAPI
from atom.engine.params import RequestOutput, SamplingParams
from atom.entrypoints.core.channel import Inbox, Outbox, send_now
from atom.entrypoints.core.messages import (
    AbortRequests,
    AddRequest,
    ApiMetrics,
    DropHold,
    EngineInfo,
    EngineStatus,
    Hello,
    HoldReleased,
    LoadLoRA,
    LoRAAdapters,
    LoRAReply,
    MetricsText,
    ReleaseHold,
    ReleaseKV,
    ReqOut,
    RequestFailed,
    Scrape,
    Shutdown,
    Stats,
    StepOutputs,
    UnloadLoRA,
    encoder,
    input_decoder,
)
from atom.entrypoints.core.step_trace import StepTrace
from atom.wire.errors import INVALID_REQUEST, KV_HOLD_CAP, kv_status

if TYPE_CHECKING:  # torch: the core's KV side is imported only where it runs
    import torch
    from prometheus_client import CollectorRegistry

    from atom.entrypoints.core.kv import CoreKV
    from atom.entrypoints.metrics_vllm import LoraState, VllmEngineInfo

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # also how often held KV blocks are reclaimed while idle
HEARTBEAT_S = 1.0
BUSY_STATS_S = 0.25
RANK_VERDICT_S = 1.0  # how long a failed step waits to learn whether a TP rank died
FATAL_FLUSH_S = 0.5


@dataclass
class CoreEndpoints:
    """Unix socket addresses (`ipc://path`): the core binds `input`; each API server i binds
    `outputs[i]` (atom.entrypoints.core.channel)."""

    input: str
    outputs: list[str]


@dataclass
class EngineCore:
    build: Callable[[], EngineAPI]  # LLMEngine, or a test's scripted engine
    endpoints: CoreEndpoints
    kv: CoreKV | None = None
    parent_pid: int | None = None  # exit when this process is gone (the API server died)
    bound: threading.Event | None = None  # set once the input socket is bound
    engine: EngineAPI | None = None  # set once built
    state: str = "starting"
    reason: str = "engine is starting"
    steps: int = 0
    info: EngineInfo | None = None
    _owner: dict[str, int] = field(default_factory=dict)  # request id -> API server index
    # prefill-role requests still running: their room under --max-held-kv-fraction
    _reserved: dict[str, Reservation] = field(default_factory=dict)
    _registry: CollectorRegistry | None = None
    # --api-server-count > 1: each API server's latest series (atom.entrypoints.metrics_merge)
    _api_metrics: dict[int, bytes] = field(default_factory=dict)
    _stats_due: bool = False  # send Stats at the end of this turn
    _vllm: VllmEngineInfo | None = None  # the vllm:* series' labels, once the engine is built
    # The sockets and codecs, made by _open() in the thread that runs the loop.
    _in: Inbox = field(init=False, repr=False)
    _outs: list[Outbox] = field(init=False, repr=False)
    _enc: msgspec.msgpack.Encoder = field(init=False, repr=False)
    _dec: msgspec.msgpack.Decoder = field(init=False, repr=False)

    @property
    def _engine(self) -> EngineAPI:
        """The built engine (the loop and the input handlers run only after the build)."""
        if self.engine is None:
            raise RuntimeError("the engine is not built yet")
        return self.engine

    # ---- sockets --------------------------------------------------------------------------
    def _open(self) -> None:
        self._in = Inbox(self.endpoints.input)
        # Never blocks the loop on a slow API server: what a socket does not take waits.
        self._outs = [Outbox(addr) for addr in self.endpoints.outputs]
        self._enc = encoder()
        self._dec = input_decoder()
        if self.bound is not None:
            self.bound.set()

    def wake(self) -> None:
        """From the KV I/O thread: the idle loop's poll returns."""
        self._in.wake()

    def _send(self, client: int, msg: Any) -> None:
        if 0 <= client < len(self._outs):
            self._outs[client].send(self._enc.encode(msg))

    def _broadcast(self, msg: Any) -> None:
        data = self._enc.encode(msg)
        for s in self._outs:
            s.send(data)

    def _status(self) -> EngineStatus:
        return EngineStatus(self.state, self.reason, os.getpid(), self.info)

    def _set_state(self, state: str, reason: str) -> None:
        self.state, self.reason = state, reason
        self._broadcast(self._status())

    # ---- lifecycle ------------------------------------------------------------------------
    def run(self) -> int:
        """Build, warm up, loop; the exit code (0 after Shutdown, 1 when the engine failed)."""
        self._open()
        try:
            return self._run()
        finally:
            if self.kv is not None:
                self.kv.close()
            if self.engine is not None:  # the tensor-parallel workers
                try:
                    self.engine.shutdown()
                except Exception:
                    logger.warning("stopping the tensor-parallel workers failed", exc_info=True)
            for out in self._outs:
                out.close(linger_s=1.0)
            self._in.close()

    def _run(self) -> int:
        from prometheus_client import CollectorRegistry, ProcessCollector

        self._registry = CollectorRegistry()
        # ThreadCore shares its process with the API server, whose collector already covers it.
        if self.parent_pid is not None:
            ProcessCollector(namespace="atom_core", registry=self._registry)
        # The engine's series (atom_* and vllm:*), read here at each scrape: what the engine
        # holds at that moment, from one source however many API servers there are.
        from atom.entrypoints.metrics import EngineCollector

        self._registry.register(EngineCollector(
            self._stats, dict, self._warmup_summary, lambda: self._vllm, self._lora_state
        ))  # fmt: skip
        try:
            self._set_state("starting", "building the engine (model, KV cache)")
            kv_port = None
            if self.kv is not None:
                kv_port = self.kv.start(
                    self._registry, lambda: self.engine.kv_holds if self.engine is not None else None
                )
                if kv_port is not None:
                    print(f"ATOM KV server listening on port {kv_port}", flush=True)
            engine = self.engine = self.build()
            if self.kv is not None:
                self.kv.attach(engine)
            self._set_state("warming", "warming up: compiling and capturing CUDA graphs")
            warmup = dict(engine.warmup())
            self.info = self._engine_info(warmup)
            self._vllm = self._vllm_info()
            # The model, compiled graphs and caches live for the whole process: keep the
            # cyclic collector from walking them again and again between steps.
            gc.collect()
            gc.freeze()
            self._set_state("ready", "ready")
        except Exception as exc:
            rank = self._rank_failure()
            if rank is not None:
                self._set_state("failed", rank)
                return 1
            if isinstance(exc, ValueError):  # a bad setting, named by the message: no traceback
                logger.error("engine start-up failed: %s", exc)
            else:
                logger.exception("engine start-up failed")
            self._set_state("failed", f"engine start-up failed: {exc}")
            return 1
        try:
            return self._loop()
        except Exception as exc:
            rank = self._rank_failure()  # a dead rank breaks rank 0's collectives: say which
            if rank is not None:
                self._set_state("failed", rank)
                return 1
            logger.error("engine step failed:\n%s", traceback.format_exc())
            self._set_state("failed", f"engine step failed: {exc}")
            return 1

    def _warmup_summary(self) -> dict[str, Any]:
        return self.info.warmup if self.info is not None else {}

    def _vllm_info(self) -> VllmEngineInfo:
        from atom.entrypoints.metrics_vllm import VllmEngineInfo

        engine = self._engine
        num_blocks = int(engine.stats().get("kv_blocks_total", 0))
        return VllmEngineInfo.from_facts(engine.facts(), num_blocks)

    def _lora_state(self) -> LoraState:
        """vllm:lora_requests_info: the adapters of the running and waiting requests."""
        from atom.entrypoints.metrics_vllm import NO_LORA, LoraState

        lora = self.engine.lora if self.engine is not None else None
        if lora is None:
            return NO_LORA
        usage = lora.usage()
        return LoraState(usage.max_loras, usage.running, usage.waiting)

    def _rank_failure(self) -> str | None:
        """Why a tensor-parallel rank died, if one did (its watcher may be a moment behind
        the collective that failed on rank 0)."""
        return self.engine.rank_failure(RANK_VERDICT_S) if self.engine is not None else None

    def fatal(self, reason: str) -> None:
        """A tensor-parallel rank died (called from the executor's watcher thread): tell every
        API server, on sockets of this thread, and exit now: the step loop may be blocked
        in a collective the dead rank will never join."""
        data = encoder().encode(EngineStatus("failed", reason, os.getpid(), self.info))
        for addr in self.endpoints.outputs:
            send_now(addr, data, FATAL_FLUSH_S)
        logging.shutdown()
        os._exit(1)

    def _engine_info(self, warmup: dict[str, Any]) -> EngineInfo:
        from atom.entrypoints.info import config_info, tp_info

        facts = self._engine.facts()
        return EngineInfo(
            max_model_len=facts.max_model_len,
            vocab_size=facts.vocab_size,
            config=_jsonable({**config_info(facts.config), **tp_info(facts.tp_pids)})
            if facts.config is not None else {},
            graphs=_jsonable(facts.graphs),
            warmup=_jsonable(warmup),
            kv=self.kv.info() if self.kv is not None else None,
            eos_token_ids=list(facts.eos_token_ids),
            lora_adapters=self._engine.lora.adapters() if self._engine.lora is not None else None,
        )

    def _loop(self) -> int:
        trace = StepTrace.from_env()
        try:
            return self._turns(trace)
        finally:
            if trace is not None:
                trace.flush()

    def _turns(self, trace: StepTrace | None) -> int:
        engine = self._engine
        last_stats = 0.0
        last_parent_check = time.monotonic()
        clock = time.perf_counter
        while True:
            busy = engine.has_unfinished_requests()
            # Idle: sleep until input or a wake-up (or a send the socket did not take yet).
            wait_ms = 0 if busy else (1 if any(o.pending for o in self._outs) else IDLE_POLL_MS)
            if self._in.wait(wait_ms) and self._drain():
                return 0
            for out in self._outs:
                out.flush()
            if self.kv is not None:
                self._add_pulled()
            now = time.monotonic()
            if engine.has_unfinished_requests():
                t0 = clock() if trace is not None else 0.0
                outs = engine.step()  # reclaims freed KV holds itself
                t1 = clock() if trace is not None else 0.0
                self.steps += 1
                if outs:
                    self._route(outs)
                if trace is not None:
                    trace.record(t0, t1, clock(), engine, len(outs))
            else:
                engine.reclaim_kv()  # held KV blocks that were pulled or timed out, while idle too
            # Also at once when work just ended or was refused: /status then shows what it left.
            due = self._stats_due or (busy and not engine.has_unfinished_requests())
            if due or now - last_stats >= (BUSY_STATS_S if busy else HEARTBEAT_S):
                last_stats, self._stats_due = now, False
                self._broadcast(Stats(self._stats(), self.steps, busy))
            if now - last_parent_check >= 0.5:
                last_parent_check = now
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.error("the API server (pid %d) is gone: exiting", self.parent_pid)
                    return 1

    def _route(self, outs: list[RequestOutput]) -> None:
        """One StepOutputs per API server that has a request in this step."""
        owner = self._owner
        # No prefill-role reservation to settle: the plain conversion (one call less a row).
        req_out = self._req_out if self._reserved else _req_out
        if len(self._outs) == 1:
            batch = [req_out(o) for o in outs]
            for o in outs:
                if o.finished:
                    owner.pop(o.request_id, None)
            self._outs[0].send(self._enc.encode(StepOutputs(batch, self.steps)))
            return
        per: dict[int, list[ReqOut]] = {}
        for o in outs:
            client = owner.get(o.request_id, 0)
            if o.finished:
                owner.pop(o.request_id, None)
            per.setdefault(client, []).append(req_out(o))
        for client, batch in per.items():
            self._send(client, StepOutputs(batch, self.steps))

    def _req_out(self, o: RequestOutput) -> ReqOut:
        out = _req_out(o)
        if o.finished and self._reserved:
            reservation = self._reserved.pop(o.request_id, None)
            if reservation is not None:  # its hold is registered now (or it ended without one)
                reservation.__exit__(None, None, None)
                assert self.kv is not None  # only the KV side reserves
                out.kv_secret = self.kv.service.keys.secret_for(o.request_id)
        return out

    def _stats(self) -> dict[str, Any]:
        engine = self._engine
        try:
            stats = dict(engine.stats())
        except Exception:  # stats are best effort; never kill the loop for them
            logger.debug("engine.stats() failed", exc_info=True)
            return {}
        from atom.utils.counters import counters

        stats["counters"] = counters.snapshot()  # this process' compile/graph counters
        holds = engine.kv_holds
        if holds is not None:
            stats["kv_holds"] = holds.num_holds
            stats["kv_holds_expired"] = holds.stats.expired
            stats["kv_blocks_held"] = holds.num_blocks_held
        if self.kv is not None:
            stats["kv_hold_cap_refused"] = self.kv.service.cap.refused
        return _jsonable(stats)

    # ---- input ----------------------------------------------------------------------------
    def _drain(self) -> bool:
        """Handle every queued message; True on Shutdown."""
        for raw in self._in.read():
            msg = self._dec.decode(raw)
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    self._abort(rid)
            elif isinstance(msg, ReleaseKV):
                if self.kv is not None:
                    self.kv.release(msg.handle)
            elif isinstance(msg, DropHold):
                self._drop_hold(msg.request_id)
            elif isinstance(msg, ReleaseHold):
                ok = self.kv is not None and self.kv.service.release_verified(
                    msg.handle, msg.secret
                )
                self._send(msg.client, HoldReleased(msg.seq, ok))
            elif isinstance(msg, Hello):
                self._send(msg.client, self._status())
            elif isinstance(msg, Scrape):
                self._scrape(msg)
            elif isinstance(msg, ApiMetrics):
                self._api_metrics[msg.client] = msg.snapshot
            elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
                self._lora_change(msg)
            elif isinstance(msg, Shutdown):
                self._set_state("stopped", "shut down")
                return True
        return False

    def _lora_change(self, msg: LoadLoRA | UnloadLoRA) -> None:
        """Load or unload an adapter between steps; the requester gets the outcome, every
        API server the new list (for /v1/models and model-name routing)."""
        lora = self._engine.lora
        reply = LoRAReply(msg.seq, 200)
        if lora is None:
            reply = LoRAReply(msg.seq, 400, INVALID_REQUEST,
                              "this server serves no LoRA adapters (start it with --max-loras "
                              "or --lora-modules)")
        else:
            try:
                if isinstance(msg, LoadLoRA):
                    lora.load(msg.name, msg.path)
                else:
                    lora.unload(msg.name)
            except KeyError:
                reply = LoRAReply(msg.seq, 404, "lora_not_found",
                                  f"LoRA adapter {msg.name!r} is not loaded")
            except (ValueError, OSError) as exc:
                reply = LoRAReply(msg.seq, 400, INVALID_REQUEST, str(exc))
        self._send(msg.client, reply)
        if lora is not None and reply.status == 200:
            self._broadcast(LoRAAdapters(lora.adapters()))

    def _add(self, msg: AddRequest) -> None:
        self._owner[msg.request_id] = msg.client
        if msg.kv_pull is not None and self.kv is not None:
            self.kv.pull(msg)  # added once the blocks are here
            return
        self._add_now(msg, None)

    def _add_now(self, msg: AddRequest, blocks: torch.Tensor | None) -> None:
        engine = self._engine
        params = msg.sampling  # validated by the engine (the API server checked it too)
        try:
            if msg.first_token is not None:
                engine.add_prefilled_request(
                    msg.request_id,
                    msg.prompt_ids,
                    msg.first_token,
                    params,
                    blocks,
                    msg.first_logprob,
                    cached_tokens=msg.cached_tokens,
                    first_top=msg.first_top_logprobs,
                )
            elif msg.hold_kv:
                self._add_holding(msg, params)
            else:
                engine.add_request(msg.request_id, msg.prompt_ids, params,
                                   lora_name=msg.lora_name)
        except HoldCapExceeded as exc:  # --max-held-kv-fraction: busy, not unwell
            self._fail(msg.request_id, 503, KV_HOLD_CAP, str(exc))
            self._stats_due = True
        except (ValueError, TypeError, OverflowError) as exc:  # the engine names the limit
            self._unreserve(msg.request_id)
            self._fail(msg.request_id, 400, INVALID_REQUEST, str(exc))

    def _add_holding(self, msg: AddRequest, params: SamplingParams) -> None:
        """A prefill-role request: room under the hold cap first, kept until it finishes."""
        if self.kv is not None:
            self._reserved[msg.request_id] = self.kv.service.reserve(len(msg.prompt_ids))
        self._engine.add_request(msg.request_id, msg.prompt_ids, params, hold_kv=True)

    def _unreserve(self, rid: str) -> None:
        reservation = self._reserved.pop(rid, None)
        if reservation is not None:
            reservation.__exit__(None, None, None)

    def _drop_hold(self, rid: str) -> None:
        """The prefill's API handler was cancelled: nobody will pull its blocks."""
        self._abort(rid)
        self._unreserve(rid)
        if self.kv is not None:
            self.kv.service.release_local(rid)

    def _add_pulled(self) -> None:
        assert self.kv is not None
        done = self.kv.done
        while done:
            d = done.popleft()
            rid = d.req.request_id
            if rid not in self._owner:  # aborted while its blocks were on the way
                if d.error is None and d.req.kv_pull is not None:
                    self.kv.release(d.req.kv_pull)  # free them on the prefill now
                continue
            if d.error is not None:
                self._fail(rid, kv_status(d.error.code), d.error.code, d.error.message)
            else:
                self._add_now(d.req, d.blocks)

    def _abort(self, rid: str) -> None:
        self._unreserve(rid)
        if self._owner.pop(rid, None) is None:
            return
        try:
            self._engine.abort_request(rid)
        except (KeyError, ValueError):
            pass  # already finished

    def _fail(self, rid: str, status: int, code: str, message: str) -> None:
        client = self._owner.pop(rid, 0)
        self._send(client, RequestFailed(rid, status, code, message))

    def _scrape(self, msg: Scrape) -> None:
        from prometheus_client import generate_latest

        assert self._registry is not None  # _run sets it before reading any message
        if msg.snapshot:
            self._api_metrics[msg.client] = msg.snapshot
        peers = [snap for client, snap in self._api_metrics.items() if client != msg.client]
        self._send(msg.client, MetricsText(msg.seq, generate_latest(self._registry), peers))


def _req_out(o: RequestOutput) -> ReqOut:
    return ReqOut(
        o.request_id,
        o.new_token_ids,
        o.new_logprobs,
        (o.finish_reason or "stop") if o.finished else None,
        o.num_prompt_tokens,
        o.num_output_tokens,
        o.num_cached_tokens,
        top_logprobs=o.new_top_logprobs,
    )


def _jsonable(obj: Any) -> Any:
    """Plain JSON types only (msgpack carries them; /status prints them)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)
