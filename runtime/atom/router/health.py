"""Health probes: each instance's /health, on a loop and on demand (the router's own /health).

200 puts an instance in rotation. Any other answer (503 while starting or draining) takes it
out but leaves its requests running. No answer at all (refused, reset, or `dead_after` probe
timeouts in a row) marks it dead: its requests in flight stop at once with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from atom.router.pool import Instance, Pool

logger = logging.getLogger(__name__)


async def probe(
    session: aiohttp.ClientSession, inst: Instance, timeout: float, dead_after: int = 3
) -> dict[str, Any]:
    """Probe one instance, update its rotation state, return the /health entry for it."""
    status: int | None = None
    try:
        async with session.get(
            inst.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            status = r.status
            try:
                detail = await r.json()
            except (aiohttp.ContentTypeError, ValueError):
                detail = {}
        if status == 200:
            inst.passed()
        else:
            reason = detail.get("reason") or detail.get("status") or f"/health answered {status}"
            inst.failed(str(reason))
    except TimeoutError:
        inst.timeouts += 1
        inst.failed(f"/health timed out ({inst.timeouts}x)", dead=inst.timeouts >= dead_after)
    except aiohttp.ClientError as exc:
        inst.failed(f"unreachable: {exc.__class__.__name__}", dead=True)
    return {"url": inst.url, "healthy": bool(inst.healthy), "status": status, "reason": inst.reason}


async def probe_pool(
    session: aiohttp.ClientSession, pool: Pool, timeout: float
) -> list[dict[str, Any]]:
    insts = list(pool.instances.values())
    return list(await asyncio.gather(*(probe(session, i, timeout) for i in insts)))


async def health_loop(
    session: aiohttp.ClientSession,
    pools: list[Pool],
    interval: float,
    timeout: float,
    dns_interval: float,
) -> None:
    """Forever: re-resolve DNS names every dns_interval, probe every instance every interval."""
    next_dns = 0.0
    while True:
        try:
            if time.monotonic() >= next_dns:
                for pool in pools:
                    await pool.resolve()
                next_dns = time.monotonic() + dns_interval
            await asyncio.gather(*(probe_pool(session, p, timeout) for p in pools))
        except Exception:  # never let the loop die: a router without probes would hang requests
            logger.exception("health loop pass failed")
        await asyncio.sleep(interval)
