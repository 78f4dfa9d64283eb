"""The KV server on `--kv-port`: hands held blocks to the decode instance that pulls them.

Each connection serves one PULL or RELEASE (wire.py). The PULL's handshake picks the transport
(negotiate.py) after the layout and the secret were checked; a fast one hands the decode an
offer and waits for its ACK (or its FALLBACK, answered with the same blocks over TCP). Blocks
for TCP are gathered from the cache on a
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
from atom.disagg.metrics import count_transport
from atom.disagg.negotiate import Decision, Offer
from atom.disagg.registry import TransportSet, tcp_only
from atom.disagg.transport import TransportFailure, TransportName
from atom.wire.trust import TransferKeys

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20


@dataclass
class KVSource:
    """What the server reads: the engine's layout, its holds and its cache tensor."""

    layout: KVLayout
    holds: KVHoldRegistry
    kv_cache: Any
    keys: TransferKeys | None = None  # None: handles alone suffice (in-process tests only)
    transports: TransportSet | None = None  # None: TCP only (auto)


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
        try:
            offer = Offer.from_body(body)
        except ValueError as exc:
            return await self._refuse(writer, wire.BAD_REQUEST, str(exc))
        transports = src.transports or tcp_only()
        decision = transports.decide(offer)
        if decision.chosen is None:  # before the hold is touched: nothing moved
            wanted = transports.mode.forced or (offer.accept[0] if offer and offer.accept else "-")
            count_transport(self.metrics, "sent", str(wanted), "refused")
            return await self._refuse(
                writer,
                wire.TRANSPORT_REFUSED,
                f"no KV transport both sides may use: {decision.reason}",
            )
        hold = src.holds.begin_pull(handle)
        if hold is None:
            return await self._refuse(writer, wire.UNKNOWN_HANDLE, src.holds.describe(handle))
        pulled = False
        try:
            pulled = await self._send(src, hold, transports, decision, offer, reader, writer)
        finally:
            src.holds.end_pull(handle, pulled)
        if pulled:  # the blocks are freed at the engine's next turn
            await wire.write_frame(writer, wire.DONE, {}, self.io_timeout)

    def _header(self, src: KVSource, hold: Hold, decision: Decision) -> dict[str, Any]:
        return {
            "layout": src.layout.to_dict(),
            "num_blocks": len(hold.block_ids),
            "num_tokens": hold.num_tokens,
            "chunk_blocks": max(1, self.chunk_bytes // src.layout.block_bytes),
            "transport": str(decision.chosen),
            "refused": {str(t): why for t, why in decision.refused.items()},
        }

    async def _send(
        self,
        src: KVSource,
        hold: Hold,
        transports: TransportSet,
        decision: Decision,
        offer: Offer | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        t0 = time.perf_counter()
        name = decision.chosen
        assert name is not None
        if name != TransportName.TCP:
            assert offer is not None
            why = await self._send_fast(src, hold, transports, decision, offer, reader, writer)
            if why is None:
                self._observe(src, hold, name, "ok", t0)
                return True
            if TransportName.TCP not in offer.accept:  # forced on the decode: it gave up
                count_transport(self.metrics, "sent", str(name), "failed")
                return False
            count_transport(self.metrics, "sent", str(name), "fallback")
            decision = Decision(TransportName.TCP, {**decision.refused, name: why})
        await self._send_tcp(src, hold, self._header(src, hold, decision), reader, writer)
        self._observe(src, hold, TransportName.TCP, "ok", t0)
        return True

    def _observe(
        self, src: KVSource, hold: Hold, name: TransportName, outcome: str, t0: float
    ) -> None:
        if self.metrics is None:
            return
        seconds = time.perf_counter() - t0
        n = len(hold.block_ids)
        self.metrics.observe("sent", n * src.layout.block_bytes, n, seconds)
        self.metrics.outcome("sent", "ok")
        count_transport(self.metrics, "sent", str(name), outcome, seconds)

    async def _send_fast(
        self,
        src: KVSource,
        hold: Hold,
        transports: TransportSet,
        decision: Decision,
        offer: Offer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> str | None:
        """None once the decode acknowledged the blocks; else why the fast path was given up
        (TCP follows if the decode accepts it)."""
        assert decision.chosen is not None
        transport = transports.get(decision.chosen)
        try:
            body = await transport.export(src.kv_cache, hold.block_ids, offer.peer)
        except TransportFailure as exc:
            logger.warning(
                "KV transport %s failed on the prefill side: %s", exc.transport, exc.cause
            )
            if TransportName.TCP not in offer.accept:
                await self._refuse(writer, wire.TRANSPORT_REFUSED, f"{exc}")
            return exc.cause  # TCP without a FALLBACK round trip: the OK will say tcp
        await wire.write_frame(writer, wire.OK, {**self._header(src, hold, decision), "offer": body},
                               self.io_timeout)  # fmt: skip
        sending = asyncio.ensure_future(transport.send(src.kv_cache, hold.block_ids, body))
        try:
            _, kind, answer = await wire.read_frame(reader, self.io_timeout)
            if kind == wire.ACK:
                try:
                    await asyncio.wait_for(asyncio.shield(sending), self.io_timeout)
                except TransportFailure as exc:
                    raise wire.WireError(f"ACK after a failed send: {exc}") from None
                return None
            if kind == wire.FALLBACK:
                why = str(answer.get("reason", "the decode gave it up"))[:300]
                logger.warning(
                    "KV transport %s refused by the decode side: %s", decision.chosen, why
                )
                return why
            raise wire.WireError(f"expected ACK or FALLBACK, got frame kind {kind}")
        finally:
            if not sending.done():  # never free the blocks while a send may still read them
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(sending), self.io_timeout)
            if not sending.done():
                sending.cancel()
            elif not sending.cancelled() and sending.exception() is not None:
                logger.warning(
                    "KV transport %s send failed: %s", decision.chosen, sending.exception()
                )

    async def _send_tcp(
        self,
        src: KVSource,
        hold: Hold,
        header: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        ids = hold.block_ids
        per_chunk = header["chunk_blocks"]
        header = {**header, "transport": str(TransportName.TCP)}
        await wire.write_frame(writer, wire.OK, header, self.io_timeout)
        loop = asyncio.get_running_loop()
        starts = list(range(0, len(ids), per_chunk))
        gather = lambda i: gather_blocks(src.kv_cache, ids[i : i + per_chunk])  # noqa: E731
        pending = loop.run_in_executor(self._executor, gather, starts[0]) if starts else None
        for n in range(len(starts)):
            assert pending is not None  # set before the loop and by every pass but the last
            data = await pending
            # The next chunk is gathered while this one drains.
            if n + 1 < len(starts):
                pending = loop.run_in_executor(self._executor, gather, starts[n + 1])
            writer.write(as_bytes(data))
            await asyncio.wait_for(writer.drain(), self.io_timeout)
        _, kind, _ = await wire.read_frame(reader, self.io_timeout)
        if kind != wire.ACK:
            raise wire.WireError(f"expected ACK, got frame kind {kind}")
