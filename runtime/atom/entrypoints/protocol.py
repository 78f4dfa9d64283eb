"""Request bodies of /v1/completions and /v1/chat/completions, validated into one internal shape.

Validation is pydantic with strict scalar types (a string where a number belongs is refused, not
coerced); every failure becomes an APIError naming the offending field as `param`. The sampling
fields become one SamplingParams, checked by its own validate() (atom.engine.params): the rules
the engine core applies too. `n` and `best_of` become that many engine requests
(atom.entrypoints.generation.generate_choices). Fields of the OpenAI API that the engine cannot
honour (echo, suffix, and UNSUPPORTED_FIELDS) are refused with a 400 naming the field rather
than silently ignored; unknown extra fields are ignored, as OpenAI does. Every number is bounded
to what the engine can represent (SamplingParams.validate), and sizes (prompt tokens, messages,
stop lists, logit_bias) are checked on the
raw body before anything costs time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
)

from atom.engine.params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_TOP_LOGPROBS,
    SamplingError,
    SamplingParams,
)
from atom.engine.token_check import all_in_vocab
from atom.entrypoints.structured_request import constrain
from atom.entrypoints.tool_request import ToolRequest, render_chat, tool_request
from atom.wire.api_error import APIError, bad_request

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256  # scanned for every generated token
MAX_MESSAGES = 2048
MAX_CHOICES = 32  # n and best_of: each choice is an engine sequence
# No tokenizer we load has a token longer than this many characters, so a text longer than
# max_model_len * this cannot fit and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 256


def _is_default(value: Any, *defaults: Any) -> bool:
    return value is None or any(value == d and type(value) is type(d) for d in defaults)


# OpenAI fields the engine does not implement: refused unless absent or at their no-op value.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "prediction": (),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # extension (vLLM)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM)
    ignore_eos: StrictBool = False  # extension (vLLM)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    best_of: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None  # extension (vLLM)
    logit_bias: dict[StrictStr, StrictFloat] | None = None  # token id (as a string) -> bias
    user: StrictStr | None = None


def _prompt_form(value: Any) -> str | None:
    """Which of the prompt's forms a value is meant as (by its type and its first item), so
    only that form is validated: a plain union tries every form and, for a list of 4,096 ids,
    first records 4,096 errors against list[str] (0.9 ms of a request's validation)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "texts" if value and isinstance(value[0], str) else "token_ids"
    return None  # pydantic: the discriminator's custom error


Prompt = Annotated[
    Annotated[StrictStr, Tag("text")]
    | Annotated[list[StrictStr], Tag("texts")]
    | Annotated[list[StrictInt], Tag("token_ids")],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a string, a list of strings or a list of token "
        "ids (integers)",
    ),
]


class CompletionBody(_Common):
    prompt: Prompt
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatBody(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


@dataclass
class GenerationRequest:
    """What the serving layer needs, independent of the endpoint."""

    model: str
    prompt_ids: list[int]
    params: SamplingParams  # validated; what the engine core gets
    stop: list[str]  # stop strings: matched on the detokenized text, in the API server
    stream: bool
    include_usage: bool
    extra: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # choices returned
    best_of: int = 1  # sequences generated (>= n): the n of highest cumulative logprob return
    # Alternatives shown per token (0: the chosen token's logprob only); None: no logprobs in
    # the answer (the engine may still compute them, for best_of)
    logprobs: int | None = None
    tools: ToolRequest | None = None  # chat with tools: the output is parsed into tool_calls


def precheck(body: dict[str, Any], max_model_len: int, chat: bool) -> None:
    """Sizes and unsupported fields, on the raw body: before pydantic walks a 5-million-entry
    list or the tokenizer reads 30 MB of text."""
    for name, defaults in UNSUPPORTED_FIELDS.items():
        if not _is_default(body.get(name), *defaults):
            raise bad_request(f"{name} is not supported by this server", param=name)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(
            f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
            param="logit_bias",
        )
    stop_ids = body.get("stop_token_ids")
    if isinstance(stop_ids, list) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_ids)}",
            param="stop_token_ids",
        )
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
        if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS:
            raise bad_request(
                f"stop strings are at most {MAX_STOP_STRING_CHARS} characters", param="stop"
            )
    if not max_model_len:
        return
    if chat:
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise bad_request(
                f"at most {MAX_MESSAGES} messages, got {len(messages)}", param="messages"
            )
        chars = sum(_text_chars(m) for m in messages) if isinstance(messages, list) else 0
        _check_chars(chars, max_model_len, "messages")
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        if len(prompt) >= max_model_len:
            _too_long(len(prompt), max_model_len, "prompt")
    elif isinstance(prompt, str):
        _check_chars(len(prompt), max_model_len, "prompt")
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        _check_chars(len(prompt[0]), max_model_len, "prompt")


def _text_chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict)
                   and isinstance(p.get("text"), str))  # fmt: skip
    return 0


def _check_chars(chars: int, max_model_len: int, param: str) -> None:
    if chars > max_model_len * MAX_CHARS_PER_TOKEN:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {chars} characters, more than {max_model_len} tokens can hold.",
            param=param,
            code="context_length_exceeded",
        )


def _too_long(prompt_len: int, max_model_len: int, param: str) -> None:
    raise bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
        f"{prompt_len} tokens, which leaves no room for a completion.",
        param=param,
        code="context_length_exceeded",
    )


def validate(model_cls: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise bad_request(
            f"{loc}: {err['msg']}",
            param=str(err["loc"][0]) if err["loc"] else None,
            code="invalid_type",
        ) from None


def check_model_name(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            404,
            f"The model `{requested}` does not exist (this server serves `{served}`).",
            param="model",
            code="model_not_found",
        )


def _choices(body: _Common) -> tuple[int, int]:
    """(n, best_of), checked: 1 <= n <= best_of <= MAX_CHOICES; best_of > n is not streamed
    (the best are known only at the end)."""
    n = body.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n")
    best_of = n if body.best_of is None else body.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise bad_request(
            f"best_of must be between n ({n}) and {MAX_CHOICES}, got {best_of}", param="best_of"
        )
    if best_of > n and body.stream:
        raise bad_request("best_of > n cannot be streamed", param="best_of")
    return n, best_of


def _logit_bias(body: _Common) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key[:40]!r}", param="logit_bias"
            ) from None
    return out


def _top_logprobs(value: int | None, param: str) -> int:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}", param=param
        )
    return value or 0


def _sampling(
    body: _Common, logprobs: int | None, best_of: int, vocab_size: int = 0
) -> SamplingParams:
    """The body's sampling fields, validated (max_tokens: resolve_max_tokens, after this).
    logprobs: alternatives per token (None: none asked); best_of > n ranks by logprobs."""
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_k=-1 if body.top_k is None else body.top_k,
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs is not None or best_of > body.n,
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body),
        top_logprobs=logprobs or 0,
    )
    try:
        params.validate(vocab_size)
    except SamplingError as exc:
        raise bad_request(str(exc), param=exc.field) from None
    return params


def _stop_strings(body: _Common) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    return [s for s in stop if s]


def resolve_max_tokens(
    requested: int | None,
    default: int | None,
    prompt_len: int,
    max_model_len: int,
    param: str,
    prompt_param: str,
) -> int:
    """Refuse prompts and budgets beyond the context window with the numbers in the message."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param=prompt_param)
    if prompt_len >= max_model_len:
        _too_long(prompt_len, max_model_len, prompt_param)
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", param=param)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion).",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def completion_request(
    body: dict[str, Any], tokenizer: Any, served: str, max_model_len: int, vocab_size: int
) -> GenerationRequest:
    precheck(body, max_model_len, chat=False)
    ids: Any = body.get("prompt")  # the raw JSON value
    # A list of plain ints in the vocabulary (the common token-id prompt) is checked in C
    # here; pydantic then validates the rest, not 4,096 ids one by one (0.1 ms), and the
    # range loop below is skipped. Anything else takes the full path and its errors.
    fast = all_in_vocab(ids, vocab_size)
    req: CompletionBody = validate(CompletionBody, {**body, "prompt": []} if fast else body)
    check_model_name(req.model, served)
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    _top_logprobs(req.logprobs, "logprobs")
    prompt = ids if fast else req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad_request(
                "batched prompts are not supported: send one prompt per request", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt)
    else:
        prompt_ids = list(prompt)
        bad = [] if fast else [i for i in prompt_ids if not 0 <= i < vocab_size]
        if bad:
            raise bad_request(
                f"token ids must be in [0, {vocab_size}), got {bad[:5]}", param="prompt"
            )
    gen = _build(
        req,
        prompt_ids,
        default_max=16,
        max_model_len=max_model_len,
        prompt_param="prompt",
        logprobs=req.logprobs,
        vocab_size=vocab_size,
    )
    constrain(gen.params, body)  # structured output (atom.entrypoints.structured_request)
    return gen


def chat_request(
    body: dict[str, Any], tokenizer: Any, served: str, max_model_len: int, vocab_size: int = 0
) -> GenerationRequest:
    precheck(body, max_model_len, chat=True)
    req: ChatBody = validate(ChatBody, body)
    check_model_name(req.model, served)
    if not req.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    top = _top_logprobs(req.top_logprobs, "top_logprobs")
    if top and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    messages = [m.model_dump() for m in req.messages]
    tools = tool_request(body, tokenizer)  # tools and tool_choice (atom.entrypoints.tool_request)
    try:
        text = render_chat(tokenizer, messages, tools)
    except Exception as exc:  # a template's raise_exception or a rendering error is the client's
        raise bad_request(f"chat template failed: {exc}", param="messages") from None
    # The template carries BOS itself when the model wants one; only the plain fallback needs it added.
    prompt_ids = tokenizer.encode(text, add_special_tokens=tokenizer.chat_template is None)
    if req.max_tokens is None and req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    gen = _build(
        req,
        prompt_ids,
        default_max=None,
        max_model_len=max_model_len,
        prompt_param="messages",
        logprobs=top if req.logprobs else None,
        vocab_size=vocab_size,
    )
    constrain(gen.params, body, tools)
    gen.tools = tools
    return gen


def _build(
    req: _Common,
    prompt_ids: list[int],
    default_max: int | None,
    max_model_len: int,
    prompt_param: str,
    logprobs: int | None,
    vocab_size: int = 0,
) -> GenerationRequest:
    n, best_of = _choices(req)
    params = _sampling(req, logprobs, best_of, vocab_size)
    stop = _stop_strings(req)
    params.max_tokens = resolve_max_tokens(
        req.max_tokens, default_max, len(prompt_ids), max_model_len, "max_tokens", prompt_param
    )
    return GenerationRequest(
        model=req.model,
        prompt_ids=prompt_ids,
        params=params,
        stop=stop,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        n=n,
        best_of=best_of,
        logprobs=logprobs,
    )
