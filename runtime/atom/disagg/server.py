"""The KV server on `--kv-port`: hands held blocks to the decode instance that pulls them.

Each connection serves one PULL or RELEASE (wire.py). Blocks are gathered from the cache on a
small thread pool, one chunk ahead of the socket, so the event loop only moves bytes. Every read
and write has a timeout: a decode instance that stalls is dropped and its hold stays for the
retry (or the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from atom.disagg import wire
from atom.disagg.holds import Hold, KVHoldRegistry
from atom.disagg.kv_blocks import as_bytes, gather_blocks
from atom.disagg.layout import KVLayout
from atom.disagg.trust import TransferKeys

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20


@dataclass
class KVSource:
    """What the server reads: the engine's layout, its holds and its cache tensor."""

    layout: KVLayout
    holds: KVHoldRegistry
    kv_cache: Any
    keys: TransferKeys | None = None  # None: handles alone suffice (in-process tests only)


class KVServer:
    def __init__(
        self,
        source: Callable[[], KVSource | None],
        metrics: Any = None,
        *,
        io_timeout: float = 10.0,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self._source = source  # None until the engine is built
        self.metrics = metrics
        self.io_timeout = io_timeout
        self.chunk_bytes = chunk_bytes
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="atom-kv")
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _refuse(self, writer: asyncio.StreamWriter, kind: int, message: str) -> None:
        message = message if len(message) <= 300 else message[:297] + "..."  # the peer chose it
        logger.warning("KV request refused (%s): %s", wire.ERROR_NAMES.get(kind, kind), message)
        if self.metrics is not None:
            self.metrics.outcome("sent", "refused")
        await wire.write_frame(writer, kind, {"message": message}, self.io_timeout)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            await self._answer(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, wire.WireError) as exc:
            logger.warning("KV transfer to %s broke: %s", peer, exc or type(exc).__name__)
            if self.metrics is not None:
                self.metrics.outcome("sent", "failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), self.io_timeout)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        version, kind, body = await wire.read_frame(reader, self.io_timeout)
        if version != wire.WIRE_VERSION:
            return await self._refuse(
                writer,
                wire.BAD_VERSION,
                f"KV wire version {version} is not supported: this prefill instance speaks "
                f"version {wire.WIRE_VERSION}",
            )
        if kind not in (wire.PULL, wire.RELEASE):
            return await self._refuse(writer, wire.BAD_REQUEST, f"unexpected frame kind {kind}")
        src = self._source()
        if src is None:
            return await self._refuse(writer, wire.NOT_READY, "the engine is not ready yet")
        handle = body.get("handle")
        try:
            theirs = KVLayout.from_dict(body.get("layout"))
            if not isinstance(handle, str):
                raise ValueError("handle must be a string")
        except ValueError as exc:
            return await self._refuse(writer, wire.BAD_REQUEST, str(exc))
        why = src.layout.mismatch(theirs, mine="the prefill instance", theirs="the decode instance")
        if why:
            return await self._refuse(writer, wire.MISMATCH, why)
        if src.keys is not None and not src.keys.verify(handle, body.get("secret")):
            return await self._refuse(writer, wire.UNKNOWN_HANDLE, src.holds.describe(handle))
        if kind == wire.RELEASE:
            if src.holds.release(handle):
                return await wire.write_frame(writer, wire.DONE, {}, self.io_timeout)
            return await self._refuse(writer, wire.UNKNOWN_HANDLE, src.holds.describe(handle))
        hold = src.holds.begin_pull(handle)
        if hold is None:
            return await self._refuse(writer, wire.UNKNOWN_HANDLE, src.holds.describe(handle))
        pulled = False
        try:
            pulled = await self._send(src, hold, reader, writer)
        finally:
            src.holds.end_pull(handle, pulled)
        if pulled:  # the blocks are freed at the engine's next turn
            await wire.write_frame(writer, wire.DONE, {}, self.io_timeout)

    async def _send(
        self,
        src: KVSource,
        hold: Hold,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        t0 = time.perf_counter()
        ids = hold.block_ids
        per_chunk = max(1, self.chunk_bytes // src.layout.block_bytes)
        header = {
            "layout": src.layout.to_dict(),
            "num_blocks": len(ids),
            "num_tokens": hold.num_tokens,
            "chunk_blocks": per_chunk,
        }
        await wire.write_frame(writer, wire.OK, header, self.io_timeout)
        loop = asyncio.get_running_loop()
        starts = list(range(0, len(ids), per_chunk))
        gather = lambda i: gather_blocks(src.kv_cache, ids[i : i + per_chunk])  # noqa: E731
        pending = loop.run_in_executor(self._executor, gather, starts[0]) if starts else None
        for n in range(len(starts)):
            data = await pending
            # The next chunk is gathered while this one drains.
            if n + 1 < len(starts):
                pending = loop.run_in_executor(self._executor, gather, starts[n + 1])
            writer.write(as_bytes(data))
            await asyncio.wait_for(writer.drain(), self.io_timeout)
        _, kind, _ = await wire.read_frame(reader, self.io_timeout)
        if kind != wire.ACK:
            raise wire.WireError(f"expected ACK, got frame kind {kind}")
        if self.metrics is not None:
            seconds = time.perf_counter() - t0
            self.metrics.observe("sent", len(ids) * src.layout.block_bytes, len(ids), seconds)
            self.metrics.outcome("sent", "ok")
        return True
