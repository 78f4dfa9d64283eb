"""Compilers that turn one FX graph piece into a callable and persist it.

InductorStandaloneAdaptor (torch >= 2.8) saves each piece with
torch._inductor.standalone_compile as a single binary file. Files are content-addressed
(name carries the sha256 of the bytes) and written temp + rename, so concurrent writers
never clobber each other and a reader can verify what it loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any, Literal

import torch

from atom.utils.counters import counters

logger = logging.getLogger(__name__)


class CorruptArtifactError(RuntimeError):
    """A cached artifact is missing, truncated or does not match its recorded checksum."""


class CompilerInterface:
    """The contract every compiler backend implements (see the guide)."""

    name: str = "base"

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False, prefix: str = "") -> None:
        self.cache_dir = cache_dir
        self.disable_cache = disable_cache
        self.prefix = prefix

    def compute_hash(self, atom_config: Any) -> str:
        """Compiler-specific state that invalidates the cache (options, versions)."""
        return ""

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: int | None = None,
        key: str | None = None,
    ) -> tuple[Callable | None, Any]:
        """Returns (compiled callable, handle to load it later or None)."""
        raise NotImplementedError

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        runtime_shape: int | None = None,
    ) -> Callable:
        raise NotImplementedError


class AlwaysHitShapeEnv:
    """A shape environment whose guards always pass.

    Inductor's FX-graph cache evaluates shape guards on lookup; outside Dynamo's tracing
    there is no ShapeEnv, and this stand-in makes the lookup succeed (the custom dispatcher
    already guarantees the shapes are the ones compiled for).
    """

    def __init__(self) -> None:
        self.guards: list[Any] = []

    def evaluate_guards_expression(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def get_pruned_guards(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    def produce_guards_expression(self, *args: Any, **kwargs: Any) -> str:
        return ""


def _graph_returns_tuple(graph: torch.fx.GraphModule) -> bool:
    from torch._inductor.compile_fx import graph_returns_tuple

    return graph_returns_tuple(graph)


def _unwrap_outputs(fn: Callable, returns_tuple: bool) -> Callable:
    """Loaded Inductor code always returns a list; the piece may return one tensor."""

    def wrapper(*args: Any) -> Any:
        out = fn(*args)
        return out if returns_tuple else out[0]

    return wrapper


def _shape_config(config: dict[str, Any], runtime_shape: int | None) -> dict[str, Any]:
    cfg = dict(config)
    # Kernel autotuning for a fixed size is worth it on GPU (the guide); on CPU it only
    # costs compile time.
    if isinstance(runtime_shape, int) and torch.cuda.is_available():
        cfg.setdefault("max_autotune", True)
        cfg.setdefault("coordinate_descent_tuning", True)
    return cfg


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write to a temp file in the same directory, then rename over the target."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _user_chose(var: str) -> bool:
    value = os.environ.get(var)
    if not value or os.environ.get(f"_ATOM_SET_{var}"):
        return False
    if var == "TORCHINDUCTOR_CACHE_DIR":
        # Inductor writes its default into the environment the first time it needs it.
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return value != default_cache_dir()
    return True


def redirect_kernel_caches(base_dir: str) -> None:
    """Keep Inductor's and Triton's own caches inside the compile cache.

    A loaded artifact still needs its kernels' binaries (the C++ .so on CPU, Triton's
    compiled kernels on GPU); with these caches on the shared volume a fresh pod finds them
    instead of rebuilding. A TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR set by the user wins.
    """
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor_cache"), ("TRITON_CACHE_DIR", "triton_cache")):
        if _user_chose(var):
            continue
        path = os.path.join(base_dir, sub)
        os.makedirs(path, exist_ok=True)
        os.environ[var] = path
        os.environ[f"_ATOM_SET_{var}"] = "1"  # ours: a later cache dir may move it again


class _InductorCompiler(CompilerInterface):
    """Both Inductor adaptors: Inductor's and Triton's kernel caches live in the compile cache."""

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False, prefix: str = "") -> None:
        super().initialize_cache(cache_dir, disable_cache, prefix)
        if not disable_cache:
            redirect_kernel_caches(os.path.dirname(cache_dir.rstrip(os.sep)) if prefix else cache_dir)


class InductorStandaloneAdaptor(_InductorCompiler):
    """torch._inductor.standalone_compile + CompiledArtifact.save/load (binary format)."""

    name = "inductor_standalone"
    save_format: Literal["binary", "unpacked"] = "binary"

    def __init__(self) -> None:
        super().__init__()
        self._loaded: dict[str, Any] = {}  # artifact digest -> loaded artifact

    def compute_hash(self, atom_config: Any) -> str:
        from atom.compilation.hashing import stable_hash

        return stable_hash({"name": self.name, "format": self.save_format})

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: int | None = None,
        key: str | None = None,
    ) -> tuple[Callable | None, Any]:
        from torch._inductor import standalone_compile

        # A concrete size compiles from the real example inputs; the general shape reuses
        # Dynamo's symbolic shapes (we are inside the backend call then).
        dynamic: Literal["from_example_inputs", "from_tracing_context"] = (
            "from_example_inputs" if isinstance(runtime_shape, int) else "from_tracing_context")
        artifact = standalone_compile(
            graph,
            list(example_inputs),
            dynamic_shapes=dynamic,
            options={"config_patches": _shape_config(compiler_config, runtime_shape)},
        )
        if self.disable_cache or key is None:
            return artifact, None
        handle = self._save(artifact, key)
        return artifact, handle

    def _save(self, artifact: Any, key: str) -> tuple[str, str, str] | None:
        os.makedirs(self.cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".tmp-", suffix=".bin")
        os.close(fd)
        try:
            artifact.save(path=tmp, format=self.save_format)
            with open(tmp, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            filename = f"{key}.{digest[:16]}.bin"
            os.replace(tmp, os.path.join(self.cache_dir, filename))
        except Exception as exc:  # an unserialisable graph still runs, it just isn't cached
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            logger.warning("could not save compiled artifact %s: %s", key, exc)
            return None
        counters.inc("artifacts_saved")
        return (key, filename, digest)

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        runtime_shape: int | None = None,
    ) -> Callable:
        key, filename, digest = handle
        if digest in self._loaded:  # a repeated layer's piece: same bytes, loaded once
            counters.inc("artifacts_reused")
            return _unwrap_outputs(self._loaded[digest], _graph_returns_tuple(graph))
        path = os.path.join(self.cache_dir, filename)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CorruptArtifactError(f"artifact {filename} unreadable: {exc}") from exc
        if hashlib.sha256(data).hexdigest() != digest:
            raise CorruptArtifactError(f"artifact {filename} does not match its checksum")
        try:
            artifact = torch._inductor.CompiledArtifact.load(path=path, format=self.save_format)
        except Exception as exc:
            raise CorruptArtifactError(f"artifact {filename} failed to load: {exc}") from exc
        counters.inc("artifacts_loaded")
        self._loaded[digest] = artifact
        return _unwrap_outputs(artifact, _graph_returns_tuple(graph))


class InductorAdaptor(_InductorCompiler):
    """compile_fx for torch < 2.8: Inductor's own FX-graph cache, kept under our cache dir.

    It has no portable handle, so a warm start re-runs compile_fx, which then hits
    Inductor's FX-graph cache (redirected into the compile cache) instead of generating code.
    """

    name = "inductor"

    def compute_hash(self, atom_config: Any) -> str:
        from atom.compilation.hashing import stable_hash

        return stable_hash({"name": self.name})

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: int | None = None,
        key: str | None = None,
    ) -> tuple[Callable | None, Any]:
        import copy

        from torch._inductor.compile_fx import compile_fx

        cfg = _shape_config(compiler_config, runtime_shape)
        cfg.setdefault("fx_graph_cache", True)
        compiled = compile_fx(copy.deepcopy(graph), list(example_inputs), config_patches=cfg)
        assert callable(compiled)  # the str and weights results are AOT mode's, not used here
        return compiled, None

    def load(self, handle: Any, graph: Any, example_inputs: Any, graph_index: int, runtime_shape: int | None = None) -> Callable:
        raise CorruptArtifactError("InductorAdaptor keeps no loadable handles")


class EagerAdaptor(CompilerInterface):
    """use_inductor=False: pieces run as plain FX graphs (nothing to persist)."""

    name = "eager"

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: int | None = None,
        key: str | None = None,
    ) -> tuple[Callable | None, Any]:
        return graph, None

    def load(self, handle: Any, graph: Any, example_inputs: Any, graph_index: int, runtime_shape: int | None = None) -> Callable:
        return graph


def make_compiler(use_inductor: bool = True) -> CompilerInterface:
    if not use_inductor:
        return EagerAdaptor()
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 8):
        return InductorStandaloneAdaptor()
    return InductorAdaptor()
