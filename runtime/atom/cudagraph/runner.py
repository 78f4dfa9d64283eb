"""The CUDA-graph side of the model runner: mode resolution, capture, and per-step dispatch.

`ModelRunner` owns one `GraphRunner` (`runner.graph_runner`). At warm-up
`capture(runner)` records the graphs the mode asks for; at each step `plan(...)` decides,
once, how the step runs (a `StepPlan`: its kind, bucket and padded sizes), the model runner
pads the step's inputs to it and puts it on the `ForwardContext`, and
`maybe_replay(runner, input_ids)` replays the graph the plan names or returns None for an
eager plan. Replay trusts the plan: it checks only that the inputs have the planned rows.

Which graph a step replays (`ForwardMode.decide`):
- NONE, enforce_eager: eager.
- FULL (decode mode FULL): a decode step replays the ReqGraph of the smallest request bucket
  holding its sequences; prefill/mixed steps run eagerly. FULL_DECODE_ONLY is the same with
  mixed batches explicitly eager.
- TR_HYBRID (and FULL_AND_TR_HYBRID, recorded as TR_HYBRID): any step whose token count fits
  a bucket recorded for its phase replays that TokenGraph, padded to the bucket's rows.
- A step above the largest bucket runs eagerly.
Each forward is counted by the kind it ran: eager_steps (ModelRunner.run_model),
req_graph_replays, token_graph_replays.
"""

from __future__ import annotations

import gc
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol

import torch

from atom.config import Config, CUDAGraphMode, default_capture_sizes
from atom.cudagraph.buckets import dummy_layout, prefill_token_sizes
from atom.cudagraph.region_graph import (
    ReqGraph,
    SegmentRecorder,
    TokenGraph,
    is_token_graph_unit,
    request_bucket,
    reset_token_graph,
    token_graph_of,
)
from atom.utils.counters import counters
from atom.utils.forward_context import (
    AttentionMetaData,
    Context,
    Phase,
    StepKind,
    StepPlan,
    TokenGraphPass,
    get_forward_context,
    reset_forward_context,
)

logger = logging.getLogger(__name__)


EAGER, TOKEN_GRAPH, REQ_GRAPH = StepKind.EAGER, StepKind.TOKEN_GRAPH, StepKind.REQ_GRAPH


class GraphRunnerHost(Protocol):
    """What the GraphRunner needs from the model runner it records for (ModelRunner)."""

    forward_vars: dict[str, torch.Tensor]  # the persistent step buffers ("outputs" among them)

    @property
    def model(self) -> torch.nn.Module:
        """Called (input_ids, positions) -> hidden states. Read-only, so a runner's model may
        be a subclass (ModelRunner's is the model's own class)."""
        ...

    def build_dummy_decode(
        self, num_seqs: int, q_len: int = 1, verify: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetaData, Context]: ...

    def set_context(self, meta: AttentionMetaData, context: Context) -> None: ...


# --------------------------------------------------------------------------- configuration


def resolve_mode(
    config: Config,
    cuda_available: bool | None = None,
    require_cuda: bool = True,
    mode: CUDAGraphMode | None = None,
) -> CUDAGraphMode:
    """The mode the runner really uses: NONE without CUDA (one warning), FULL_AND_TR_HYBRID
    recorded as TR_HYBRID (the guide), NONE under enforce_eager or use_cudagraph=False.
    require_cuda=False keeps the mode for an emulated recorder (CPU tests); mode overrides
    the config's cudagraph_mode."""
    cc = config.compilation_config
    if mode is None:
        mode = cc.cudagraph_mode if cc.cudagraph_mode is not None else CUDAGraphMode.NONE
    if config.enforce_eager or not cc.use_cudagraph or mode == CUDAGraphMode.NONE:
        return CUDAGraphMode.NONE
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    device = str(config.device or ("cuda" if cuda_available else "cpu"))
    if require_cuda and (not cuda_available or not device.startswith("cuda")):
        logger.warning(
            "cudagraph_mode %s needs CUDA; running without CUDA graphs (NONE) on %s", mode, device
        )
        return CUDAGraphMode.NONE
    if mode == CUDAGraphMode.FULL_AND_TR_HYBRID:
        logger.info("cudagraph_mode FULL_AND_TR_HYBRID is recorded as TR_HYBRID")
        return CUDAGraphMode.TR_HYBRID
    return mode


def resolve_capture_sizes(
    cudagraph_capture_sizes: list[int] | None, cuda_graph_sizes: list[int], max_num_seqs: int
) -> list[int]:
    """The guide's capture-size rule, largest first.

    An explicit cudagraph_capture_sizes is used as is; one cuda_graph_sizes value N gives the
    pattern [1..8] + [16, 32, ..., N] (clamped to max_num_seqs: the scheduler never produces
    more); several values are used as given. Sizes the scheduler cannot produce are refused.
    """
    if cudagraph_capture_sizes:
        sizes = list(cudagraph_capture_sizes)
    elif len(cuda_graph_sizes) == 1:
        sizes = [s for s in default_capture_sizes(cuda_graph_sizes[0]) if s <= max_num_seqs]
    else:
        sizes = list(cuda_graph_sizes)
    sizes = sorted(set(sizes), reverse=True)
    if sizes and sizes[0] > max_num_seqs:
        raise ValueError(
            f"compilation_config capture size {sizes[0]} (cudagraph_capture_sizes / "
            f"cuda_graph_sizes) exceeds max_num_seqs={max_num_seqs}: a graph the scheduler "
            "cannot fill would write past the per-sequence buffers"
        )
    return sizes


def pad_to_bucket(n: int, buckets: list[int]) -> int | None:
    """Smallest bucket >= n, None above the largest."""
    fits = [b for b in buckets if b >= n]
    return min(fits) if fits else None


# --------------------------------------------------------------------------- dispatch


class ForwardMode:
    """Chooses eager, token-graph or request-graph execution for a step."""

    @staticmethod
    def decide(
        decode_mode: CUDAGraphMode,
        mixed_mode: CUDAGraphMode,
        *,
        is_prefill: bool,
        num_seqs: int,
        num_tokens: int,
        q_len: int,
        token_sizes: list[int],
        req_keys: list[tuple[int, int]],
    ) -> StepPlan:
        eager = StepPlan(EAGER, num_tokens, num_seqs)
        mode = mixed_mode if is_prefill else decode_mode
        if mode == CUDAGraphMode.TR_HYBRID:
            rows = pad_to_bucket(num_tokens, token_sizes)
            if rows is None:
                return eager
            # Decode pads whole sequences (one row each per q); a prefill pads rows only.
            seqs = num_seqs if is_prefill or rows % q_len else rows // q_len
            return StepPlan(TOKEN_GRAPH, rows, seqs, phase=_phase(is_prefill))
        if mode == CUDAGraphMode.FULL and not is_prefill:
            draft = q_len - 1
            bs = pad_to_bucket(num_seqs, [k[0] for k in req_keys if k[1] == draft])
            if bs is None:
                return eager
            return StepPlan(REQ_GRAPH, bs * q_len, bs, (bs, draft))
        return eager


def _phase(is_prefill: bool) -> Phase:
    return "prefill" if is_prefill else "decode"


@contextmanager
def frozen_gc() -> Iterator[None]:
    """No collection during capture (it dominates capture time); collect once after."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
        gc.collect()


def _takes_ids_positions(module: torch.nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return params[:2] == ["input_ids", "positions"]


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


# --------------------------------------------------------------------------- runner


class GraphRunner:
    """Captures and replays the graphs of one ModelRunner."""

    def __init__(
        self,
        config: Config,
        cuda_available: bool | None = None,
        recorder_factory: Callable[[], SegmentRecorder] | None = None,
        mode: CUDAGraphMode | None = None,
        capture_sizes: list[int] | None = None,
        q_len: int = 1,
        is_draft: bool = False,
        req_graph_cls: type[ReqGraph] = ReqGraph,
    ) -> None:
        """recorder_factory replaces CUDA capture (CpuOpRecorder in CPU tests); mode and
        capture_sizes override the config's (tests and benchmarks switch modes on one
        compiled model). is_draft: a drafter's runner, whose decode passes are recorded
        whole in either graph mode (the guide), never as token graphs; req_graph_cls is then
        atom.spec_decode.draft_graph.DraftGraph (cudagraph imports no engine package)."""
        self.config = config
        self._sizes_override = list(capture_sizes) if capture_sizes else None
        self.recorder_factory = recorder_factory
        self._cuda = recorder_factory is None
        self.mode = resolve_mode(config, cuda_available, require_cuda=self._cuda, mode=mode)
        self.is_draft = bool(is_draft)
        self.req_graph_cls = req_graph_cls
        if self.is_draft and self.mode != CUDAGraphMode.NONE:
            self.mode = CUDAGraphMode.FULL_DECODE_ONLY
        self.decode_mode = self.mode.decode_mode()
        self.mixed_mode = self.mode.mixed_mode()
        self.capture_sizes: list[int] = []  # ascending, once captured
        self.req_graph = self._new_req_graph()
        self.token_graphs: list[TokenGraph] = []
        self._token_sizes: dict[str, list[int]] = {}
        self._unit: torch.nn.Module | None = None  # the single recording unit, called directly
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # Query rows per decode request: 1, or 1 + draft tokens when a drafter verifies them
        # (request buckets (bs, q_len - 1), token buckets bs * q_len rows).
        self.q_len = int(q_len)

    def _new_req_graph(self) -> ReqGraph:
        return self.req_graph_cls(self.recorder_factory)

    def ladder(self) -> list[tuple[int, int]]:
        """The request buckets capture records, (running_bs, draft_num), largest first: a
        verify bucket holds bs * q_len rows (q_len = k + 1 under speculation). FULL decode
        under speculation also records the plain (bs, 0) buckets: a step without drafts (the
        n-gram drafter found no match, or no room for k more tokens) then replays one too."""
        sizes = self._sizes()
        keys = [request_bucket(bs, self.q_len) for bs in sizes]
        if self._plain_ladder():
            keys += [request_bucket(bs, 1) for bs in sizes]
        return keys

    def _plain_ladder(self) -> bool:
        return self.q_len > 1 and self.decode_mode == CUDAGraphMode.FULL

    @property
    def covers_plain_decode(self) -> bool:
        """Whether a plain decode step replays a graph as a verify step does (else it runs
        eagerly: TR_HYBRID decode under speculation holds only the verify rows' buckets)."""
        return self.q_len == 1 or self._plain_ladder() or self.mode == CUDAGraphMode.NONE

    @property
    def active(self) -> bool:
        """Whether any graph will be recorded (a mode other than NONE)."""
        return self.mode != CUDAGraphMode.NONE

    # ---------------------------------------------------------------- planning

    def token_sizes(self, phase: str) -> list[int]:
        """Token buckets every unit recorded for the phase (a step must fit all of them)."""
        cached = self._token_sizes.get(phase)
        if cached is not None:
            return cached
        if not self.token_graphs:
            return []
        common = set(self.token_graphs[0].captured_sizes(phase))
        for tg in self.token_graphs[1:]:
            common &= set(tg.captured_sizes(phase))
        return sorted(common)

    def plan(
        self, is_prefill: bool, num_seqs: int, num_tokens: int, q_len: int = 1,
        verify_rows: int = 1,
    ) -> StepPlan:
        """How the next step runs: the one decision of the step, which the model runner pads
        its inputs to (plan.rows / plan.seqs when plan.padded) and replay follows.
        verify_rows > 1: a verify step whose num_seqs are one-token rows, verify_rows per
        request; it plans as num_seqs / verify_rows requests of verify_rows rows (bucket
        (bs, k)) and pads one metadata sequence per row."""
        if verify_rows > 1 and not is_prefill:
            plan = self._decide(False, num_seqs // verify_rows, num_tokens, verify_rows)
            return replace(plan, seqs=plan.rows if plan.padded else num_seqs)
        return self._decide(is_prefill, num_seqs, num_tokens, q_len)

    def _decide(self, is_prefill: bool, num_seqs: int, num_tokens: int, q_len: int) -> StepPlan:
        if self.mode == CUDAGraphMode.NONE:  # also under enforce_eager (resolve_mode)
            return StepPlan(EAGER, num_tokens, num_seqs)
        return ForwardMode.decide(
            self.decode_mode,
            self.mixed_mode,
            is_prefill=is_prefill,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            q_len=q_len,
            token_sizes=self.token_sizes(_phase(is_prefill)),
            req_keys=self.req_graph.keys(),
        )

    # ---------------------------------------------------------------- capture

    def _sizes(self) -> list[int]:
        cc = self.config.compilation_config
        given = self._sizes_override or self.config.capture_sizes
        if given:
            sizes = sorted(set(given), reverse=True)
            if sizes[0] > self.config.max_num_seqs:
                raise ValueError(
                    f"capture size {sizes[0]} (capture_sizes) exceeds "
                    f"max_num_seqs={self.config.max_num_seqs}"
                )
            return sizes
        return resolve_capture_sizes(
            cc.cudagraph_capture_sizes, cc.cuda_graph_sizes, self.config.max_num_seqs
        )

    def _find_units(self, runner: GraphRunnerHost) -> list[TokenGraph]:
        units = [m for m in runner.model.modules() if is_token_graph_unit(m)]
        if not units:
            raise RuntimeError(
                "TR_HYBRID needs a @token_graph recording unit in the model (none found)"
            )
        tgs = [reset_token_graph(m) for m in units]  # a new capture starts from no recordings
        if self.recorder_factory is not None:
            for tg in tgs:
                tg.recorder_factory = self.recorder_factory
        outputs = runner.forward_vars.get("outputs")
        if len(tgs) == 1 and outputs is not None:
            tgs[0].outputs = outputs  # recorded outputs land in the runner's static buffer
        # One unit taking (input_ids, positions), as the Llama backbone does: record and
        # replay it directly, outside any Dynamo wrapper around the whole model (level 1).
        self._unit = units[0] if len(units) == 1 and _takes_ids_positions(units[0]) else None
        return tgs

    def _dummy(
        self, runner: GraphRunnerHost, bs: int, is_prefill: bool, q_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Install a fake decode batch of bs sequences in the forward context: a decode pass
        under speculation records verify steps (q_len one-token rows per request)."""
        q = self.q_len if q_len is None else q_len
        ids, positions, md, ctx = runner.build_dummy_decode(bs, q, verify=not is_prefill)
        ctx.is_prefill = is_prefill
        ctx.is_draft = self.is_draft
        runner.set_context(md, ctx)  # also installs the runner's attention layers
        return ids, positions

    def _prefill_sizes(self, sizes: list[int]) -> list[int]:
        """The prefill pass's token buckets: the capture sizes and, above them, the prefill
        buckets up to the token budget (atom.cudagraph.buckets)."""
        cfg = self.config
        return prefill_token_sizes(sizes, cfg.compilation_config.prefill_token_sizes,
                                   int(cfg.max_num_batched_tokens or 0),
                                   int(cfg.max_num_seqs), int(cfg.block_size))

    def _dummy_prefill(self, runner: GraphRunnerHost, rows: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A fake prefill batch of rows tokens, as sequences the runner's buffers hold."""
        layout = dummy_layout(rows, int(self.config.max_num_seqs), int(self.config.block_size))
        assert layout is not None  # prefill_token_sizes keeps only buckets with a layout
        if layout.q_len == 1:
            return self._dummy(runner, rows, is_prefill=True)
        ids, positions, md, ctx = runner.build_dummy_decode(layout.num_seqs, layout.q_len)
        ctx.is_prefill = True
        ctx.is_draft = self.is_draft
        runner.set_context(md, ctx)
        return ids, positions

    @torch.inference_mode()
    def capture(self, runner: GraphRunnerHost) -> tuple[float, list[int]]:
        """Record every bucket the mode needs; returns (seconds, sizes ascending)."""
        if self.mode == CUDAGraphMode.NONE:
            return 0.0, []
        sizes = self._sizes()
        use_full = self.decode_mode == CUDAGraphMode.FULL
        use_tr = self.mode.uses_tr_hybrid()
        if use_tr:
            self.token_graphs = self._find_units(runner)
        outputs = runner.forward_vars.get("outputs")
        self.req_graph = self._new_req_graph()  # a new capture starts empty
        self._token_sizes = {}
        self._sync()
        free_before = torch.cuda.mem_get_info()[0] if self._cuda else 0
        start = time.perf_counter()
        try:
            from tqdm import tqdm

            bar = tqdm(self.ladder(), desc=f"Capturing CUDA graphs ({self.mode.name})",
                       disable=_rank() != 0, leave=False)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = self.ladder()
        with frozen_gc():
            try:
                for bs, draft in bar:
                    ids, positions = self._dummy(runner, bs, is_prefill=False, q_len=draft + 1)
                    runner.model(ids, positions)  # warm-up: lazy compiles, autotuning, workspaces
                    if use_full:
                        key = request_bucket(bs, int(ids.shape[0]) // bs)
                        self.req_graph.record(key, runner.model, (ids, positions), outputs)
                    if use_tr and draft + 1 == self.q_len:  # token buckets: the verify rows'
                        self._record_token_graphs(runner, ids, positions)
                    self._sync()
                if use_tr and self.mixed_mode == CUDAGraphMode.TR_HYBRID:
                    # Prefill pass: a unit that records the same work in both phases only claims
                    # the decode recordings; a per-phase unit records its own.
                    for rows in self._prefill_sizes(sizes):
                        ids, positions = self._dummy_prefill(runner, rows)
                        if any(tg.per_phase for tg in self.token_graphs):
                            runner.model(ids, positions)
                        self._record_token_graphs(runner, ids, positions)
                    self._sync()
            finally:
                reset_forward_context()
        self.capture_seconds = time.perf_counter() - start
        if self._cuda:
            self.pool_bytes = max(free_before - torch.cuda.mem_get_info()[0], 0)
        self.capture_sizes = sorted(sizes)
        self._token_sizes = {p: self.token_sizes(p) for p in ("prefill", "decode")}
        if use_tr and not self.token_sizes("decode"):
            raise RuntimeError(
                "token graph capture recorded nothing: put @token_graph above "
                "@support_torch_compile on the recording unit"
            )
        logger.info(
            "captured %s graphs for sizes %s in %.2f s (pool %.1f MiB)",
            self.mode.name, self.capture_sizes, self.capture_seconds, self.pool_bytes / 2**20,
        )
        return self.capture_seconds, list(self.capture_sizes)

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _record_token_graphs(
        self, runner: GraphRunnerHost, ids: torch.Tensor, positions: torch.Tensor
    ) -> None:
        ctx = get_forward_context()
        ctx.tr_graph = TokenGraphPass.RECORD
        try:
            (self._unit or runner.model)(ids, positions)
        finally:
            ctx.tr_graph = None

    # ---------------------------------------------------------------- replay

    def maybe_replay(self, runner: GraphRunnerHost, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Replay the graph the step's plan (ForwardContext.plan) names and return its hidden
        states; None for an eager plan (the runner runs the step and counts eager_steps).
        Inputs not padded as planned, or a plan naming no recording, are an error, never a
        silent eager step."""
        fctx = get_forward_context()
        plan = fctx.plan
        if plan.kind == EAGER:
            return None
        rows = int(input_ids.shape[0])
        if rows != plan.rows:
            raise ValueError(
                f"the step was planned as {plan} but its inputs have {rows} rows: prepare it "
                "with ModelRunner.prepare_step, which pads it to the plan"
            )
        if not self._recorded(plan):
            raise ValueError(f"no graph of this capture serves {plan}")
        if fctx.spec_decode_metadata is not None:
            counters.inc("verify_graph_replays")
        counters.inc(f"{plan.kind}_replays")  # req_graph_replays, token_graph_replays
        positions = fctx.context.positions if fctx.context is not None else None
        if plan.key is not None:
            return self.req_graph.replay(plan.key, (input_ids, positions))
        assert plan.phase is not None  # StepPlan: a token-graph plan has its phase
        if self._unit is not None:
            return token_graph_of(self._unit).replay((input_ids, positions), plan.phase)
        fctx.tr_graph = TokenGraphPass.REPLAY
        try:
            return runner.model(input_ids, positions)
        finally:
            fctx.tr_graph = None

    def _recorded(self, plan: StepPlan) -> bool:
        if plan.key is not None:
            return plan.key in self.req_graph
        return plan.phase is not None and plan.rows in self.token_sizes(plan.phase)

    # ---------------------------------------------------------------- reporting

    def stats(self) -> dict[str, Any]:
        """For the warm-up summary, /metrics and /status."""
        return {
            "cudagraph_mode": self.mode.name,
            "captured_sizes": list(self.capture_sizes),
            "capture_seconds": round(self.capture_seconds, 4),
            "graph_pool_bytes": int(self.pool_bytes),
            "req_graph_buckets": [list(k) for k in self.req_graph.keys()],
            "token_graph_sizes": {p: self.token_sizes(p) for p in ("prefill", "decode")},
        }
