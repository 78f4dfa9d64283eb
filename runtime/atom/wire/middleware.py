"""The one aiohttp middleware of the runtime server and the router: every failure is a JSON body, every answer
is counted.

Client errors (APIError, a body that cannot be read or parsed, routing's 404/405, 413) become
OpenAI error bodies with their status; anything unexpected is logged and answered 500 in the same
shape, never aiohttp's plain-text page. A CancelledError that leaked out of something the handler
awaited (its own task was not cancelled) is such an unexpected failure too: aiohttp would close
the connection without a status line. `on_status` sees the status of every response the
handlers produced, so /metrics counts 4xx and 5xx as well as 200s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from atom.wire.api_error import APIError
from atom.wire.body import BodyError

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_errors(on_status: Callable[[web.Request, int], None]) -> Callable:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resp = await _answer(request, handler)
        try:
            on_status(request, resp.status)
        except Exception:  # counting must never turn an answer into an error
            logger.exception("counting a %d response failed", resp.status)
        return resp

    return middleware


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        resp = exc.response()
        if exc.status == 408:  # the body never came: do not wait on this connection again
            resp.force_close()
        return resp
    except BodyError as exc:
        return APIError(400, exc.message, code=exc.code).response()
    except web.HTTPRequestEntityTooLarge as exc:
        return APIError(413, exc.text or "request body too large").response()
    except web.HTTPException as exc:  # 404/405 from routing, in the OpenAI shape
        if exc.status < 400:
            raise
        return APIError(exc.status, exc.reason, code=str(exc.status)).response()
    except Exception as exc:  # a bug: say so in JSON, keep the server up
        return _internal_error(request, exc)
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # our handler was cancelled: the client left, or the server is stopping
        # A cancellation that leaked out of something awaited (a cancelled future): aiohttp
        # would drop the connection without a word; the client gets a 500 and the log the trace.
        return _internal_error(request, exc)


def _internal_error(request: web.Request, exc: BaseException) -> web.StreamResponse:
    logger.error("%s %s failed", request.method, request.path, exc_info=exc)
    name = type(exc).__name__
    return APIError(500, f"internal error ({name})", code="internal_error").response()
