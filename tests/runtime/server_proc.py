"""Start `atom-runtime serve` (or the router) as a real subprocess for the server and router tests."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from atom_devtools.localprocs import free_port

REPO = Path(__file__).resolve().parents[2]
TINY_SERVER_ARGS = [
    "--model",
    "tiny-llama",
    "--load-format",
    "dummy",
    "--level",
    "0",
    "--dtype",
    "float32",
]
# The children's output, kept for failure messages while this test process lives, then removed
# (a run leaves nothing in /tmp).
LOG_DIR = Path(tempfile.mkdtemp(prefix="atom-test-logs-"))
atexit.register(shutil.rmtree, LOG_DIR, True)


class Proc:
    """A child process serving HTTP on 127.0.0.1:port, with its output kept for failure messages."""

    def __init__(
        self, args: Sequence[str], port: int, log_name: str, env: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = LOG_DIR / f"{log_name}-{port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not healthy after {timeout_s}s:\n{self.log()}")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_server(*extra: str, port: int | None = None, env: dict[str, str] | None = None) -> Proc:
    port = port or free_port()
    return Proc(
        [
            "-m",
            "atom.cli.main",
            "serve",
            *TINY_SERVER_ARGS,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        port,
        "atom-server",
        env,
    )


def healthy_server(*extra: str, env: dict[str, str] | None = None) -> Iterator[Proc]:
    """For a module fixture (`yield from healthy_server(...)`): started, healthy, then stopped."""
    proc = start_server(*extra, env=env)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def start_router(
    prefill: Sequence[str],
    decode: Sequence[str],
    *extra: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    port = port or free_port()
    return Proc(
        [
            "-m",
            "atom.router.main",
            "--prefill",
            *prefill,
            "--decode",
            *decode,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        port,
        "atom-router",
        env,
    )


def kill_during_streams(url: str, pid: int, bodies: Sequence[dict],
                        timeout_s: float = 15.0) -> tuple[list[list[str]], float]:
    """Open a stream per body, SIGKILL `pid` once each has sent data, and read them to their
    end: each stream's `data:` lines (a last "cut: ..." when the connection broke), and the
    seconds from the kill until every stream had ended."""

    async def one(c: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list[str]:
        lines: list[str] = []
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            try:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        started.set()
                        lines.append(line)
            except httpx.HTTPError as exc:  # a cut connection is a clear failure too
                lines.append(f"cut: {exc!r}")
        return lines

    async def run() -> tuple[list[list[str]], float]:
        async with httpx.AsyncClient(timeout=60) as c:
            flags = [asyncio.Event() for _ in bodies]
            tasks = [asyncio.create_task(one(c, b, f)) for b, f in zip(bodies, flags, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            ends = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
            return ends, time.monotonic() - t0

    return asyncio.run(run())
