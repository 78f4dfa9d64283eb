"""ModelRunner: turns a scheduled batch into model inputs, runs the model, returns logits.

Every step copies its inputs and attention metadata into slices of persistent device
buffers (`forward_vars`), so the addresses a CUDA graph recorded stay valid at replay; it
writes them through persistent host mirrors (atom.engine.host_staging).
Graph recording and replay belong to `self.graph_runner` (atom.cudagraph.runner), installed
only when a graph mode is in force; without one every step runs eagerly. The runner is fed a
`StepBatch` (atom.engine.batch), never the scheduler's sequences.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from atom.compilation.decorators import compile_for_level
from atom.compilation.prefetch import CompilePrefetch
from atom.config import CompilationLevel, Config
from atom.cudagraph.mode_defaults import default_mode
from atom.cudagraph.region_graph import ReqGraph
from atom.cudagraph.runner import GraphRunner
from atom.distributed.communication import all_reduce_min
from atom.distributed.parallel_state import tp_rank, tp_size
from atom.engine.batch import PENDING_TOKEN, StepBatch, StepRows
from atom.engine.host_staging import HostStaging
from atom.layers.sharding import split_evenly
from atom.lora.manager import LoRAManager
from atom.models.loader import build_model
from atom.models.model_config import ModelConfig
from atom.models.registry import load_model_config
from atom.quantization.kv_cache import kv_cache_dtype
from atom.spec_decode.draft_graph import DraftGraph
from atom.utils.counters import counters
from atom.utils.forward_context import (
    EAGER_STEP,
    AttentionMetaData,
    Context,
    ForwardContext,
    SpecDecodeMetadata,
    StepKind,
    StepPlan,
    forward_context,
    get_forward_context,
    set_forward_context,
)

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BLOCKS = 512
# Steps of at most this many rows are prepared row by row, larger ones with numpy (whose
# per-call cost is a few microseconds, a Python row's about a quarter of one).
SMALL_BATCH_ROWS = 16


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# A step's model inputs: token ids, positions, attention metadata, step context.
StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetaData, Context]


@dataclass(frozen=True)
class PreparedStep:
    """A step's inputs, padded as its plan says, and the plan (prepare_step): the one decision
    of how the step runs, which step_context puts on the ForwardContext for replay."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetaData
    context: Context
    plan: StepPlan


class ModelRunner:
    def __init__(self, config: Config, hf_config: ModelConfig | None = None,
                 is_draft: bool = False) -> None:
        """is_draft: the runner of a speculative drafter (Context.is_draft, DraftGraphs)."""
        self.config = config
        self.is_draft = is_draft
        self.hf_config = hf_config or load_model_config(config.model)
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            config.finalize_model_len(self.hf_config.max_position_embeddings)
        limits = config.model_limits()
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.block_size = int(config.block_size)
        self.max_model_len = int(limits.max_model_len)
        self.max_blocks_per_seq = _cdiv(self.max_model_len, self.block_size)
        self.capture_sizes: list[int] = sorted(config.capture_sizes or [])
        torch.manual_seed(int(config.seed))

        compiles = config.compilation_config.level >= CompilationLevel.DYNAMO_ONCE
        # enforce_eager is decided once, in Config: it sets level 0 and graph mode NONE.
        self.compile_prefetch = CompilePrefetch(self.device.type, compiles)
        # Attention layers register themselves in the current forward context's layer dict,
        # which after a step is another runner's own: build in a fresh one (a second engine or
        # a draft model would otherwise replace that runner's layers).
        with forward_context(no_compile_layers={}):
            self.model = build_model(config, self.hf_config)
        self.dtype = self.model.model.embed_tokens.weight.dtype
        # --kv-cache-dtype fp8: the cache in float8_e4m3fn (atom.quantization.kv_cache).
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if config.graph_mode_by_size and not is_draft:  # no mode set: the size table's
            config.compilation_config.cudagraph_mode = default_mode(
                self.model.num_params() * tp_size())
        self.attn_layers = self.model.attention_layers()
        # Level 1 wraps the whole model in Dynamo (eager backend); levels 2-3 compile inside
        # the backbone's @support_torch_compile.
        self.model = compile_for_level(self.model, config)

        # The CUDA-graph engine resolves the mode (NONE without CUDA, with one warning, and
        # under enforce_eager); installed only when graphs will be recorded.
        # Under speculation a verify step runs k + 1 rows per request, as one-token decode rows
        # (atom.spec_decode.decoder): its buckets are (running_bs, k), recorded with
        # max_q_len = k + 1 (the guide's capture loop); its metadata has a sequence per row.
        spec = config.speculative_config
        self.q_len = spec.k + 1 if spec is not None and not is_draft else 1
        graphs = GraphRunner(config, q_len=self.q_len, is_draft=is_draft,
                             req_graph_cls=DraftGraph if is_draft else ReqGraph)
        self.graph_runner: GraphRunner | None = graphs if graphs.active else None

        self.max_num_seqs = max([int(config.max_num_seqs)] + self.capture_sizes)
        self.max_num_rows = max(int(limits.max_num_batched_tokens), self.max_num_seqs * self.q_len)
        self.max_meta_seqs = self.max_num_seqs * self.q_len  # a verify step: one per row
        self.staging = self._input_staging()
        self.forward_vars = {**self.staging.buffers,
                             "outputs": torch.zeros(self.max_num_rows, self.hf_config.hidden_size,
                                                    dtype=self.dtype, device=self.device)}
        self.num_kv_blocks = 0
        self.dummy_block = -1  # reserved block that dummy/capture batches write into
        # Multi-LoRA (atom.lora): the adapters' slots and buffers; None: the model has no
        # LoRA path at all. A drafter runs the base model.
        self.lora: LoRAManager | None = None
        if config.lora_config is not None and not is_draft:
            from atom.engine.lora_attach import attach_lora

            self.lora = attach_lora(self.model, config.lora_config, self.max_num_rows,
                                    self.dtype, self.device)
            self.lora.rows.use_slots(self.forward_vars["lora_slots"])

    # ---- buffers -------------------------------------------------------------------------
    def _input_staging(self) -> HostStaging:
        """The step's input buffers (forward_vars, less the outputs) and their host mirrors."""
        rows, seqs = self.max_num_rows, self.max_meta_seqs
        i64, i32 = torch.long, torch.int32
        return HostStaging({
            "input_ids": (i64, (rows,), 0),
            "positions": (i64, (rows,), 0),
            "slot_mapping": (i64, (rows,), -1),
            "context_lens": (i32, (seqs,), 0),
            "cu_seqlens_q": (i32, (seqs + 1,), 0),
            "cu_seqlens_k": (i32, (seqs + 1,), 0),
            "block_tables": (i32, (seqs, self.max_blocks_per_seq), 0),
            # each row's LoRA slot (0: none), only when adapters are served
            **({"lora_slots": (i64, (rows,), 0)} if self.config.lora_config is not None
               and not self.is_draft else {}),
        }, self.device)

    def kv_heads_per_rank(self) -> int:
        """This rank's KV heads: the cache is sharded by KV head under tensor parallelism."""
        _, heads = split_evenly(self.hf_config.num_key_value_heads, tp_size(), tp_rank(),
                                "num_key_value_heads")
        return heads

    def kv_block_bytes(self) -> int:
        cfg = self.hf_config
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * self.kv_heads_per_rank() * cfg.head_dim * elem

    def determine_num_blocks(self) -> int:
        """CPU: config.num_kv_blocks (default 512). GPU: free memory x utilisation after a profile run."""
        if self.config.num_kv_blocks is not None:
            return int(self.config.num_kv_blocks)
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BLOCKS
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_run()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        used = total - free
        # Budget: utilisation x total, minus what is in use, minus the forward's transient peak.
        avail = total * float(self.config.gpu_memory_utilization) - used - (peak - current)
        # Every rank must hold the same blocks (the scheduler's block ids are global).
        num_blocks = all_reduce_min(int(avail // self.kv_block_bytes()), self.device)
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache (gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}, {avail / 2**30:.2f} GiB available)"
            )
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_block_bytes() / 2**30)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One extra block at index num_blocks is reserved for dummy and capture batches."""
        cfg = self.hf_config
        shape = (2, cfg.num_hidden_layers, num_blocks + 1, self.block_size,
                 self.kv_heads_per_rank(), cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, (layer_id, layer) in enumerate(sorted(self.attn_layers.items())):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
            assert layer_id == i
        self.num_kv_blocks = num_blocks
        self.dummy_block = num_blocks

    # ---- inputs --------------------------------------------------------------------------
    def _check_size(self, rows: int, nseq: int) -> None:
        if rows > self.max_num_rows or nseq > self.max_meta_seqs:
            raise ValueError(f"batch of {rows} rows / {nseq} sequences exceeds the runner's buffers "
                             f"({self.max_num_rows} rows, {self.max_meta_seqs} sequences)")

    def _build(self, rows_ids: Any, rows_pos: Any, rows_slot: Any, q_lens: Any, ctx_lens: Any,
               tables: list[list[int]] | None, is_prefill: bool, num_seqs: int, num_rows: int,
               pending_tokens: torch.Tensor | None = None, verify_rows: int = 1) -> StepInputs:
        """Copy host values (lists or numpy arrays, already padded) into the persistent buffers
        and wrap them. A token id -(j + 1) is a placeholder for pending_tokens[j] (the previous
        step's sampled ids, on the device), filled in on the device. tables None: the caller
        put the block tables already (after staging.begin()). verify_rows > 1: a verify step's
        rows, one sequence each, verify_rows per request (running_bs counts requests)."""
        rows, nseq = len(rows_ids), len(ctx_lens)
        self._check_size(rows, nseq)
        staging = self.staging
        if tables is not None:
            staging.begin()
            # Only the real rows' own blocks are written: kernels never read past a context's
            # blocks, and padded sequences (context 0) read none.
            staging.put_rows("block_tables", tables)
        cu_q, max_q = _cumulative(q_lens)
        cu_k, max_k = _cumulative(ctx_lens)
        input_ids = staging.put("input_ids", rows_ids)
        positions = staging.put("positions", rows_pos)
        slot_mapping = staging.put("slot_mapping", rows_slot)
        context_lens = staging.put("context_lens", ctx_lens)
        cu_seqlens_q = staging.put("cu_seqlens_q", cu_q)
        cu_seqlens_k = staging.put("cu_seqlens_k", cu_k)
        staging.flush(gather=("input_ids", pending_tokens) if pending_tokens is not None
                      else None)
        bt = self.forward_vars["block_tables"]
        meta = AttentionMetaData(
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_q, max_seqlen_k=max_k,
            slot_mapping=slot_mapping, context_lens=context_lens, block_tables=bt[:nseq],
            num_seqs=num_seqs, num_rows=num_rows,
            extra={"decode": not is_prefill}, verify_rows=verify_rows,
        )
        context = Context(positions=positions, is_prefill=is_prefill,
                          batch_size=num_seqs // verify_rows, running_bs=nseq // verify_rows,
                          running_tokens=rows, is_draft=self.is_draft)
        return input_ids, positions, meta, context

    def prepare_inputs(self, batch: StepBatch, pad_to_rows: int | None = None,
                       pad_to_seqs: int | None = None, pending_tokens: torch.Tensor | None = None,
                       verify_rows: int = 1) -> StepInputs:
        """Rows for each sequence's scheduled tokens; padding rows have token 0, position 0, slot -1.

        Decode (q rows per sequence: 1, or k + 1 in a verify step): padding adds sequences of q
        rows with context length 0, so rows r*q..r*q+q-1 belong to sequence r. Prefill:
        padding rows belong to no sequence and padded sequences have no rows. A row whose
        token is PENDING_TOKEN takes it from
        `pending_tokens` (the previous step's sampled ids, on the device) at the sequence's
        `pending_src`, on the device (its row is staged as the placeholder -(pending_src + 1)).
        verify_rows > 1: a verify step, each sequence one row of a request's verify_rows
        (atom.spec_decode.decoder); padding then adds whole requests.
        Per-row values are computed with numpy from the batch's columns (batch.rows).
        """
        r, is_prefill, bs = batch.rows, batch.is_prefill, self.block_size
        num_seqs, num_rows = len(r.starts), len(r.token_ids)
        ids: list[int] | np.ndarray
        pos: list[int] | np.ndarray
        slots: list[int] | np.ndarray
        if num_rows <= SMALL_BATCH_ROWS:  # numpy's cost per call outweighs a few rows' loop
            ids, pos, slots, pending = _rows_by_row(r, bs)
            q: Any = r.num_tokens
            ctx: Any = [s + n for s, n in zip(r.starts, r.num_tokens, strict=True)]
        else:
            ids, pos, seq_of_row, pending = _rows_by_column(r, bs)
            q = np.array(r.num_tokens, dtype=np.int64)
            ctx = np.array(r.starts, dtype=np.int64) + q
        if is_prefill:
            rows = max(num_rows, pad_to_rows or 0)
            nseq = max(num_seqs, pad_to_seqs or 0)
            q_pad = 0
        else:
            q_pad = max(r.num_tokens, default=1)
            nseq = max(num_seqs, pad_to_seqs or 0, _cdiv(pad_to_rows or 0, q_pad))
            nseq = _cdiv(nseq, verify_rows) * verify_rows
            rows = max(num_rows, nseq * q_pad)
        if pending and pending_tokens is None:
            raise ValueError(f"{pending} rows wait for sampled tokens, none given")
        self._check_size(rows, nseq)
        self.staging.begin()
        # Only the real rows' own blocks are written: kernels never read past a context's
        # blocks, and padded sequences (context 0) read none. The keyed store wants one row
        # a request: a verify step's rows share theirs, so they are just written.
        keyed = num_rows > SMALL_BATCH_ROWS and verify_rows == 1
        self.staging.put_rows("block_tables", r.block_tables,
                              keys=r.request_ids if keyed else None)
        if self.lora is not None:
            self.staging.put("lora_slots", self.lora.row_slots(r.num_tokens, r.lora_slots, rows))
        if num_rows > SMALL_BATCH_ROWS:  # each row's slot, from its own staged table
            assert isinstance(pos, np.ndarray)  # _rows_by_column's
            blocks = pos // bs
            table = self.staging.host("block_tables")
            slots = table[seq_of_row, blocks].astype(np.int64) * bs + pos % bs
        if batch.shared_kv:
            _store_nothing(slots, r.num_tokens, batch.shared_kv)
        return self._build(_padded(ids, rows, 0), _padded(pos, rows, 0), _padded(slots, rows, -1),
                           _padded(q, nseq, q_pad), _padded(ctx, nseq, 0), None, is_prefill,
                           num_seqs, num_rows, pending_tokens if pending else None, verify_rows)

    def build_dummy_decode(self, num_seqs: int, q_len: int = 1, verify: bool = False
                           ) -> StepInputs:
        """A fake decode batch for capture and warm-up: every sequence lives in the reserved block.
        verify: q_len one-token rows per sequence (a verify step's layout), not q_len-row ones."""
        if verify and q_len > 1:
            if self.dummy_block < 0:
                raise RuntimeError("allocate_kv_cache() first: dummy batches write into its "
                                   "reserved block")
            base = self.dummy_block * self.block_size
            pos = list(range(q_len)) * num_seqs
            return self._build([0] * len(pos), pos, [base + p for p in pos], [1] * len(pos),
                               [p + 1 for p in pos], [[self.dummy_block]] * len(pos), False,
                               len(pos), len(pos), verify_rows=q_len)
        return self._build_dummy(num_seqs, q_len, is_prefill=False)

    def _build_dummy(self, num_seqs: int, q_len: int, is_prefill: bool) -> StepInputs:
        if self.dummy_block < 0:
            raise RuntimeError("allocate_kv_cache() first: dummy batches write into its reserved block")
        if not 1 <= q_len <= self.block_size:
            raise ValueError(f"dummy q_len must be in 1..{self.block_size}, got {q_len}")
        base = self.dummy_block * self.block_size
        rows = num_seqs * q_len
        pos = list(range(q_len)) * num_seqs
        slots = [base + p for p in pos]
        return self._build([0] * rows, pos, slots, [q_len] * num_seqs, [q_len] * num_seqs,
                           [[self.dummy_block]] * num_seqs, is_prefill, num_seqs, rows)

    # ---- forward -------------------------------------------------------------------------
    def _context_kwargs(self, meta: AttentionMetaData, context: Context,
                        spec: SpecDecodeMetadata | None = None,
                        plan: StepPlan = EAGER_STEP) -> dict[str, Any]:
        return dict(attn_metadata=meta, atom_config=self.config, context=context,
                    num_tokens=context.running_tokens, no_compile_layers=self.attn_layers,
                    spec_decode_metadata=spec, plan=plan)

    def set_context(self, meta: AttentionMetaData, context: Context) -> None:
        """Install the step's forward context (with this runner's attention layers)."""
        set_forward_context(**self._context_kwargs(meta, context))

    def step_context(self, meta: AttentionMetaData, context: Context,
                     spec: SpecDecodeMetadata | None = None, plan: StepPlan = EAGER_STEP
                     ) -> AbstractContextManager[ForwardContext]:
        """The step's forward context for a with-block, reset afterwards. plan: how the step
        runs (prepare_step's); the default runs it eagerly."""
        return forward_context(**self._context_kwargs(meta, context, spec, plan))

    def prepared_context(self, step: PreparedStep, spec: SpecDecodeMetadata | None = None
                         ) -> AbstractContextManager[ForwardContext]:
        """step_context for a prepared step, its plan included."""
        return self.step_context(step.meta, step.context, spec, step.plan)

    def run_model(self, input_ids: torch.Tensor, logits_indices: torch.Tensor | int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states for the step in the forward context, and logits for logits_indices
        (an int n: the first n rows; None: every row)."""
        forward_context = get_forward_context()
        context = forward_context.context
        assert context is not None, "run_model runs inside step_context"
        positions = context.positions
        hidden_states = None
        if self.graph_runner is not None:
            # Replays the graph the step's plan names (None: an eager plan).
            hidden_states = self.graph_runner.maybe_replay(self, input_ids)
        if hidden_states is None:
            hidden_states = self.model(input_ids, positions)
            counters.inc("eager_steps")
        if logits_indices is None:
            selected = hidden_states
        elif isinstance(logits_indices, int):
            selected = hidden_states[:logits_indices]  # a view: no gather kernel
        else:
            selected = hidden_states[logits_indices]
        return self.model.compute_logits(selected), hidden_states

    @staticmethod
    def _logits_indices(batch: StepBatch) -> list[int]:
        """The last row of each sequence whose tokens are all computed after this step (a
        verify step: every row)."""
        r = batch.rows
        if batch.logits_all:
            return list(range(len(r.token_ids)))
        if r.num_tokens.count(1) == len(r.num_tokens) and all(r.samples):
            return list(range(len(r.num_tokens)))  # a decode step: one row per sequence
        return [end - 1 for end, samples in zip(accumulate(r.num_tokens), r.samples, strict=True)
                if samples]

    def logits_rows(self, idx: list[int]) -> torch.Tensor | int:
        """run_model's logits_indices for these rows: a count when they are the first rows in
        order (every decode step: no index copy, no gather), else the indices on the device."""
        if idx == list(range(len(idx))):
            return len(idx)
        return torch.from_numpy(np.array(idx, dtype=np.int64)).to(self.device, non_blocking=True)

    def prepare_step(self, batch: StepBatch, pending_tokens: torch.Tensor | None = None,
                     spec: SpecDecodeMetadata | None = None) -> PreparedStep:
        """The step's plan (the graph runner's one decision: kind and bucket) and its inputs
        padded to it (execute_model's; a drafter runs several passes on one preparation:
        atom.spec_decode.draft_model)."""
        # A verify step's sequences are its requests' rows (SpecDecodeMetadata.rows_per_request).
        verify_rows = spec.rows_per_request if spec is not None and not batch.is_prefill else 1
        r = batch.rows
        num_seqs, num_rows = len(r.starts), len(r.token_ids)
        if self.graph_runner is None:
            plan = StepPlan(StepKind.EAGER, num_rows, num_seqs)
        else:
            q_len = 1 if batch.is_prefill else max(r.num_tokens, default=1)
            plan = self.graph_runner.plan(batch.is_prefill, num_seqs, num_rows, q_len,
                                          verify_rows)
        pad_rows, pad_seqs = (plan.rows, plan.seqs) if plan.padded else (None, None)
        ids, positions, meta, context = self.prepare_inputs(batch, pad_rows, pad_seqs,
                                                            pending_tokens, verify_rows)
        return PreparedStep(ids, positions, meta, context, plan)

    @torch.inference_mode()
    def execute_model(self, batch: StepBatch, pending_tokens: torch.Tensor | None = None,
                      spec: SpecDecodeMetadata | None = None) -> tuple[torch.Tensor, list[int]]:
        """Run one scheduled step; returns logits [n, vocab] (the model's dtype) and the
        indices in batch.seqs of the n sequences to sample. pending_tokens: the previous
        step's sampled ids on the device, for rows whose token the host has not read yet
        (prepare_inputs). spec: a verify step's drafts (ForwardContext.spec_decode_metadata),
        batch.seqs then its requests' rows, rows_per_request each, one token a row."""
        step = self.prepare_step(batch, pending_tokens, spec)
        indices = self.logits_rows(self._logits_indices(batch))
        with self.prepared_context(step, spec):
            logits, _ = self.run_model(step.input_ids, indices)
        return logits, batch.sampled()

    @torch.inference_mode()
    def dummy_run(self, num_rows: int, is_prefill: bool) -> None:
        """A forward over the reserved block (warm-up, compilation); no real cache is touched."""
        q_len = min(self.block_size, num_rows) if is_prefill else 1
        num_seqs = _cdiv(num_rows, q_len)
        input_ids, _, meta, context = self._build_dummy(num_seqs, q_len, is_prefill)
        with self.step_context(meta, context):
            self.run_model(input_ids)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest prefill the scheduler can produce, before the KV cache exists."""
        rows = self.max_num_rows
        context = Context(positions=self.forward_vars["positions"][:rows], is_prefill=True,
                          batch_size=1, running_bs=1, running_tokens=rows)
        with self.step_context(AttentionMetaData(num_rows=rows), context):
            # The backbone's plain forward: eager, so profiling neither compiles nor records.
            backbone = self.model.model
            hidden = backbone.forward(self.forward_vars["input_ids"][:rows],
                                      self.forward_vars["positions"][:rows])
            self.model.compute_logits(hidden[: self.max_num_seqs * self.q_len])

    def warmup_model(self) -> float:
        """Trigger compilation (levels 2-3) on a prefill-sized and a decode-sized batch; >= 2 rows
        where the limits allow, so no dimension specialises to 1. A dummy prefill sequence
        fills at most the one reserved block, so it takes at most max_num_seqs of them."""
        t0 = time.perf_counter()
        self.compile_prefetch.wait()
        prefill_rows = min(self.max_num_rows, self.block_size * min(2, self.max_num_seqs))
        self.dummy_run(max(2, prefill_rows), is_prefill=True)
        self.dummy_run(min(self.max_num_seqs, 8), is_prefill=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def capture_cudagraph(self) -> tuple[float, list[int]]:
        """Delegates to the CUDA-graph engine; without one nothing is captured."""
        if self.graph_runner is not None:
            return self.graph_runner.capture(self)
        return 0.0, []


def _cumulative(values: Any) -> tuple[Any, int]:
    """[0, v0, v0 + v1, ...] (a list or an array, as values) and the largest value (or 0)."""
    if isinstance(values, np.ndarray):
        cu = np.zeros(len(values) + 1, dtype=np.int64)
        np.add.accumulate(values, out=cu[1:])
        return cu, int(np.maximum.reduce(values)) if len(values) else 0
    return [0, *accumulate(values)], max(values, default=0)


def _padded(values: Any, n: int, fill: int) -> Any:
    """A list or array extended with fill up to n values."""
    if len(values) >= n:
        return values
    if isinstance(values, list):
        return values + [fill] * (n - len(values))
    return np.concatenate((values, np.full(n - len(values), fill, dtype=values.dtype)))


def _store_nothing(slots: Any, num_tokens: list[int], seqs: tuple[int, ...]) -> None:
    """Slot -1 (store nothing) for the one row of each of seqs: its key and value are in a
    shared cached block already (StepBatch.shared_kv). The decode kernels then take the row's
    own key and value from registers and the torch path reads the cached ones."""
    first = [0, *accumulate(num_tokens)]
    for i in seqs:
        if num_tokens[i] != 1:
            raise ValueError(f"a sequence whose key and value are cached computes one row, "
                             f"not {num_tokens[i]}")
        slots[first[i]] = -1


def _short_table(rows: StepRows, i: int, position: int) -> IndexError:
    return IndexError(f"request {rows.request_ids[i]!r}: its block table holds "
                      f"{len(rows.block_tables[i])} blocks, a row has position {position}")


def _stray_token(rows: StepRows, i: int) -> ValueError:
    return ValueError(f"request {rows.request_ids[i]!r}: a token of its scheduled range is still "
                      "on the device and no sampled row is named for it")


def _rows_by_row(r: StepRows, bs: int) -> tuple[list[int], list[int], list[int], int]:
    """A small step's token ids (its pending last tokens staged as -(pending_src + 1)),
    positions and slots, and how many are pending. Only a sequence's last token can be
    pending (the host reads a step's tokens before the step after next is prepared); any
    other negative id would be taken for a placeholder, so it is refused."""
    ids = list(r.token_ids)
    pos: list[int] = []
    slots: list[int] = []
    pending = row = 0
    for i, n in enumerate(r.num_tokens):
        start, table, src = r.starts[i], r.block_tables[i], r.pending_src[i]
        row += n
        last_pending = src is not None and n and ids[row - 1] == PENDING_TOKEN
        if n and min(ids[row - n:row - 1 if last_pending else row], default=0) < 0:
            raise _stray_token(r, i)
        if last_pending and src is not None:  # src is not None when last_pending
            ids[row - 1] = -(src + 1)
            pending += 1
        if n and (start + n - 1) // bs >= len(table):
            raise _short_table(r, i, start + n - 1)
        pos.extend(range(start, start + n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
    return ids, pos, slots, pending


def _rows_by_column(r: StepRows, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """_rows_by_row's token ids, positions and pending count with numpy, and each row's
    sequence (the slots are read from the staged block tables)."""
    num_seqs, num_rows = len(r.starts), len(r.token_ids)
    q = np.array(r.num_tokens, dtype=np.int64)
    starts = np.array(r.starts, dtype=np.int64)
    ids = np.array(r.token_ids, dtype=np.int64)
    one_row = num_rows == num_seqs and r.num_tokens.count(1) == num_seqs
    if one_row:
        seq_of_row, pos = np.arange(num_seqs), starts  # one row per sequence (decode)
    else:
        seq_of_row = np.repeat(np.arange(num_seqs), q)
        first = np.add.accumulate(q) - q  # each sequence's first row
        pos = starts[seq_of_row] + (np.arange(num_rows) - first[seq_of_row])
    pending = 0
    if num_rows and min(r.token_ids) < 0:
        src = np.array([-1 if p is None else p for p in r.pending_src], dtype=np.int64)
        if one_row:  # row i is sequence i's last
            last = seqs = ((src >= 0) & (ids == PENDING_TOKEN)).nonzero()[0]
        else:
            seqs = ((src >= 0) & (q > 0)).nonzero()[0]
            last = np.add.accumulate(q)[seqs] - 1
            hit = ids[last] == PENDING_TOKEN
            seqs, last = seqs[hit], last[hit]
        stray = ids < 0
        if np.count_nonzero(stray) != len(last):
            stray[last] = False
            raise _stray_token(r, int(seq_of_row[int(np.argmax(stray))]))
        ids[last] = -(src[seqs] + 1)
        pending = len(last)
    lens = np.fromiter(map(len, r.block_tables), dtype=np.int64, count=num_seqs)
    short = pos // bs >= (lens if one_row else lens[seq_of_row])
    if np.count_nonzero(short):
        row = int(np.argmax(short))
        raise _short_table(r, int(seq_of_row[row]), int(pos[row]))
    return ids, pos, seq_of_row, pending
