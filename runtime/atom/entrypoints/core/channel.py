"""Framed messages between the API servers and the engine core, over Unix stream sockets.

The core binds one input socket that every API server connects to; each API server binds its
own output socket that the core connects to. A frame is a 4-byte little-endian length and the
message (msgpack, atom.entrypoints.core.messages). Nothing here blocks the engine loop: the
core's sends queue what the socket does not take at once and flush it on later turns; the
API servers' side runs on their asyncio loop.

Why not ZeroMQ (which carried these messages before): every ZeroMQ message passes through an
I/O thread on each side, so a hop to an idle receiver costs three thread wake-ups instead of
one. On the H200's host (gVisor, where a wake-up and a syscall cost more) the two hops of a
request were 0.85 ms of a cached prompt's 5.5 ms to its first token; bench/hop_latency.py
measures both transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable

HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 31  # a message larger than this is a bug (or not ours): the peer is dropped
RECV_BYTES = 1 << 20
QUEUE_LIMIT = 256 << 20  # bytes a peer that never connected may have queued before sends drop
CONNECT_RETRY_S = 0.005
CONNECT_BACKOFF_S = 0.05
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNREFUSED, errno.ENOENT)


def socket_path(addr: str) -> str:
    """The file of an `ipc://path` address (the scheme names what the address is)."""
    return addr.removeprefix("ipc://")


def frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


class Frames:
    """Reassembles frames from a byte stream that joins and splits them at will."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out, pos, end = [], 0, len(buf)
        while end - pos >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, pos)
            if n >= MAX_FRAME:
                raise ValueError(f"a frame of {n} bytes")
            if end - pos - HEADER.size < n:
                break
            pos += HEADER.size
            out.append(bytes(buf[pos : pos + n]))
            pos += n
        del buf[:pos]
        return out


# ---- the engine core's side (blocking calls never; one thread) --------------------------------
class Inbox:
    """The core's input: one listening socket, a connection per API server, and a wake-up
    pipe for another thread, polled together. `read` touches only what the last `wait` found
    ready (no syscall on a quiet socket: the busy loop looks once a step)."""

    def __init__(self, addr: str) -> None:
        self.path = socket_path(addr)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._listener, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._conns: dict[int, tuple[socket.socket, Frames]] = {}
        self._ready: list[int] = []  # the fds the last wait found readable

    def wake(self) -> None:
        """From any thread: the next (or current) wait returns."""
        with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
            os.write(self._wake_w, b"\0")

    def wait(self, timeout_ms: float) -> bool:
        """Whether anything arrived within timeout_ms (0: look, do not wait)."""
        self._ready = [fd for fd, _ in self._poll.poll(timeout_ms)]
        return bool(self._ready)

    def read(self) -> list[bytes]:
        """Every whole message that arrived on what the last wait found ready, in each
        sender's order (a connection accepted here is read after the next wait)."""
        ready, self._ready = self._ready, []
        out: list[bytes] = []
        for fd in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd == self._listener.fileno():
                self._accept()
            elif fd in self._conns:
                out += self._receive(fd)
        return out

    def _receive(self, fd: int) -> list[bytes]:
        conn, frames = self._conns[fd]
        out: list[bytes] = []
        while True:
            try:
                data = conn.recv(RECV_BYTES)
            except BlockingIOError:
                return out
            except OSError:
                data = b""
            if not data:  # the API server closed or died: its messages end here
                self._drop(fd)
                return out
            try:
                out += frames.feed(data)
            except ValueError:  # not our framing: drop the connection
                self._drop(fd)
                return out

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            self._conns[conn.fileno()] = (conn, Frames())
            self._poll.register(conn, select.POLLIN)

    def _drop(self, fd: int) -> None:
        conn, _ = self._conns.pop(fd)
        self._poll.unregister(fd)
        conn.close()

    def close(self) -> None:
        for fd in list(self._conns):
            self._drop(fd)
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Outbox:
    """The core's socket to one API server. It connects on first use and again while the
    server is not there yet (an extra API server binds after the core starts); a send queues
    what the socket does not take at once (`flush` on later turns), and a server that was
    connected and went away gets nothing more (ZeroMQ's PUSH with no high-water mark)."""

    def __init__(self, addr: str) -> None:
        self.path = socket_path(addr)
        self._sock: socket.socket | None = None
        self._queue: deque[memoryview] = deque()
        self._queued = 0
        self._gone = False
        self._next_try = 0.0

    @property
    def pending(self) -> bool:
        return bool(self._queue) and not self._gone

    def send(self, data: bytes) -> None:
        if self._gone:
            return
        if self._sock is None and self._queued + len(data) > QUEUE_LIMIT:
            return  # a server that never came: do not grow without bound
        self._queue.append(memoryview(frame(data)))
        self._queued += len(data) + HEADER.size
        self.flush()

    def flush(self) -> None:
        """Write what the socket takes now; never waits."""
        if not self._queue or self._gone or not self._connect():
            return
        sock, queue = self._sock, self._queue
        assert sock is not None
        while queue:
            head = queue[0]
            try:
                n = sock.send(head)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _GONE:
                    self._lost()
                    return
                raise
            self._queued -= n
            if n == len(head):
                queue.popleft()
            else:
                queue[0] = head[n:]

    def _connect(self) -> bool:
        if self._sock is not None:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            self._next_try = now + CONNECT_RETRY_S
            return False
        sock.setblocking(False)
        self._sock = sock
        return True

    def _lost(self) -> None:
        self._gone = True
        self._queue.clear()
        self._queued = 0
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self, linger_s: float = 1.0) -> None:
        """Flush for up to linger_s, then close."""
        deadline = time.monotonic() + linger_s
        while self.pending and time.monotonic() < deadline:
            self.flush()
            if self.pending:
                time.sleep(0.001)
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def send_now(addr: str, data: bytes, timeout_s: float) -> None:
    """One message on a socket of its own, blocking up to timeout_s (a thread that must not
    share the loop's sockets: the core's fatal path). Errors are swallowed: best effort."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(socket_path(addr))
        s.sendall(frame(data))


# ---- an API server's side (its asyncio loop) ----------------------------------------------------
class _Receiver(asyncio.Protocol):
    def __init__(self, on_message: Callable[[bytes], None]) -> None:
        self._on_message = on_message
        self._frames = Frames()
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except ValueError:
            assert self._transport is not None
            self._transport.close()
            return
        for msg in messages:
            self._on_message(msg)


async def serve_inbox(addr: str, on_message: Callable[[bytes], None]) -> asyncio.AbstractServer:
    """Bind addr; every whole message from any connection goes to on_message, on the loop,
    as soon as it arrives (no task in between)."""
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(lambda: _Receiver(on_message), socket_path(addr))


class AsyncOutbox:
    """An API server's socket to the core. Sends made before the core has bound its input
    (it is still starting) wait in order and go once `connect` gets through."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._transport: asyncio.WriteTransport | None = None
        self._early: list[bytes] = []
        self._closed = False

    async def connect(self, alive: Callable[[], bool]) -> None:
        """Retry until connected, while alive() says the core may still bind (a spawned core
        takes seconds to: the retries back off to CONNECT_BACKOFF_S apart)."""
        loop = asyncio.get_running_loop()
        pause = CONNECT_RETRY_S
        while not self._closed and alive():
            try:
                transport, _ = await loop.create_unix_connection(
                    asyncio.Protocol, socket_path(self.addr)
                )
            except OSError:
                await asyncio.sleep(pause)
                pause = min(2 * pause, CONNECT_BACKOFF_S)
                continue
            if self._closed:
                transport.close()
                return
            self._transport = transport
            for data in self._early:
                transport.write(data)
            self._early.clear()
            return

    def send(self, data: bytes) -> None:
        """Queued in the transport when the socket does not take it now (never blocks)."""
        if self._transport is not None:
            if not self._transport.is_closing():
                self._transport.write(frame(data))
        elif not self._closed:
            self._early.append(frame(data))

    def close(self) -> None:
        """Close once what was sent is written (the transport flushes its buffer first)."""
        self._closed = True
        if self._transport is not None:
            self._transport.close()
