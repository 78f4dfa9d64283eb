"""Instances of one role, and how the router picks one.

A target is a URL (`http://10.0.0.5:8000`: one instance, as given) or a DNS name with a port
(`demo-prefill-abc.ns.svc:8000`: every address it resolves to is an instance, so a headless
Service's A records are its ready pods; re-resolved periodically). An instance is in rotation
until a health probe or a request fails, and back once a probe passes. Leaving rotation only
stops new requests: those in flight keep their own connections and end only if those fail.
The router picks the instance with the fewest outstanding requests, the least recently picked
first on a tie.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
DEFAULT_PORT = 8000
MAX_REASON = 200  # characters of one instance's reason: log lines and 503 bodies stay short


def bounded(text: str, limit: int = MAX_REASON) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    target: str  # what it came from (a URL or a DNS name)
    name: str = ""  # what clients are told (prefill-1): never the URL
    healthy: bool | None = None  # None: not probed yet (in rotation, optimistically)
    reason: str = "not probed yet"
    outstanding: int = 0
    last_pick: int = 0
    timeouts: int = 0  # consecutive probe timeouts
    # When bytes last arrived from it (monotonic): a busy instance is slow to answer /health
    # but its requests progress, and it stays in rotation.
    last_progress: float = field(default=0.0)
    out_by_timeouts: bool = False  # out of rotation only because /health was slow

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def in_rotation(self) -> bool:
        return self.healthy is not False

    def passed(self) -> None:
        if self.healthy is False:
            logger.info("%s instance %s is back in rotation", self.role, self.url)
        self.healthy, self.reason, self.timeouts = True, "ok", 0
        self.out_by_timeouts = False

    def failed(self, reason: str, slow: bool = False) -> None:
        """Out of rotation for new requests; the ones in flight are left alone. `slow`: only
        because /health timed out (bytes arriving from it bring it back)."""
        reason = bounded(reason)
        if self.healthy is not False:
            logger.warning("%s instance %s out of rotation: %s", self.role, self.url, reason)
        self.healthy, self.reason, self.out_by_timeouts = False, reason, slow

    def busy(self) -> None:
        """Slow to answer /health, but its requests progress: in rotation."""
        self.reason = f"busy: /health timed out ({self.timeouts}x), its requests progress"
        if self.healthy is False and self.out_by_timeouts:
            logger.info("%s instance %s is busy, not dead: back in rotation", self.role, self.url)
            self.healthy, self.out_by_timeouts = True, False

    def progressed(self) -> None:
        self.last_progress = time.monotonic()
        if self.out_by_timeouts:
            self.busy()

    def progressing(self, window: float) -> bool:
        """Requests in flight on it and bytes from it within the last `window` seconds."""
        return self.outstanding > 0 and time.monotonic() - self.last_progress <= window


def _url(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"http://{host}:{port}"


def parse_target(spec: str) -> tuple[str | None, str, int]:
    """(static url, None, 0) for a URL, or (None, host, port) for a DNS name."""
    spec = spec.strip()
    if "://" in spec:
        parts = urlsplit(spec)
        if not parts.hostname:
            raise ValueError(f"instance URL {spec!r} has no host")
        return spec.rstrip("/"), "", 0
    parts = urlsplit(f"//{spec}")
    if not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"{spec!r} is neither a URL nor a DNS name with a port (name:port)")
    return None, parts.hostname, parts.port or DEFAULT_PORT


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address of `host` (A and AAAA records), in the resolver's order, without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Pool:
    def __init__(self, role: str, targets: list[str], resolver: Resolver = resolve_dns) -> None:
        if not targets:
            raise ValueError(f"at least one --{role} URL or DNS name is required")
        self.role = role
        self.targets = list(targets)
        self.instances: dict[str, Instance] = {}
        self._names: list[tuple[str, str, int]] = []  # (target, host, port) to resolve
        self._resolver = resolver
        self._picks = itertools.count(1)
        self._numbers = itertools.count(1)
        for spec in self.targets:
            url, host, port = parse_target(spec)
            if url is not None:
                self.instances[url] = self._new(url, spec)
            else:
                self._names.append((spec, host, port))

    async def resolve(self) -> None:
        """Re-read the DNS names: new addresses join, vanished ones leave. A failed lookup keeps
        what was known (health probes judge those)."""
        for spec, host, port in self._names:
            try:
                addrs = await self._resolver(host, port)
            except (OSError, UnicodeError) as exc:
                logger.warning("cannot resolve %s (%s): keeping %s", spec, exc, self.role)
                continue
            fresh = {_url(a, port) for a in addrs}
            for url in fresh - self.instances.keys():
                inst = self.instances[url] = self._new(url, spec)
                logger.info("%s instance %s (%s) joined (from %s)", self.role, inst.name, url, spec)
            for url, inst in list(self.instances.items()):
                if inst.target == spec and url not in fresh:
                    logger.info("%s instance %s left (not in %s any more)", self.role, url, spec)
                    del self.instances[url]

    def _new(self, url: str, target: str) -> Instance:
        return Instance(url, self.role, target, name=f"{self.role}-{next(self._numbers)}")

    @property
    def hosts(self) -> set[str]:
        return {i.host for i in self.instances.values()}

    def pick(self, exclude: set[Instance] | frozenset = frozenset()) -> Instance | None:
        ready = [i for i in self.instances.values() if i.in_rotation and i not in exclude]
        if not ready:
            return None
        best = min(ready, key=lambda i: (i.outstanding, i.last_pick))
        best.last_pick = next(self._picks)
        return best

    def unavailable_reason(self, scrub: Callable[[str], str] = str) -> str:
        """For a client: instances by name, their reasons passed through `scrub` (which takes
        internal addresses out); the router's /status has the URLs."""
        if not self.instances:
            return f"no {self.role} instance is known (nothing resolved yet)"
        insts = list(self.instances.values())
        detail = "; ".join(f"{i.name}: {scrub(i.reason)}" for i in insts[:5])
        more = len(insts) - 5
        return f"no healthy {self.role} instance ({detail}{f'; {more} more' if more > 0 else ''})"

    @contextmanager
    def busy(self, inst: Instance) -> Iterator[Instance]:
        inst.outstanding += 1
        try:
            yield inst
        finally:
            inst.outstanding -= 1
