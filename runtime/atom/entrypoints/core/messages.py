"""The typed seam between the API server(s) and the engine core (msgpack via msgspec).

API -> core: AddRequest, AbortRequests, ReleaseKV, DropHold, ReleaseHold, Hello, Scrape,
ApiMetrics, Shutdown.
core -> API: StepOutputs (every request that moved in one engine step), RequestFailed,
EngineStatus (state changes, and the engine's facts once ready), Stats (also the heartbeat),
MetricsText (the core's own Prometheus series, on request), HoldReleased (ReleaseHold's answer).
"""

from __future__ import annotations

from typing import Any

import msgspec

from atom.disagg.handle import KVHandle
from atom.engine.params import SamplingParams, TopLogprobs


# ---- API -> core ------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    client: int  # which API server gets the outputs
    prompt_ids: list[int]
    sampling: SamplingParams  # as the API validated it; the engine validates it again
    hold_kv: bool = False  # prefill role: keep the prompt's blocks for a pull
    first_token: int | None = None  # decode role: the prompt ran elsewhere, this was sampled
    first_logprob: float | None = None
    kv_pull: KVHandle | None = None  # decode role: pull these blocks first (None: not needed)
    cached_tokens: int = 0  # decode role: prompt tokens the prefill found in its prefix cache
    lora_name: str | None = None  # run under this loaded LoRA adapter (None: the base model)
    first_top_logprobs: TopLogprobs | None = None  # decode role: the first token's alternatives


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class ReleaseKV(msgspec.Struct, tag=True, array_like=True):
    """Free a handle's blocks on its prefill instance (the decode side did not need them)."""

    handle: KVHandle


class DropHold(msgspec.Struct, tag=True, array_like=True):
    """Drop this core's hold of a prefill-role request (its API handler was cancelled)."""

    request_id: str


class ReleaseHold(msgspec.Struct, tag=True, array_like=True):
    """POST /internal/kv/release: drop a hold if `secret` is its per-transfer secret (the key
    lives only in the core); answered with HoldReleased."""

    client: int
    seq: int
    handle: str
    secret: str


class Hello(msgspec.Struct, tag=True, array_like=True):
    """An API server connected: the core answers with its current EngineStatus."""

    client: int
    pid: int


class Scrape(msgspec.Struct, tag=True, array_like=True):
    client: int
    seq: int
    # --api-server-count > 1: this API server's series (atom.entrypoints.metrics_merge), kept
    # by the core and handed to the others' scrapes
    snapshot: bytes = b""


class ApiMetrics(msgspec.Struct, tag=True, array_like=True):
    """An API server's series, pushed every metrics_merge.PUSH_S (--api-server-count > 1)."""

    client: int
    snapshot: bytes


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class LoadLoRA(msgspec.Struct, tag=True, array_like=True):
    """POST /v1/load_lora_adapter: answered with LoRAReply, then LoRAAdapters to every API
    server."""

    client: int
    seq: int
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag=True, array_like=True):
    """POST /v1/unload_lora_adapter: answered as LoadLoRA is."""

    client: int
    seq: int
    name: str


CoreInput = (
    AddRequest
    | AbortRequests
    | ReleaseKV
    | DropHold
    | ReleaseHold
    | Hello
    | Scrape
    | ApiMetrics
    | Shutdown
    | LoadLoRA
    | UnloadLoRA
)


# ---- core -> API ------------------------------------------------------------------------------
class ReqOut(msgspec.Struct, array_like=True, gc=False):
    """One request's new tokens in one step (and its end, if it ended)."""

    request_id: str
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # None: goes on; "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    kv_secret: str | None = None  # a finished hold_kv request: its handle's per-transfer secret
    top_logprobs: list[TopLogprobs] | None = None  # per token, when the request asked


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[ReqOut]
    steps: int  # engine steps so far


class RequestFailed(msgspec.Struct, tag=True, array_like=True):
    """The core refused or lost a request: answered with `status` and an OpenAI error body."""

    request_id: str
    status: int
    code: str
    message: str


class KVInfo(msgspec.Struct):
    """What the API server needs to make KV handles and describe the holds."""

    layout: dict[str, Any] | None  # atom.disagg.layout.KVLayout.to_dict()
    port: int | None  # the KV port this core serves blocks on (None: serves none)
    advertise_host: str | None
    hold_seconds: float
    max_held_fraction: float = 0.5  # --max-held-kv-fraction


class EngineInfo(msgspec.Struct):
    """Facts known once the engine is built and warm."""

    max_model_len: int
    vocab_size: int
    config: dict[str, Any]  # atom.entrypoints.info.config_info
    graphs: dict[str, Any]  # atom.entrypoints.info.graph_info
    warmup: dict[str, Any]
    kv: KVInfo | None
    eos_token_ids: list[int] = []  # where the engine stops unless ignore_eos (atom.engine.eos)
    lora_adapters: dict[str, str] | None = None  # None: no LoRA served; else name -> directory


class EngineStatus(msgspec.Struct, tag=True, array_like=True):
    state: str  # starting | warming | ready | failed | stopped
    reason: str
    pid: int
    info: EngineInfo | None = None


class Stats(msgspec.Struct, tag=True, array_like=True):
    stats: dict[str, Any]  # LLMEngine.stats(): gauges and the process-wide counters
    steps: int
    busy: bool


class MetricsText(msgspec.Struct, tag=True, array_like=True):
    seq: int
    text: bytes
    peers: list[bytes] = []  # the other API servers' latest snapshots (Scrape.snapshot)


class LoRAReply(msgspec.Struct, tag=True, array_like=True):
    """LoadLoRA's or UnloadLoRA's outcome: status 200, or the HTTP error to answer."""

    seq: int
    status: int
    code: str = ""
    message: str = ""


class LoRAAdapters(msgspec.Struct, tag=True, array_like=True):
    """The loaded adapters (name -> directory), sent to every API server when they change."""

    adapters: dict[str, str]


class HoldReleased(msgspec.Struct, tag=True, array_like=True):
    seq: int
    released: bool  # False: unknown handle, wrong secret, already pulled/released/expired


CoreOutput = (
    StepOutputs | RequestFailed | EngineStatus | Stats | MetricsText | HoldReleased | LoRAReply
    | LoRAAdapters
)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreOutput)
