"""The seam's pieces in isolation: messages round-trip, streams coalesce, histograms and SSE
encode like the libraries they replace on the hot path."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from atom.disagg.handle import KVHandle
from atom.engine.params import SamplingParams
from atom.entrypoints.core import messages as m
from atom.entrypoints.core.client import EngineDead
from atom.entrypoints.core.stream import RequestStream
from atom.entrypoints.metrics import LATENCY_BUCKETS, FastHistogram
from atom.entrypoints.openai_format import sse
from atom.wire.errors import error_body
from atom.wire.kv_modes import KVMode, parse_mode


def test_messages_round_trip_typed() -> None:
    enc = m.encoder()
    handle = KVHandle("h", "10.0.0.1", 8001, "id", "model", 2, [1, 2, 3], 7, -0.5, 30.0)
    add = m.AddRequest(
        "r", 1, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4), first_token=7, kv_pull=handle
    )
    assert m.input_decoder().decode(enc.encode(add)) == add
    out = m.StepOutputs([m.ReqOut("r", [5, 6], [-0.1, -0.2], None, 3, 2)], steps=9)
    back = m.output_decoder().decode(enc.encode(out))
    assert isinstance(back, m.StepOutputs) and back.outputs[0].tokens == [5, 6]
    status = m.EngineStatus("ready", "ready", 42, None)
    assert m.output_decoder().decode(enc.encode(status)) == status


def test_hold_and_prefix_fields_round_trip() -> None:
    """harden's secrets and prefix caching's cached tokens cross the seam."""
    enc = m.encoder()
    handle = KVHandle(
        "h", "10.0.0.1", 8001, "id", "model", 2, [1, 2], 7, None, 30.0, secret="s", cached_tokens=16
    )
    add = m.AddRequest(
        "r", 0, [1, 2], SamplingParams(), first_token=7, kv_pull=handle, cached_tokens=16
    )
    back = m.input_decoder().decode(enc.encode(add))
    assert back.cached_tokens == 16 and back.kv_pull.secret == "s"
    for msg in (m.DropHold("r"), m.ReleaseHold(1, 3, "h", "s")):
        assert m.input_decoder().decode(enc.encode(msg)) == msg
    out = m.ReqOut("r", [5], None, "stop", 3, 1, num_cached_tokens=2, kv_secret="s")
    got = m.output_decoder().decode(enc.encode(m.StepOutputs([out], 1))).outputs[0]
    assert (got.num_cached_tokens, got.kv_secret) == (2, "s")
    assert m.output_decoder().decode(enc.encode(m.HoldReleased(3, True))) == m.HoldReleased(3, True)


def test_stream_coalesces_steps_and_fails_after_its_tokens() -> None:
    async def main() -> None:
        s = RequestStream("r")
        for i in range(3):  # three steps before the handler looks
            s.push(m.ReqOut("r", [i], None, None, 4, i + 1), 0.0)
        chunk = await s.get()
        assert chunk.tokens == [0, 1, 2] and chunk.num_output_tokens == 3
        s.push(m.ReqOut("r", [9], None, None, 4, 4), 0.0)
        s.fail(EngineDead("gone"))
        assert (await s.get()).tokens == [9]  # what came before the failure first
        with pytest.raises(EngineDead):
            await s.get()

        waiter = RequestStream("w")
        task = asyncio.create_task(waiter.get())
        await asyncio.sleep(0)
        waiter.push(m.ReqOut("w", [1], None, "length", 4, 1), 0.0)
        done = await task
        assert done.tokens == [1] and done.finish_reason == "length"

    asyncio.run(main())


def test_fast_histogram_renders_like_prometheus_client() -> None:
    values = [0.0005, 0.001, 0.003, 0.05, 0.05, 1.5, 100.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = FastHistogram("atom_x_seconds", "x", LATENCY_BUCKETS, ours)
    ref = Histogram("atom_x_seconds", "x", buckets=LATENCY_BUCKETS, registry=theirs)
    for v in values[:-2]:
        fast.observe(v)
        ref.observe(v)
    fast.observe_n(values[-2], 1)
    ref.observe(values[-2])
    fast.observe(values[-1])
    ref.observe(values[-1])

    def lines(reg: CollectorRegistry) -> list[str]:
        return [
            line
            for line in generate_latest(reg).decode().splitlines()
            if not line.startswith("#") and "_created" not in line
        ]

    assert lines(ours) == lines(theirs)


def test_sse_escapes_what_splitlines_would_cut() -> None:
    event = sse({"text": "a\u2028b\u0085c\u2029d é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.decode().splitlines() == [event.decode()[:-2], ""]  # no cut inside the event
    assert json.loads(event[6:])["text"] == "a\u2028b\u0085c\u2029d é"


def test_wire_contract() -> None:
    assert error_body(503, "down", "engine_unavailable") == {
        "error": {
            "message": "down",
            "type": "service_unavailable",
            "param": None,
            "code": "engine_unavailable",
        }
    }
    assert parse_mode("decode") is KVMode.DECODE and parse_mode("x") is None
    assert parse_mode(None) is None


def test_engine_info_tells_the_api_server_the_engines_eos_ids() -> None:
    """The engine applies EOS; the API server only learns the ids (a decode request that ends
    at its first token pulls no blocks)."""
    from atom.entrypoints.generation import ends_at_first_token

    info = m.EngineInfo(64, 256, {}, {}, {}, None, eos_token_ids=[2])
    back = m.output_decoder().decode(m.encoder().encode(m.EngineStatus("ready", "", 1, info)))
    assert back.info.eos_token_ids == [2]
    eos = frozenset(back.info.eos_token_ids)
    assert ends_at_first_token(SamplingParams(max_tokens=5), 2, eos)
    assert not ends_at_first_token(SamplingParams(max_tokens=5, ignore_eos=True), 2, eos)
    assert not ends_at_first_token(SamplingParams(max_tokens=5), 3, eos)
    assert ends_at_first_token(SamplingParams(max_tokens=5, stop_token_ids=[3]), 3, eos)
