"""KV transfer in one process: layout checks, the wire, holds, retries, and two engines.

The KV server and the puller talk over real loopback sockets; a byte-counting proxy in between
breaks transfers on purpose. test_disagg.py runs the same through real server processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator

import msgspec
import pytest
import torch
from kv_fixtures import SHAPE, handle_for, kv_server, make_cache
from tiny import tiny_engine

from atom.disagg import wire
from atom.disagg.client import KVTransferError, pull_kv, release_kv
from atom.disagg.handle import KVHandle
from atom.disagg.holds import KVHoldRegistry
from atom.disagg.kv_blocks import engine_layout, gather_blocks, layout_of_cache, scatter_blocks
from atom.disagg.layout import KVLayout, model_identity
from atom.disagg.server import KVServer, KVSource
from atom.engine import LLMEngine, SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingMetrics:
    def __init__(self) -> None:
        self.observed: list[tuple[str, int, int]] = []
        self.outcomes: list[tuple[str, str]] = []

    def observe(self, direction: str, nbytes: int, nblocks: int, seconds: float) -> None:
        self.observed.append((direction, nbytes, nblocks))

    def outcome(self, direction: str, outcome: str) -> None:
        self.outcomes.append((direction, outcome))


@contextlib.asynccontextmanager
async def cutting_proxy(port: int, cut_after: list[int]) -> AsyncIterator[int]:
    """Forwards to 127.0.0.1:port; connection i is cut after cut_after[i] bytes from the server
    (-1: never). Stands in for a transfer that breaks mid-way."""
    conns = iter(cut_after)

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, limit: int) -> None:
        sent = 0
        while data := await r.read(65536):
            if limit >= 0 and sent + len(data) > limit:
                w.write(data[: limit - sent])
                w.transport.abort()
                return
            sent += len(data)
            w.write(data)
            await w.drain()
        w.close()

    async def serve(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        limit = next(conns, -1)
        sr, sw = await asyncio.open_connection("127.0.0.1", port)
        up = asyncio.ensure_future(pipe(cr, sw, -1))
        await pipe(sr, cw, limit)
        up.cancel()
        sw.transport.abort()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


# ---- layout, identity, handle --------------------------------------------------------------------
def test_layout_mismatch_names_what_differs() -> None:
    a = KVLayout("id-a", "tiny-llama", "bfloat16", 16, 16, 8, 64)
    assert a.block_bytes == 2 * 16 * 16 * 8 * 64 * 2
    assert a.mismatch(a) == ""
    other = KVLayout("id-b", "tiny-qwen3", "bfloat16", 16, 16, 8, 64)
    why = a.mismatch(other, mine="decode", theirs="prefill")
    assert "model identity differs" in why and "'tiny-qwen3'" in why and "id-b" in why
    assert "dtype differs: prefill has float16, decode has bfloat16" in a.mismatch(
        KVLayout("id-a", "tiny-llama", "float16", 16, 16, 8, 64), mine="decode", theirs="prefill"
    )
    assert "block_size" in a.mismatch(KVLayout("id-a", "m", "bfloat16", 32, 16, 8, 64))
    assert KVLayout.from_dict(a.to_dict()) == a
    with pytest.raises(ValueError, match="layout.num_layers"):
        KVLayout.from_dict({**a.to_dict(), "num_layers": "16"})


def test_model_identity_covers_weights_and_shape() -> None:
    shape = {"num_hidden_layers": 2, "hidden_size": 64, "name": "x", "path": None}
    base = model_identity("tiny-llama", "dummy", 0, shape)
    assert base == model_identity("tiny-llama", "auto", 0, {**shape, "name": "y"})
    assert base != model_identity("tiny-llama", "dummy", 1, shape)  # other random weights
    assert base != model_identity("tiny-llama", "dummy", 0, {**shape, "hidden_size": 128})
    real = {**shape, "path": "/m"}
    assert model_identity("/m", "auto", 0, real) == model_identity("/m", "safetensors", 5, real)


def test_handle_round_trip_and_validation() -> None:
    layout = KVLayout("id", "m", "float32", 4, 3, 2, 8)
    h = handle_for("h1", layout, 8001, tokens=6)
    assert KVHandle.from_dict(h.to_dict()) == h
    with pytest.raises(ValueError, match="kv_transfer.kv_port"):
        KVHandle.from_dict({**h.to_dict(), "kv_port": 70000})
    with pytest.raises(ValueError, match="version 2 is not supported"):
        KVHandle.from_dict({**h.to_dict(), "version": 2})
    with pytest.raises(ValueError, match="prompt_token_ids"):
        KVHandle.from_dict({**h.to_dict(), "prompt_token_ids": []})
    # the first token's alternatives (issue 45): through JSON, as the router relays them
    h.first_top_logprobs = [(7, -0.5), (3, -1.25)]
    assert KVHandle.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    for bad in ([[7]], [["7", -0.5]], [[7, -0.5]] * 21):
        with pytest.raises(ValueError, match="kv_transfer.first_top_logprobs"):
            KVHandle.from_dict({**h.to_dict(), "first_top_logprobs": bad})


# ---- holds ---------------------------------------------------------------------------------------
def test_holds_expire_but_never_during_a_pull() -> None:
    clock = Clock()
    reg = KVHoldRegistry(5.0, clock=clock)
    assert reg.hold("a", [1, 2], 20) and reg.hold("b", [3], 4) and not reg.hold("a", [9], 1)
    assert reg.num_blocks_held == 3 and reg.reclaim() == []
    assert reg.begin_pull("a") is not None
    clock.now += 10  # both past their deadline; "a" is being read
    assert reg.reclaim() == [3] and reg.stats.expired == 1
    reg.end_pull("a", pulled=False)  # broken: the hold stays for the retry...
    assert reg.begin_pull("a") is None  # ...but not past its deadline
    assert reg.reclaim() == [1, 2] and reg.num_blocks_held == 0 and reg.num_holds == 0


def test_holds_free_after_pull_or_release() -> None:
    reg = KVHoldRegistry(5.0, clock=Clock())
    reg.hold("a", [1], 3)
    reg.hold("b", [2], 3)
    assert reg.begin_pull("a") is not None
    reg.end_pull("a", pulled=True)
    assert reg.begin_pull("a") is None and "already pulled" in reg.describe("a")
    # two pulls of one handle (a retry racing a slow first attempt): freed after the last
    reg.hold("c", [3], 3)
    assert reg.begin_pull("c") is not None and reg.begin_pull("c") is not None
    reg.end_pull("c", pulled=True)
    assert reg.reclaim() == [1]
    reg.end_pull("c", pulled=False)
    assert reg.reclaim() == [3]
    assert reg.release("b") and not reg.release("b") and not reg.release("zzz")
    assert reg.reclaim() == [2]
    assert (reg.stats.pulled, reg.stats.released, reg.stats.expired) == (2, 1, 0)


def test_gather_scatter_round_trip() -> None:
    src, dst = make_cache(0), torch.zeros(SHAPE)
    blocks = gather_blocks(src, [5, 1, 7])
    assert blocks.shape == (3, 2, 3, 4, 2, 8) and blocks.is_contiguous()
    scatter_blocks(dst, [0, 2, 3], blocks)
    for d, s in ((0, 5), (2, 1), (3, 7)):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert dst[:, :, 1].abs().sum() == 0
    with pytest.raises(ValueError, match="do not fit"):
        scatter_blocks(dst, [0, 1], blocks)


# ---- the wire ------------------------------------------------------------------------------------
def test_pull_copies_blocks_then_frees_the_hold() -> None:
    cache = make_cache(1)
    layout = layout_of_cache(cache, "id-1", "m")
    holds = KVHoldRegistry(30.0)
    holds.hold("h", [6, 2, 4], 10)  # 10 tokens, block_size 4: 3 blocks
    sent, received = CountingMetrics(), CountingMetrics()

    async def main() -> None:
        # chunks of one block: the header, three chunks, ACK and DONE all cross the socket
        async with kv_server(cache, holds, layout, metrics=sent, chunk_bytes=1) as srv:
            h = handle_for("h", layout, srv.port, tokens=10)
            pulled = await pull_kv(h, layout, metrics=received)
            assert pulled.attempts == 1 and pulled.num_tokens == 10
            assert torch.equal(pulled.blocks, gather_blocks(cache, [6, 2, 4]))
            with pytest.raises(KVTransferError, match="unknown: already pulled") as err:
                await pull_kv(h, layout)
            assert err.value.code == "kv_unknown_handle" and not err.value.retryable

    asyncio.run(main())
    assert sorted(holds.reclaim()) == [2, 4, 6] and holds.num_holds == 0
    block_bytes = layout.block_bytes
    assert sent.observed == [("sent", 3 * block_bytes, 3)]
    assert received.observed == [("received", 3 * block_bytes, 3)]
    assert ("sent", "refused") in sent.outcomes


def test_other_model_is_refused_before_any_block_moves() -> None:
    cache = make_cache(2)
    mine = layout_of_cache(cache, "id-prefill", "tiny-qwen3")
    theirs = KVLayout(**{**mine.to_dict(), "identity": "id-decode", "model": "tiny-llama"})
    holds = KVHoldRegistry(30.0)
    holds.hold("h", [1], 4)

    async def main() -> None:
        async with kv_server(cache, holds, mine) as srv:
            h = handle_for("h", theirs, srv.port, tokens=4)
            with pytest.raises(KVTransferError) as err:
                await pull_kv(h, theirs)
            assert err.value.code == "kv_mismatch"
            assert "model identity differs" in err.value.message
            assert "'tiny-qwen3'" in err.value.message and "'tiny-llama'" in err.value.message
            # same identity, other cache shape: refused as well, naming the field
            other = KVLayout(**{**mine.to_dict(), "head_dim": 16})
            with pytest.raises(KVTransferError, match="head_dim differs"):
                await pull_kv(handle_for("h", other, srv.port, 4), other)

    asyncio.run(main())
    assert holds.num_holds == 1 and holds.begin_pull("h") is not None  # nothing was taken


def test_decode_checks_the_offered_layout_too() -> None:
    """A prefill that skips its own check (a bug, another version) is caught by the decode,
    from the OK header, before any block is read."""
    layout = KVLayout("id", "m", "float32", 4, 3, 2, 8)
    other = KVLayout(**{**layout.to_dict(), "num_layers": 4})
    sent_blocks = []

    async def careless(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await wire.read_frame(r, 5.0)
        head = {"layout": other.to_dict(), "num_blocks": 1, "num_tokens": 4, "chunk_blocks": 1}
        w.write(wire.encode_frame(wire.OK, head) + b"\0" * other.block_bytes)
        sent_blocks.append(1)
        await w.drain()
        w.close()

    async def main() -> None:
        srv = await asyncio.start_server(careless, "127.0.0.1", 0)
        h = handle_for("h", layout, srv.sockets[0].getsockname()[1], 4)
        with pytest.raises(KVTransferError, match="num_layers differs") as err:
            await pull_kv(h, layout)
        assert err.value.code == "kv_mismatch" and sent_blocks == [1]
        srv.close()

    asyncio.run(main())


def test_version_mismatch_is_named_by_both_sides() -> None:
    cache = make_cache(3)
    layout = layout_of_cache(cache, "id", "m")

    async def main() -> None:
        async with kv_server(cache, KVHoldRegistry(30.0), layout) as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(wire.encode_frame(wire.PULL, {"handle": "h"}, version=2))
            version, kind, body = await wire.read_frame(reader, 5.0)
            writer.close()
            assert (version, kind) == (wire.WIRE_VERSION, wire.BAD_VERSION)
            assert "version 2 is not supported" in body["message"]

        async def future_server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await wire.read_frame(r, 5.0)
            w.write(wire.encode_frame(wire.OK, {}, version=9))
            await w.drain()
            w.close()

        srv9 = await asyncio.start_server(future_server, "127.0.0.1", 0)
        h = handle_for("h", layout, srv9.sockets[0].getsockname()[1], 4)
        with pytest.raises(KVTransferError, match="speaks KV wire version 9") as err:
            await pull_kv(h, layout)
        assert err.value.code == "kv_version_mismatch"
        srv9.close()

        bad = struct.pack("!4sHHI", b"HTTP", 1, 0, 0)
        srvx = await asyncio.start_server(lambda r, w: (w.write(bad), w.close()), "127.0.0.1", 0)
        h = handle_for("h", layout, srvx.sockets[0].getsockname()[1], 4)
        with pytest.raises(KVTransferError, match="not an ATOM KV peer"):
            await pull_kv(h, layout)
        srvx.close()

    asyncio.run(main())


def test_broken_transfer_is_retried_once_then_fails_clearly() -> None:
    cache = make_cache(4)
    layout = layout_of_cache(cache, "id", "m")
    holds = KVHoldRegistry(30.0)
    holds.hold("ok", [1, 2], 8)
    holds.hold("never", [3], 4)
    metrics = CountingMetrics()

    async def main() -> None:
        async with kv_server(cache, holds, layout, chunk_bytes=layout.block_bytes) as srv:
            # first connection cut after the header and part of the first block; the retry works
            async with cutting_proxy(srv.port, [1000]) as port:
                pulled = await pull_kv(handle_for("ok", layout, port, 8), layout, metrics=metrics)
            assert pulled.attempts == 2
            assert torch.equal(pulled.blocks, gather_blocks(cache, [1, 2]))
            # cut every time: fails after two attempts, with the cause; the hold stays
            async with cutting_proxy(srv.port, [1000, 1000]) as port:
                with pytest.raises(KVTransferError) as err:
                    await pull_kv(handle_for("never", layout, port, 4), layout, metrics=metrics)
            assert "failed after 2 attempt(s)" in err.value.message
            assert f"KV transfer from 127.0.0.1:{port} failed" in err.value.message
            # nobody listening: refused twice, quickly
            dead = handle_for("never", layout, port, 4)
            with pytest.raises(KVTransferError, match="after 2 attempt"):
                await pull_kv(dead, layout, io_timeout=2.0)
            assert await release_kv(handle_for("never", layout, srv.port, 4), layout)

    asyncio.run(main())
    assert [o for _, o in metrics.outcomes] == ["retried", "ok", "retried", "failed"]
    assert sorted(holds.reclaim()) == [1, 2, 3] and holds.num_holds == 0


def test_silent_prefill_times_out_within_the_bound() -> None:
    layout = KVLayout("id", "m", "float32", 4, 3, 2, 8)

    async def main() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)

        srv = await asyncio.start_server(silent, "127.0.0.1", 0)
        h = handle_for("h", layout, srv.sockets[0].getsockname()[1], 4)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(KVTransferError, match="timed out"):
            await pull_kv(h, layout, timeout=0.3, io_timeout=5.0)
        assert loop.time() - t0 < 2.0  # two attempts of 0.3 s
        srv.close()

    asyncio.run(main())


# ---- two engines -------------------------------------------------------------------------------
def _engine(**kw: object) -> LLMEngine:
    return tiny_engine(warmup=False, **{"max_model_len": 256, **kw})


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_prefill_engine_to_decode_engine_matches_unified() -> None:
    prefill, decode, unified = _engine(), _engine(), _engine()
    assert engine_layout(prefill) == engine_layout(decode)
    assert engine_layout(prefill) != engine_layout(_engine(seed=1))  # other weights
    prompts = [[1, *range(5, 5 + n)] for n in (3, 15, 16, 40, 90)]  # around block edges
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    want = unified.generate(prompts, greedy) + unified.generate(prompts[:2], seeded)
    free = (prefill.block_manager.num_free_blocks, decode.block_manager.num_free_blocks)
    layout = engine_layout(decode)
    cases = [(p, greedy) for p in prompts] + [(p, seeded) for p in prompts[:2]]

    async def main() -> list[list[int]]:
        src = KVSource(engine_layout(prefill), prefill.kv_holds, prefill.runner.kv_cache)
        srv = KVServer(lambda: src)
        port = await srv.start("127.0.0.1", 0)
        firsts: dict[str, int] = {}
        for i, (p, params) in enumerate(cases):
            one = msgspec.structs.replace(params, max_tokens=1)
            prefill.add_request(f"p{i}", p, one, hold_kv=True)
        while prefill.has_unfinished_requests():
            firsts.update({o.request_id: o.new_token_ids[0] for o in prefill.step()})
        assert prefill.stats()["kv_blocks_held"] == sum(layout.blocks_for(len(p)) for p, _ in cases)
        out: dict[str, list[int]] = {}
        for i, (p, params) in enumerate(cases):
            h = handle_for(f"p{i}", layout, port, len(p))
            h.prompt_token_ids = p
            pulled = await pull_kv(h, layout)
            decode.add_prefilled_request(f"d{i}", p, firsts[f"p{i}"], params, pulled.blocks)
            out[f"d{i}"] = []
        while decode.has_unfinished_requests():
            for o in decode.step():
                out[o.request_id] += o.new_token_ids
        await srv.close()
        return [out[f"d{i}"] for i in range(len(cases))]

    assert asyncio.run(main()) == want
    assert prefill.reclaim_kv() > 0 and prefill.stats()["kv_blocks_held"] == 0
    assert (prefill.block_manager.num_free_blocks, decode.block_manager.num_free_blocks) == free


def test_engine_frees_unpulled_blocks_after_the_timeout() -> None:
    engine = _engine()
    clock = Clock()
    engine.kv_holds = KVHoldRegistry(2.0, clock=clock)
    free = engine.block_manager.num_free_blocks
    engine.add_request("p", list(range(1, 40)), SamplingParams(max_tokens=1), hold_kv=True)
    engine.add_request("q", list(range(1, 9)), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == free - 3  # "p" held, "q" freed
    engine.step()
    assert engine.stats()["kv_blocks_held"] == 3
    clock.now += 2.5
    engine.step()  # every step (and the server's idle loop) reclaims
    assert engine.block_manager.num_free_blocks == free and engine.kv_holds.stats.expired == 1


def test_prefilled_request_ending_at_its_first_token_needs_no_blocks() -> None:
    engine = _engine()
    free = engine.block_manager.num_free_blocks
    engine.add_prefilled_request("a", [1, 2, 3], 5, SamplingParams(max_tokens=1), None)
    engine.add_prefilled_request("b", [1, 2, 3], 9, SamplingParams(stop_token_ids=[9]), None)
    outs = engine.step()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [5], "length"),
        ("b", [9], "stop"),
    ]
    with pytest.raises(ValueError, match="needs 1 blocks, got none"):
        engine.add_prefilled_request("c", [1, 2, 3], 5, SamplingParams(max_tokens=4), None)
    assert engine.block_manager.num_free_blocks == free and not engine.has_unfinished_requests()
