"""One instance's side of disaggregation, as the HTTP server uses it.

Every instance can pull (decode); an instance with a KV port also serves its held blocks
(prefill). The engine is attached from the engine thread once it is built; until then the KV
server answers NOT_READY.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from atom.disagg.client import PulledKV, pull_kv, release_kv
from atom.disagg.handle import KVHandle
from atom.disagg.holds import HoldCap, Reservation
from atom.disagg.kv_blocks import engine_layout
from atom.disagg.layout import KVLayout
from atom.disagg.registry import TransportSet, build_transports
from atom.disagg.server import KVServer, KVSource
from atom.disagg.transport import TransportMode
from atom.wire.kv_modes import DEFAULT_KV_PORT
from atom.wire.trust import TransferKeys

__all__ = ["DEFAULT_KV_PORT", "KVService"]

logger = logging.getLogger(__name__)


@dataclass
class KVService:
    host: str = "127.0.0.1"  # the KV port's bind address (--kv-host, else --host)
    port: int | None = None  # None: this instance serves no blocks (0: any free port)
    advertise_host: str | None = None  # the address decode instances dial; None: router fills it
    hold_seconds: float = 30.0
    pull_timeout: float = 30.0
    max_held_fraction: float = 0.5  # --max-held-kv-fraction
    transport: str = "auto"  # --kv-transport
    metrics: Any = None  # atom.disagg.metrics.KVMetrics
    layout: KVLayout | None = None
    engine: Any = None
    server: KVServer | None = None
    bound_port: int = 0
    keys: TransferKeys = field(default_factory=TransferKeys)
    transports: TransportSet | None = None  # built at attach, from the engine's cache device
    cap: HoldCap = field(init=False)
    mode: TransportMode = field(init=False)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.cap = HoldCap(self.max_held_fraction)
        self.mode = TransportMode.parse(self.transport)  # ValueError before anything starts

    # ---- lifecycle ------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        """Engine thread, right after the engine is built."""
        engine.kv_holds.hold_seconds = self.hold_seconds
        transports = build_transports(self.mode, engine.runner.kv_cache, self.host)
        transports.check_start()  # a forced transport this instance cannot use fails start-up
        self.transports = transports
        if self.metrics is not None:
            self.metrics.watch_handles(
                lambda: {str(t.name): t.counters for t in transports.fast.values()}
            )
        logger.info(
            "KV transports: --kv-transport %s; usable here: %s", self.mode,
            ", ".join(transports.offer().accept),
        )  # fmt: skip
        self.layout = engine_layout(engine)
        self.engine = engine

    @property
    def serves(self) -> bool:
        return self.server is not None

    async def start(self) -> int | None:
        if self.port is None:
            return None
        self.server = KVServer(self._source, self.metrics)
        self.bound_port = await self.server.start(self.host, self.port)
        return self.bound_port

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.server is not None:
            await self.server.close()
        if self.transports is not None:
            self.transports.close()  # IPC mappings and NCCL groups: counters balance

    def _source(self) -> KVSource | None:
        if self.engine is None or self.layout is None:
            return None
        return KVSource(
            self.layout,
            self.engine.kv_holds,
            self.engine.runner.kv_cache,
            keys=self.keys,
            transports=self.transports,
        )

    def reserve(self, num_tokens: int) -> Reservation:
        """Room for one prefill's hold under the cap (HoldCapExceeded when there is none)."""
        assert self.layout is not None
        return self.cap.reserve(
            self.layout.blocks_for(num_tokens),
            held=self.engine.kv_holds.num_blocks_held,
            total_blocks=self.engine.block_manager.num_blocks,
        )

    def release_local(self, handle: str) -> bool:
        """Drop one of this instance's holds now (its answer never reached a decode instance)."""
        if self.engine is None:
            return False
        return self.engine.kv_holds.release(handle)

    def release_verified(self, handle: str, secret: object) -> bool:
        """POST /internal/kv/release: drop a hold only for its per-transfer secret."""
        return self.keys.verify(handle, secret) and self.release_local(handle)

    # ---- decode side ----------------------------------------------------------------------------
    async def pull(self, handle: KVHandle) -> PulledKV:
        assert self.layout is not None
        return await pull_kv(
            handle,
            self.layout,
            timeout=self.pull_timeout,
            metrics=self.metrics,
            transports=self.transports,
        )

    def release_soon(self, handle: KVHandle) -> None:
        """Free a handle's blocks on its prefill instance without waiting (best effort)."""
        if self.layout is None or handle.kv_host is None:
            return
        task = asyncio.create_task(release_kv(handle, self.layout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
