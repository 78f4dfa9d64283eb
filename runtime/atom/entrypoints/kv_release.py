"""`POST /internal/kv/release`: the router frees a prefill's hold when the decode side failed or
its client left, instead of leaving the blocks pinned for --kv-hold-seconds.

Body `{"handle", "secret"}`; only with the internal token (trust.py), and only with the handle's
per-transfer secret. Answers `{"released": bool}` (false: already pulled, released or expired).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from atom.disagg.trust import is_internal
from atom.entrypoints.body import parse_object, read_body
from atom.entrypoints.errors import APIError

RELEASE_PATH = "/internal/kv/release"


def release_handler(kv_of: Callable[[web.Request], Any]) -> Callable:
    """kv_of: the request's KVService (None on an instance without KV transfers)."""

    async def release(request: web.Request) -> web.Response:
        if not is_internal(request.headers):
            raise APIError(
                403, "only the router may release KV holds", code="kv_transfer_forbidden"
            )
        body = await parse_object(await read_body(request, 64 * 1024))
        handle, kv = body.get("handle"), kv_of(request)
        if (
            kv is None
            or not isinstance(handle, str)
            or not kv.keys.verify(handle, body.get("secret"))
        ):
            return web.json_response({"released": False}, status=404)
        return web.json_response({"released": kv.release_local(handle)})

    return release
