"""One message's latency from one process to another, the way the API server and the engine
core talk (issue 29: the two hops of a repeated prompt's request cost 0.85 ms on the H200's
host), over ZeroMQ (PUSH -> PULL over ipc, as today) and over a plain Unix stream socket, with
the receiver as the core waits (a blocking poll, or spinning on a zero-timeout poll) or as the
API server does (an asyncio event loop).

The sender sends one message every --gap-ms (so the receiver is idle, asleep in its poll, when
it arrives: a served request's situation), stamped with CLOCK_MONOTONIC; the receiver takes the
difference on arrival. Medians and p90 over --messages, per transport and receiver.

    PYTHONPATH=runtime:bench python bench/hop_latency.py [--bytes 216 20000] [--out hop.json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import select
import socket
import statistics
import struct
import tempfile
import time
from typing import Any

from common import emit_report

RECEIVERS = ("zmq-poll", "zmq-spin", "zmq-asyncio", "unix-poll", "unix-spin", "unix-asyncio")
STAMP = struct.Struct("q")


def _send(kind: str, where: str, size: int, count: int, gap: float) -> None:
    time.sleep(0.5)  # the receiver binds first
    if kind.startswith("zmq"):
        import zmq

        s = zmq.Context().socket(zmq.PUSH)
        s.connect(f"ipc://{where}")
        send = s.send
    else:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(where)
        send = c.sendall
    time.sleep(0.3)
    pad = b"x" * (size - STAMP.size)
    for _ in range(count):
        time.sleep(gap)
        send(STAMP.pack(time.monotonic_ns()) + pad)
    time.sleep(0.3)


def _frames(buf: bytearray, size: int, now: int, out: list[int]) -> None:
    """Latencies of the whole messages at buf's front (a stream may join or split them)."""
    while len(buf) >= size:
        out.append(now - STAMP.unpack_from(buf)[0])
        del buf[:size]


def _receive(kind: str, where: str, size: int, count: int, q: Any) -> None:
    lat: list[int] = []
    spin = kind.endswith("spin")
    if kind in ("zmq-poll", "zmq-spin"):
        import zmq

        s = zmq.Context().socket(zmq.PULL)
        s.bind(f"ipc://{where}")
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        while len(lat) < count:
            if poller.poll(0 if spin else 50):
                msg = s.recv(zmq.NOBLOCK)
                lat.append(time.monotonic_ns() - STAMP.unpack_from(msg)[0])
    elif kind in ("unix-poll", "unix-spin"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(where)
        listener.listen()
        conn, _ = listener.accept()
        conn.setblocking(False)
        p = select.poll()
        p.register(conn, select.POLLIN)
        buf = bytearray()
        while len(lat) < count:
            if p.poll(0 if spin else 50):
                buf += conn.recv(1 << 20)
                _frames(buf, size, time.monotonic_ns(), lat)
    else:
        asyncio.run(_receive_async(kind, where, size, count, lat))
    q.put(lat)


async def _receive_async(kind: str, where: str, size: int, count: int, lat: list[int]) -> None:
    if kind == "zmq-asyncio":
        import zmq
        import zmq.asyncio

        s = zmq.asyncio.Context().socket(zmq.PULL)
        s.bind(f"ipc://{where}")
        while len(lat) < count:
            msg = await s.recv()
            lat.append(time.monotonic_ns() - STAMP.unpack_from(msg)[0])
        return
    done = asyncio.get_running_loop().create_future()
    buf = bytearray()

    class Receiver(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            buf.extend(data)
            _frames(buf, size, time.monotonic_ns(), lat)
            if len(lat) >= count and not done.done():
                done.set_result(None)

    server = await asyncio.get_running_loop().create_unix_server(Receiver, where)
    await done
    server.close()


def measure(kind: str, size: int, count: int, gap: float) -> dict[str, float]:
    where = os.path.join(tempfile.mkdtemp(prefix="atom-hop-"), "sock")
    q: Any = mp.Queue()
    rx = mp.Process(target=_receive, args=(kind, where, size, count, q))
    tx = mp.Process(target=_send, args=(kind, where, size, count, gap))
    rx.start()
    tx.start()
    lat = sorted(q.get(timeout=60 + count * gap * 2))
    rx.join()
    tx.join()
    return {
        "median_us": round(statistics.median(lat) / 1e3, 1),
        "p90_us": round(lat[int(len(lat) * 0.9)] / 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, nargs="+", default=[216, 20000], help="message sizes")
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--receivers", nargs="+", default=list(RECEIVERS), choices=RECEIVERS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {
        f"{kind} {size} B": measure(kind, size, args.messages, args.gap_ms / 1e3)
        for size in args.bytes
        for kind in args.receivers
    }
    for name, r in results.items():
        print(f"{name:24s} median {r['median_us']:8.1f} us  p90 {r['p90_us']:8.1f} us", flush=True)
    emit_report({"cpus": os.cpu_count(), "results": results}, args.out)


if __name__ == "__main__":
    main()
