"""`atom-runtime serve|warmup` (flags: atom.cli.args, the contract the operator renders)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from atom.cli.args import build_parser
from atom.cli.config import config_from_args
from atom.executor.checks import check_tensor_parallel

logger = logging.getLogger("atom.cli")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_serve(args: Any) -> int:
    from atom.entrypoints.launcher import run_serve as serve

    config = config_from_args(args)
    check_tensor_parallel(config)  # before any process starts (the GPU count: in the core)
    return serve(args, config)


def run_warmup(args: Any) -> int:
    """Build the engine, compile and capture into the cache, print one JSON summary line."""
    from atom.engine import LLMEngine
    from atom.entrypoints.info import config_info, graph_info, parallel_info
    from atom.utils.counters import counters

    config = config_from_args(args)
    check_tensor_parallel(config)
    t0 = time.monotonic()
    with counters.track() as delta:
        engine = LLMEngine(config)
        try:
            t_built = time.monotonic()
            summary = dict(engine.warmup() or {})
        finally:
            engine.shutdown()
    out = {
        "model": config.model,
        "role": config.role,
        **config_info(config),
        **graph_info(engine),
        **parallel_info(engine),
        "build_seconds": round(t_built - t0, 3),
        "warmup_seconds": round(time.monotonic() - t_built, 3),
        "counters": delta,
        "summary": summary,
    }
    print(json.dumps(out, default=str, sort_keys=True), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        if args.command == "serve":
            return run_serve(args)
        return run_warmup(args)
    except ValueError as exc:  # a bad flag value: say which, no traceback
        print(f"atom-runtime {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
