"""`POST /internal/kv/release`: the router frees a prefill's hold when the decode side failed or
its client left, instead of leaving the blocks pinned for --kv-hold-seconds.

Body `{"handle", "secret"}`; only with the internal token (trust.py), and only with the handle's
per-transfer secret (the engine core checks it: the key never leaves it). Answers `{"released": bool}` (false: already pulled, released or expired).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from atom.wire import errors as codes
from atom.wire.api_error import APIError
from atom.wire.body import parse_object, read_body
from atom.wire.kv_modes import RELEASE_PATH
from atom.wire.trust import is_internal

__all__ = ["RELEASE_PATH", "release_handler"]


def release_handler(
    release_of: Callable[[web.Request], Callable[[str, str], Awaitable[bool]] | None],
) -> Callable:
    """release_of: the request's hold release (the secret is checked where the key lives,
    the engine core), or None on an instance without KV transfers."""

    async def release(request: web.Request) -> web.Response:
        if not is_internal(request.headers):
            raise APIError(
                403, "only the router may release KV holds", code=codes.KV_TRANSFER_FORBIDDEN
            )
        body = await parse_object(await read_body(request, 64 * 1024))
        handle, secret, drop = body.get("handle"), body.get("secret"), release_of(request)
        if drop is None or not isinstance(handle, str) or not isinstance(secret, str):
            return web.json_response({"released": False}, status=404)
        return web.json_response({"released": await drop(handle, secret)})

    return release
