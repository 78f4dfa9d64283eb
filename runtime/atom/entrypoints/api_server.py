"""Process-level serving: listen at once, build + warm the engine in the background, drain on SIGTERM.

The socket opens before the engine is built so /health can say 503 (with the reason) through the
whole compile-and-capture phase; Kubernetes' startupProbe relies on that. On SIGTERM the server
stops accepting, lets in-flight requests finish for up to `grace_s` (then cancels them, which
aborts their sequences), stops the engine thread and returns, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from atom.entrypoints.async_engine import AsyncEngine
from atom.entrypoints.body import RUNNER_KWARGS
from atom.entrypoints.server import ServerState, create_app
from atom.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def engine_builder(config: Any, state: ServerState) -> Callable[[], Any]:
    """Build LLMEngine(config) and the matching tokenizer; runs in the engine thread."""

    def build() -> Any:
        from atom.engine import LLMEngine
        from atom.models.registry import load_model_config

        model_cfg = load_model_config(config.model)
        engine = LLMEngine(config)
        if config.max_model_len is None:
            config.finalize_model_len(model_cfg.max_position_embeddings)
        bos = model_cfg.bos_token_id if isinstance(model_cfg.bos_token_id, int) else None
        state.tokenizer = load_tokenizer(
            config.model, model_cfg.vocab_size, bos, model_cfg.eos_token_id
        )
        state.vocab_size = model_cfg.vocab_size
        state.max_model_len = int(config.max_model_len)
        state.config = config
        if state.kv is not None:
            state.kv.attach(engine)
        return engine

    return build


async def serve(
    state: ServerState,
    host: str,
    port: int,
    grace_s: float = 30.0,
    stop: asyncio.Event | None = None,
    install_signals: bool = True,
) -> int:
    """Run until SIGTERM/SIGINT (or `stop` is set); returns the exit code."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    app = create_app(state)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its sequence.
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=grace_s, access_log=None, **RUNNER_KWARGS
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port  # the real port when --port 0
    logger.info("listening on http://%s:%s", host, bound)
    print(f"ATOM server listening on http://{host}:{bound}", flush=True)
    try:
        kv_port = await state.kv.start() if state.kv is not None else None
    except OSError as exc:  # the KV port is taken: fail fast, like the HTTP port does
        logger.error("cannot serve KV blocks: %s", exc)
        await runner.cleanup()
        return 1
    if kv_port is not None:
        print(f"ATOM KV server listening on {host}:{kv_port}", flush=True)
    state.engine.start()
    failed = asyncio.create_task(_wait_failed(state.engine))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 1 if state.engine.state == "failed" else 0
    for task in (failed, stopped):
        task.cancel()
    state.draining = True
    logger.info("shutting down: %d request(s) in flight", len(state.engine.streams))
    t0 = time.monotonic()
    await runner.cleanup()  # stop accepting; wait for in-flight handlers up to grace_s, then cancel
    await state.engine.stop()
    if state.kv is not None:
        await state.kv.close()
    logger.info("shut down in %.2fs", time.monotonic() - t0)
    return exit_code


async def _wait_failed(engine: AsyncEngine) -> None:
    while engine.state != "failed":
        await asyncio.sleep(0.2)
    logger.error("%s", engine.reason)
