"""The engine core's KV side: the KV port server (prefill) and block pulls (decode).

Both run on one I/O thread with its own asyncio loop, so a transfer never waits on the engine
loop and the engine loop never waits on a socket. A finished pull is queued for the engine
loop, which adds the prefilled request at its next turn (the `wake` callback gets it there at
once when it is idle).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atom.disagg.client import KVTransferError
from atom.disagg.handle import KVHandle
from atom.disagg.metrics import KVMetrics
from atom.disagg.service import KVService
from atom.entrypoints.core.messages import AddRequest, KVInfo
from atom.wire.errors import KV_TRANSFER_FAILED

logger = logging.getLogger(__name__)


@dataclass
class PullDone:
    """A decode request whose blocks arrived (blocks set) or could not be pulled (error set)."""

    req: AddRequest
    blocks: Any = None  # host tensor (atom.disagg.kv_blocks)
    error: KVTransferError | None = None


class CoreKV:
    def __init__(self, service: KVService, wake: Callable[[], None]) -> None:
        self.service = service
        self._wake = wake
        self.done: collections.deque[PullDone] = collections.deque()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="atom-kv", daemon=True)
        self._thread.start()

    def _call(self, coro: Any, timeout: float | None = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, registry: Any, holds: Callable[[], Any]) -> int | None:
        """Open the KV port (prefill); the bound port, or None when this core serves none."""
        self.service.metrics = KVMetrics(registry, holds)
        return self._call(self.service.start())

    def attach(self, engine: Any) -> None:
        self.service.attach(engine)

    def info(self) -> KVInfo:
        svc = self.service
        return KVInfo(
            layout=svc.layout.to_dict() if svc.layout is not None else None,
            port=svc.bound_port if svc.serves else None,
            advertise_host=svc.advertise_host,
            hold_seconds=svc.hold_seconds,
            max_held_fraction=svc.cap.fraction,
        )

    # ---- decode side ----------------------------------------------------------------------
    def pull(self, req: AddRequest) -> None:
        """Start pulling req.kv_pull's blocks; the result lands in `done`."""
        asyncio.run_coroutine_threadsafe(self._pull(req), self._loop)

    async def _pull(self, req: AddRequest) -> None:
        assert req.kv_pull is not None
        try:
            pulled = await self.service.pull(req.kv_pull)
            self.done.append(PullDone(req, blocks=pulled.blocks))
        except KVTransferError as exc:
            self.service.release_soon(req.kv_pull)  # the prefill frees its blocks now
            self.done.append(PullDone(req, error=exc))
        except Exception as exc:  # never lose a request: it fails with the cause
            logger.exception("KV pull failed")
            self.service.release_soon(req.kv_pull)
            self.done.append(PullDone(req, error=KVTransferError(str(exc), KV_TRANSFER_FAILED)))
        except BaseException:  # cancelled (the core is closing): free them on the prefill
            self.service.release_soon(req.kv_pull)
            raise
        self._wake()

    def release(self, handle: KVHandle) -> None:
        self._loop.call_soon_threadsafe(self.service.release_soon, handle)

    def close(self) -> None:
        try:
            self._call(self.service.close(), timeout=5.0)
        except Exception:  # closing is best effort at exit
            logger.debug("KV close failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
