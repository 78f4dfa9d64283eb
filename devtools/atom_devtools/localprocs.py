"""Local child processes of the demo and the tests: the operator and one CPU runtime, each in its
own session, stopped with the demo; a free port; the check that nothing is left running.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from atom_devtools.devcluster.procs import Process, stop_all


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 2) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except OSError as error:
        return 0, str(error)


class Child:
    """A child process in its own session that dies with the demo (devcluster's Process)."""

    name = "child"

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        self.proc = Process(self.name, argv, log_path, env=env)

    @property
    def pid(self) -> int:
        assert self.proc.popen is not None, "not started"
        return self.proc.popen.pid

    def _check_alive(self) -> None:
        if not self.proc.alive:
            code = self.proc.popen.returncode if self.proc.popen else None
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        self.proc.start()

    def stop(self, grace: float = 20) -> None:
        stop_all([self.proc], grace=grace)  # SIGTERM (both shut down in order), then SIGKILL


class LocalOperator(Child):
    """`python -m atom_operator.main` as a child process, with its log in a file."""

    name = "atom-operator"

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        namespaces: Sequence[str] = (),
        reconcile_interval: float = 2.0,
    ) -> None:
        self.health_port, self.metrics_port = free_port(), free_port()
        full_env = dict(os.environ, **env)
        full_env.update(
            ATOM_OPERATOR_NAMESPACES=",".join(namespaces),
            ATOM_OPERATOR_RECONCILE_INTERVAL=str(reconcile_interval),
            ATOM_OPERATOR_HEALTH_PORT=str(self.health_port),
            ATOM_OPERATOR_METRICS_PORT=str(self.metrics_port),
            PYTHONUNBUFFERED="1",
        )
        super().__init__([sys.executable, "-m", "atom_operator.main"], log_path, full_env)

    def __enter__(self) -> LocalOperator:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reconciles(self) -> int:
        """Reconciles done since it started (its /metrics): how a test knows a pass happened."""
        code, text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        found = re.search(r"^atom_operator_reconciles_total (\S+)$", text, re.M)
        if code != 200 or found is None:
            raise RuntimeError(f"no reconcile count on :{self.metrics_port}: {code} {text[:200]}")
        return int(float(found[1]))

    def wait_healthy(self, timeout: float = 60) -> None:
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if http_get(url)[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"operator not healthy on {url} after {timeout}s:\n{self.log_tail()}")


class RuntimeProcess(Child):
    """One real `atom-runtime serve` on the CPU, stopped on exit."""

    name = "atom-runtime"

    def __init__(self, model: str, port: int, log_path: Path) -> None:
        script = Path(sys.executable).with_name("atom-runtime")  # the console script, as documented
        launcher = [str(script)] if script.exists() else [sys.executable, "-m", "atom.cli.main"]
        self.port = port
        self.argv = [
            *launcher, "serve",
            "--model", model, "--load-format", "dummy", "--level", "0",
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        super().__init__(self.argv, log_path, dict(os.environ, PYTHONUNBUFFERED="1"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RuntimeProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=15)

    def wait_healthy(
        self, timeout: float = 300, progress: Callable[[str], None] | None = None
    ) -> None:
        """Poll /health (503 with a reason until compile and capture are done)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            code, body = http_get(self.url + "/health")
            if code == 200:
                return
            line = f"/health -> {code} {body.strip()[:100]}" if code else "/health -> no answer yet"
            if progress and line != last:
                progress(line)
                last = line
            time.sleep(0.5)
        raise TimeoutError(f"atom-runtime not healthy after {timeout}s:\n{self.log_tail()}")


def leftovers(pids: Sequence[int]) -> list[int]:
    """Process groups (one per child, each led by its pid) that still have a live member."""
    alive = []
    for pid in pids:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        alive.append(pid)
    return alive
