"""What /status and `warmup` report about the resolved Config."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atom.config import Config
    from atom.engine.api import EngineAPI


def cache_key(local_cache_dir: str) -> str | None:
    """The hash directory of a compile cache path `<root>/<hash>/rank_<r>/<prefix>`."""
    if not local_cache_dir:
        return None
    return (
        os.path.basename(os.path.dirname(os.path.dirname(os.path.normpath(local_cache_dir))))
        or None
    )


def config_info(config: Config) -> dict[str, Any]:
    """Level, graph mode, buckets, cache location: read live, since compilation fills the cache dir."""
    cc = config.compilation_config
    local = cc.local_cache_dir
    return {
        "level": int(cc.level),
        "mode": str(cc.cudagraph_mode) if cc.cudagraph_mode is not None else "NONE",
        "buckets": list(config.capture_sizes or []),
        "enforce_eager": bool(config.enforce_eager),
        "async_scheduling": config.async_scheduling,
        "enable_prefix_caching": config.enable_prefix_caching,
        "device": config.device,
        "dtype": config.dtype,
        "max_num_seqs": config.max_num_seqs,
        "cache_dir": local or cc.cache_dir,
        "cache_key": cache_key(local),
        "speculative_config": spec.to_dict() if (spec := config.speculative_config) else None,
    }


def prefix_cache_info(stats: dict[str, Any]) -> dict[str, Any]:
    """/status: whether prefix caching is on and its hit rate (prompt tokens found cached over
    prompt tokens looked up, since start), from LLMEngine.stats()."""
    queries = int(stats.get("prefix_cache_queries", 0) or 0)
    hits = int(stats.get("prefix_cache_hits", 0) or 0)
    return {
        "enabled": bool(stats.get("prefix_caching", False)),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "queried_tokens": queries,
        "hit_tokens": hits,
        "requests": int(stats.get("prefix_cache_requests", 0) or 0),
        "requests_hit": int(stats.get("prefix_cache_requests_hit", 0) or 0),
        "cached_blocks": int(stats.get("kv_blocks_cached", 0) or 0),
        "evicted_blocks": int(stats.get("prefix_cache_evicted_blocks", 0) or 0),
    }


def graph_info(engine: EngineAPI) -> dict[str, Any]:
    """What the graph runner really does (CPU resolves every mode to NONE)."""
    return dict(engine.facts().graphs)


def parallel_info(engine: EngineAPI) -> dict[str, Any]:
    """/status: the tensor-parallel size and every rank's pid (rank 0 first: the core)."""
    return tp_info(engine.facts().tp_pids)


def tp_info(pids: list[int]) -> dict[str, Any]:
    pids = pids or [os.getpid()]
    return {"tensor_parallel_size": len(pids), "tp_pids": list(pids)}
