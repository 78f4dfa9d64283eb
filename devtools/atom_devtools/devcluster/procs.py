"""Child processes that cannot outlive the launcher: own process group, parent-death signal."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from .errors import tail

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def _die_with_parent() -> None:
    # Runs in the child before exec: SIGKILL it when the parent dies (even by SIGKILL).
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Process:
    """One component: started in its own session, output to `log`."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(("$ " + " ".join(self.argv) + "\n").encode())
            out.flush()
            # The death signal tracks the creating *thread*; only arm it from the main thread,
            # where it means "the launcher process is gone".
            main = threading.current_thread() is threading.main_thread()
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True, preexec_fn=_die_with_parent if main else None,
            )

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)  # the whole group: helpers a component forks die too
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> bool:
        """Whether the whole group ended within `timeout`: the leader can exit before members
        it started (the runtime's engine-core process exits after its API server)."""
        if self.popen is None:
            return True
        deadline = time.monotonic() + timeout
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        while _group_alive(self.popen.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def describe_exit(self) -> str:
        state = "is running" if self.alive else f"exited with {self.popen and self.popen.returncode}"
        return f"{self.name} {state}; last lines of {self.log}:\n{tail(self.log)}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_all(procs: list[Process], grace: float = 10.0) -> None:
    """SIGTERM every group at once, SIGKILL what is left after `grace` seconds."""
    for proc in procs:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        if not proc.wait(max(0.0, deadline - time.monotonic())):
            proc.signal(signal.SIGKILL)
            proc.wait(5)

def free_ports(count: int) -> list[int]:
    """Distinct free ports on 127.0.0.1 (all held open together so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
