"""What the bench scripts share: the repository root and commit, the benchmarked model's shape,
the device copy rate, timing in a CUDA graph, polling, and `atom-runtime` child processes.

Run a script from the repository root as `python3 bench/X.py` with
`PYTHONPATH=runtime:operator`: Python puts the script's folder first on sys.path, so this module
and the other scripts import by name. torch is imported only inside the functions that need it,
so the operator and serving benches load this module without it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama-3.2-1b"  # the decode benches' model shape (built in, dummy weights)
CALLS = 20  # calls recorded back to back in one graph by time_graph
T = TypeVar("T")


def git_commit(short: bool = False) -> str:
    """HEAD of the checkout the bench runs from, "-dirty" after it when the files differ from
    it (the device tool's copy carries an older .git under the working tree it sends), or
    "unknown" without git."""
    cmd = ["git", "describe", "--always", "--dirty", f"--abbrev={7 if short else 40}"]
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def emit_report(report: dict[str, Any], out: str | None) -> None:
    """The report as JSON on stdout, and into `out` when given (the scripts' --out)."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def projection_shapes(c: Any) -> dict[str, tuple[int, int]]:
    """A decoder layer's projection weights from a model config: name -> (rows, K)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }


def sync() -> None:
    import torch

    torch.cuda.synchronize()


def copy_rate_bytes_per_s(nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device copy rate counting the bytes read and written (2 x size per copy)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync()
    rate = 2 * nbytes * iters / (time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return rate


def record_graph(fn: Callable[[], Any], calls: int = 1) -> Any:
    """fn run once (its kernels compiled), then recorded `calls` times in one CUDA graph that
    is replayed once before it is returned."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    sync()
    return g


def time_graph(fn: Callable[[], Any], iters: int = 50) -> float:
    """Microseconds per call of fn, recorded CALLS times in one graph: the median of 5 runs
    of `iters` replays (launch cost as in a decode graph)."""
    g = record_graph(fn, CALLS)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        sync()
        samples.append((time.perf_counter() - t0) / iters / CALLS * 1e6)
    return sorted(samples)[len(samples) // 2]


def wait_for(fn: Callable[[], T], *, timeout: float, what: str, interval: float = 0.25) -> T:
    """fn() polled until it is truthy; a raise counts as not yet (an API server that is busy
    or starting). TimeoutError naming `what` and the last answer at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - kept as the last answer
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"{what}: not after {timeout} s (last: {last!r})")


# One shared secret for the router and the instances it starts, so a P/D pull is honoured
# where the runtime checks ATOM_INTERNAL_TOKEN (ignored where it does not).
_TOKEN = os.environ.get("ATOM_INTERNAL_TOKEN") or secrets.token_hex(16)


class Served:
    """`python -m <argv>` as a child process in the repository root that answers GET
    <health> on 127.0.0.1:port with 200 once ready; its output in $TMPDIR/<log>-<port>.log."""

    def __init__(self, argv: Sequence[str], port: int, log: str, *, health: str = "/health",
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health_url = self.url + health
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{log}-{port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        with self.log_path.open("wb") as out:  # the child keeps its own handle
            self.proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT, env=env)  # fmt: skip

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"{self.url} exited with {self.proc.returncode}:\n"
                    + self.log_path.read_text(errors="replace")[-4000:]
                )
            with urllib.request.urlopen(self.health_url, timeout=2) as r:
                return r.status == 200

        wait_for(healthy, timeout=timeout_s, what=self.health_url, interval=0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(*args: str) -> Served:
    """`atom-runtime serve` with these flags (the later of two equal flags wins)."""
    port = free_port()
    argv = ["atom.cli.main", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    return Served(argv, port, "atom-server", env={"ATOM_INTERNAL_TOKEN": _TOKEN})


def start_router(prefill: Sequence[str], decode: Sequence[str]) -> Served:
    port = free_port()
    argv = ["atom.router.main", "--prefill", *prefill, "--decode", *decode,
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return Served(argv, port, "atom-router", env={"ATOM_INTERNAL_TOKEN": _TOKEN})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def long_tiny_llama(directory: Path, max_position_embeddings: int = 8192) -> Path:
    """A config.json directory of tiny-llama's shape that takes longer prompts than its 2,048
    positions (dummy weights; no tokenizer.json, so the server's tokenizer is byte-level)."""
    import json

    from atom.models.registry import BUILTIN_SHAPES

    shape = BUILTIN_SHAPES["tiny-llama"].to_dict()
    keep = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id")  # fmt: skip
    data = {k: shape[k] for k in keep}
    data["max_position_embeddings"] = max_position_embeddings
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(data))
    return directory


def archived_runtime(rev: str, directory: Path) -> Path:
    """REV's runtime/ (git archive) unpacked under directory: a --compare run's "before"."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "runtime"],
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory / "runtime"
