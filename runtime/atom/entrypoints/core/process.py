"""Starting the engine core in its own process, and tying its life to its parent's.

The core is spawned (not forked: the parent may hold threads and an event loop) and asks the
kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG), with a getppid() poll in the loop
as a second guard, so no orphan keeps the GPU. It ignores SIGINT/SIGTERM: the API server owns
the drain and tells the core when to stop.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from atom.entrypoints.core.channel import socket_path
from atom.entrypoints.core.engine_core import CoreEndpoints
from atom.executor.lifetime import die_with_parent

if TYPE_CHECKING:
    from atom.config import Config
    from atom.disagg.service import KVService
    from atom.engine.api import EngineAPI

logger = logging.getLogger(__name__)


def new_endpoints(num_api_servers: int) -> CoreEndpoints:
    """Unix socket paths in a fresh private directory (atom.entrypoints.core.channel)."""
    base = tempfile.mkdtemp(prefix="atom-ipc-")
    return CoreEndpoints(
        input=f"ipc://{base}/core-in",
        outputs=[f"ipc://{base}/api-{i}" for i in range(num_api_servers)],
    )


def remove_endpoints(endpoints: CoreEndpoints) -> None:
    """Remove new_endpoints' socket files and their directory (what is there of them)."""
    paths = [socket_path(a) for a in (endpoints.input, *endpoints.outputs)]
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    with contextlib.suppress(OSError):  # not ours, or not empty: left alone
        os.rmdir(os.path.dirname(paths[0]))


@dataclass
class KVSettings:
    """atom.disagg.service.KVService's settings, built into one inside the core (which keeps
    torch out of the API server)."""

    host: str = "0.0.0.0"
    port: int | None = None  # None: serves no blocks (0: any free port)
    advertise_host: str | None = None
    hold_seconds: float = 30.0
    pull_timeout: float = 30.0
    max_held_fraction: float = 0.5  # --max-held-kv-fraction
    transport: str = "auto"  # --kv-transport (atom.disagg.transport.TransportMode)

    def service(self) -> KVService:
        from atom.disagg.service import KVService

        return KVService(**asdict(self))


@dataclass
class CoreSpec:
    """Everything the core process needs; pickled to the spawned child."""

    config: Config
    endpoints: CoreEndpoints
    kv: KVSettings | None
    parent_pid: int
    log_level: str = "info"


def core_main(spec: CoreSpec) -> None:
    """The core process' entry point."""
    die_with_parent(spec.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=getattr(logging, spec.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s core %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from atom.entrypoints.core.engine_core import EngineCore
    from atom.entrypoints.core.kv import CoreKV

    def build() -> EngineAPI:
        from atom.engine import LLMEngine

        # A dead tensor-parallel rank ends the core at once, reported as the reason
        return LLMEngine(spec.config, on_fatal=core.fatal)

    core = EngineCore(build, spec.endpoints, parent_pid=spec.parent_pid)
    core.kv = CoreKV(spec.kv.service(), core.wake) if spec.kv is not None else None
    code = core.run()
    logging.shutdown()
    os._exit(code)  # no atexit work: the engine's memory goes with the process


def spawn_core(spec: CoreSpec) -> multiprocessing.process.BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(
        target=core_main, args=(spec,), name="atom-engine-core", daemon=False
    )
    proc.start()
    return proc
