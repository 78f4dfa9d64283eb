"""Issue 27's reproduction, with real processes on loopback: SIGTERM of a decode instance behind
the router mid-stream, and its streams finish.

One prefill instance, one decode instance (`--drain-seconds 30`) and atom-router in front (tiny
dummy Llama, CPU, level 0). Eight streams run through the router; once each has its first
token the decode instance gets SIGTERM. It drains: its listener stays open, /health answers 503
`draining`, the router takes it out of rotation and sends it nothing new (with no other decode
instance a new request waits `--queue-timeout` for one and gets 503 `no_backend`), and every
stream in flight ends with all its tokens and `[DONE]`. Then it exits 0, having drained once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Proc, start_router, start_server

from atom.wire.trust import TOKEN_ENV

MODEL = "tiny-llama"
P_D = {TOKEN_ENV: "test-internal-token"}  # router, prefill and decode share it
STREAMS = 8
MAX_TOKENS = 600  # long enough (3-4 s on 2 cores) that the drain overlaps the checks
QUEUE_TIMEOUT_S = 1.0  # the router's wait for a decode instance in rotation, then 503


def metric(proc: Proc, name: str, **labels: str) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def body(prompt: str, stream: bool) -> dict:
    out = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def stream(c: httpx.AsyncClient, url: str, i: int, first: asyncio.Event) -> dict:
    """One streamed completion: its status, every `data:` payload, and whether it was whole."""
    events: list[str] = []
    async with c.stream("POST", url + "/v1/completions", json=body(f"stream {i}:", True)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    return {"status": r.status_code, "events": events}


def check_stream(got: dict) -> None:
    events = got["events"]
    assert got["status"] == 200, got
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    finish = [ch["finish_reason"] for c in chunks for ch in c.get("choices", [])]
    assert finish.count("length") == 1 and finish[-1] == "length", finish
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS, usage


def test_sigterm_of_a_decode_instance_behind_the_router_mid_stream_lets_its_streams_finish() -> (
    None
):
    prefill = start_server("--role", "prefill", "--kv-port", "0", env=P_D)
    decode = start_server("--role", "decode", "--drain-seconds", "30", env=P_D)
    router: Proc | None = None
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        router = start_router(
            [prefill.url],
            [decode.url],
            "--health-interval",
            "0.2",
            "--health-timeout",
            "2",
            "--queue-timeout",
            str(QUEUE_TIMEOUT_S),
            env=P_D,
        )
        router.wait_healthy()
        r_url = router.url

        async def run() -> dict:
            async with httpx.AsyncClient(timeout=60) as c:
                firsts = [asyncio.Event() for _ in range(STREAMS)]
                tasks = [
                    asyncio.create_task(stream(c, r_url, i, firsts[i])) for i in range(STREAMS)
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
                assert not any(t.done() for t in tasks)  # every stream is mid-stream
                decode.proc.send_signal(signal.SIGTERM)
                t_term = time.monotonic()

                # The listener stays open and says it drains.
                while True:
                    h = await c.get(decode.url + "/health")
                    if h.status_code == 503:
                        break
                    assert time.monotonic() - t_term < 10, "no drain seen on /health"
                    await asyncio.sleep(0.02)
                health = h.json()
                # The router's probe loop takes it out of rotation (read from /metrics, which,
                # unlike the router's /health, probes nothing itself).
                while metric(router, "atom_router_instance_healthy", role="decode") != 0:
                    assert time.monotonic() - t_term < 10, "router kept the draining instance"
                    await asyncio.sleep(0.02)
                t_out = time.monotonic() - t_term
                sent_decode = metric(router, "atom_router_requests_total", role="decode")
                sent_prefill = metric(router, "atom_router_requests_total", role="prefill")
                still_running = sum(not t.done() for t in tasks)

                # A new request meanwhile: not sent to the draining instance (nor prefilled).
                t0 = time.monotonic()
                late = await c.post(r_url + "/v1/completions", json=body("late", False))
                late_s = time.monotonic() - t0
                after = {
                    "decode": metric(router, "atom_router_requests_total", role="decode"),
                    "prefill": metric(router, "atom_router_requests_total", role="prefill"),
                }
                running_after_late = sum(not t.done() for t in tasks)

                results = await asyncio.gather(*tasks)
                return {
                    "health": health,
                    "t_out": t_out,
                    "still_running": still_running,
                    "running_after_late": running_after_late,
                    "late": late,
                    "late_s": late_s,
                    "sent": {"decode": sent_decode, "prefill": sent_prefill},
                    "after": after,
                    "results": results,
                    "streams_s": time.monotonic() - t_term,
                    "t_term": t_term,
                }

        got = asyncio.run(run())
        print(
            f"out of rotation after {got['t_out']:.2f}s; {got['still_running']} streams running "
            f"then, {got['running_after_late']} after the late request ({got['late_s']:.2f}s); "
            f"streams done {got['streams_s']:.2f}s after SIGTERM"
        )
        assert got["health"] == {"status": "draining", "reason": "server is shutting down"}
        # the drain really overlapped the checks below
        assert got["running_after_late"] > 0

        late = got["late"]
        err = late.json()["error"]
        assert late.status_code == 503 and err["code"] == "no_backend", late.text
        assert "decode-1: server is shutting down" in err["message"], err
        assert decode.url not in err["message"] and late.headers["Retry-After"] == "1"
        assert QUEUE_TIMEOUT_S - 0.2 < got["late_s"] < QUEUE_TIMEOUT_S + 3, got["late_s"]
        assert got["after"] == got["sent"]  # neither instance saw it

        for res in got["results"]:
            check_stream(res)

        code = decode.proc.wait(30)
        # it exits once its streams are done, not at the end of the 30 s grace
        exit_s = time.monotonic() - got["t_term"]
        assert exit_s < 15, exit_s
        log = decode.log_path.read_text(errors="replace")
        assert code == 0, log[-4000:]
        assert log.count("SIGTERM: draining") == 1, log[-4000:]
        assert log.count("draining: ") == 1, log[-4000:]
        assert "drain deadline" not in log, log[-4000:]
        # the router's 503s on the decode side: the late request's only (no stream was cut)
        assert metric(router, "atom_router_unavailable_total", role="decode") == 1
    finally:
        for p in [router, decode, prefill]:
            if p is not None:
                p.stop()
