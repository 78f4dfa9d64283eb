"""argparse namespace (atom.cli.args.build_parser) -> Config, per docs/architecture.md."""

from __future__ import annotations

import argparse
from typing import Any

from atom.config import CompilationConfig, Config, SpeculativeConfig
from atom.lora.config import DEFAULT_MAX_LORA_RANK, LoRAConfig, parse_lora_module

DEFAULT_CLI_LEVEL = 3  # production default; the dataclass keeps the guide's 0


def compilation_from_args(args: argparse.Namespace) -> CompilationConfig:
    """--compilation-config JSON first, then the explicit flags override it."""
    data: dict[str, Any] = dict(args.compilation_config or {})
    if args.level is not None:
        data["level"] = args.level
    elif "level" not in data:
        data["level"] = DEFAULT_CLI_LEVEL
    if args.cudagraph_mode is not None:
        data["cudagraph_mode"] = args.cudagraph_mode
    if args.cudagraph_capture_sizes is not None:
        data["cudagraph_capture_sizes"] = list(args.cudagraph_capture_sizes)
    if args.cuda_graph_sizes is not None:
        data["cuda_graph_sizes"] = list(args.cuda_graph_sizes)
    if args.compile_cache_dir is not None:
        data["cache_dir"] = args.compile_cache_dir
    return CompilationConfig.from_dict(data)


def lora_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """--enable-lora / --lora-modules / --max-loras / --max-lora-rank; None: no LoRA."""
    modules = dict(parse_lora_module(m) for m in args.lora_modules or [])
    if not (args.enable_lora or modules or args.max_loras or args.max_lora_rank):
        return None
    return LoRAConfig(modules=modules, max_loras=args.max_loras or max(1, len(modules)),
                      max_lora_rank=args.max_lora_rank or DEFAULT_MAX_LORA_RANK)


def config_from_args(args: argparse.Namespace) -> Config:
    """Build the engine Config; bad values raise ValueError naming the field."""
    return Config(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=args.enable_prefix_caching,
        compilation_config=compilation_from_args(args),
        seed=args.seed,
        role=args.role,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=(SpeculativeConfig.from_dict(args.speculative_config)
                            if args.speculative_config else None),
        lora_config=lora_from_args(args),
    )
