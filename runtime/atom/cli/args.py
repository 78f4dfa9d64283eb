"""The runtime's command line: the contract the operator renders (see DESIGN.md).

Kept free of torch imports so the operator's contract test and `--help` stay fast.
"""

from __future__ import annotations

import argparse
import json

from atom.config import KV_CACHE_DTYPES, QUANTIZATIONS

ROLES = ("unified", "prefill", "decode")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("bfloat16", "float16", "float32", "auto")
DEVICES = ("cpu", "cuda")
KV_TRANSPORTS = ("auto", "cuda-ipc", "nccl", "tcp")


def _json_object(text: str, flag: str = "--compilation-config") -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object")
    return value


def _spec_object(text: str) -> dict:
    return _json_object(text, "--speculative-config")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return value


def _lora_module(text: str) -> str:
    """name=path, checked here so argparse names the flag."""
    from atom.lora.config import parse_lora_module

    try:
        parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _level(text: str) -> int:
    value = int(text)
    if value not in (0, 1, 2, 3):
        raise argparse.ArgumentTypeError(f"--level must be one of 0, 1, 2, 3, got {value}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `warmup`."""
    parser.add_argument("--model", required=True, help="model directory (config.json + safetensors) or a built-in shape name")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="fp8: the decoder's projection weights in float8_e4m3fn (per-channel scales, quantized at load; per-token activation scales)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="fp8: the KV cache in float8_e4m3fn (per-tensor scales); auto: the model's dtype")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-num-seqs", type=_positive_int, default=512)
    parser.add_argument("--max-model-len", type=_positive_int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="end every step with its tokens on the host (default: launch each step before reading the last)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of cached prompt prefixes (default on; --no-enable-prefix-caching turns it off)")
    parser.add_argument("--level", type=_level, default=None, help="compilation level 0-3 (default 3)")
    parser.add_argument("--cudagraph-mode", default=None, help="NONE, TR_HYBRID, FULL, FULL_DECODE_ONLY, FULL_AND_TR_HYBRID")
    parser.add_argument("--cudagraph-capture-sizes", type=_positive_int, nargs="+", default=None)
    parser.add_argument("--cuda-graph-sizes", type=_positive_int, nargs="+", default=None)
    parser.add_argument("--compilation-config", type=_json_object, default=None, help="CompilationConfig fields as JSON")
    parser.add_argument("--compile-cache-dir", default=None)
    parser.add_argument("--speculative-config", type=_spec_object, default=None,
                        help='speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_min": 1, "prompt_lookup_max": 3} or {"method": "draft_model", '
                             '"model": PATH_OR_BUILTIN, "num_speculative_tokens": 3}')
    parser.add_argument("--role", choices=ROLES, default="unified")
    parser.add_argument("--kv-port", type=int, default=None, help="serve held KV blocks on this port (prefill default 8001; 0: any free port)")
    parser.add_argument("--kv-host", default=None, help="address the KV port binds to and decode instances dial (default: bind --host; dial $ATOM_KV_HOST, else the address the router reached)")
    parser.add_argument("--kv-hold-seconds", type=_positive_float, default=30.0, help="prefill: free blocks not pulled within this time")
    parser.add_argument("--max-held-kv-fraction", type=_fraction, default=0.5, help="prefill: cap on KV blocks held for pulls, as a fraction of the pool; beyond it prefills get 503 kv_hold_cap")
    parser.add_argument("--kv-pull-timeout", type=_positive_float, default=30.0, help="decode: bound on one pull attempt (a broken pull is retried once)")
    parser.add_argument("--kv-transport", choices=KV_TRANSPORTS, default="auto", help="P/D KV transfer path, negotiated in the handshake (auto: the fastest both sides support)")
    parser.add_argument("--tensor-parallel-size", type=_positive_int, default=1, help="one worker process per GPU (gloo on the CPU); must divide the heads, KV heads and vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=DEVICES, default=None, help="where the engine runs (default: cuda when available, else cpu)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--num-kv-blocks", type=_positive_int, default=None, help="KV blocks on CPU (GPU: sized from free memory)")
    parser.add_argument("--max-waiting", type=_positive_int, default=1024, help="queue bound; beyond it requests get 429")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules; adapters can then be loaded at runtime)")
    parser.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend", default=None, metavar="NAME=PATH", help="PEFT LoRA adapters served as models NAME (repeatable)")
    parser.add_argument("--max-loras", type=_positive_int, default=None, help="LoRA adapters resident at once (default: 1, or the number of --lora-modules)")
    parser.add_argument("--max-lora-rank", type=_positive_int, default=None, help="largest LoRA rank served (default 16)")
    parser.add_argument("--log-level", default="info")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `serve` only: the API server processes and their connections."""
    parser.add_argument("--api-server-count", type=_positive_int, default=1, help="API server processes sharing the port (SO_REUSEPORT) and one engine core")
    parser.add_argument("--api-key", default=None, help="OpenAI endpoints (/v1/*) and /status require 'Authorization: Bearer KEY' (default $ATOM_API_KEY)")
    parser.add_argument("--drain-seconds", type=_positive_float, default=30.0, help="on SIGTERM: how long in-flight requests may finish")
    parser.add_argument("--liveness-timeout", type=_positive_float, default=60.0, help="/livez fails when the engine loop made no progress for this long")
    parser.add_argument("--stall-timeout", type=_positive_float, default=15.0, help="/health answers 503 engine_stalled when the engine core made no progress for this long while requests wait")
    parser.add_argument("--stream-stall-timeout", type=_positive_float, default=45.0, help="open requests end with a 503 engine_stalled error when the engine core made no progress for this long")
    parser.add_argument("--keepalive-timeout", type=_positive_float, default=5.0, help="close a connection that sends no complete request for this long (idle or partial headers)")
    parser.add_argument("--body-timeout", type=_positive_float, default=30.0, help="answer 408 when a request body takes longer than this")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom-runtime", description="ATOM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    add_engine_args(serve)
    add_serve_args(serve)
    warmup = sub.add_parser("warmup", help="compile and capture into the cache, print a JSON summary, exit")
    add_engine_args(warmup)
    return parser
