"""`atom-runtime serve`: the first API server, the engine core it spawns, and the extra API
servers of `--api-server-count`.

Processes: this one (API server 0) spawns the engine core, then N-1 API servers, all of them
listening on the same port (SO_REUSEPORT). The core and the extra API servers die with this
process (PR_SET_PDEATHSIG); an extra API server that dies makes this one exit 1, so the pod is
restarted whole. On SIGTERM this process forwards it to the extra API servers, each drains,
and the core stops last.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from atom.config import Config
from atom.entrypoints.core.engine_core import CoreEndpoints
from atom.entrypoints.core.process import KVSettings, remove_endpoints
from atom.wire.kv_modes import DEFAULT_KV_PORT
from atom.wire.trust import TOKEN_ENV, internal_token

if TYPE_CHECKING:
    from atom.entrypoints.core.client import CoreClient
    from atom.entrypoints.state import ServerState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    """The API servers' settings, read once from the `serve` flags (atom.cli.args); pickled to
    the extra API servers. The engine's own settings are the Config."""

    host: str
    port: int
    log_level: str
    max_waiting: int
    api_key: str | None  # --api-key, else $ATOM_API_KEY
    body_timeout: float
    liveness_timeout: float
    stall_timeout: float  # /health 503 engine_stalled after this long without progress
    stream_stall_timeout: float  # ...and open streams end after this long
    keepalive_timeout: float
    drain_seconds: float
    api_server_count: int
    kv: KVSettings

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        return cls(
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            max_waiting=args.max_waiting,
            api_key=args.api_key or os.environ.get("ATOM_API_KEY") or None,
            body_timeout=args.body_timeout,
            liveness_timeout=args.liveness_timeout,
            stall_timeout=args.stall_timeout,
            stream_stall_timeout=args.stream_stall_timeout,
            keepalive_timeout=args.keepalive_timeout,
            drain_seconds=args.drain_seconds,
            api_server_count=args.api_server_count,
            kv=kv_settings(args),
        )


def kv_settings(args: argparse.Namespace) -> KVSettings:
    """The instance's KV transfer side: a prefill serves its blocks (on 8001 unless told)."""
    port = args.kv_port
    if port is None and args.role == "prefill":
        port = DEFAULT_KV_PORT
    return KVSettings(
        host=args.kv_host or args.host,  # the operator renders --kv-host $(POD_IP)
        port=port,
        advertise_host=args.kv_host or os.environ.get("ATOM_KV_HOST") or None,
        hold_seconds=args.kv_hold_seconds,
        pull_timeout=args.kv_pull_timeout,
        max_held_fraction=args.max_held_kv_fraction,
        transport=args.kv_transport,  # negotiated per pull (atom.disagg.negotiate)
    )


def _state(settings: ServeSettings, config: Config, engine: CoreClient, index: int) -> ServerState:
    """The API server's state, with the tokenizer it loads itself (no engine needed)."""
    from atom.entrypoints.state import ServerState
    from atom.models.registry import load_model_config
    from atom.tokenizer import load_tokenizer

    model_cfg = load_model_config(config.model)
    bos = model_cfg.bos_token_id if isinstance(model_cfg.bos_token_id, int) else None
    state = ServerState(
        engine=engine,
        served_model_name=config.served_model_name or config.model,
        model=config.model,
        max_waiting=settings.max_waiting,
        role=config.role,
        config=config,
        api_key=settings.api_key,
        body_timeout=settings.body_timeout,
        liveness_timeout=settings.liveness_timeout,
        stall_timeout=settings.stall_timeout,
        stream_stall_timeout=settings.stream_stall_timeout,
        api_server_index=index,
        api_server_count=settings.api_server_count,
    )
    state.tokenizer = load_tokenizer(
        config.model, model_cfg.vocab_size, bos, model_cfg.eos_token_id
    )
    state.vocab_size = model_cfg.vocab_size
    return state


def _serve_kwargs(settings: ServeSettings) -> dict[str, Any]:
    return {
        "grace_s": settings.drain_seconds,
        "reuse_port": settings.api_server_count > 1,
        "keepalive_timeout": settings.keepalive_timeout,
    }


def _tune_process() -> None:
    """The API server allocates many short-lived objects per token: collect the young
    generation less often, never re-walk what start-up made, and use uvloop if installed."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


def check_internal_token(role: str) -> None:
    """A prefill or decode instance without ATOM_INTERNAL_TOKEN would refuse every request a
    router sends it (403 on kv_transfer) while looking healthy: refuse to start instead."""
    if role in ("prefill", "decode") and internal_token() is None:
        raise ValueError(
            f"--role {role} needs {TOKEN_ENV} (the secret shared with the router; the operator "
            "mounts it from the <deployment>-internal-token Secret)"
        )


def run_serve(args: argparse.Namespace, config: Config) -> int:
    from atom.entrypoints.api_server import serve
    from atom.entrypoints.core.client import ProcessCore
    from atom.entrypoints.core.process import CoreSpec, new_endpoints

    check_internal_token(config.role)
    settings = ServeSettings.from_args(args)
    if settings.api_server_count > 1 and settings.port == 0:
        raise ValueError("--api-server-count > 1 needs a fixed --port (the servers share it)")
    endpoints = new_endpoints(settings.api_server_count)
    spec = CoreSpec(config, endpoints, settings.kv, os.getpid(), settings.log_level)
    workers = ApiWorkers(settings, config, endpoints)
    _tune_process()

    async def main() -> int:
        engine = ProcessCore(spec)
        state = _state(settings, config, engine, 0)
        fail = asyncio.Event()

        def started() -> None:
            workers.start(engine.core_pid or 0, fail)

        return await serve(
            state,
            settings.host,
            settings.port,
            on_started=started,
            on_stopping=workers.stop,
            on_drained=workers.wait,
            fail=fail,
            **_serve_kwargs(settings),
        )

    try:
        return asyncio.run(main())
    finally:
        workers.kill()
        remove_endpoints(endpoints)


@dataclass
class WorkerSpec:
    settings: ServeSettings
    config: Config
    endpoints: CoreEndpoints
    index: int
    core_pid: int
    parent_pid: int


def worker_main(spec: WorkerSpec) -> None:
    """An extra API server process (index >= 1)."""
    from atom.entrypoints.api_server import serve
    from atom.entrypoints.core.client import AttachedCore
    from atom.executor.lifetime import die_with_parent

    die_with_parent(spec.parent_pid)
    logging.basicConfig(
        level=getattr(logging, spec.settings.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s api{spec.index} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _tune_process()

    async def main() -> int:
        engine = AttachedCore(spec.endpoints, spec.index, spec.core_pid, spec.parent_pid)
        settings = spec.settings
        state = _state(settings, spec.config, engine, spec.index)
        return await serve(state, settings.host, settings.port, **_serve_kwargs(settings))

    sys.exit(asyncio.run(main()))


class ApiWorkers:
    """The extra API server processes, seen from the first."""

    def __init__(self, settings: ServeSettings, config: Config, endpoints: CoreEndpoints) -> None:
        self.settings, self.config, self.endpoints = settings, config, endpoints
        self.procs: list[BaseProcess] = []
        self._watch: asyncio.Task | None = None
        self._draining = False

    def start(self, core_pid: int, fail: asyncio.Event) -> None:
        ctx = multiprocessing.get_context("spawn")
        for i in range(1, self.settings.api_server_count):
            spec = WorkerSpec(self.settings, self.config, self.endpoints, i, core_pid, os.getpid())
            p = ctx.Process(target=worker_main, args=(spec,), name=f"atom-api-{i}")
            p.start()
            self.procs.append(p)
        if self.procs:
            self._watch = asyncio.create_task(self._watch_loop(fail))

    async def _watch_loop(self, fail: asyncio.Event) -> None:
        while not self._draining:
            for p in self.procs:
                if not p.is_alive():
                    logger.error("API server %s (pid %d) exited with %s", p.name, p.pid, p.exitcode)
                    fail.set()
                    return
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        """Forward the drain (SIGTERM) to the extra API servers."""
        self._draining = True
        for p in self.procs:
            if p.is_alive() and p.pid is not None:  # a live process has its pid
                os.kill(p.pid, signal.SIGTERM)

    async def wait(self) -> None:
        """Until the extra API servers ended their drains (they run theirs alongside ours)."""
        loop = asyncio.get_running_loop()
        for p in self.procs:
            await loop.run_in_executor(None, p.join, 10.0)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
