"""Process-level serving: listen at once, start the engine core, drain on SIGTERM, exit.

The socket opens before the engine is built so /health can say 503 (with the reason) through the
whole compile-and-capture phase; Kubernetes' startupProbe relies on that. Connections are
bounded in time: one that sends no complete request within `keepalive_timeout` (partial
headers, or idle between requests) is closed, and a body that does not arrive within the
server's body timeout is answered 408.

SIGTERM (once; a second is ignored) starts the drain: the listener stays open, /health answers
503 "draining", new generations get 503, in-flight requests have `grace_s` to finish; those
still running then end with an error (an SSE error event and [DONE] for streams), the core
is stopped and the process exits 0. If the core dies or fails, every in-flight request fails
at once and the process exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from atom.entrypoints.core.client import EngineDead
from atom.entrypoints.metrics_merge import PUSH_S, snapshot
from atom.entrypoints.server import ServerState, create_app
from atom.wire.body import RUNNER_KWARGS

logger = logging.getLogger(__name__)

HANDLER_FINISH_S = 2.0  # after the drain deadline: time for cut streams to write their end


async def serve(
    state: ServerState,
    host: str,
    port: int,
    grace_s: float = 30.0,
    stop: asyncio.Event | None = None,
    install_signals: bool = True,
    *,
    reuse_port: bool = False,
    keepalive_timeout: float = 5.0,
    on_started: Callable[[], None] | None = None,
    on_stopping: Callable[[], None] | None = None,
    on_drained: Callable[[], Awaitable[None]] | None = None,
    fail: asyncio.Event | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or `stop` is set); returns the exit code.

    on_started: after the core started (extra API servers are spawned there); on_stopping: when
    the drain starts; on_drained: awaited after this server's drain, before the core stops;
    fail: set by others to exit 1."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    fail = fail or asyncio.Event()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _once(stop, sig))
    app = create_app(state)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its sequence.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=HANDLER_FINISH_S,
        access_log=None,
        keepalive_timeout=keepalive_timeout,
        **RUNNER_KWARGS,  # aiohttp's own inflating off: atom.wire.body bounds what inflates
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048, reuse_port=reuse_port or None)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port  # the real port when --port 0
    logger.info("listening on http://%s:%s", host, bound)
    print(f"ATOM server listening on http://{host}:{bound}", flush=True)
    engine = state.engine
    await engine.start()
    if on_started is not None:
        on_started()
    pusher = asyncio.create_task(_push_metrics(state)) if state.api_server_count > 1 else None
    waits = {
        asyncio.create_task(engine.failed.wait()),
        asyncio.create_task(stop.wait()),
        asyncio.create_task(fail.wait()),
    }
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if pusher is not None:
        pusher.cancel()
    exit_code = 1 if (engine.failed.is_set() or fail.is_set()) else 0
    state.draining = True
    t0 = time.monotonic()
    if on_stopping is not None:
        on_stopping()
    if exit_code == 0:
        await _drain(state, grace_s)
    if on_drained is not None:
        await on_drained()
    await runner.cleanup()  # closes the listener; handlers have finished by now
    await engine.stop()
    logger.info("shut down in %.2fs", time.monotonic() - t0)
    return exit_code


async def _push_metrics(state: ServerState) -> None:
    """--api-server-count > 1: this process' series to the core, for the others' scrapes."""
    while True:
        await asyncio.sleep(PUSH_S)
        state.engine.push_metrics(snapshot(state.metrics.registry, state.api_server_index))


def _once(stop: asyncio.Event, sig: signal.Signals) -> Callable[[], None]:
    def handler() -> None:
        if stop.is_set():
            logger.info("%s: already draining", sig.name)
            return
        logger.info("%s: draining", sig.name)
        stop.set()

    return handler


async def _drain(state: ServerState, grace_s: float) -> None:
    """Let in-flight requests finish within grace_s; then end the rest with an error."""
    engine = state.engine
    logger.info("draining: %d request(s) in flight, up to %.0fs", len(engine.streams), grace_s)
    deadline = time.monotonic() + grace_s
    while engine.streams and time.monotonic() < deadline and not engine.failed.is_set():
        await asyncio.sleep(0.05)
    if engine.streams:
        logger.warning("drain deadline: cutting %d request(s)", len(engine.streams))
        engine.cut_all(EngineDead(f"server is shutting down: not finished within {grace_s:g}s"))
        await asyncio.sleep(0.2)  # the handlers write their error event and [DONE]
