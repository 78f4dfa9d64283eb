"""The tiny CPU engine the runtime tests share: a built-in shape with dummy weights, in float32.

`tiny_config(**kw)` and `tiny_engine(**kw)` take any Config field; what a test cares about (the
context length, the KV blocks, the seed, the scheduler's limits) it states at the call.
"""

from __future__ import annotations

from atom.config import Config
from atom.engine import LLMEngine

TINY: dict[str, object] = dict(
    model="tiny-llama", load_format="dummy", dtype="float32", device="cpu", num_kv_blocks=64
)


def tiny_config(**kw: object) -> Config:
    return Config(**{**TINY, **kw})


def tiny_engine(*, warmup: bool = True, **kw: object) -> LLMEngine:
    """An engine on tiny_config(**kw), warmed up (compile and capture done) unless told not."""
    engine = LLMEngine(tiny_config(**kw))
    if warmup:
        engine.warmup()
    return engine


def tiny_tokens(n: int, seed: int = 0) -> list[int]:
    """n deterministic prompt ids inside the tiny vocabulary (3..252), different per seed."""
    return [(seed * 31 + 7 * j) % 250 + 3 for j in range(n)]
