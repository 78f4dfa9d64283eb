"""Parsing and validating request bodies (atom.wire.body, atom.entrypoints.protocol) in-process:
the msgspec fast path decodes exactly what json.loads does and accepts nothing it refuses, the
depth and Unicode checks hold whether or not the tree walk is skipped, and a prompt in each of
its forms is validated as that form only, with 400s naming the field.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom.entrypoints.protocol import completion_request
from atom.wire.api_error import APIError
from atom.wire.body import MAX_DEPTH, BodyError, loads_object

VOCAB = 256


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types (floats: NaN and the sign of zero too, dicts: key order)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _outcome(raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", loads_object(raw)
    except BodyError as exc:
        return "error", exc.code


def _reference(raw: bytes) -> tuple[str, Any]:
    """What loads_object answered with json.loads alone and the tree always walked."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return "error", "invalid_json"
    if not isinstance(body, dict):
        return "error", "invalid_json"
    stack = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return "error", "invalid_json"
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            for s in (key, value):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        return "error", "invalid_unicode"
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))
    return "ok", body


EDGE_BODIES = [
    b'{"a": NaN, "b": Infinity}',  # json.loads takes these: so does the server
    b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark
    b'{"a": 1e400}',  # inf
    b'{"a": 123456789012345678901234567890, "b": -9223372036854775809}',
    b'{"a": ' + b"9" * 4301 + b"}",  # past Python's digit limit
    b'{"a": 1, "a": 2}',
    b'{"a": "\\ud800"}',  # a lone surrogate escape
    b'{"a": "\\ud83d\\ude00"}',  # a pair: a character
    b'{"a": "\xed\xa0\x80"}',  # a surrogate encoded in the bytes
    b'{"a": "\xff"}',
    '{"a": 1}'.encode("utf-16"),
    b'{"a": "x\ny"}',  # a raw control character in a string
    b'{"a": 01}',
    b'{"a": [1,]}',
    b'{"a": 1} x',
    b"[1, 2]",
    b'"a"',
    b"",
    b'{"s": "' + b"[" * 100 + b'"}',  # brackets in a string: nothing nests
    b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}",  # depth MAX_DEPTH
    b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",  # one deeper
    b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"a": [[{"b": "\\udfff"}]]}',  # a surrogate deep in a short body
    b'{"\\ud800": 1}',  # ... or in a key
]


@pytest.mark.parametrize("raw", EDGE_BODIES, ids=range(len(EDGE_BODIES)))
def test_edge_bodies_decode_as_json_loads_does(raw: bytes) -> None:
    got, want = _outcome(raw), _reference(raw)
    assert got[0] == want[0], (got, want)
    assert got[0] == "error" and got[1] == want[1] or _same(got[1], want[1])


def test_depth_and_surrogates_are_refused_without_the_walk_too() -> None:
    """The walk is skipped only where it cannot find anything: both refusals stay."""
    deep = b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
    with pytest.raises(BodyError, match=f"deeper than {MAX_DEPTH}"):
        loads_object(deep)
    with pytest.raises(BodyError) as info:
        loads_object(b'{"prompt": ["ok", "a\\ud800b"]}')
    assert info.value.code == "invalid_unicode"


_text = st.text(st.characters(codec=None), max_size=12)  # lone surrogates included
_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(), _text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=24,
)


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(st.dictionaries(_text, _values, max_size=4), st.booleans())
def test_random_bodies_decode_as_json_loads_does(body: dict[str, Any], ascii_only: bool) -> None:
    raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    got, want = _outcome(raw), _reference(raw)
    assert got[0] == want[0] and (got[0] == "error" and got[1] == want[1] or _same(got[1], want[1]))


def test_mutated_bodies_are_accepted_only_where_json_loads_accepts_them() -> None:
    """Random byte edits of valid bodies: the fast path must not accept malformed JSON."""
    rng = random.Random(0)
    alphabet = b'{}[]",:0123456789.eE+-\\u tfnrlaesx\x00\x1f\x7f\xff\xc3\xa9\xed\xa0\x80\t\n'
    seeds = [b'{"a": [1, 2.5, -3e2, "s\\u00e9", true, null, {"b": []}]}',
             b'{"prompt": [1, 2, 3], "x": "\\ud83d\\ude00", "y": 1E400, "z": -0.0}']  # fmt: skip
    for _ in range(5000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(raw))
            if rng.random() < 0.5:
                raw[i] = rng.choice(alphabet)
            else:
                raw[i:i] = bytes([rng.choice(alphabet)])
        got, want = _outcome(bytes(raw)), _reference(bytes(raw))
        assert got[0] == want[0], (bytes(raw), got, want)
        assert got[0] == "error" or _same(got[1], want[1]), bytes(raw)


def _completion(prompt: Any) -> Any:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    return completion_request(body, None, "m", 8192, VOCAB)


def test_a_long_token_id_prompt_is_served_as_given() -> None:
    ids = [random.Random(1).randrange(VOCAB) for _ in range(4096)]
    req = _completion(loads_object(json.dumps({"p": ids}).encode())["p"])
    assert req.prompt_ids == ids and req.params.max_tokens == 1


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ([1, "a"], "prompt.token_ids.1: Input should be a valid integer"),
        ([1, True], "prompt.token_ids.1: Input should be a valid integer"),
        ([1.0], "prompt.token_ids.0: Input should be a valid integer"),
        ([[1]], "prompt.token_ids.0: Input should be a valid integer"),
        (["a", 1], "prompt.texts.1: Input should be a valid string"),
        (5, "prompt: Input should be a string, a list of strings or a list of token ids"),
        (None, "prompt: Input should be a string, a list of strings or a list of token ids"),
        ({"a": 1}, "prompt: Input should be a string, a list of strings or a list of token ids"),
        ([1, 2, VOCAB], f"token ids must be in [0, {VOCAB}), got [{VOCAB}]"),
        ([-1], f"token ids must be in [0, {VOCAB}), got [-1]"),
        ([], "the prompt is empty"),
        (["a", "b"], "batched prompts are not supported"),
    ],
)
def test_bad_prompts_are_400s_naming_the_field(prompt: Any, fragment: str) -> None:
    with pytest.raises(APIError) as info:
        _completion(prompt)
    assert info.value.status == 400
    assert info.value.param == "prompt"
    assert fragment in info.value.message


@pytest.mark.parametrize("prompt", ["x", ["x"]])
def test_text_prompts_take_the_tokenizer(prompt: Any) -> None:
    class Tok:
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    assert completion_request(body, Tok(), "m", 8192, VOCAB).prompt_ids == [ord("x")]


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("temperature", 2.5, "temperature must be between 0 and 2"),
        ("temperature", -0.1, "temperature must be between 0 and 2"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_k", 0, "top_k must be -1 (disabled) or at least 1"),
        ("top_k", 2**63, "top_k must be below 2**63"),
        ("seed", 2**63, "seed must fit in a signed 64-bit integer"),
        ("stop_token_ids", [VOCAB], f"stop_token_ids must be in [0, {VOCAB})"),
    ],
)
def test_the_api_and_the_engine_refuse_sampling_values_by_one_rule(
    field: str, value: Any, fragment: str
) -> None:
    """The API's 400 and the engine core's refusal are the same SamplingParams.validate()."""
    from atom.engine.params import SamplingError, SamplingParams

    body = {"model": "m", "prompt": [1, 2], "max_tokens": 1, field: value}
    with pytest.raises(APIError) as api:
        completion_request(body, None, "m", 64, VOCAB)
    assert api.value.status == 400 and api.value.param == field
    assert fragment in api.value.message
    with pytest.raises(SamplingError) as engine:
        SamplingParams(**{field: value}).validate(VOCAB)
    assert engine.value.field == field and str(engine.value) == api.value.message


def test_the_request_carries_one_validated_sampling_struct() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "temperature": 1e-45,
            "top_k": VOCAB + 5, "stop_token_ids": [7], "ignore_eos": True, "logprobs": 1}  # fmt: skip
    params = completion_request(body, None, "m", 64, VOCAB).params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, -1, 3)  # normalised
    assert params.stop_token_ids == [7] and params.ignore_eos and params.logprobs
