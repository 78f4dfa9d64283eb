"""The `go` client: locating it, checking its version, and running it with a log per step."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import versions
from .errors import ProvisionError, tail

# Where Go's tarball and Debian's golang-go put it when PATH lacks it.
GO_FALLBACKS = ("/usr/local/go/bin/go", "/usr/lib/go/bin/go")


def find_go() -> str:
    go = shutil.which("go") or next((p for p in GO_FALLBACKS if os.access(p, os.X_OK)), None)
    if not go:
        raise ProvisionError(
            "go not found: building etcd, kube-apiserver, kube-controller-manager, kube-scheduler, "
            f"kwok and helm needs the go client (>= {_min_go()}) on PATH"
        )
    out = subprocess.run([go, "version"], capture_output=True, text=True).stdout
    match = re.search(r"go(\d+)\.(\d+)", out)
    if not match or (int(match[1]), int(match[2])) < versions.MIN_GO:
        raise ProvisionError(
            f"go too old: {out.strip()!r}; the pinned modules need go >= {_min_go()}"
        )
    return go


def _min_go() -> str:
    return ".".join(map(str, versions.MIN_GO))


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Static binaries, no surprise toolchain downloads, no VCS stamping of the wrapper modules.
    env.update(CGO_ENABLED="0", GOTOOLCHAIN="local", GOFLAGS="-buildvcs=false")
    return env


def run(cmd: list[str], *, what: str, log: Path, cwd: Path, env: dict[str, str] | None = None,
        ) -> str:
    """Run one step, appending its output to `log`; on failure raise with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env or go_env(), stdout=subprocess.PIPE,
                              stderr=fh, text=True)
        fh.write(proc.stdout)
    if proc.returncode != 0:
        raise ProvisionError(
            f"{what} failed (exit {proc.returncode}); full log: {log}\n{tail(log)}"
        )
    print(f"  {what}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    return proc.stdout


def ldflags_x(values: dict[str, str]) -> str:
    """`-s -w` (smaller binaries; linker-only, so the compile cache still hits) plus -X pairs."""
    return " ".join(["-s", "-w"] + [f"-X {k}={v}" for k, v in values.items()])
