"""The rank-0 side: the seam between the engine and its model runner(s).

`ModelExecutor` (atom.executor.protocol, re-exported here) is what the engine calls on its
runner for the calls every rank must make in lock-step. One rank: the engine holds a plain ModelRunner (it is the single-process executor;
no extra process, no message per step). N ranks: `MultiprocExecutor` spawns ranks 1..N-1,
joins the group, builds rank 0's own runner, and before each such call sends the workers the
same command (one encoded ExecuteStep per step, into a reused buffer), then runs it locally.
Everything else (device, kv_cache, graph_runner, ...) is rank 0's runner's, read through.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from atom.distributed.parallel_state import (
    DEFAULT_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    destroy_tensor_parallel,
    init_tensor_parallel,
    set_collective_timeout,
)
from atom.engine.batch import StepBatch
from atom.engine.model_runner import ModelRunner
from atom.executor import messages as m
from atom.executor.checks import check_tensor_parallel
from atom.executor.protocol import ModelExecutor
from atom.executor.ranks import GroupSpec, WorkerGroup
from atom.executor.sync import (
    broadcast_from_rank0,
    logits_agree,
    min_across_ranks,
    same_across_ranks,
)

logger = logging.getLogger(__name__)
__all__ = ["ModelExecutor", "MultiprocExecutor", "exit_now", "local_init_method"]

CHECK_STEPS_ENV = "ATOM_TP_CHECK_STEPS"  # "1": every step's logits compared across ranks
TIMEOUT_ENV = "ATOM_TP_COLLECTIVE_TIMEOUT_S"  # after warm-up (default DEFAULT_TIMEOUT_S)


def exit_now(reason: str) -> None:
    """on_fatal without an engine core (warmup, offline): rank 0 may be stuck in a collective
    with the dead rank, so end the process here."""
    print(f"atom-runtime: error: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


def local_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class MultiprocExecutor:
    """Rank 0 of N: its own ModelRunner plus the workers that mirror it."""

    def __init__(self, local: ModelRunner, group: WorkerGroup) -> None:
        self.local, self.group = local, group
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray(64 * 1024)  # one step's encoding, reused
        self._tables = m.TableDelta()

    @classmethod
    def start(cls, config: Any, hf_config: Any,
              on_fatal: Callable[[str], None] | None = None,
              timeout_s: float | None = None) -> MultiprocExecutor:
        """Spawn the workers, join the group as rank 0, build rank 0's runner. config must
        be final (the workers build theirs from a copy). on_fatal(reason): a rank died."""
        if timeout_s is None:
            timeout_s = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
        n = int(config.tensor_parallel_size)
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        visible = torch.cuda.device_count() if device.startswith("cuda") else None
        check_tensor_parallel(config, device, visible)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        check = os.environ.get(CHECK_STEPS_ENV) == "1"
        spec = GroupSpec(config, n, local_init_method(), device, timeout_s, level, check)
        group = WorkerGroup(spec, on_fatal or exit_now)
        group.start()
        try:
            init_tensor_parallel(0, n, spec.init_method, device, STARTUP_TIMEOUT_S)
            local = ModelRunner(config, hf_config)
        except BaseException:
            group.close()
            destroy_tensor_parallel()
            raise
        return cls(local, group)

    def __getattr__(self, name: str) -> Any:
        if name in ("local", "group"):  # not set yet (half-built): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def tp_pids(self) -> list[int]:
        return [os.getpid(), *self.group.pids]

    def failure(self, timeout: float = 0.0) -> str | None:
        """Why a rank died (waits up to timeout for the watcher's verdict)."""
        return self.group.failure(timeout)

    def _send(self, msg: Any) -> None:
        self._enc.encode_into(msg, self._buf)
        self.group.send(self._buf)

    # ---- lock-step calls --------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        self._send(m.DetermineBlocks())
        return min_across_ranks(self.local.determine_num_blocks(), self.local.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send(m.AllocateKV(num_blocks))
        self.local.allocate_kv_cache(num_blocks)

    def warmup_model(self) -> float:
        self._send(m.WarmupModel())
        return self.local.warmup_model()

    def capture_cudagraph(self) -> tuple[float, list[int]]:
        self._send(m.CaptureGraphs())
        seconds, sizes = self.local.capture_cudagraph()
        if not same_across_ranks(list(sizes), self.local.device):
            raise RuntimeError(f"the ranks captured different buckets (rank 0: {sizes})")
        set_collective_timeout(self.group.spec.timeout_s)  # warm-up is over (the workers too)
        return seconds, sizes

    def execute_model(self, batch: StepBatch, pending_tokens: torch.Tensor | None = None,
                      spec: Any = None) -> tuple[torch.Tensor, list[int]]:
        if spec is not None:  # check_tensor_parallel refuses speculative decoding
            raise NotImplementedError("verify steps are not run across tensor-parallel ranks")
        if pending_tokens is not None and not pending_tokens.is_contiguous():
            pending_tokens = pending_tokens.contiguous()
        n = m.NO_PENDING if pending_tokens is None else int(pending_tokens.shape[0])
        self._send(m.ExecuteStep.of(batch, n, self._tables))
        if pending_tokens is not None:
            broadcast_from_rank0(pending_tokens)
        logits, sampled = self.local.execute_model(batch, pending_tokens)
        if self.group.spec.check_steps and not logits_agree(logits, self.local.device):
            raise RuntimeError("the tensor-parallel ranks computed different logits")
        return logits, sampled

    def shutdown(self) -> None:
        self.group.close()
        destroy_tensor_parallel()
