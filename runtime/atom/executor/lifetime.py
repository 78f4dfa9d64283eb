"""Tying a child process' life to its parent's (engine core, TP workers, API servers)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits (Linux); exit now if it already has.
    The signal follows the parent *thread* that spawned us: spawn from a long-lived one."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the callers' getppid() polls still guard
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
