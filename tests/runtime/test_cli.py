"""`atom-runtime` flags -> Config, error exits, and the `warmup` command's JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atom.cli.args import build_parser
from atom.cli.config import config_from_args
from atom.cli.main import main
from atom.config import CUDAGraphMode

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--dtype", "float32"]


def parse(*flags: str):
    return build_parser().parse_args(["serve", "--model", "m", *flags])


def test_defaults_are_production_level_3() -> None:
    cfg = config_from_args(parse())
    cc = cfg.compilation_config
    assert cc.level == 3
    assert cc.cudagraph_mode == CUDAGraphMode.TR_HYBRID  # level 3 default (guide)
    assert cc.splitting_ops and "aiter.unified_attention_with_output" in cc.splitting_ops
    assert cfg.model == "m" and cfg.served_model_name == "m" and cfg.role == "unified"
    assert cfg.max_num_seqs == 512 and cfg.capture_sizes[-1] == 512


def test_flags_map_to_config_fields() -> None:
    cfg = config_from_args(
        parse(
            "--served-model-name",
            "served",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "256",
            "--max-num-batched-tokens",
            "512",
            "--num-kv-blocks",
            "64",
            "--dtype",
            "float16",
            "--load-format",
            "dummy",
            "--role",
            "decode",
            "--seed",
            "7",
            "--gpu-memory-utilization",
            "0.5",
            "--level",
            "2",
            "--cudagraph-mode",
            "FULL_DECODE_ONLY",
            "--cudagraph-capture-sizes",
            "1",
            "2",
            "4",
            "--compile-cache-dir",
            "/cache/key",
        )
    )
    assert (
        cfg.served_model_name,
        cfg.max_num_seqs,
        cfg.max_model_len,
        cfg.max_num_batched_tokens,
    ) == ("served", 8, 256, 512)
    assert (cfg.num_kv_blocks, cfg.dtype, cfg.load_format, cfg.role, cfg.seed) == (
        64,
        "float16",
        "dummy",
        "decode",
        7,
    )
    assert cfg.gpu_memory_utilization == 0.5
    cc = cfg.compilation_config
    assert cc.level == 2 and cc.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert cfg.capture_sizes == [1, 2, 4] and cc.cache_dir == "/cache/key"


def test_compilation_config_json_then_flags_override() -> None:
    js = json.dumps(
        {"level": 1, "cudagraphMode": "FULL", "cuda_graph_sizes": [16], "use_inductor": False}
    )
    cfg = config_from_args(parse("--compilation-config", js, "--level", "3"))
    cc = cfg.compilation_config
    assert cc.level == 3  # the flag wins over the JSON
    assert (
        cc.cudagraph_mode == CUDAGraphMode.FULL and cc.use_inductor is False
    )  # JSON kept where no flag
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    only_json = config_from_args(parse("--compilation-config", '{"level": 1}'))
    assert only_json.compilation_config.level == 1  # JSON level beats the CLI default of 3


def test_enforce_eager_turns_everything_off() -> None:
    cfg = config_from_args(parse("--enforce-eager"))
    assert (
        cfg.compilation_config.level == 0
        and cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    )
    assert cfg.capture_sizes == []


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--cudagraph-mode", "SIDEWAYS"], "cudagraph_mode must be one of"),
        (
            ["--cudagraph-mode", "FULL", "--max-num-seqs", "4", "--cudagraph-capture-sizes", "8"],
            "max_num_seqs=4",
        ),
        (["--compilation-config", '{"warp_speed": 9}'], "no field 'warp_speed'"),
    ],
)
def test_bad_values_exit_2_naming_the_field(
    flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["warmup", "--model", "tiny-llama", *flags]) == 2
    assert fragment in capsys.readouterr().err


def test_parser_refuses_bad_level() -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--model", "m", "--level", "5"])
    assert info.value.code == 2


def run_warmup(*flags: str) -> dict:
    """The summary line, and beside it (`wall_seconds`) how long the process ran."""
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "atom.cli.main", "warmup", *TINY, "--log-level", "warning", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - start
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out.stdout
    return {**json.loads(lines[0]), "wall_seconds": wall}


def test_warmup_level0_prints_summary_and_exits_0() -> None:
    summary = run_warmup("--level", "0")
    assert (
        summary["level"] == 0 and summary["mode"] == "NONE" and summary["effective_mode"] == "NONE"
    )
    assert summary["model"] == "tiny-llama" and summary["role"] == "unified"
    assert summary["summary"]["max_model_len"] == 2048
    assert summary["counters"].get("graphs_compiled", 0) == 0  # level 0 compiles nothing
    # both phases take time, in seconds: together within the process's own run
    assert summary["build_seconds"] > 0 and summary["warmup_seconds"] > 0
    assert summary["build_seconds"] + summary["warmup_seconds"] < summary["wall_seconds"]


@pytest.mark.slow
def test_warmup_level3_fills_the_cache_then_loads_it(tmp_path: Path) -> None:
    """The operator's warm-up Job: a cold run saves artifacts, a second run only loads them."""
    cold = run_warmup("--level", "3", "--compile-cache-dir", str(tmp_path))
    assert (
        cold["counters"]["artifacts_saved"] > 0 and cold["counters"].get("artifacts_loaded", 0) == 0
    )
    assert cold["cache_key"] and (tmp_path / cold["cache_key"]).is_dir()
    assert cold["effective_mode"] == "NONE"  # no CUDA here: graphs resolve to NONE
    warm = run_warmup("--level", "3", "--compile-cache-dir", str(tmp_path))
    assert warm["cache_key"] == cold["cache_key"]
    assert warm["counters"]["artifacts_loaded"] == cold["counters"]["artifacts_saved"]
    assert (
        warm["counters"].get("artifacts_saved", 0) == 0
        and warm["counters"].get("pieces_compiled", 0) == 0
    )


def test_device_flag_maps_to_config() -> None:
    assert config_from_args(parse("--device", "cpu")).device == "cpu"
    assert config_from_args(parse("--device", "cuda")).device == "cuda"
    with pytest.raises(SystemExit):
        parse("--device", "tpu")
