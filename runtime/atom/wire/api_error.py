"""OpenAI-style errors: every failure a client can cause becomes one of these, never a crash.

Torch-free (aiohttp and orjson only): the router's middleware answers them too.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from atom.wire.errors import ERROR_TYPES, RETRY_AFTER_S, error_body, error_type, retry_headers

__all__ = ["ERROR_TYPES", "APIError", "bad_request"]


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        retry_after: int = RETRY_AFTER_S,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # Retry-After seconds of a 429 or 503
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param, self.err_type)

    def response(self) -> web.Response:
        return web.Response(
            body=orjson.dumps(self.body()),
            status=self.status,
            content_type="application/json",
            headers=retry_headers(self.status, self.retry_after),
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
