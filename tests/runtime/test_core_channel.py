"""atom.entrypoints.core.channel: framed messages between the API servers and the engine core."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from atom.entrypoints.core.channel import (
    AsyncOutbox,
    Frames,
    Inbox,
    Outbox,
    frame,
    send_now,
    serve_inbox,
)
from testutil import async_wait_for

_DIRS: list[str] = []


def _addr(name: str) -> str:
    _DIRS.append(tempfile.mkdtemp(prefix="atom-chan-test-"))
    return "ipc://" + os.path.join(_DIRS[-1], name)


@pytest.fixture(autouse=True, scope="module")
def _remove_socket_dirs() -> Iterator[None]:
    """The sockets' directories go with the module: a run leaves nothing in /tmp."""
    yield
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)


def _read_until(inbox: Inbox, n: int, timeout: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        if inbox.wait(50):
            got += inbox.read()
    return got


def test_frames_reassemble_joined_and_split_messages() -> None:
    msgs = [b"", b"a", b"x" * 70000, b"end"]
    stream = b"".join(frame(m) for m in msgs)
    for cut in (1, 3, 5, 4096, len(stream)):
        f, out = Frames(), []
        for i in range(0, len(stream), cut):
            out += f.feed(stream[i : i + cut])
        assert out == msgs
    with pytest.raises(ValueError):
        Frames().feed(b"\xff\xff\xff\xff")  # a length no message of ours has


def test_inbox_reads_every_sender_in_order_and_drops_a_closed_one() -> None:
    inbox = Inbox(_addr("in"))
    try:
        a, b = Outbox(f"ipc://{inbox.path}"), Outbox(f"ipc://{inbox.path}")
        for i in range(100):
            a.send(b"a%d" % i)
            b.send(b"b%d" % i)
        got = _read_until(inbox, 200)
        assert [m for m in got if m[:1] == b"a"] == [b"a%d" % i for i in range(100)]
        assert [m for m in got if m[:1] == b"b"] == [b"b%d" % i for i in range(100)]
        a.close()
        b.send(b"after")
        assert _read_until(inbox, 1) == [b"after"]
    finally:
        inbox.close()
    assert not os.path.exists(inbox.path)


def test_wake_from_another_thread_ends_the_wait() -> None:
    inbox = Inbox(_addr("in"))
    try:
        threading.Timer(0.05, inbox.wake).start()
        t0 = time.monotonic()
        assert inbox.wait(5000)
        assert time.monotonic() - t0 < 2.0
        assert inbox.read() == []  # a wake-up is no message
        assert not inbox.wait(0)
    finally:
        inbox.close()


def test_outbox_queues_until_the_server_binds_and_never_blocks() -> None:
    """An extra API server binds after the core started: what was sent before goes once it
    is there; a large message the socket cannot take at once waits for later flushes."""
    addr = _addr("out")
    out = Outbox(addr)
    out.send(b"early")
    assert out.pending
    inbox = Inbox(addr)
    try:
        time.sleep(0.01)  # past the connect retry interval
        big = os.urandom(8 << 20)  # more than a Unix socket buffers
        t0 = time.monotonic()
        out.send(big)
        assert time.monotonic() - t0 < 1.0 and out.pending
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            out.flush()
            if inbox.wait(10):
                got += inbox.read()
        assert got == [b"early", big]
        assert not out.pending
    finally:
        inbox.close()


def test_outbox_to_a_server_that_went_away_drops_and_does_not_raise() -> None:
    addr = _addr("out")
    inbox = Inbox(addr)
    out = Outbox(addr)
    out.send(b"one")
    assert _read_until(inbox, 1) == [b"one"]
    inbox.close()
    for _ in range(50):  # the first sends may still land in the dead socket's buffer
        out.send(b"x" * 65536)
    assert not out.pending


def test_send_now_and_the_async_side() -> None:
    """The API server's receiver dispatches each message as it arrives; its outbox holds what
    it sends before the core binds and delivers it in order once connected."""
    out_addr, in_addr = _addr("api-0"), _addr("core-in")

    async def main() -> None:
        got: list[bytes] = []
        arrived = asyncio.Event()

        def on_message(m: bytes) -> None:
            got.append(m)
            if len(got) == 3:
                arrived.set()

        server = await serve_inbox(out_addr, on_message)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, send_now, out_addr, b"fatal", 1.0)
        core_side = Outbox(out_addr)
        core_side.send(b"s1")
        core_side.send(b"s2")
        await asyncio.wait_for(arrived.wait(), 5)
        assert got == [b"fatal", b"s1", b"s2"]
        core_side.close()
        server.close()

        tx = AsyncOutbox(in_addr)
        checks = [0]  # connect asks alive() before each attempt

        def alive() -> bool:
            checks[0] += 1
            return True

        connecting = asyncio.create_task(tx.connect(alive))
        tx.send(b"hello")
        tx.send(b"second")
        # the core is not there yet: an attempt failed and connect is retrying
        await async_wait_for("a failed connect attempt", lambda: checks[0] >= 2)
        inbox = Inbox(in_addr)
        try:
            await asyncio.wait_for(connecting, 5)
            tx.send(b"third")
            msgs = await loop.run_in_executor(None, _read_until, inbox, 3)
            assert msgs == [b"hello", b"second", b"third"]
        finally:
            tx.close()
            inbox.close()

    asyncio.run(main())


def test_async_outbox_stops_retrying_when_the_core_is_gone() -> None:
    async def main() -> None:
        tx = AsyncOutbox(_addr("never"))
        alive, checks = [True], [0]

        def still_alive() -> bool:
            checks[0] += 1
            return alive[0]

        task = asyncio.create_task(tx.connect(still_alive))
        await async_wait_for("connect retrying", lambda: checks[0] >= 2)
        alive[0] = False
        await asyncio.wait_for(task, 2)
        tx.send(b"dropped?")  # queued, never sent; no error
        tx.close()

    asyncio.run(main())


def test_a_stranger_with_a_bad_frame_is_dropped_not_fatal() -> None:
    inbox = Inbox(_addr("in"))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(inbox.path)
            s.sendall(b"\xff\xff\xff\xffjunk")
            assert inbox.wait(1000) and inbox.read() == []  # the stranger accepted
            assert inbox.wait(1000)  # its bad frame is ready
            assert inbox.read() == []  # read: no message and no error
            s.settimeout(5)
            assert s.recv(1) == b""  # and the inbox hung up on it
        good = Outbox(f"ipc://{inbox.path}")
        good.send(b"ok")
        assert _read_until(inbox, 1) == [b"ok"]
    finally:
        inbox.close()
