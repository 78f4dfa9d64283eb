"""A tensor-parallel worker (ranks 1..N-1): join the group, build the model runner, then do
what rank 0 says, in its order, until Shutdown.

The worker holds no scheduler and samples nothing: an ExecuteStep runs the forward rank 0
runs (the model's collectives pair the ranks up inside it) and drops the logits. It dies with
rank 0 (PR_SET_PDEATHSIG, a closed command pipe, a parent-pid poll); on any error it tells
rank 0 why over its health pipe and exits 1, which ends the server.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from atom.distributed.parallel_state import (
    STARTUP_TIMEOUT_S,
    destroy_tensor_parallel,
    init_tensor_parallel,
    set_collective_timeout,
)
from atom.engine.model_runner import ModelRunner
from atom.executor import messages as m
from atom.executor.lifetime import die_with_parent
from atom.executor.sync import (
    broadcast_from_rank0,
    logits_agree,
    min_across_ranks,
    same_across_ranks,
)

PARENT_POLL_S = 0.5

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Pickled to the spawned worker."""

    config: Any  # atom.config.Config, as rank 0 finalized it
    rank: int
    world_size: int
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:P
    device: str  # "cuda" (the rank's GPU: cuda:<rank>) or "cpu" (gloo)
    timeout_s: float  # a collective stuck longer than this fails the rank
    parent_pid: int
    commands: Connection
    health: Connection
    log_level: str = "info"
    check_steps: bool = False  # compare each step's logits with rank 0's (sync.logits_agree)


class RankZeroGone(RuntimeError):
    pass


def worker_main(spec: WorkerSpec) -> None:
    """The worker process' entry point."""
    die_with_parent(spec.parent_pid)
    # A process group of its own: a signal to the server's group (Ctrl-C, a supervisor's
    # SIGTERM) is the API server's to drain on; rank 0 stops us, or we die with it.
    os.setpgid(0, 0)
    logging.basicConfig(
        level=getattr(logging, spec.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    code = 0
    try:
        Worker(spec).run()
    except RankZeroGone as exc:
        logger.error("%s: exiting", exc)
        code = 1
    except BaseException as exc:
        if isinstance(exc, ValueError):  # a bad setting (rank 0 says the same): one line
            logger.error("tensor-parallel rank %d: %s", spec.rank, exc)
        else:
            logger.exception("tensor-parallel rank %d failed", spec.rank)
        try:
            spec.health.send_bytes(msgspec.msgpack.encode(
                m.WorkerFailed(spec.rank, f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
        code = 1
    logging.shutdown()
    os._exit(code)  # no atexit work: the model's memory goes with the process


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec

    def run(self) -> None:
        s = self.spec
        # The long start-up timeout until capture ends (parallel_state.STARTUP_TIMEOUT_S).
        init_tensor_parallel(s.rank, s.world_size, s.init_method, s.device, STARTUP_TIMEOUT_S)
        runner = ModelRunner(s.config)  # the model shards itself by tp_rank()/tp_size()
        device = runner.device
        self.runner = runner
        self.tables = m.TableDelta()
        self.pending = torch.zeros(runner.max_num_seqs, dtype=torch.long, device=device)
        logger.info("rank %d of %d ready on %s", s.rank, s.world_size, device)
        dec = m.command_decoder()
        steps = 0
        while True:
            msg = dec.decode(self._next())
            if isinstance(msg, m.ExecuteStep):
                self.step(msg)
                steps += 1
            elif isinstance(msg, m.DetermineBlocks):
                min_across_ranks(runner.determine_num_blocks(), device)
            elif isinstance(msg, m.AllocateKV):
                runner.allocate_kv_cache(msg.num_blocks)
            elif isinstance(msg, m.WarmupModel):
                runner.warmup_model()
            elif isinstance(msg, m.CaptureGraphs):
                _, sizes = runner.capture_cudagraph()
                if not same_across_ranks(list(sizes), device):
                    raise RuntimeError(f"rank {s.rank} captured buckets {sizes}, not rank 0's")
                set_collective_timeout(s.timeout_s)
            elif isinstance(msg, m.Shutdown):
                logger.info("rank %d: shut down after %d steps", s.rank, steps)
                destroy_tensor_parallel()
                return

    def _next(self) -> bytes:
        """The next command; waits as long as rank 0 lives (an idle server sends none)."""
        conn, parent = self.spec.commands, self.spec.parent_pid
        while not conn.poll(PARENT_POLL_S):
            if os.getppid() != parent:
                raise RankZeroGone(f"rank 0 (pid {parent}) is gone")
        try:
            return conn.recv_bytes()
        except EOFError:
            raise RankZeroGone(f"rank 0 (pid {parent}) closed the command pipe") from None

    def step(self, msg: m.ExecuteStep) -> None:
        pending = None
        if msg.pending != m.NO_PENDING:
            if msg.pending > self.pending.numel():
                self.pending = self.pending.new_zeros(msg.pending)
            pending = self.pending[: msg.pending]
            broadcast_from_rank0(pending)  # the previous step's sampled ids, from rank 0
        # The logits are only compared (check_steps), never sampled: rank 0 samples.
        logits, _ = self.runner.execute_model(msg.batch(self.tables), pending)
        if self.spec.check_steps and not logits_agree(logits, self.runner.device):
            raise RuntimeError(f"rank {self.spec.rank}'s logits differ from rank 0's")
