"""The runtime's layout: the guide's import paths still work, and imports point downwards.

The import-direction rules are those of docs/architecture.md ("Packages and their allowed
imports"); they are checked on the source with `ast`, so an import inside a function counts.
Across the runtime, the operator and the dev tools no two modules import each other (through
any chain, lazy and TYPE_CHECKING imports included), no module takes another's private names,
and no project code imports a re-export module: those paths are the guide's, for users.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import import_graph
import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "runtime" / "atom"

# Every import path of the guide's quick-reference and source-files tables, with its names.
GUIDE_PATHS = {
    "atom.config": ["CompilationLevel", "CompilationConfig", "CUDAGraphMode", "Config"],
    "atom.utils.region_graph": [
        "TokenGraph",
        "ReqGraph",
        "eager_region",
        "token_graph",
        "graph_pool",
    ],
    "atom.utils.forward_context": [
        "ForwardContext",
        "Context",
        "AttentionMetaData",
        "DPMetadata",
        "set_forward_context",
        "get_forward_context",
    ],
    "atom.utils.backends": [
        "VllmBackend",
        "CompilerManager",
        "SplitItem",
        "split_graph",
        "PiecewiseCompileInterpreter",
    ],
    "atom.utils.compiler_inferface": [
        "CompilerInterface",
        "InductorAdaptor",
        "InductorStandaloneAdaptor",
        "AlwaysHitShapeEnv",
    ],
    "atom.utils.cuda_piecewise_backend": ["PiecewiseBackend", "ConcreteSizeEntry"],
    "atom.utils.decorators": [
        "support_torch_compile",
        "TorchCompileWrapperWithCustomDispatcher",
        "start_monitoring_torch_compile",
    ],
    "atom.utils.custom_register": ["direct_register_custom_op", "aiter_lib"],
    "atom.model_engine.model_runner": ["ModelRunner"],
}
# Each guide path that re-exports, and the module that holds its objects.
GUIDE_HOMES = {
    "atom.utils.region_graph": ("atom.cudagraph.region_graph", ["TokenGraph", "record"]),
    "atom.utils.backends": ("atom.compilation.backends", ["VllmBackend", "PiecewiseBackend"]),
    "atom.utils.compiler_inferface": (
        "atom.compilation.compiler_interface",
        ["CompilerInterface", "make_compiler"],
    ),
    "atom.utils.cuda_piecewise_backend": ("atom.compilation.backends", ["PiecewiseBackend"]),
    "atom.utils.decorators": ("atom.compilation.decorators", ["support_torch_compile"]),
    "atom.utils.custom_register": ("atom.compilation.custom_ops", ["direct_register_custom_op"]),
    "atom.model_engine.model_runner": ("atom.engine.model_runner", ["ModelRunner"]),
}


@pytest.mark.parametrize("module", sorted(GUIDE_PATHS))
def test_guide_paths_import_with_their_names(module: str) -> None:
    mod = importlib.import_module(module)
    assert [n for n in GUIDE_PATHS[module] if not hasattr(mod, n)] == []


def test_guide_methods_take_the_guides_arguments() -> None:
    from atom.model_engine.model_runner import ModelRunner

    runner, input_ids = object(), object()
    # bind() raises TypeError when the signature no longer takes the guide's call.
    inspect.signature(ModelRunner.capture_cudagraph).bind(runner)
    inspect.signature(ModelRunner.run_model).bind(runner, input_ids)


@pytest.mark.parametrize("old", sorted(GUIDE_HOMES))
def test_guide_paths_are_the_real_objects(old: str) -> None:
    new, names = GUIDE_HOMES[old]
    old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_mod, name) is getattr(new_mod, name), name


# ----------------------------------------------------------------- import direction

# package -> atom packages it may import (besides itself). Absent from the table: no rule.
ALLOWED = {
    "kernels": set(),
    # The tensor-parallel group and its collectives: a leaf every layer of the engine may read.
    "distributed": set(),
    "router": {"wire"},  # torch-free: the router image needs none of the engine
    "wire": set(),  # the torch-free contract: imports no other atom package
    "layers": {"kernels", "compilation", "cudagraph", "distributed", "utils", "config"},
    "models": {"layers", "kernels", "compilation", "cudagraph", "distributed", "utils", "config",
               "quantization", "lora"},
    # Adapters' static buffers and their batched delta: a leaf the config, the model and the
    # engine read (no engine type in it, so the model can hold its buffers).
    "lora": set(),
    # FP8 weights' ops and the KV cache's dtype: beside the layers (the models and the engine
    # read it; the kernels' FP8 cache storage is below it).
    "quantization": {"layers", "kernels", "compilation"},
    "compilation": {"config", "distributed", "utils"},
    "cudagraph": {"config", "distributed", "utils"},
    "config": {"compilation", "lora"},  # compilation.levels and lora.config only
    "engine": {
        "models",
        "layers",
        "kernels",
        "compilation",
        "cudagraph",
        "disagg",
        "spec_decode",
        "structured",
        "executor",
        "distributed",
        "quantization",
        "lora",
        "utils",
        "config",
    },
    # Beside the engine: the tensor-parallel executor wraps the runner the engine drives (the
    # engine imports it only to build it for N > 1); it reaches the process group only
    # through atom.distributed.parallel_state.
    "executor": {"engine", "distributed", "config"},
    # Beside the engine: drafters and verification drive the runner and the block manager.
    "spec_decode": {"engine", "models", "cudagraph", "utils", "config", "structured"},
    # Beside the engine: grammar matchers follow its sequences; the vocabulary is the server's.
    "structured": {"engine", "tokenizer"},
}
# Modules below the scheduler: they never see a Sequence.
BELOW_SCHEDULER = ["engine/model_runner.py", "engine/host_staging.py", "engine/batch.py"]
LEAF_UTILS = ["utils/counters.py", "utils/forward_context.py"]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m == "atom" or m.startswith("atom.")}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_downwards(package: str) -> None:
    files = (
        sorted((RUNTIME / package).rglob("*.py"))
        if (RUNTIME / package).is_dir()
        else [RUNTIME / f"{package}.py"]
    )
    bad = []
    for f in files:
        for module in _imports(f):
            target = _package(module)
            if target and target != package and target not in ALLOWED[package]:
                bad.append(f"{f.relative_to(RUNTIME)} imports {module}")
    assert bad == []


def test_config_takes_only_the_enums_from_compilation() -> None:
    mods = {m for m in _imports(RUNTIME / "config.py") if _package(m) == "compilation"}
    assert {m for m in mods if not m.startswith("atom.compilation.levels")} == set()


@pytest.mark.parametrize("rel", BELOW_SCHEDULER)
def test_the_runner_side_never_imports_the_scheduler_side(rel: str) -> None:
    upward = (
        "atom.engine.sequence",
        "atom.engine.scheduler",
        "atom.engine.llm_engine",
        "atom.entrypoints",
    )
    assert [m for m in _imports(RUNTIME / rel) if m.startswith(upward)] == []


@pytest.mark.parametrize("rel", LEAF_UTILS)
def test_leaf_utils_import_no_atom_module(rel: str) -> None:
    assert _imports(RUNTIME / rel) == set()


def test_no_runtime_file_is_over_600_lines() -> None:
    long = {
        str(f.relative_to(RUNTIME)): n
        for f in RUNTIME.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > 600
    }
    assert long == {}


def test_the_executor_reaches_the_group_only_through_parallel_state() -> None:
    mods = {m for f in (RUNTIME / "executor").rglob("*.py") for m in _imports(f)
            if _package(m) == "distributed"}
    assert {m for m in mods if not m.startswith("atom.distributed.parallel_state")} == set()


# ----------------------------------------------------------------- module graph

MODULES = import_graph.load()
BENCH = import_graph.REPO / "bench"


def test_no_module_import_cycles() -> None:
    """A cycle through a lazy or TYPE_CHECKING import is still a cycle: the shared part wants
    a module of its own."""
    assert import_graph.cycles(import_graph.edges(MODULES)) == []


def test_no_module_takes_another_modules_private_names() -> None:
    bad = [f"{name}:{use}" for name, module in sorted(MODULES.items())
           for use in import_graph.private_uses(module, MODULES)]
    assert bad == []


def _shims() -> set[str]:
    return {name for name, module in MODULES.items()
            if name.startswith("atom.") and import_graph.is_reexport(module)}


def test_the_shim_scan_finds_the_guide_paths() -> None:
    """The scan below is only as good as this: every guide path that re-exports is a shim."""
    assert set(GUIDE_HOMES) <= _shims()


def test_project_code_imports_no_shim_path() -> None:
    """The guide's old paths stay for users; runtime, operator, dev tools and bench import the
    module that holds the code."""
    shims = _shims()
    scanned = MODULES | import_graph.load_files(sorted(BENCH.glob("*.py")), import_graph.REPO)
    bad = set()
    for name, module in scanned.items():
        if name in shims:
            continue
        for imp in import_graph.imports(module):
            to = import_graph.target(imp, MODULES)
            if to in shims:
                bad.add(f"{module.path.relative_to(import_graph.REPO)}:{imp.line} imports {to}")
    assert sorted(bad) == []
