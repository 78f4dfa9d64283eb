"""Token graphs and request graphs: the CUDA-graph recordings the model runner replays.

A *recording* runs a forward once under CUDA-graph capture. A breakable recording
(`TokenGraph`) stops capturing whenever the forward reaches an op declared `@eager_region`:
what ran before becomes one graph segment, the region runs eagerly, and capture resumes in a
new segment. Replay launches the segments in order and calls each region in between, so the
region sees the live step's forward context (sequence lengths, block tables) while everything
sized by the row count alone is replayed. The region writes into a caller-provided buffer that
the next segment was recorded reading, which is what makes the hand-over address-stable.

A `ReqGraph` is the same recording without breaks: the whole forward in one graph per request
bucket `(running_bs, draft_num)`; its eager regions are captured inline.

Every recording shares one memory pool (`graph_pool()`): recordings never replay concurrently
and each one's output is consumed before the next replays, so the pool is the largest
recording's, not the sum. Capture largest first so that the smaller ones fit inside it.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, overload

import torch

from atom.cudagraph.pool import GRAPH_POOL, graph_pool
from atom.distributed.nccl_watchdog import drain_nccl_works
from atom.utils.counters import counters
from atom.utils.forward_context import TokenGraphPass, get_forward_context

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)
PHASES = ("prefill", "decode")


# --------------------------------------------------------------------------- recorders


class Segment(Protocol):
    def replay(self) -> None: ...


class SegmentRecorder(Protocol):
    """Records graph segments. The CUDA one captures kernels; tests use a fake one."""

    def enter(self) -> None: ...  # before the first segment of a recording
    def begin(self) -> None: ...  # start capturing a segment
    def end(self) -> Segment: ...  # stop capturing, return the replayable segment
    def exit(self) -> None: ...  # after the last segment (also on error)
    def is_capturing(self) -> bool: ...


class CudaSegmentRecorder:
    """Captures segments with torch.cuda.CUDAGraph on a side stream into graph_pool().

    capture_begin/capture_end are called directly rather than through torch.cuda.graph(),
    whose __enter__ synchronises and empties the cache: per segment that would dominate
    the recording time. thread_local error mode: another thread's unsafe CUDA call (a
    watchdog polling events) must not invalidate our capture.
    """

    # Region arguments are kept as non-owning aliases: see _weak_alias.
    weak_refs = True

    def __init__(self, pool: Any = None) -> None:
        self.pool = pool
        self._stream: torch.cuda.Stream | None = None
        self._stream_ctx: Any = None
        self._graph: torch.cuda.CUDAGraph | None = None

    def enter(self) -> None:
        torch.cuda.synchronize()
        if self._stream is None:
            self._stream = GRAPH_POOL.capture_stream()
        # The side stream must see everything queued on the current one (warm-up writes).
        self._stream.wait_stream(torch.cuda.current_stream())
        self._stream_ctx = torch.cuda.stream(self._stream)
        self._stream_ctx.__enter__()

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        pool = self.pool if self.pool is not None else graph_pool()
        self._graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        GRAPH_POOL.track(self._graph, pool)

    def end(self) -> Segment:
        graph, self._graph = self._graph, None
        assert graph is not None
        with warnings.catch_warnings():
            # A segment with no kernels (a break at the very start or end) is legal here.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            graph.capture_end()
        return graph

    def exit(self) -> None:
        if self._graph is not None:  # an error mid-segment: close the capture first
            try:
                self._graph.capture_end()
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            self._graph = None
        if self._stream_ctx is not None:
            self._stream_ctx.__exit__(None, None, None)
            self._stream_ctx = None
        assert self._stream is not None, "exit follows enter"
        torch.cuda.current_stream().wait_stream(self._stream)
        torch.cuda.synchronize()

    def is_capturing(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------- recording


@dataclass
class _Region:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Recording:
    """One recorded forward: segments, the eager regions between them, static I/O."""

    segments: list[Segment] = field(default_factory=list)
    regions: list[_Region] = field(default_factory=list)
    static_inputs: tuple[Any, ...] = ()
    output: Any = None
    num_tokens: int = 0
    # Set when regions were recorded inline (a ReqGraph, or a token graph whose regions the
    # bucket fixed): the metadata tensors they read, by AttentionMetaData field name. Replay
    # copies the live step's metadata there, since no eager call reads it afresh.
    static_metadata: dict[str, torch.Tensor] | None = None

    _calls: list[Callable[[], Any]] | None = None

    def _schedule(self) -> list[Callable[[], Any]]:
        """Segments and regions interleaved as ready-to-call closures: the replay loop is
        host overhead on every step, so it does nothing but call them."""
        calls: list[Callable[[], Any]] = []
        for i, seg in enumerate(self.segments):
            calls.append(seg.replay)
            if i < len(self.regions):
                r = self.regions[i]
                calls.append(functools.partial(r.fn, *r.args, **r.kwargs))
        self._calls = calls
        return calls

    def replay(self, inputs: Sequence[Any] = ()) -> Any:
        if inputs:
            _copy_into_static(self.static_inputs, inputs)
        if self.static_metadata:
            live = _tensor_fields(get_forward_context().attn_metadata)
            names = [n for n in self.static_metadata if n in live]
            _copy_into_static([self.static_metadata[n] for n in names], [live[n] for n in names])
        for call in self._calls or self._schedule():
            call()  # a region reads the live forward context
        if self.regions:
            counters.inc("eager_region_runs", len(self.regions))
        return self.output


class _ActiveRecording:
    """State of the recording in progress; eager regions consult it."""

    def __init__(self, recorder: SegmentRecorder, breakable: bool) -> None:
        self.recorder = recorder
        self.breakable = breakable
        self.rec = Recording()
        self.open = False
        self.inlined = False  # a region ran inside a segment (see eager_region's inline_when)

    def begin(self) -> None:
        self.recorder.begin()
        self.open = True

    def end(self) -> None:
        self.open = False
        self.rec.segments.append(self.recorder.end())

    def break_at(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.end()
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor) or (
            isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)
        ):
            # A fresh tensor would live outside the pool at an address the next segment
            # never saw: the region must fill a buffer the caller allocated.
            raise RuntimeError(
                f"eager region {getattr(fn, '__qualname__', fn)} returned a tensor; an eager "
                "region must write into a caller-provided output buffer and return None"
            )
        if getattr(self.recorder, "weak_refs", False):
            args = tuple(_weak_alias(a) for a in args)
            kwargs = {k: _weak_alias(v) for k, v in kwargs.items()}
        self.rec.regions.append(_Region(fn, args, kwargs))
        self.begin()
        return out


class _InProgress:
    """The process's recording in progress, if any: captures never nest, and an eager
    region reached during one asks it whether to break the segment there."""

    def __init__(self) -> None:
        self.current: _ActiveRecording | None = None


IN_PROGRESS = _InProgress()


def _weak_alias(x: Any) -> Any:
    """A tensor at x's address that does not own x's memory.

    A region's inputs and output buffer live in the graph pool. Holding them strongly would
    keep every bucket's blocks allocated (the pool would grow per bucket); an alias lets the
    blocks return to the pool when the recording's forward ends, so the next (smaller)
    recording reuses them. That is safe because recordings never replay concurrently and,
    within one replay, a region runs before any later segment can overwrite its inputs.
    """
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        return x
    st = x.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(st.data_ptr(), x.device, st.nbytes())
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(
        alias, x.storage_offset(), x.size(), x.stride()
    )


def is_recording() -> bool:
    return IN_PROGRESS.current is not None


def record(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    breakable: bool,
    recorder: SegmentRecorder | None = None,
    static_output: torch.Tensor | None = None,
) -> Recording:
    """Run fn(*inputs) once under capture; break at eager regions when breakable.

    With static_output, the result is copied into static_output[:rows] inside the last
    segment and the recording holds that view, so the pool block of the result is freed for
    the next (smaller) recording instead of each bucket keeping its own output alive.
    """
    recorder = recorder or CudaSegmentRecorder()
    if IN_PROGRESS.current is not None or recorder.is_capturing():
        raise RuntimeError("nested graph recording refused: a recording is already in progress")
    # An eager collective still pending would be polled by the NCCL watchdog mid-capture
    # (token and request graphs alike record through here).
    drain_nccl_works()
    state = _ActiveRecording(recorder, breakable)
    recorder.enter()
    IN_PROGRESS.current = state
    try:
        state.begin()
        out = fn(*inputs)
        if static_output is not None and isinstance(out, torch.Tensor):
            dst = static_output[: out.shape[0]]
            dst.copy_(out)
            out = dst
        state.end()
        if not breakable or state.inlined:
            state.rec.static_metadata = _tensor_fields(get_forward_context().attn_metadata)
    finally:
        IN_PROGRESS.current = None
        recorder.exit()
    rec = state.rec
    rec.static_inputs = tuple(inputs)
    rec.output = out
    rec.num_tokens = _rows(inputs)
    return rec


def _rows(inputs: Sequence[Any]) -> int:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 0


def _copy_into_static(static: Sequence[Any], live: Sequence[Any]) -> None:
    """Bring the live inputs to the addresses the recording reads (no-op when they are those).

    The leading (row / sequence) dimension must match: the step has to be padded to the
    bucket. Trailing dimensions may be narrower (a block table of fewer columns).
    """
    for s, x in zip(static, live, strict=False):
        if not (isinstance(s, torch.Tensor) and isinstance(x, torch.Tensor)) or s is x:
            continue
        if s.data_ptr() == x.data_ptr() and s.shape == x.shape:
            continue
        if s.dim() != x.dim() or (s.dim() and s.shape[0] != x.shape[0]) or any(
            a < b for a, b in zip(s.shape[1:], x.shape[1:], strict=True)
        ):
            raise ValueError(
                f"replay input of shape {tuple(x.shape)} does not fit the recorded "
                f"{tuple(s.shape)}: pad the step to the bucket first"
            )
        if s.shape == x.shape:
            s.copy_(x, non_blocking=True)
        else:
            s[tuple(slice(0, d) for d in x.shape)].copy_(x, non_blocking=True)


# --------------------------------------------------------------------------- eager regions


@overload
def eager_region(fn: F, *, inline_when: Callable[[], bool] | None = None) -> F: ...
@overload
def eager_region(
    fn: None = None, *, inline_when: Callable[[], bool] | None = None
) -> Callable[[F], F]: ...


def eager_region(fn: Any = None, *, inline_when: Callable[[], bool] | None = None) -> Any:
    """Declare an op impl that runs eagerly between token-graph segments.

    inline_when, asked at record time, says the step's launches are fixed by its bucket (no
    host data sizes them): the region is then recorded inside the segment, like a ReqGraph
    records it, and the recording serves only the phase that recorded it.

    Outside a breakable recording the wrapper only calls fn (a ReqGraph captures it inline).
    During one, the segment ends here, fn runs, and a new segment begins; at replay fn is
    called again with the same tensors, reading the live forward context. fn must write into
    a caller-provided buffer and return None. Works as a plain decorator on the op's Python
    impl, so the break happens at every compilation level (the dispatcher calls the impl).
    """

    if fn is None:
        return lambda f: eager_region(f, inline_when=inline_when)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = IN_PROGRESS.current
        if state is None or not state.breakable:
            return fn(*args, **kwargs)
        if inline_when is not None and inline_when():
            state.inlined = True
            return fn(*args, **kwargs)
        return state.break_at(fn, args, kwargs)

    wrapper.__eager_region__ = True  # type: ignore[attr-defined]
    return wrapper


# --------------------------------------------------------------------------- token graphs


class TokenGraph:
    """A unit's breakable recordings, one per token bucket (per phase when per_phase).

    A recording of n rows serves every step padded to n rows, whatever its requests, and
    serves both phases unless the unit records different work per phase. It counts as a
    phase's bucket only once that phase's record pass asked for it (captured_sizes).
    """

    def __init__(
        self,
        name: str = "",
        per_phase: bool = False,
        recorder_factory: Callable[[], SegmentRecorder] | None = None,
    ) -> None:
        self.name = name
        self.per_phase = per_phase
        self.recorder_factory = recorder_factory or CudaSegmentRecorder
        self.outputs: torch.Tensor | None = None  # static output buffer (forward_vars["outputs"])
        self._recordings: dict[tuple[str, int], Recording] = {}
        self._phase_sizes: dict[str, set[int]] = {p: set() for p in PHASES}

    def _key(self, phase: str, num_tokens: int) -> tuple[str, int]:
        return (phase if self.per_phase else "any", num_tokens)

    def captured_sizes(self, phase: str) -> list[int]:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return sorted(self._phase_sizes[phase])

    def has(self, phase: str, num_tokens: int) -> bool:
        return num_tokens in self._phase_sizes[phase]

    def record(self, fn: Callable[..., Any], inputs: Sequence[Any], phase: str) -> Any:
        """Record fn(*inputs) for its row count and phase; returns the forward's output."""
        n = _rows(inputs)
        key = self._key(phase, n)
        shared = self._recordings.get(key)
        if shared is not None and not shared.static_metadata:
            # recorded by the other phase's pass with every region eager: just claim it
            self._phase_sizes[phase].add(n)
            return shared.output
        rec = record(
            fn, inputs, breakable=True, recorder=self.recorder_factory(), static_output=self.outputs
        )
        # Regions recorded inline hold this phase's launches: the recording is this phase's.
        self._recordings[(phase, n) if rec.static_metadata else key] = rec
        self._phase_sizes[phase].add(n)
        counters.inc("graphs_recorded")
        logger.debug(
            "token graph %s: %d rows (%s), %d segments, %d eager regions",
            self.name, n, phase, len(rec.segments), len(rec.regions),
        )
        return rec.output

    def recording(self, phase: str, num_tokens: int) -> Recording:
        if not self.has(phase, num_tokens):
            raise KeyError(f"no {phase} token graph recorded for {num_tokens} rows")
        own = self._recordings.get((phase, num_tokens))
        return own if own is not None else self._recordings[self._key(phase, num_tokens)]

    def replay(self, inputs: Sequence[Any], phase: str) -> Any:
        rec = self.recording(phase, _rows(inputs))
        out = rec.replay(inputs)
        counters.inc("graph_replays")
        return out

    def __len__(self) -> int:
        return len(self._recordings)


def token_graph_of(module: Any) -> TokenGraph:
    """The TokenGraph of a @token_graph unit instance (created on first use)."""
    tg = module.__dict__.get("_atom_token_graph")
    if tg is None:
        tg = TokenGraph(type(module).__name__, per_phase=type(module)._atom_token_graph_per_phase)
        module.__dict__["_atom_token_graph"] = tg
    return tg


def reset_token_graph(module: Any) -> TokenGraph:
    """Drop a unit's recordings (their pool memory is freed with them); returns the new one."""
    module.__dict__.pop("_atom_token_graph", None)
    return token_graph_of(module)


def is_token_graph_unit(module: Any) -> bool:
    return getattr(type(module), "_atom_token_graph_unit", False)


def _phase() -> str:
    ctx = get_forward_context().context
    return "prefill" if ctx is not None and ctx.is_prefill else "decode"


@overload
def token_graph(cls: type, *, per_phase: bool = False) -> type: ...
@overload
def token_graph(cls: None = None, *, per_phase: bool = False) -> Callable[[type], type]: ...


def token_graph(cls: type | None = None, *, per_phase: bool = False) -> Any:
    """Mark a module class as the token-graph recording unit.

    Wraps __call__: with ForwardContext.tr_graph RECORD the call is recorded as a token
    graph for its row count (and phase), with REPLAY the recorded graph is replayed, and
    otherwise the call runs as before. Put it ABOVE @support_torch_compile so the recording
    holds the compiled call.
    """

    def wrap(klass: type) -> type:
        # A subclass of a unit re-decorated: wrap the original call, not the wrapper.
        inner_call = getattr(klass.__call__, "__token_graph_inner__", klass.__call__)

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            mode = get_forward_context().tr_graph
            if mode is None:
                return inner_call(self, *args, **kwargs)
            tg = token_graph_of(self)
            if mode == TokenGraphPass.REPLAY:
                return tg.replay(args, _phase())
            if mode == TokenGraphPass.RECORD:
                return tg.record(lambda *a: inner_call(self, *a, **kwargs), args, _phase())
            raise ValueError(f"ForwardContext.tr_graph must be None, 'record' or 'replay': {mode!r}")

        __call__.__token_graph_inner__ = inner_call  # type: ignore[attr-defined]
        # Marking and patching the class is this decorator's job.
        klass.__call__ = __call__  # type: ignore[method-assign]  # patch
        klass._atom_token_graph_unit = True  # type: ignore[attr-defined]  # marker
        klass._atom_token_graph_per_phase = per_phase  # type: ignore[attr-defined]  # marker
        return klass

    return wrap(cls) if cls is not None else wrap


# --------------------------------------------------------------------------- request graphs


def request_bucket(running_bs: int, max_seqlen_q: int) -> tuple[int, int]:
    """(running_bs, draft_num): draft_num is the query rows per request less the decoded one."""
    return (int(running_bs), max(int(max_seqlen_q) - 1, 0))


class ReqGraph:
    """Whole-forward recordings keyed by request bucket (running_bs, draft_num)."""

    def __init__(self, recorder_factory: Callable[[], SegmentRecorder] | None = None) -> None:
        self.recorder_factory = recorder_factory or CudaSegmentRecorder
        self.graphs: dict[tuple[int, int], Recording] = {}

    def record(
        self,
        key: tuple[int, int],
        fn: Callable[..., Any],
        inputs: Sequence[Any],
        static_output: torch.Tensor | None = None,
    ) -> Any:
        if key in self.graphs:
            raise ValueError(f"request bucket {key} already recorded")
        rec = record(
            fn, inputs, breakable=False, recorder=self.recorder_factory(), static_output=static_output
        )
        self.graphs[key] = rec
        counters.inc("graphs_recorded")
        return rec.output

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self.graphs)

    def replay(self, key: tuple[int, int], inputs: Sequence[Any] = ()) -> Any:
        """Copy the live step's inputs and metadata to the recorded addresses, then replay."""
        out = self.graphs[key].replay(inputs)  # copies live inputs and metadata in first
        counters.inc("graph_replays")
        return out

    def __contains__(self, key: object) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)


def _tensor_fields(md: Any) -> dict[str, torch.Tensor]:
    if md is None or isinstance(md, dict):
        return {}
    return {k: v for k, v in vars(md).items() if isinstance(v, torch.Tensor)}
