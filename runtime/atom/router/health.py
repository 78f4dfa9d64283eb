"""Health probes: each instance's /health, on a loop and on demand (the router's own /health).

200 puts an instance in rotation, unless its /health says it refuses the router's internal
token (`internal_token`: mismatch or unset): that instance is out, with the reason. Any other answer (503 while starting or `draining`), a
refused or reset probe, or `out_after` probe timeouts in a row take it out of rotation: no new
requests go there, and the ones in flight carry on (they end only if their own connection
fails). "Busy" is told from "dead" by progress: an instance whose requests in flight sent bytes
within `busy_window` seconds stays in rotation however slow its /health is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from atom.router.pool import Instance, Pool, bounded

logger = logging.getLogger(__name__)

# What an instance's /health says of the X-Atom-Internal-Token we sent, when it refuses it.
TOKEN_REFUSED = {
    "mismatch": "internal token mismatch: the instance's ATOM_INTERNAL_TOKEN differs from the "
    "router's (it would refuse every kv_transfer)",
    "unset": "internal token missing: the instance has no ATOM_INTERNAL_TOKEN (it would "
    "refuse every kv_transfer)",
}


async def probe(
    session: aiohttp.ClientSession,
    inst: Instance,
    timeout: float,
    out_after: int = 2,
    busy_window: float = 10.0,
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
        verdict = detail.get("internal_token")
        if verdict in TOKEN_REFUSED:  # it would 403 every kv_transfer we send it
            inst.failed(TOKEN_REFUSED[verdict])
        elif status == 200:
            inst.passed()
        else:
            reason = detail.get("reason") or detail.get("status") or f"/health answered {status}"
            inst.failed(str(reason))
    except TimeoutError:
        inst.timeouts += 1
        if inst.progressing(busy_window):
            inst.busy()
        elif inst.timeouts >= out_after:
            inst.failed(f"/health timed out ({inst.timeouts}x in a row)", slow=True)
    except aiohttp.ClientError as exc:
        inst.failed(f"/health unreachable: {bounded(exc.__class__.__name__)}")
    return {"url": inst.url, "healthy": bool(inst.healthy), "status": status, "reason": inst.reason}


async def probe_pool(
    session: aiohttp.ClientSession, pool: Pool, timeout: float, **kw: Any
) -> list[dict[str, Any]]:
    """kw: probe()'s out_after and busy_window."""
    insts = list(pool.instances.values())
    return list(await asyncio.gather(*(probe(session, i, timeout, **kw) for i in insts)))


async def health_loop(
    session: aiohttp.ClientSession,
    pools: list[Pool],
    interval: float,
    timeout: float,
    dns_interval: float,
    **kw: Any,
) -> None:
    """Forever: re-resolve DNS names every dns_interval, probe every instance every interval."""
    next_dns = 0.0
    while True:
        try:
            if time.monotonic() >= next_dns:
                for pool in pools:
                    await pool.resolve()
                next_dns = time.monotonic() + dns_interval
            await asyncio.gather(*(probe_pool(session, p, timeout, **kw) for p in pools))
        except Exception:  # never let the loop die: a router without probes would hang requests
            logger.exception("health loop pass failed")
        await asyncio.sleep(interval)
