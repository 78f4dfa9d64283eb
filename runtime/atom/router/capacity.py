"""Waiting for room on a busy role, instead of failing the request.

Every instance of a role can decline a request for a while without being unwell: a prefill
whose held KV blocks reached `--max-held-kv-fraction` (503 `kv_hold_cap`), an instance whose
queue is at `--max-waiting` (429). Under a burst that is the normal state for a moment: the
prefill's holds drain as the decode instances pull them. So the router holds such a request
(up to its queue timeout) and retries it once room is freed, rather than answering 503.
(The other way out, exempting from the cap the holds this router is about to pull, would let
prompts pin the whole pool whenever the decode side is slow: the cap exists for that case.)

`Capacity` is a FIFO of the requests waiting on one role. Room freed is signalled by what
frees it: a decode that started answering (it pulled its blocks), a released hold, a request
that finished; each signal wakes one waiter. A request that then got in wakes two more, so
the number retrying grows while there is room and stops at the first refusal, and a burst
retries about once per freed hold rather than all at once. A tick wakes the first waiter when
nothing signalled (room freed elsewhere: holds that expired, another router's pulls). While
requests wait, new ones queue behind them instead of trying first.
"""

from __future__ import annotations

import asyncio
import collections

TICK_S = 0.25  # wake the first waiter this often when nothing signalled
GROWTH = 2  # waiters a request that got in wakes


class Capacity:
    def __init__(self, role: str, tick_s: float = TICK_S) -> None:
        self.role = role
        self.tick_s = tick_s
        self.reason = ""  # the last busy answer's message (no internal addresses)
        self.code = ""
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ticker: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def declined(self, reason: str, code: str) -> None:
        """An instance of the role said it is busy (the reason a timed-out waiter is given)."""
        self.reason, self.code = reason, code

    async def wait(self, timeout: float, first: bool = False) -> None:
        """Until woken (room may be free: retry), or TimeoutError. first: back to the head of
        the line (a woken waiter that was refused again keeps its turn)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if first:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name=f"atom-room-{self.role}")
        try:
            await asyncio.wait_for(fut, timeout)
        finally:
            if not fut.done():
                fut.cancel()
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass  # woken: already off the line

    def freed(self, n: int = 1) -> None:
        """Room was freed (or a request got in): wake the first n waiters."""
        while n > 0 and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    def got_in(self) -> None:
        self.freed(GROWTH)

    async def _tick(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.tick_s)
            self.freed(1)

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
