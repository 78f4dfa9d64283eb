"""The persistent compile cache: fresh processes, sharing, corruption, what the hash covers."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_compile_support import (
    build_random,
    make_config,
    random_inputs,
    share_inductor_cache_for_tests,
    speed_up_cpu_inductor,
)

from atom.compilation.backends import CACHE_INDEX_FILE

speed_up_cpu_inductor()
share_inductor_cache_for_tests()

WORKER = str(Path(__file__).with_name("test_compile_support.py"))
LAYERS = 1  # pieces compiled per cold start: LAYERS + 1


def _worker_cmd(cache_dir: str, *extra: str) -> list[str]:
    return [sys.executable, WORKER, "--cache-dir", cache_dir, "--layers", str(LAYERS), "--fast-isa", *extra]


def _env(**extra: str) -> dict[str, str]:
    # A fresh pod: no kernel cache of ours, so the worker keeps its kernels in the compile cache.
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(extra)
    return env


def _parse(proc_stdout: str) -> dict[str, Any]:
    lines = [line for line in proc_stdout.splitlines() if line.startswith("{")]
    assert lines, proc_stdout
    return json.loads(lines[-1])


def run_worker(cache_dir: str, *extra: str, **env: str) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        _worker_cmd(cache_dir, *extra), capture_output=True, text=True, timeout=600, env=_env(**env)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _parse(proc.stdout), proc.stderr


@pytest.fixture(scope="module")
def cold_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    cache_dir = str(tmp_path_factory.mktemp("cold") / "cache")
    result, _ = run_worker(cache_dir, HOSTNAME="pod-a", POD_IP="10.0.0.1", RANK="0")
    return cache_dir, result


def copy_of_cold_cache(cold_cache: tuple[str, dict[str, Any]], tmp_path: Path) -> tuple[str, str]:
    """(cache dir, its model's artifact dir): a private copy of the cold cache to damage."""
    src_dir, cold = cold_cache
    cache_dir = str(tmp_path / "cache")
    shutil.copytree(src_dir, cache_dir)
    return cache_dir, cold["local_cache_dir"].replace(src_dir, cache_dir)


def test_cold_process_compiles_and_saves(cold_cache: tuple[str, dict[str, Any]]) -> None:
    cache_dir, cold = cold_cache
    c = cold["counters"]
    assert cold["ok"]
    assert c["pieces_compiled"] == LAYERS + 1
    assert c["artifacts_saved"] == LAYERS + 1
    assert c["cache_misses"] == LAYERS + 1
    assert "artifacts_loaded" not in c
    assert c["dynamo_traces_saved"] == 1
    local = cold["local_cache_dir"]
    assert local.startswith(cache_dir) and local.endswith(os.path.join("rank_0", "RandomToyModel"))
    files = os.listdir(local)
    assert CACHE_INDEX_FILE in files and "computation_graph.py" in files
    assert len([f for f in files if f.endswith(".bin")]) == LAYERS + 1
    index_text = Path(local, CACHE_INDEX_FILE).read_text()
    assert "(None, 0, 'inductor_standalone')" in index_text  # pprint of (shape, index, backend)


def test_warm_process_on_another_pod_loads_everything(cold_cache: tuple[str, dict[str, Any]]) -> None:
    cache_dir, cold = cold_cache
    # Per-pod values differ; the hash must not: the same directory is found and loaded.
    warm, _ = run_worker(cache_dir, HOSTNAME="pod-b", POD_IP="10.0.0.2", ATOM_PORT="9001")
    c = warm["counters"]
    assert warm["ok"]
    assert warm["local_cache_dir"] == cold["local_cache_dir"]
    assert c["artifacts_loaded"] == LAYERS + 1
    assert c["cache_hits"] == LAYERS + 1
    assert "pieces_compiled" not in c and "artifacts_saved" not in c
    # The saved Dynamo trace was used: the backend never saw a new graph.
    assert c["dynamo_traces_loaded"] == 1 and "graphs_compiled" not in c


def test_corrupt_dynamo_trace_is_traced_again(cold_cache: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    cache_dir, _ = copy_of_cold_cache(cold_cache, tmp_path)
    (entry,) = Path(cache_dir, "dynamo_traces").rglob("dynamo_trace.pkl")
    entry.write_bytes(entry.read_bytes()[:100])
    result, stderr = run_worker(cache_dir)
    c = result["counters"]
    assert result["ok"] and "unreadable" in stderr
    assert c["graphs_compiled"] == 1 and "dynamo_traces_loaded" not in c
    assert c["artifacts_loaded"] == LAYERS + 1 and "pieces_compiled" not in c
    assert c["dynamo_traces_saved"] == 1  # rewritten: the next start skips Dynamo again
    again, _ = run_worker(cache_dir)
    assert again["counters"]["dynamo_traces_loaded"] == 1


def test_dynamo_trace_is_dropped_when_a_traced_file_changes(tmp_path: Path) -> None:
    from atom.compilation import warm_start

    source = tmp_path / "layer.py"
    source.write_text("def f(x):\n    return x * 2\n")
    entry = warm_start.TraceEntry(warm_start.ENTRY_VERSION, b"", ["L['x']"], [0], {}, "h",
                                  [str(source)], warm_start.files_hash([str(source)]))
    path = str(tmp_path / "trace" / warm_start.ENTRY_FILE)
    warm_start.save(path, entry)
    assert warm_start.load(path) == entry
    source.write_text("def f(x):\n    return x * 3\n")
    assert warm_start.load(path) is None


def test_disabled_cache_saves_nothing(tmp_path: Path) -> None:
    result, _ = run_worker(str(tmp_path / "c"), ATOM_DISABLE_COMPILE_CACHE="1")
    assert result["ok"]
    assert result["counters"]["pieces_compiled"] == LAYERS + 1
    assert "artifacts_saved" not in result["counters"]


def test_corrupt_artifact_is_recompiled_with_a_warning(cold_cache: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    cache_dir, local = copy_of_cold_cache(cold_cache, tmp_path)
    victim = sorted(f for f in os.listdir(local) if f.endswith(".bin"))[0]
    data = Path(local, victim).read_bytes()
    Path(local, victim).write_bytes(data[: len(data) // 2])  # truncated
    result, stderr = run_worker(cache_dir)
    assert result["ok"]
    assert result["counters"]["pieces_compiled"] == 1
    assert result["counters"]["artifacts_loaded"] == LAYERS
    assert "unusable" in stderr and "recompiling" in stderr
    assert result["counters"]["cache_corrupt"] >= 1  # the recompile is told from a plain miss
    healed, _ = run_worker(cache_dir)
    assert healed["counters"]["artifacts_loaded"] == LAYERS + 1
    assert "pieces_compiled" not in healed["counters"] and "cache_corrupt" not in healed["counters"]


def test_corrupt_index_is_rebuilt(cold_cache: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    cache_dir, local = copy_of_cold_cache(cold_cache, tmp_path)
    Path(local, CACHE_INDEX_FILE).write_text("{(None, 0, 'inductor_standalone'): ('artifact_sh")
    result, stderr = run_worker(cache_dir)
    assert result["ok"] and result["counters"]["pieces_compiled"] == LAYERS + 1
    assert "corrupt" in stderr


def test_two_concurrent_processes_share_one_cache_dir(tmp_path: Path) -> None:
    cache_dir = str(tmp_path / "shared")
    procs = [
        subprocess.Popen(_worker_cmd(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(HOSTNAME=f"pod-{i}"))
        for i in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        results.append(_parse(out))
    assert all(r["ok"] for r in results)
    assert results[0]["local_cache_dir"] == results[1]["local_cache_dir"]
    leftovers = [f for f in os.listdir(results[0]["local_cache_dir"]) if f.startswith(".tmp-")]
    assert leftovers == []
    after, _ = run_worker(cache_dir)
    assert after["counters"]["artifacts_loaded"] == LAYERS + 1
    assert "pieces_compiled" not in after["counters"]


# ----------------------------------------------------------------- hash factors (in-process,
# no Inductor: use_inductor=False traces with Dynamo and computes the directory only)


def _cache_dir_of(model: torch.nn.Module, *inputs: torch.Tensor) -> str:
    model(*inputs)
    return model.atom_config.compilation_config.local_cache_dir


def test_config_field_change_changes_the_hash(tmp_path: Path) -> None:
    root = str(tmp_path)
    ids, pos = random_inputs(4)
    base = _cache_dir_of(build_random(3, root, use_inductor=False), ids, pos)
    same = _cache_dir_of(build_random(3, root, use_inductor=False), ids, pos)
    other_sizes = _cache_dir_of(build_random(3, root, use_inductor=False, compile_sizes=[8]), ids, pos)
    other_opts = _cache_dir_of(build_random(3, root, use_inductor=False, inductor_compile_config={"max_autotune": True}), ids, pos)
    assert base == same
    assert len({base, other_sizes, other_opts}) == 3
    # The first batch size does not matter (the hash uses the symbolic shapes).
    assert _cache_dir_of(build_random(3, root, use_inductor=False), *random_inputs(9)) == base


def test_model_shape_and_dtype_change_the_hash(tmp_path: Path) -> None:
    from test_compile_support import RandomToyModel

    root = str(tmp_path)
    ids, pos = random_inputs(4)
    cfg = make_config(3, root, use_inductor=False)
    small = _cache_dir_of(RandomToyModel(atom_config=cfg, hidden=16), ids, pos)
    wide = _cache_dir_of(RandomToyModel(atom_config=make_config(3, root, use_inductor=False), hidden=32), ids, pos)
    half_cfg = make_config(3, root, use_inductor=False)
    half_cfg.dtype = "bfloat16"
    half = _cache_dir_of(RandomToyModel(atom_config=half_cfg, hidden=16), ids, pos)
    assert len({small, wide, half}) == 3


def test_cache_dir_is_honoured(tmp_path: Path) -> None:
    a = _cache_dir_of(build_random(3, str(tmp_path / "a"), use_inductor=False), *random_inputs(4))
    b = _cache_dir_of(build_random(3, str(tmp_path / "b"), use_inductor=False), *random_inputs(4))
    assert a.startswith(str(tmp_path / "a")) and b.startswith(str(tmp_path / "b"))
    assert os.path.relpath(a, tmp_path / "a") == os.path.relpath(b, tmp_path / "b")


_MODEL_SRC = """
import torch
from torch import nn
from atom.compilation.decorators import support_torch_compile
from {helper} import scale


@support_torch_compile
class Traced(nn.Module):
    def __init__(self, *, atom_config):
        super().__init__()

    def forward(self, x):
        h = scale(x) + 1
        out = torch.empty_like(h)
        torch.ops.aiter.toy_affine(h, out)
        return out
"""


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_traced_source_change_changes_the_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    helper = tmp_path / "toy_traced_helper.py"
    model_file = tmp_path / "toy_traced_model.py"
    model_file.write_text(_MODEL_SRC.format(helper="toy_traced_helper"))
    root = str(tmp_path / "cache")
    x = torch.randn(4, 3)

    def trace(tag: str) -> str:
        sys.modules.pop("toy_traced_helper", None)  # re-read the helper from disk
        cls = _load(model_file, "toy_traced_model").Traced
        return _cache_dir_of(cls(atom_config=make_config(3, root, use_inductor=False)), x)

    helper.write_text("def scale(x):\n    return x * 2\n")
    first = trace("a")
    assert trace("b") == first
    helper.write_text("def scale(x):\n    return x * 3.0\n")  # an inlined helper; new size, so no stale .pyc
    changed = trace("c")
    assert changed != first
    model_file.write_text(_MODEL_SRC.format(helper="toy_traced_helper") + "\n# edited\n")
    assert trace("d") not in (first, changed)


def test_hash_ignores_per_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    ids, pos = random_inputs(4)
    monkeypatch.setenv("HOSTNAME", "pod-a")
    a = _cache_dir_of(build_random(3, root, use_inductor=False), ids, pos)
    monkeypatch.setenv("HOSTNAME", "pod-b")
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    b = _cache_dir_of(build_random(3, root, use_inductor=False), ids, pos)
    assert a == b



def test_repeated_layer_pieces_load_one_artifact(tmp_path: Path) -> None:
    """Pieces of identical layers are named by position, so their artifacts have the same
    bytes; a warm start loads that artifact once and reuses it (outputs still match eager)."""
    cache_dir = str(tmp_path / "cache")
    layers = ["--layers", "4"]  # pieces: first, 3 identical middles, last
    cmd = [sys.executable, WORKER, "--cache-dir", cache_dir, "--fast-isa", *layers]
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
        assert proc.returncode == 0, proc.stderr[-4000:]
    warm = _parse(proc.stdout)
    c = warm["counters"]
    assert warm["ok"] and c["cache_hits"] == 5 and "pieces_compiled" not in c
    assert c["artifacts_reused"] >= 1
    assert c["artifacts_loaded"] + c["artifacts_reused"] == 5
