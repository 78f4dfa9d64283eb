"""The API server's state, shared by its routes (server) and its P/D branches (disagg_routes).

`ServerState` is what every handler reads: the engine core's client, the tokenizer, the limits
learned once the engine is ready, and `KVView`, the server's view of the core's KV side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from atom.disagg.handle import KVHandle
from atom.disagg.layout import KVLayout
from atom.entrypoints.admission import Admission
from atom.entrypoints.core.client import CoreClient
from atom.entrypoints.core.messages import EngineInfo, KVInfo
from atom.entrypoints.metrics import ServerMetrics
from atom.tokenizer import BaseTokenizer

if TYPE_CHECKING:
    from atom.config import Config


@dataclass
class KVView:
    """The API server's view of the core's KV side (from its EngineInfo)."""

    layout: KVLayout | None
    port: int | None
    advertise_host: str | None
    hold_seconds: float
    max_held_fraction: float = 0.5

    @classmethod
    def from_info(cls, info: KVInfo) -> KVView:
        layout = KVLayout.from_dict(info.layout) if info.layout else None
        return cls(
            layout, info.port, info.advertise_host, info.hold_seconds, info.max_held_fraction
        )

    @property
    def serves(self) -> bool:
        return self.port is not None

    def make_handle(
        self,
        request_id: str,
        prompt_ids: list[int],
        first_token: int,
        logprob: float | None,
        secret: str | None,
    ) -> KVHandle:
        """secret: the per-transfer secret the core made (its key never leaves the core)."""
        assert self.layout is not None and self.port is not None
        return KVHandle(
            handle=request_id,
            kv_host=self.advertise_host,
            kv_port=self.port,
            identity=self.layout.identity,
            model=self.layout.model,
            num_blocks=self.layout.blocks_for(len(prompt_ids)),
            prompt_token_ids=list(prompt_ids),
            first_token_id=first_token,
            first_logprob=logprob,
            expires_in=self.hold_seconds,
            secret=secret or "",
        )

    def describe(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {
            "port": self.port,
            "advertise_host": self.advertise_host,
            "hold_seconds": self.hold_seconds,
            "identity": self.layout.identity if self.layout else None,
            "holds": int(stats.get("kv_holds", 0) or 0),
            "blocks_held": int(stats.get("kv_blocks_held", 0) or 0),
            "holds_expired": int(stats.get("kv_holds_expired", 0) or 0),
            "max_held_fraction": self.max_held_fraction,
            "hold_cap_refused": int(stats.get("kv_hold_cap_refused", 0) or 0),
        }


@dataclass
class ServerState:
    engine: CoreClient
    served_model_name: str
    model: str
    max_waiting: int = 1024
    role: str = "unified"
    config: Config | None = None  # the resolved Config (None: a test's scripted engine)
    tokenizer: BaseTokenizer | None = None  # loaded by the API server itself
    max_model_len: int = 0
    vocab_size: int = 0
    draining: bool = False
    api_key: str | None = None  # --api-key / ATOM_API_KEY: /v1/* need "Bearer <key>"
    body_timeout: float = 30.0
    liveness_timeout: float = 60.0
    # /health answers 503 engine_stalled once the core is silent this long while requests
    # wait; open streams end after stream_stall_timeout (atom.entrypoints.core.client).
    stall_timeout: float = 15.0
    stream_stall_timeout: float = 45.0
    api_server_index: int = 0
    api_server_count: int = 1
    started: float = field(default_factory=time.time)
    kv: KVView | None = None  # the core's KV side (prefill serves, decode pulls), once ready
    # The engine's EOS ids, once ready: a decode request that ends at its first token pulls
    # no blocks (atom.entrypoints.generation.ends_at_first_token).
    eos_token_ids: frozenset[int] = frozenset()
    metrics: ServerMetrics = field(init=False)
    admission: Admission = field(init=False)  # --max-waiting

    def __post_init__(self) -> None:
        self.admission = Admission(self.max_waiting)
        self.engine.stream_stall_timeout = self.stream_stall_timeout
        self.metrics = ServerMetrics(
            stats=lambda: self.engine.last_stats,
            counters=lambda: {},  # the counters live in the core; they come in its stats
            warmup=lambda: self.engine.warmup_summary,
            model_name=self.served_model_name,
        )
        self.engine.on_ready.append(self._engine_ready)

    def _engine_ready(self, info: EngineInfo) -> None:
        if info.max_model_len:
            self.max_model_len = info.max_model_len
        if info.vocab_size and not self.vocab_size:
            self.vocab_size = info.vocab_size
        if info.kv is not None:
            self.kv = KVView.from_info(info.kv)
        self.eos_token_ids = frozenset(info.eos_token_ids)

    @property
    def ready(self) -> bool:
        return self.engine.is_ready and self.tokenizer is not None
