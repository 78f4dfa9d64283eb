"""KV transports (issue 32): negotiation, fallback to TCP, failures, holds and handle counters.

The control connection is a real loopback socket (atom.disagg.server / client); the fast path is
a fake transport that stands in for cuda-ipc: it "maps" the prefill's cache through an in-process
table and copies the held blocks, counting what it opened and closed. The real cuda-ipc path
runs only in the GPU-marked test at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from typing import Any

import pytest
import torch
from kv_fixtures import SHAPE, handle_for, kv_server, make_cache
from prometheus_client import CollectorRegistry

from atom.disagg import wire
from atom.disagg.client import KVTransferError, pull_kv, release_kv
from atom.disagg.cuda_ipc import CacheExport, PeerMappings
from atom.disagg.holds import KVHoldRegistry
from atom.disagg.kv_blocks import gather_blocks, layout_of_cache
from atom.disagg.layout import KVLayout
from atom.disagg.metrics import KVMetrics
from atom.disagg.negotiate import Offer, auto_nccl_reason, negotiate, same_host_gpu_reason
from atom.disagg.peer import PeerFacts
from atom.disagg.registry import TransportSet, TransportUnavailable
from atom.disagg.server import KVServer, KVSource
from atom.disagg.service import KVService
from atom.disagg.transport import (
    HandleCounters,
    ReceiveContext,
    TransportFailure,
    TransportMode,
    TransportName,
)
from atom.wire.errors import kv_status

IPC, NCCL, TCP = TransportName.CUDA_IPC, TransportName.NCCL, TransportName.TCP
GPUS = ("GPU-a", "GPU-b")
PREFILL = PeerFacts("host-1", 100, "GPU-a", GPUS)
DECODE = PeerFacts("host-1", 200, "GPU-b", GPUS)
ELSEWHERE = PeerFacts("host-2", 300, "GPU-c", ("GPU-c",))

_MAPPED: dict[str, torch.Tensor] = {}  # the fake's "IPC": export token -> the prefill's cache


class FakeIpc:
    """cuda-ipc's stand-in: same rules for who may use it, an in-process mapping for the bytes."""

    name = IPC

    def __init__(self, fail_receive: int = 0, fail_export: bool = False) -> None:
        self.counters = HandleCounters()  # decode: mappings opened / closed
        self.exported = 0
        self.received = 0
        self.fail_receive, self.fail_export = fail_receive, fail_export
        self._open: dict[str, torch.Tensor] = {}

    def why_unavailable(self, local: PeerFacts) -> str | None:
        return None if local.gpu_uuid else "the KV cache is not on a GPU"

    def why_unreachable(self, local: PeerFacts, peer: PeerFacts) -> str | None:
        return same_host_gpu_reason(self.name, local, peer)

    async def export(self, kv_cache: Any, block_ids: list[int], peer: PeerFacts) -> dict[str, Any]:
        if self.fail_export:
            raise TransportFailure(self.name, "sharing the KV cache failed: injected")
        token = f"cache-{id(kv_cache)}"
        _MAPPED[token] = kv_cache
        self.exported += 1
        return {"token": token, "block_ids": list(block_ids)}

    async def send(self, kv_cache: Any, block_ids: list[int], offer: dict[str, Any]) -> None:
        return None

    async def receive(self, offer: dict[str, Any], ctx: ReceiveContext) -> Any:
        self.received += 1
        token = offer["token"]
        if token not in self._open:
            self._open[token] = _MAPPED[token]
            self.counters.opened += 1
        if self.fail_receive:
            self.fail_receive -= 1
            self._close(token)  # as cuda_ipc does: a broken mapping is not reused
            raise TransportFailure(self.name, "cudaIpcOpenMemHandle: invalid device context")
        return gather_blocks(self._open[token], offer["block_ids"])

    def _close(self, token: str) -> None:
        if self._open.pop(token, None) is not None:
            self.counters.closed += 1

    def close(self) -> None:
        for token in list(self._open):
            self._close(token)


class Metrics:
    """Records what KVMetrics would (observe / outcome / transport_outcome)."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, str]] = []
        self.by_transport: list[tuple[str, str, str]] = []

    def observe(self, direction: str, nbytes: int, nblocks: int, seconds: float) -> None:
        pass

    def outcome(self, direction: str, outcome: str) -> None:
        self.outcomes.append((direction, outcome))

    def transport_outcome(
        self, direction: str, transport: str, outcome: str, seconds: float | None = None
    ) -> None:
        self.by_transport.append((direction, transport, outcome))


def transports(mode: str, facts: PeerFacts, fake: FakeIpc | None = None) -> TransportSet:
    return TransportSet(TransportMode.parse(mode), facts, {IPC: fake} if fake else {})


# ---- negotiation (pure) --------------------------------------------------------------------------
def reachable(allowed: dict[TransportName, str | None]):
    return lambda t, peer: allowed.get(t, "not built here")


def test_auto_picks_the_fastest_transport_both_sides_can_use() -> None:
    auto = TransportMode.parse("auto")
    every = reachable({IPC: None, NCCL: None, TCP: None})
    assert negotiate(auto, Offer((IPC, NCCL, TCP), DECODE), every).chosen == IPC
    assert negotiate(auto, Offer((NCCL, TCP), DECODE), every).chosen == NCCL
    # the fastest is refused for this peer: the next one, with the reason kept for the report
    d = negotiate(auto, Offer((IPC, NCCL, TCP), DECODE), reachable({IPC: "cannot see GPU-a",
                                                                   NCCL: None, TCP: None}))  # fmt: skip
    assert (d.chosen, d.refused) == (NCCL, {IPC: "cannot see GPU-a"})
    # a handshake-1 decode offers nothing: TCP
    assert negotiate(auto, None, every).chosen == TCP


def test_forced_transport_is_the_only_one_and_a_refusal_names_why() -> None:
    every = reachable({IPC: None, NCCL: None, TCP: None})
    tcp_only = TransportMode.parse("tcp")
    d = negotiate(tcp_only, Offer((IPC, TCP), DECODE), every)
    assert d.chosen == TCP and "runs --kv-transport tcp" in d.refused[IPC]
    forced = TransportMode.parse("cuda-ipc")
    d = negotiate(forced, Offer((NCCL, TCP), DECODE), every)
    assert d.chosen is None and "does not offer it" in d.refused[IPC]
    d = negotiate(forced, None, every)
    assert d.chosen is None and "predates KV transports" in d.reason
    with pytest.raises(ValueError, match="not one of auto, cuda-ipc, nccl, tcp"):
        TransportMode.parse("rdma")


def test_same_host_rules_for_the_gpu_transports() -> None:
    assert same_host_gpu_reason(IPC, PREFILL, DECODE) is None
    assert same_host_gpu_reason(NCCL, PREFILL, DECODE) is None
    assert "different hosts" in same_host_gpu_reason(IPC, PREFILL, ELSEWHERE)
    hidden = PeerFacts("host-1", 200, "GPU-b", ("GPU-b",))  # its container sees one GPU
    assert "cannot see GPU GPU-a" in same_host_gpu_reason(IPC, PREFILL, hidden)
    assert same_host_gpu_reason(NCCL, PREFILL, hidden) is None  # NCCL needs no mapping
    one_gpu = PeerFacts("host-1", 200, "GPU-a", GPUS)
    assert "one GPU" in same_host_gpu_reason(NCCL, PREFILL, one_gpu)
    assert same_host_gpu_reason(IPC, PREFILL, one_gpu) is None
    assert "one process" in same_host_gpu_reason(IPC, PREFILL, PREFILL)
    cpu = PeerFacts("host-1", 200)
    assert "not on a GPU" in same_host_gpu_reason(IPC, PREFILL, cpu)
    # pods of one node: the same pid in two pid namespaces is two processes (instance ids)
    pod_a = PeerFacts("host-1", 7, "GPU-a", GPUS, instance="a1")
    pod_b = PeerFacts("host-1", 7, "GPU-b", GPUS, instance="b2")
    assert same_host_gpu_reason(IPC, pod_a, pod_b) is None
    assert "one process" in same_host_gpu_reason(IPC, pod_a, pod_a)


class FakeNcclReach:
    """nccl's negotiation rules only (no bytes move in these tests)."""

    name = NCCL

    def why_unavailable(self, local: PeerFacts) -> str | None:
        return None

    def why_unreachable(self, local: PeerFacts, peer: PeerFacts) -> str | None:
        return same_host_gpu_reason(self.name, local, peer)


def test_auto_takes_nccl_only_where_it_can_go_gpu_to_gpu() -> None:
    # one GPU per pod: under auto nccl would take its socket path, so tcp is chosen
    hidden = PeerFacts("host-1", 200, "GPU-b", ("GPU-b",))
    assert "socket path" in auto_nccl_reason(NCCL, PREFILL, hidden)
    assert auto_nccl_reason(NCCL, PREFILL, DECODE) is None  # the decode sees GPU-a
    assert auto_nccl_reason(IPC, PREFILL, hidden) is None  # a rule for nccl alone
    local = TransportSet(TransportMode.parse("auto"), PREFILL, {NCCL: FakeNcclReach()})
    d = local.decide(Offer((NCCL, TCP), hidden))
    assert d.chosen == TCP and "socket path" in d.refused[NCCL]
    forced = TransportSet(TransportMode.parse("nccl"), PREFILL, {NCCL: FakeNcclReach()})
    assert forced.decide(Offer((NCCL,), hidden)).chosen == NCCL  # the user knows the node


def test_offer_round_trip_and_malformed_offers() -> None:
    offer = Offer((IPC, TCP), DECODE)
    assert Offer.from_body({"transport": offer.to_dict()}) == offer
    assert Offer.from_body({}) is None  # handshake 1
    newer = offer.to_dict() | {"accept": ["rdma", "tcp"], "handshake": 3}
    assert Offer.from_body({"transport": newer}).accept == (TCP,)  # unknown names skipped
    with pytest.raises(ValueError, match="handshake"):
        Offer.from_body({"transport": offer.to_dict() | {"handshake": 1}})
    with pytest.raises(ValueError, match="peer.pid"):
        Offer.from_body({"transport": offer.to_dict() | {"peer": {"host_id": "h", "pid": "1"}}})


def test_a_forced_transport_this_instance_cannot_use_fails_at_start() -> None:
    cpu = PeerFacts("host-1", 1)
    transports("tcp", cpu).check_start()
    transports("auto", cpu).check_start()
    assert transports("auto", cpu).offer().accept == (TCP,)
    with pytest.raises(TransportUnavailable, match="cuda-ipc cannot be used here: not built"):
        transports("cuda-ipc", cpu).check_start()
    with pytest.raises(TransportUnavailable, match="nccl cannot be used here"):
        transports("nccl", cpu, FakeIpc()).check_start()
    # the KV service refuses the same way, before its engine is attached
    engine = types.SimpleNamespace(
        kv_holds=KVHoldRegistry(30.0), runner=types.SimpleNamespace(kv_cache=torch.zeros(SHAPE))
    )
    with pytest.raises(TransportUnavailable, match="--kv-transport cuda-ipc"):
        KVService(transport="cuda-ipc").attach(engine)
    with pytest.raises(ValueError, match="not one of"):
        KVService(transport="rdma")
    # a pull under that mode is refused before it dials (port 1 has nobody listening)
    layout = KVLayout("id", "m", "float32", 4, 3, 2, 8)
    with pytest.raises(KVTransferError, match="cuda-ipc is not usable on this decode") as err:
        asyncio.run(pull_kv(handle_for("h", layout, 1, 4), layout,
                            transports=transports("cuda-ipc", cpu)))  # fmt: skip
    assert err.value.code == "kv_transfer_failed" and "not built" in err.value.message


def test_launcher_renders_the_flag_into_the_kv_service() -> None:
    from atom.cli.args import build_parser
    from atom.entrypoints.launcher import kv_settings

    serve = ["serve", "--model", "tiny-llama"]
    args = build_parser().parse_args([*serve, "--role", "prefill", "--kv-transport", "nccl"])
    settings = kv_settings(args)
    assert settings.transport == "nccl"
    assert settings.service().mode == TransportMode(NCCL)
    default = kv_settings(build_parser().parse_args(serve))
    assert default.service().mode.auto


def export_named(handle: str) -> CacheExport:
    return CacheExport("GPU-a", handle, 1 << 20, 0, None, 0, None, False, SHAPE, (1,) * 6, 0,
                       "float32")  # fmt: skip


def test_cuda_ipc_opens_each_export_once_and_closes_every_mapping() -> None:
    """The real transport's bookkeeping (the CUDA open is the injected `opener`)."""
    opened: list[str] = []
    maps = PeerMappings(lambda e: opened.append(e.key) or torch.zeros(1), max_peers=2)
    a1, a2, b, c = (export_named(h) for h in ("a1", "a2", "b", "c"))
    first = maps.get("10.0.0.1:8001", a1)
    assert maps.get("10.0.0.1:8001", a1) is first  # reused for that peer's later pulls
    maps.get("10.0.0.1:8001", a2)  # the prefill at that address restarted: a1 is closed
    assert (maps.counters.opened, maps.counters.closed) == (2, 1)
    maps.get("10.0.0.2:8001", b)
    maps.get("10.0.0.3:8001", c)  # past max_peers: the least recently used (a2) goes
    assert (maps.counters.opened, maps.counters.closed) == (4, 2)
    maps.drop(b.key)  # a copy from it failed
    maps.get("10.0.0.2:8001", b)  # opened anew
    assert opened == [a1.key, a2.key, b.key, c.key, b.key]
    maps.close()
    assert maps.counters.open == 0 and maps.counters.opened == 5
    assert CacheExport.from_dict(a1.to_dict()) == a1
    with pytest.raises(ValueError, match="malformed"):
        CacheExport.from_dict({"handle": "x"})


# ---- transfers over the control connection ---------------------------------------------------------
def test_fast_path_moves_the_blocks_frees_the_hold_and_closes_its_handles() -> None:
    cache = make_cache(1)
    layout = layout_of_cache(cache, "id", "m")
    holds = KVHoldRegistry(30.0)
    holds.hold("h", [6, 2, 4], 10)
    holds.hold("h2", [1], 3)
    served, pulling = FakeIpc(), FakeIpc()
    decode = transports("auto", DECODE, pulling)
    registry = CollectorRegistry()
    metrics = KVMetrics(registry)
    metrics.watch_handles(lambda: {"cuda-ipc": pulling.counters})

    async def main() -> None:
        async with kv_server(cache, holds, layout, transports("auto", PREFILL, served)) as srv:
            pulled = await pull_kv(handle_for("h", layout, srv.port, 10), layout,
                                   transports=decode, metrics=metrics)  # fmt: skip
            assert pulled.report.transport == IPC and pulled.report.fallback_from is None
            assert torch.equal(pulled.blocks, gather_blocks(cache, [6, 2, 4]))
            # a second pull from the same prefill reuses the mapping
            again = await pull_kv(handle_for("h2", layout, srv.port, 3), layout, transports=decode)
            assert torch.equal(again.blocks, gather_blocks(cache, [1]))

    asyncio.run(main())
    assert sorted(holds.reclaim()) == [1, 2, 4, 6] and holds.num_holds == 0
    assert (served.exported, pulling.received) == (2, 2)
    assert (pulling.counters.opened, pulling.counters.closed) == (1, 0)
    handles_open = {"transport": "cuda-ipc"}
    assert registry.get_sample_value("atom_kv_transport_handles_open", handles_open) == 1
    decode.close()
    assert pulling.counters.open == 0 and pulling.counters.opened == 1
    assert registry.get_sample_value("atom_kv_transport_handles_open", handles_open) == 0
    ok = {"direction": "received", "transport": "cuda-ipc", "outcome": "ok"}
    assert registry.get_sample_value("atom_kv_transport_transfers_total", ok) == 1


def test_fast_path_that_fails_falls_back_to_tcp_on_the_same_connection() -> None:
    cache = make_cache(2)
    layout = layout_of_cache(cache, "id", "m")
    holds = KVHoldRegistry(30.0)
    holds.hold("h", [3, 4], 8)
    pulling = FakeIpc(fail_receive=1)
    sent, received = Metrics(), Metrics()

    async def main() -> None:
        ts = transports("auto", PREFILL, FakeIpc())
        async with kv_server(cache, holds, layout, ts, metrics=sent) as srv:
            pulled = await pull_kv(handle_for("h", layout, srv.port, 8), layout, metrics=received,
                                   transports=transports("auto", DECODE, pulling))  # fmt: skip
            assert pulled.attempts == 1  # one connection: FALLBACK, then the bytes over TCP
            assert pulled.report.transport == TCP and pulled.report.fallback_from == IPC
            assert "invalid device context" in pulled.report.fallback_reason
            assert "fallback from cuda-ipc" in pulled.report.describe()
            assert torch.equal(pulled.blocks, gather_blocks(cache, [3, 4]))

    asyncio.run(main())
    assert sorted(holds.reclaim()) == [3, 4]
    assert pulling.counters.open == 0  # the broken mapping was closed at once
    assert ("received", "cuda-ipc", "fallback") in received.by_transport
    assert ("received", "tcp", "ok") in received.by_transport
    assert sent.by_transport == [("sent", "cuda-ipc", "fallback"), ("sent", "tcp", "ok")]


@pytest.mark.parametrize(
    ("prefill_ipc", "decode_facts", "why"),
    [
        (FakeIpc, ELSEWHERE, "different hosts"),  # refused in the handshake
        (lambda: FakeIpc(fail_export=True), DECODE, "sharing the KV cache failed"),
        (None, DECODE, "not built on this instance"),  # a CPU prefill
    ],
)
def test_refused_fast_path_is_recorded_and_tcp_carries_the_blocks(
    prefill_ipc: Any, decode_facts: PeerFacts, why: str
) -> None:
    cache = make_cache(3)
    layout = layout_of_cache(cache, "id", "m")
    holds = KVHoldRegistry(30.0)
    holds.hold("h", [5], 4)
    pulling = FakeIpc()

    async def main() -> None:
        ts = transports("auto", PREFILL, prefill_ipc() if prefill_ipc else None)
        async with kv_server(cache, holds, layout, ts) as srv:
            pulled = await pull_kv(handle_for("h", layout, srv.port, 4), layout,
                                   transports=transports("auto", decode_facts, pulling))  # fmt: skip
            assert pulled.report.transport == TCP and pulled.report.fallback_from == IPC
            assert why in pulled.report.fallback_reason
            assert torch.equal(pulled.blocks, gather_blocks(cache, [5]))

    asyncio.run(main())
    assert pulling.received == 0 and holds.reclaim() == [5]


def test_forced_fast_path_that_breaks_is_retried_once_then_fails_naming_it() -> None:
    cache = make_cache(4)
    layout = layout_of_cache(cache, "id", "m")
    clock = [100.0]
    holds = KVHoldRegistry(30.0, clock=lambda: clock[0])
    holds.hold("h", [1, 2], 8)
    pulling = FakeIpc(fail_receive=2)
    received = Metrics()

    async def main() -> None:
        ts = transports("auto", PREFILL, FakeIpc())
        async with kv_server(cache, holds, layout, ts) as srv:
            with pytest.raises(KVTransferError) as err:
                await pull_kv(handle_for("h", layout, srv.port, 8), layout, metrics=received,
                              transports=transports("cuda-ipc", DECODE, pulling))  # fmt: skip
        assert err.value.code == "kv_transfer_failed" and kv_status(err.value.code) == 503
        assert "failed after 2 attempt(s) over cuda-ipc" in err.value.message
        assert "invalid device context" in err.value.message

    asyncio.run(main())
    assert pulling.received == 2 and pulling.counters.open == 0
    assert [o for _, o in received.outcomes] == ["retried", "failed"]
    assert ("received", "cuda-ipc", "failed") in received.by_transport
    # the hold stayed for the retry; nobody pulled it: the deadline frees it
    assert holds.num_holds == 1 and holds.reclaim() == []
    clock[0] += 31
    assert sorted(holds.reclaim()) == [1, 2] and holds.stats.expired == 1


def test_forced_fast_path_the_prefill_cannot_serve_is_refused_before_any_copy() -> None:
    cache = make_cache(5)
    layout = layout_of_cache(cache, "id", "m")
    holds = KVHoldRegistry(30.0)
    holds.hold("h", [7], 4)
    served, pulling = FakeIpc(), FakeIpc()

    async def main() -> None:
        async with kv_server(cache, holds, layout, transports("auto", PREFILL, served)) as srv:
            with pytest.raises(KVTransferError) as err:
                await pull_kv(handle_for("h", layout, srv.port, 4), layout,
                              transports=transports("cuda-ipc", ELSEWHERE, pulling))  # fmt: skip
            assert err.value.code == "kv_transfer_failed" and not err.value.retryable
            assert "refused KV transport(s) cuda-ipc" in err.value.message
            assert "different hosts" in err.value.message
            # the hold is untouched: a release still frees it
            assert await release_kv(handle_for("h", layout, srv.port, 4), layout)

    asyncio.run(main())
    assert (served.exported, pulling.received) == (0, 0)
    assert holds.reclaim() == [7]


def test_identity_mismatch_is_refused_before_the_fast_path_is_touched() -> None:
    cache = make_cache(6)
    mine = layout_of_cache(cache, "id-prefill", "tiny-qwen3")
    theirs = KVLayout(**{**mine.to_dict(), "identity": "id-decode", "model": "tiny-llama"})
    holds = KVHoldRegistry(30.0)
    holds.hold("h", [1], 4)
    served, pulling = FakeIpc(), FakeIpc()

    async def main() -> None:
        async with kv_server(cache, holds, mine, transports("auto", PREFILL, served)) as srv:
            with pytest.raises(KVTransferError) as err:
                await pull_kv(handle_for("h", theirs, srv.port, 4), theirs,
                              transports=transports("auto", DECODE, pulling))  # fmt: skip
            assert err.value.code == "kv_mismatch" and "model identity differs" in err.value.message

    asyncio.run(main())
    assert (served.exported, pulling.received, pulling.counters.opened) == (0, 0, 0)
    assert holds.num_holds == 1 and holds.begin_pull("h") is not None


def test_a_handshake_1_prefill_gets_tcp_and_a_forced_decode_refuses_it() -> None:
    """A prefill of before transports: ignores the offer, answers a plain OK and the bytes."""
    layout = KVLayout("id", "m", "float32", 4, 3, 2, 8)
    payload = torch.arange(layout.block_bytes // 4, dtype=torch.float32)

    async def old_prefill(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await wire.read_frame(r, 5.0)
        head = {"layout": layout.to_dict(), "num_blocks": 1, "num_tokens": 4, "chunk_blocks": 1}
        w.write(wire.encode_frame(wire.OK, head) + payload.numpy().tobytes())
        await w.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await wire.read_frame(r, 5.0)  # ACK
            w.write(wire.encode_frame(wire.DONE, {}))
        w.close()

    async def main() -> None:
        srv = await asyncio.start_server(old_prefill, "127.0.0.1", 0)
        h = handle_for("h", layout, srv.sockets[0].getsockname()[1], 4)
        pulled = await pull_kv(h, layout, transports=transports("auto", DECODE, FakeIpc()))
        assert pulled.report.transport == TCP and "predates" in pulled.report.fallback_reason
        assert torch.equal(pulled.blocks.reshape(-1), payload)
        with pytest.raises(KVTransferError, match="predates KV transports") as err:
            await pull_kv(h, layout, transports=transports("cuda-ipc", DECODE, FakeIpc()))
        assert err.value.code == "kv_transfer_failed"
        srv.close()

    asyncio.run(main())


# ---- GPU -----------------------------------------------------------------------------------------
def _gpu_prefill(conn: Any) -> None:
    """Child process: a CUDA cache behind a KV server with the real transports."""
    from atom.disagg.registry import build_transports

    async def serve() -> None:
        cache = make_cache(7).cuda()
        layout = layout_of_cache(cache, "id", "m")
        holds = KVHoldRegistry(30.0)
        holds.hold("h", [2, 3, 5], 12)
        ts = build_transports(TransportMode.parse("cuda-ipc"), cache, "127.0.0.1")
        server = KVServer(lambda: KVSource(layout, holds, cache, transports=ts))
        conn.send(await server.start("127.0.0.1", 0))
        conn.recv()  # the parent pulled
        conn.send((holds.reclaim(), gather_blocks(cache, [2, 3, 5])))
        await server.close()
        ts.close()

    asyncio.run(serve())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuda-ipc between processes)")
def test_cuda_ipc_between_two_processes() -> None:
    import multiprocessing

    from atom.disagg.registry import build_transports

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_prefill, args=(child,))
    proc.start()
    try:
        port = parent.recv()
        local = torch.zeros(SHAPE, device="cuda")
        layout = layout_of_cache(local, "id", "m")
        ts = build_transports(TransportMode.parse("cuda-ipc"), local, "127.0.0.1")
        pulled = asyncio.run(pull_kv(handle_for("h", layout, port, 12), layout, transports=ts))
        assert pulled.report.transport == IPC and pulled.blocks.is_cuda
        parent.send("done")
        freed, expected = parent.recv()
        assert sorted(freed) == [2, 3, 5] and torch.equal(pulled.blocks.cpu(), expected)
        ts.close()
        ipc = ts.get(IPC)
        assert ipc.counters.opened == 1 and ipc.counters.open == 0
    finally:
        proc.join(30)
        assert proc.exitcode == 0, f"the prefill process exited with {proc.exitcode}"
