"""The KV transfer's TCP framing (asyncio streams). Version 1.

Every message is a frame: magic b"ATKV", u16 version, u16 kind, u32 length, then `length` bytes
of UTF-8 JSON (network byte order). Magic and version come first in every version, so two
instances of different versions can always tell each other so.

    decode -> prefill   PULL    {"handle", "secret", "layout"}  (or RELEASE: drop them unread)
    prefill -> decode   OK      {"layout", "num_blocks", "num_tokens", "chunk_blocks"}
                        then num_blocks * layout.block_bytes raw bytes, block-major: each block is
                        [2 (k, v), layers, block_size, kv_heads, head_dim] in layout.dtype,
                        little-endian, sent in chunks of chunk_blocks blocks
    decode -> prefill   ACK     {}                        (all bytes received)
    prefill -> decode   DONE    {}                        (blocks freed on the prefill side)

Handshake 2 (negotiate.py; the frame version stays 1, so either side may be older): the PULL
may carry {"transport": {"handshake": 2, "accept": [names], "peer": PeerFacts}}, and the OK
then names {"transport": name, "refused": {faster name: why}, "offer": {...}} (a prefill of
handshake 1 sends neither: TCP). With a fast transport no raw bytes follow the OK: the decode
imports the offer, then sends ACK, or FALLBACK {"reason"} to have the same blocks sent over
TCP on this connection (a second OK with "transport": "tcp", then the bytes, ACK, DONE).

Errors answer the first frame instead of OK: {"message": ...} with kind UNKNOWN_HANDLE, MISMATCH,
BAD_REQUEST, NOT_READY, BAD_VERSION or TRANSPORT_REFUSED (no transport both sides may use). A wrong `secret` is answered UNKNOWN_HANDLE, as an
unknown handle is (nothing tells a guesser which handles exist). The prefill instance checks the decode's layout (and the
decode checks the prefill's) before any block is read or written.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

MAGIC = b"ATKV"
WIRE_VERSION = 1
_HEADER = struct.Struct("!4sHHI")
MAX_JSON_BYTES = 1 << 20

# requests
PULL, RELEASE, ACK, FALLBACK = 1, 2, 3, 5
# answers
OK, DONE = 0, 4
UNKNOWN_HANDLE, MISMATCH, BAD_REQUEST, NOT_READY, BAD_VERSION = 10, 11, 12, 13, 14
TRANSPORT_REFUSED = 15
ERROR_NAMES = {
    UNKNOWN_HANDLE: "unknown_handle",
    MISMATCH: "mismatch",
    BAD_REQUEST: "bad_request",
    NOT_READY: "not_ready",
    BAD_VERSION: "bad_version",
    TRANSPORT_REFUSED: "transport_refused",
}


class WireError(Exception):
    """The peer broke the protocol (bad magic, oversized or invalid frame)."""


class TransferCut(ConnectionError):
    """The peer closed the connection before everything announced arrived."""


def encode_frame(kind: int, body: dict[str, Any], version: int = WIRE_VERSION) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return _HEADER.pack(MAGIC, version, kind, len(data)) + data


async def write_frame(
    writer: asyncio.StreamWriter, kind: int, body: dict[str, Any], timeout: float
) -> None:
    writer.write(encode_frame(kind, body))
    await asyncio.wait_for(writer.drain(), timeout)


async def read_frame(reader: asyncio.StreamReader, timeout: float) -> tuple[int, int, dict]:
    """(version, kind, body). IncompleteReadError / TimeoutError when the stream breaks."""
    head = await asyncio.wait_for(reader.readexactly(_HEADER.size), timeout)
    version, kind, length = _parse_header(head)
    raw = await asyncio.wait_for(reader.readexactly(length), timeout)
    return version, kind, _parse_body(raw)


def _parse_header(head: bytes) -> tuple[int, int, int]:
    magic, version, kind, length = _HEADER.unpack(head)
    if magic != MAGIC:
        raise WireError(f"not an ATOM KV peer (magic {magic!r})")
    if length > MAX_JSON_BYTES:
        raise WireError(f"frame of {length} bytes exceeds {MAX_JSON_BYTES}")
    return version, kind, length


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"frame is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise WireError("frame body is not a JSON object")
    return body


class SocketConn:
    """The puller's connection: a non-blocking socket driven by the event loop, so blocks are
    received straight into the destination buffer (a stream reader would copy them twice)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def open(cls, host: str, port: int, timeout: float) -> SocketConn:
        loop = asyncio.get_running_loop()
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout
        )
        error: Exception = OSError(f"{host} has no address")
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, addr), timeout)
                return cls(sock, timeout)
            except (OSError, TimeoutError) as exc:
                sock.close()
                error = exc
        raise error

    def close(self) -> None:
        self.sock.close()

    async def write_frame(self, kind: int, body: dict[str, Any]) -> None:
        await asyncio.wait_for(self._loop.sock_sendall(self.sock, encode_frame(kind, body)),
                               self.timeout)  # fmt: skip

    async def recv_into(self, view: memoryview) -> None:
        """Fill `view` exactly; TransferCut if the peer closes first."""
        got, total = 0, len(view)
        while got < total:
            n = await asyncio.wait_for(self._loop.sock_recv_into(self.sock, view[got:]),
                                       self.timeout)  # fmt: skip
            if n == 0:
                raise TransferCut(f"connection closed after {got} of {total} bytes")
            got += n

    async def read_frame(self) -> tuple[int, int, dict]:
        head = bytearray(_HEADER.size)
        await self.recv_into(memoryview(head))
        version, kind, length = _parse_header(bytes(head))
        raw = bytearray(length)
        await self.recv_into(memoryview(raw))
        return version, kind, _parse_body(bytes(raw))
