"""Per-step side channel for metadata the model reads during a forward pass.

Captured CUDA graphs cannot take new arguments, so everything that changes per step
(positions, sequence lengths, block tables) reaches the layers through this module-level
context: set before the forward, read inside it, reset after it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch


@dataclass
class AttentionMetaData:
    """What the attention op needs to find this step's keys and values in the paged cache.

    Row-level tensors are padded to the step's row count; padded rows have slot -1.
    """

    cu_seqlens_q: torch.Tensor | None = None  # int32 [num_seqs + 1], query rows per sequence
    cu_seqlens_k: torch.Tensor | None = None  # int32 [num_seqs + 1], cached + new tokens per sequence
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None  # int64 [num_rows], KV slot per row, -1 = padding
    context_lens: torch.Tensor | None = None  # int32 [num_seqs], KV length per sequence after this step
    block_tables: torch.Tensor | None = None  # int32 [num_seqs, max_blocks_per_seq]
    num_seqs: int = 0  # real (unpadded) sequences in the step
    num_rows: int = 0  # real (unpadded) query rows in the step
    extra: dict[str, Any] = field(default_factory=dict)
    # A speculative verify step laid out as decode rows (atom.spec_decode.decoder): each
    # request's k + 1 query rows are k + 1 one-token "sequences" r*q .. r*q + q - 1 sharing its
    # block table, their keys stored before any attends. 1: every other step.
    verify_rows: int = 1

    @property
    def request_q_len(self) -> int:
        """Query rows per request: the request bucket's max_seqlen_q (a verify's k + 1)."""
        return self.verify_rows if self.verify_rows > 1 else self.max_seqlen_q


@dataclass
class Context:
    positions: torch.Tensor | None = None  # token position ids
    is_prefill: bool = False  # whether this is a prefill (or mixed) step
    batch_size: int = 0  # number of sequences in the batch
    running_bs: int = 0  # padded SEQUENCE count: graph lookup, draft width
    running_tokens: int = 0  # padded ROW count
    is_draft: bool = False


@dataclass
class DPMetadata:
    """Token counts across data-parallel ranks (one rank here: kept for the guide's API)."""

    num_tokens_across_dp: list[int] = field(default_factory=list)

    @property
    def max_tokens_across_dp(self) -> int:
        return max(self.num_tokens_across_dp, default=0)


@dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor | None = None
    num_draft_tokens: list[int] = field(default_factory=list)
    logits_indices: torch.Tensor | None = None

    @property
    def rows_per_request(self) -> int:
        """Query rows of each verified request: its k drafts and the token before them (every
        request of a step verifies the same k: the graph buckets are (running_bs, k))."""
        ks = set(self.num_draft_tokens)
        if len(ks) > 1:
            raise ValueError(f"a verify step's requests draft one k each, got {sorted(ks)}")
        return 1 + (ks.pop() if ks else 0)


class TokenGraphPass(enum.StrEnum):
    """ForwardContext.tr_graph: what a @token_graph unit's call does (None: runs as before).
    A StrEnum, so the strings "record" and "replay" compare equal to its members."""

    RECORD = "record"  # record a TokenGraph for the call's row count
    REPLAY = "replay"  # replay the recorded one


Phase = Literal["prefill", "decode"]


class StepKind(enum.StrEnum):
    """How one step runs (StepPlan.kind)."""

    EAGER = "eager"
    REQ_GRAPH = "req_graph"  # FULL: the whole forward of one request bucket
    TOKEN_GRAPH = "token_graph"  # piecewise: a phase's token bucket, eager regions between


@dataclass(frozen=True)
class StepPlan:
    """How one step runs, decided once (atom.cudagraph.runner.GraphRunner.plan) and trusted at
    replay: the kind, the rows and metadata sequences the step's inputs are padded to (an
    eager step's own counts), and the bucket: a request graph's key (running_bs, draft_num),
    a token graph's phase (its bucket is `rows`)."""

    kind: StepKind
    rows: int
    seqs: int
    key: tuple[int, int] | None = None  # REQ_GRAPH only
    phase: Phase | None = None  # TOKEN_GRAPH only

    def __post_init__(self) -> None:
        if (self.key is not None) != (self.kind == StepKind.REQ_GRAPH):
            raise ValueError(f"a request bucket key goes with a req_graph plan only: {self}")
        if (self.phase is not None) != (self.kind == StepKind.TOKEN_GRAPH):
            raise ValueError(f"a phase goes with a token_graph plan only: {self}")

    @property
    def padded(self) -> bool:
        """Whether the inputs are padded to a recorded bucket (any kind but EAGER)."""
        return self.kind != StepKind.EAGER


# The plan of a forward nobody planned (warm-up, profiling, tests): it runs eagerly.
EAGER_STEP = StepPlan(StepKind.EAGER, 0, 0)


@dataclass
class ForwardContext:
    no_compile_layers: dict[int, Any] = field(default_factory=dict)
    attn_metadata: AttentionMetaData | dict[str, AttentionMetaData] | None = None
    kv_cache_data: dict[str, Any] = field(default_factory=dict)
    context: Context | None = None
    dp_metadata: DPMetadata | None = None
    spec_decode_metadata: SpecDecodeMetadata | None = None
    # None: eager; RECORD: a TokenGraph is being recorded; REPLAY: replay the token graph.
    tr_graph: TokenGraphPass | None = None
    atom_config: Any = None
    plan: StepPlan = EAGER_STEP  # how the step runs (ModelRunner.prepare_step's plan)


_forward_context: ForwardContext = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


def launch_rows(rows: int) -> int:
    """The rows a decode kernel of `rows` rows picks its launch for: in a verify step laid out
    as decode rows, the requests' (rows / verify_rows), so each row runs the kernels and
    reduction order its request would in a plain decode step of that many rows (greedy
    verification then reproduces decoding bit for bit); otherwise rows."""
    md = _forward_context.attn_metadata
    q = md.verify_rows if isinstance(md, AttentionMetaData) else 1
    return -(-rows // q) if q > 1 else rows


def set_forward_context(
    attn_metadata: AttentionMetaData | dict[str, AttentionMetaData] | None = None,
    atom_config: Any = None,
    context: Context | None = None,
    num_tokens: int | None = None,
    num_tokens_across_dp: list[int] | None = None,
    spec_decode_metadata: SpecDecodeMetadata | None = None,
    tr_graph: TokenGraphPass | None = None,
    no_compile_layers: dict[int, Any] | None = None,
    kv_cache_data: dict[str, Any] | None = None,
    plan: StepPlan = EAGER_STEP,
) -> ForwardContext:
    """Install the context for the next forward; layers read it with get_forward_context()."""
    global _forward_context
    dp = None
    if num_tokens_across_dp is not None:
        dp = DPMetadata(list(num_tokens_across_dp))
    elif num_tokens is not None:
        dp = DPMetadata([num_tokens])
    if no_compile_layers is None:
        no_compile_layers = _forward_context.no_compile_layers
    if kv_cache_data is None:
        kv_cache_data = _forward_context.kv_cache_data
    _forward_context = ForwardContext(
        no_compile_layers=no_compile_layers,
        attn_metadata=attn_metadata,
        kv_cache_data=kv_cache_data,
        context=context,
        dp_metadata=dp,
        spec_decode_metadata=spec_decode_metadata,
        tr_graph=tr_graph,
        atom_config=atom_config,
        plan=plan,
    )
    return _forward_context


def reset_forward_context() -> None:
    """Drop the step's metadata; the static layer registry and KV cache stay registered."""
    global _forward_context
    _forward_context = ForwardContext(
        no_compile_layers=_forward_context.no_compile_layers,
        kv_cache_data=_forward_context.kv_cache_data,
    )


@contextmanager
def forward_context(**kwargs: Any) -> Iterator[ForwardContext]:
    """set_forward_context for the duration of a with-block, reset afterwards."""
    ctx = set_forward_context(**kwargs)
    try:
        yield ctx
    finally:
        reset_forward_context()
