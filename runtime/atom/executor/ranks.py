"""Rank 0's view of its worker processes: spawn them, send them commands, watch them die.

Each worker gets a command pipe (rank 0 writes; EOF tells the worker rank 0 is gone) and a
health pipe (the worker's last word before an error exit). A watcher thread waits on the
processes' sentinels: the first rank that exits while the group is not closing is reported
to `on_fatal` at once, since rank 0 may be blocked in a collective that rank will never join.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from atom.executor.messages import Shutdown, health_decoder
from atom.executor.worker import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

JOIN_S = 5.0  # for all workers together: one stuck in a collective is killed after it


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or could not be reached; the server cannot go on."""


@dataclass
class Rank:
    rank: int
    proc: BaseProcess
    commands: Connection  # rank 0's write end
    health: Connection  # rank 0's read end


@dataclass
class GroupSpec:
    config: Any  # atom.config.Config, finalized (every rank builds the same runner from it)
    world_size: int
    init_method: str
    device: str
    timeout_s: float
    log_level: str = "info"
    check_steps: bool = False  # compare every step's logits across ranks (ATOM_TP_CHECK_STEPS)


class WorkerGroup:
    def __init__(self, spec: GroupSpec, on_fatal: Callable[[str], None]) -> None:
        self.spec, self.on_fatal = spec, on_fatal
        self.ranks: list[Rank] = []
        self._closing = False
        self._failure: str | None = None
        self._failed = threading.Event()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._watcher: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid or 0 for r in self.ranks]

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        s = self.spec
        for rank in range(1, s.world_size):
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            health_r, health_w = ctx.Pipe(duplex=False)
            wspec = WorkerSpec(s.config, rank, s.world_size, s.init_method, s.device,
                               s.timeout_s, os.getpid(), cmd_r, health_w, s.log_level,
                               s.check_steps)
            # daemon: an exiting rank 0 (warmup, offline) takes its workers along
            proc = ctx.Process(target=worker_main, args=(wspec,), name=f"atom-tp-rank{rank}",
                               daemon=True)
            proc.start()
            cmd_r.close()  # only the worker holds these ends: EOF reaches each side
            health_w.close()
            self.ranks.append(Rank(rank, proc, cmd_w, health_r))
        logger.info("tensor parallel: %d ranks, workers %s", s.world_size, self.pids)
        self._watcher = threading.Thread(target=self._watch, name="atom-tp-watch", daemon=True)
        self._watcher.start()

    def send(self, data: bytes | bytearray) -> None:
        """One encoded command to every worker."""
        for r in self.ranks:
            try:
                r.commands.send_bytes(data)
            except OSError as exc:  # its pipe broke: it is gone (the watcher says why)
                raise RankFailed(self.failure(timeout=2.0) or
                                 f"tensor-parallel rank {r.rank} is unreachable: {exc}") from exc

    def failure(self, timeout: float = 0.0) -> str | None:
        """Why a rank died (None: none has, within timeout)."""
        self._failed.wait(timeout)
        return self._failure

    def close(self, timeout: float = JOIN_S) -> None:
        """Shut the workers down (Shutdown, then a kill for any that lingers)."""
        if self._closing:
            return
        self._closing = True
        self._wake_w.send_bytes(b"")
        data = msgspec.msgpack.encode(Shutdown())
        for r in self.ranks:
            try:
                r.commands.send_bytes(data)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for r in self.ranks:
            r.proc.join(max(0.0, deadline - time.monotonic()))
            if r.proc.is_alive():
                logger.warning("tensor-parallel rank %d did not stop: killing it", r.rank)
                r.proc.kill()
                r.proc.join(5)
            r.commands.close()
            r.health.close()

    # ---- the watcher thread -----------------------------------------------------------
    def _watch(self) -> None:
        by_sentinel = {r.proc.sentinel: r for r in self.ranks}
        ready = wait([*by_sentinel, self._wake_r])
        if self._closing:
            return
        dead = [by_sentinel[s] for s in ready if s in by_sentinel]
        if not dead:
            return
        reason = self._describe(dead[0])
        self._failure = reason
        self._failed.set()
        logger.error("%s: ending the server", reason)
        self.on_fatal(reason)

    def _describe(self, r: Rank) -> str:
        r.proc.join(1.0)
        code = r.proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        why = ""
        try:
            if r.health.poll(0):
                why = f": {health_decoder().decode(r.health.recv_bytes()).error}"
        except (OSError, EOFError, msgspec.DecodeError):
            pass
        return f"tensor-parallel rank {r.rank} (pid {r.proc.pid}) {how}{why}"
