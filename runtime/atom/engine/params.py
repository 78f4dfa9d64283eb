"""Per-request sampling parameters and the per-step output (docs/architecture.md, Engine API).

`SamplingParams` is the one shape of a request's sampling settings from the API's request
parser to the sampler: the parser builds it, it crosses to the engine core inside AddRequest
(atom.entrypoints.core.messages) and the engine keeps it on the Sequence. Its `validate()` is
the one rule set: the API answers its SamplingError with a 400 naming `field`, and the engine
core refuses the same values with the same message.
"""

from __future__ import annotations

import msgspec

from atom.structured.spec import StructuredSpec

MAX_TEMPERATURE = 2.0  # OpenAI's bound
# Below this a temperature divides the logits into inf/NaN (1e-45 is a float32 denormal): such
# a request is greedy in all but name, so it runs greedy (issue 48).
MIN_SAMPLED_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one logit_bias value
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's cap on logit_bias's size
MAX_TOP_LOGPROBS = 20  # OpenAI's (and vLLM's default) cap on alternatives per token

# One generated token's most likely alternatives: (token id, logprob), best first.
TopLogprobs = list[tuple[int, float]]


class SamplingError(ValueError):
    """A sampling value out of range; `field` names it (the 400's `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SamplingParams(msgspec.Struct, array_like=True):
    """array_like: it travels in every AddRequest, where field names would be most of it."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    # Logits processors (atom.engine.logits_processors); at their defaults a row takes the
    # sampler's plain path.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    top_logprobs: int = 0  # alternatives returned per token (with logprobs), 0..20
    # Structured output (atom.structured): the grammar the output must follow (None: free).
    structured: StructuredSpec | None = None
    # Whether a logits processor changes this row's logits (penalties, logit_bias): derived,
    # set on construction and by validate(), a field so the sampler's per-step check is one
    # attribute read (a property cost the plain step a microsecond)
    processed: bool = False

    def __post_init__(self) -> None:
        self.processed = self._processed()

    def _processed(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def validate(self, vocab_size: int = 0) -> None:
        """Check every field (SamplingError naming it) and normalise in place: a temperature
        below MIN_SAMPLED_TEMPERATURE becomes 0 (greedy), and a top_k of at least vocab_size
        (when known) becomes -1 (every token is a candidate: the same as disabled, as vLLM)."""
        max_tokens = self.max_tokens
        if not _is_int(max_tokens) or max_tokens < 1:
            raise SamplingError("max_tokens", f"max_tokens must be at least 1, got {max_tokens!r}")
        t = self.temperature
        if not _is_number(t) or not 0.0 <= t <= MAX_TEMPERATURE:
            raise SamplingError(
                "temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {t!r}"
            )
        if t < MIN_SAMPLED_TEMPERATURE:
            self.temperature = 0.0
        top_p = self.top_p
        if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {top_p!r}")
        top_k = self.top_k
        if not _is_int(top_k) or top_k == 0 or top_k < -1:
            raise SamplingError(
                "top_k", f"top_k must be -1 (disabled) or at least 1, got {top_k!r}"
            )
        if top_k > INT64_MAX:
            raise SamplingError("top_k", f"top_k must be below 2**63, got {top_k}")
        if vocab_size and top_k >= vocab_size:
            self.top_k = -1
        seed = self.seed
        if seed is not None and (not _is_int(seed) or not INT64_MIN <= seed <= INT64_MAX):
            raise SamplingError(
                "seed", f"seed must fit in a signed 64-bit integer [-2**63, 2**63), got {seed!r}"
            )
        bound = vocab_size or INT64_MAX + 1
        bad = [i for i in self.stop_token_ids if not _is_int(i) or not 0 <= i < bound]
        if bad:
            raise SamplingError(
                "stop_token_ids", f"stop_token_ids must be in [0, {bound}), got {bad[:5]}"
            )
        self._validate_processors(bound)
        self.processed = self._processed()

    def _validate_processors(self, bound: int) -> None:
        for name, v in (("presence_penalty", self.presence_penalty),
                        ("frequency_penalty", self.frequency_penalty)):
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise SamplingError(
                    name, f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {v!r}"
                )
        rep = self.repetition_penalty
        if not _is_number(rep) or not 0.0 < rep < float("inf"):
            raise SamplingError(
                "repetition_penalty", f"repetition_penalty must be above 0, got {rep!r}"
            )
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingError(
                "logit_bias",
                f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
            )
        bad = [k for k in bias if not _is_int(k) or not 0 <= k < bound]
        if bad:
            raise SamplingError(
                "logit_bias", f"logit_bias keys must be token ids in [0, {bound}), got {bad[:5]}"
            )
        off = [v for v in bias.values() if not _is_number(v) or not abs(v) <= MAX_LOGIT_BIAS]
        if off:
            raise SamplingError(
                "logit_bias",
                f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and "
                f"{MAX_LOGIT_BIAS:g}, got {off[:5]}",
            )
        top = self.top_logprobs
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise SamplingError(
                "top_logprobs",
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RequestOutput(msgspec.Struct, gc=False):
    """One request's progress in one step. A msgspec Struct, not a dataclass: a step makes one
    per running request, and the Struct's constructor (in C) costs a third of a dataclass's."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    # Prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
    # Per new token, its top_logprobs alternatives (None: the request asked for none)
    new_top_logprobs: list[TopLogprobs] | None = None
