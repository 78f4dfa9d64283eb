"""Blocks a prefill instance keeps after its prompt ran, until a decode instance pulls them.

The engine thread adds holds (when a prefill sequence finishes) and takes back freed blocks
(`reclaim`, every loop turn); the KV server's threads pull and release. A hold ends when it was
pulled (the decode acknowledged every byte), released, or its deadline passed while no pull was
running; its blocks then go back to the engine's free list. A pull in progress is never cut
short by the deadline, and a failed pull leaves the hold in place for the decode's one retry.

`HoldCap` bounds what holds may pin: a prefill reserves its prompt's blocks before it runs, and
is refused (HoldCapExceeded, answered 503 `kv_hold_cap`) when held + reserved + its own would
pass the cap, so prompts nobody pulls cannot starve the engine of blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Hold:
    handle: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    pulls: int = 0  # pulls in progress
    done: bool = False  # pulled or released: free at the next reclaim


@dataclass
class HoldStats:
    held: int = 0  # holds ever made
    pulled: int = 0
    released: int = 0
    expired: int = 0


class KVHoldRegistry:
    def __init__(self, hold_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if hold_seconds <= 0:
            raise ValueError(f"kv hold seconds must be > 0, got {hold_seconds}")
        self.hold_seconds = float(hold_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self.stats = HoldStats()
        self._blocks_held = 0

    # ---- engine thread ------------------------------------------------------------------------
    def hold(self, handle: str, block_ids: list[int], num_tokens: int) -> bool:
        """False (nothing held) if the handle is taken: the caller frees the blocks."""
        with self._lock:
            if handle in self._holds:
                return False
            self._holds[handle] = Hold(
                handle, list(block_ids), num_tokens, self._clock() + self.hold_seconds
            )
            self._blocks_held += len(block_ids)
            self.stats.held += 1
            return True

    def reclaim(self) -> list[int]:
        """Blocks of holds that are done or expired, removed from the registry."""
        now = self._clock()
        freed: list[int] = []
        with self._lock:
            for handle, h in list(self._holds.items()):
                if h.pulls:  # being read: never freed under a reader
                    continue
                expired = not h.done and now >= h.deadline
                if h.done or expired:
                    del self._holds[handle]
                    freed.extend(h.block_ids)
                    self._blocks_held -= len(h.block_ids)
                    if expired:
                        self.stats.expired += 1
        return freed

    # ---- KV server ----------------------------------------------------------------------------
    def begin_pull(self, handle: str) -> Hold | None:
        """The hold, marked as being read (its blocks stay put); None if unknown or ended."""
        with self._lock:
            h = self._holds.get(handle)
            if h is None or h.done or (h.pulls == 0 and self._clock() >= h.deadline):
                return None
            h.pulls += 1
            return h

    def end_pull(self, handle: str, pulled: bool) -> None:
        with self._lock:
            h = self._holds.get(handle)
            if h is None:
                return
            h.pulls -= 1
            if pulled and not h.done:
                h.done = True
                self.stats.pulled += 1

    def release(self, handle: str) -> bool:
        """Drop a hold unread (the decode did not need the blocks). False if unknown."""
        with self._lock:
            h = self._holds.get(handle)
            if h is None or h.done:
                return False
            h.done = True
            self.stats.released += 1
            return True

    # ---- introspection ------------------------------------------------------------------------
    @property
    def num_holds(self) -> int:
        return len(self._holds)

    @property
    def num_blocks_held(self) -> int:
        return self._blocks_held

    def describe(self, handle: str) -> str:
        """Why a handle cannot be pulled, for the error message (bounded: the peer chose it)."""
        return (
            f"KV handle {handle[:80]!r} is unknown: already pulled, released, or expired "
            f"(blocks are held {self.hold_seconds:g}s)"
        )


class HoldCapExceeded(Exception):
    """A prefill would pin more blocks than the cap allows; the message gives the numbers."""


class Reservation:
    """Blocks reserved for one prefill until its hold is registered (or it failed)."""

    def __init__(self, cap: HoldCap, blocks: int) -> None:
        self._cap, self.blocks = cap, blocks

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cap.unreserve(self)


class HoldCap:
    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"--max-held-kv-fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self._lock = threading.Lock()
        self.reserved = 0
        self.refused = 0  # prefills answered kv_hold_cap

    def limit(self, total_blocks: int) -> int:
        return int(total_blocks * self.fraction)

    def reserve(self, blocks: int, held: int, total_blocks: int) -> Reservation:
        """A reservation of `blocks`, or HoldCapExceeded; `held`: blocks holds pin now."""
        limit = self.limit(total_blocks)
        with self._lock:
            if held + self.reserved + blocks > limit:
                self.refused += 1
                raise HoldCapExceeded(
                    f"KV blocks held for transfers are at their cap: {held} held and "
                    f"{self.reserved} reserved of {limit} ({self.fraction:g} of {total_blocks}); "
                    f"this prompt needs {blocks} more. Retry once decode instances pull them."
                )
            self.reserved += blocks
        return Reservation(self, blocks)

    def unreserve(self, reservation: Reservation) -> None:
        with self._lock:
            self.reserved -= reservation.blocks
            reservation.blocks = 0
