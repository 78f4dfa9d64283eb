"""Structured output (atom.structured) on the tiny CPU engine with random weights: fuzzed JSON
Schemas give valid JSON every time, constrained and free rows share a batch (the free rows'
tokens unchanged), asynchronous scheduling and speculative decoding (drafts the grammar refuses
are rejected, the matcher rolled back) give the tokens of a plain synchronous run, the cache
compiles a schema once, and the request parser's 400s name the field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tiny import tiny_engine

from atom.engine import LLMEngine, SamplingParams
from atom.entrypoints.protocol import chat_request, completion_request
from atom.structured.compiler import GrammarCache
from atom.structured.grammar import build_grammar
from atom.structured.matcher import GrammarState
from atom.structured.spec import StructuredKind, StructuredSpec
from atom.structured.vocab import tokenizer_info
from atom.tokenizer import ByteTokenizer
from atom.wire.api_error import APIError

EOS = 2
VOCAB = 256
BASE: dict[str, object] = dict(max_model_len=1024, num_kv_blocks=2048, max_num_seqs=64, seed=11)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return tiny_engine(**BASE)


# ---- a JSON Schema strategy whose outputs are bounded, and a validator for it -------------

NAMES = st.text(alphabet="abcxyz_", min_size=1, max_size=5)


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.tuples(st.integers(-999, 999), st.integers(0, 999)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    string = st.integers(0, 4).flatmap(lambda lo: st.integers(lo, 5).map(
        lambda hi: {"type": "string", "minLength": lo, "maxLength": hi}))
    enum = st.lists(st.one_of(st.text(alphabet="ab c\"", max_size=4), st.integers(-9, 9),
                              st.booleans(), st.none()),
                    min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v})
    return st.one_of(integer, string, enum, st.just({"type": "boolean"}),
                     st.just({"type": "null"}),
                     st.text(alphabet="xy1", max_size=3).map(lambda v: {"const": v}))


def _node(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    obj = st.dictionaries(NAMES, children, max_size=3).flatmap(lambda props: st.lists(
        st.sampled_from(sorted(props)) if props else st.nothing(), unique=True,
        max_size=len(props)).map(lambda req: {
            "type": "object", "properties": props, "required": req,
            "additionalProperties": False}))
    arr = st.tuples(children, st.integers(0, 1), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    anyof = st.lists(children, min_size=1, max_size=2).map(lambda s: {"anyOf": s})
    return st.one_of(obj, arr, anyof)


SCHEMAS = st.recursive(_leaf(), _node, max_leaves=6)


def valid(value: Any, schema: dict[str, Any]) -> bool:
    """JSON Schema's rules for the keywords SCHEMAS uses."""
    if "anyOf" in schema:
        return any(valid(value, s) for s in schema["anyOf"])
    if "enum" in schema:
        return any(_same(value, v) for v in schema["enum"])
    if "const" in schema:
        return _same(value, schema["const"])
    t = schema.get("type")
    if t == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(value) <= set(props)
                and set(schema.get("required", [])) <= set(value)
                and all(valid(v, props[k]) for k, v in value.items()))
    if t == "array":
        return (isinstance(value, list)
                and schema.get("minItems", 0) <= len(value) <= schema["maxItems"]
                and all(valid(v, schema["items"]) for v in value))
    if t == "string":
        return (isinstance(value, str)
                and schema.get("minLength", 0) <= len(value) <= schema["maxLength"])
    if t == "integer":
        return (type(value) is int and schema["minimum"] <= value <= schema["maximum"])
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    raise AssertionError(f"unexpected schema {schema}")


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def bound(schema: dict[str, Any]) -> int:
    """Most bytes a value of the schema takes (compact JSON, ", " and ": "; a string's
    character as a 6-byte escape)."""
    if "anyOf" in schema:
        return max(bound(s) for s in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return max(len(json.dumps(v)) * 6 for v in values)
    t = schema["type"]
    if t == "object":
        return 2 + sum(len(k) * 6 + 6 + bound(v) for k, v in schema["properties"].items())
    if t == "array":
        return 2 + schema["maxItems"] * (bound(schema["items"]) + 2)
    if t == "string":
        return 2 + 6 * schema["maxLength"]
    return 6


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
         ) -> tuple[list[list[int]], list[str | None]]:
    ids = [f"r{i}-{id(params)}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    reasons: dict[str, str | None] = {}
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [tokens[r] for r in ids], [reasons.get(r) for r in ids]


def _json_spec(schema: dict[str, Any]) -> StructuredSpec:
    return StructuredSpec(StructuredKind.JSON, json.dumps(schema))


def _check_batch(engine: LLMEngine, cases: list[tuple[dict[str, Any], list[int], int]]) -> None:
    """Every case's output is complete (stopped at EOS, before its bound) and valid."""
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=bound(s) + 2,
                             structured=_json_spec(s)) for s, _, seed in cases]
    outs, reasons = _run(engine, [p for _, p, _ in cases], params)
    for (schema, _, _), toks, reason in zip(cases, outs, reasons, strict=True):
        assert reason == "stop" and toks[-1] == EOS, (schema, bytes(toks), reason)
        text = bytes(toks[:-1]).decode("utf-8")
        assert valid(json.loads(text), schema), (schema, text)


CASES = st.tuples(SCHEMAS, st.lists(st.integers(3, 255), min_size=1, max_size=12),
                  st.integers(0, 2**31))
FUZZ = settings(derandomize=True, deadline=None, database=None, phases=[Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(FUZZ, max_examples=1)
@given(st.lists(CASES, min_size=48, max_size=48))
def test_fuzzed_schemas_give_valid_json(engine: LLMEngine, cases) -> None:
    _check_batch(engine, cases)


@pytest.mark.slow
@settings(FUZZ, max_examples=11)
@given(st.lists(CASES, min_size=48, max_size=48))
def test_fuzzed_schemas_give_valid_json_528(engine: LLMEngine, cases) -> None:
    """11 batches of 48 random schema/prompt pairs (528)."""
    _check_batch(engine, cases)


# ---- the batch, the step order and speculation --------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
SPECS = [
    _json_spec(PERSON),
    StructuredSpec(StructuredKind.REGEX, r"[a-c]{2,4}@x\.(com|org)"),
    StructuredSpec(StructuredKind.CHOICE, '["yes", "no", "maybe"]'),
    StructuredSpec(StructuredKind.GRAMMAR, 'root ::= "(" [ab]{1,3} ")" | "[]"'),
]
# a repetitive prompt: the n-gram drafter proposes its continuation, which the grammars refuse
PROMPT = [5, 9, 200, 31, 5, 9, 200, 31, 5, 9]


def _mixed(temperature: float) -> list[SamplingParams]:
    constrained = [SamplingParams(temperature=temperature, seed=i, max_tokens=60,
                                  structured=s) for i, s in enumerate(SPECS)]
    free = [SamplingParams(temperature=temperature, seed=50 + i, max_tokens=12)
            for i in range(len(constrained))]
    return [p for pair in zip(constrained, free, strict=True) for p in pair]


def _check_mixed(outs: list[list[int]]) -> None:
    for params_out, spec in zip(outs[0::2], SPECS, strict=True):
        assert params_out[-1] == EOS, (spec, bytes(params_out))
        text = bytes(params_out[:-1]).decode()
        if spec.kind is StructuredKind.JSON:
            assert valid(json.loads(text), PERSON), text
        elif spec.kind is StructuredKind.REGEX:
            assert re.fullmatch(r"[a-c]{2,4}@x\.(com|org)", text), text
        elif spec.kind is StructuredKind.CHOICE:
            assert text in ("yes", "no", "maybe"), text
        else:
            assert re.fullmatch(r"\([ab]{1,3}\)|\[\]", text), text


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_mixed_batch_async_and_spec_decode_agree(engine: LLMEngine, temperature: float) -> None:
    """Constrained and free rows in one batch: the free rows' tokens are those they get alone;
    synchronous, asynchronous (the default) and n-gram speculative steps give the same tokens
    (greedy; sampled: seeded rows without speculation, whose acceptance draws differ)."""
    params = _mixed(temperature)
    prompts = [PROMPT[: 3 + i] for i in range(len(params))]
    outs, _ = _run(engine, prompts, params)
    _check_mixed(outs)
    alone, _ = _run(engine, prompts[1::2], params[1::2])
    assert outs[1::2] == alone
    engine.async_scheduling = False
    try:
        sync, _ = _run(engine, prompts, params)
    finally:
        engine.async_scheduling = True
    assert sync == outs
    if temperature == 0.0:
        spec = tiny_engine(speculative_config=NGRAM, **BASE)
        spec_outs, _ = _run(spec, prompts, params)
        assert spec_outs == outs
        stats = spec.stats()
        assert stats["spec_decode_steps"] > 0
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_drafts_fill_rows_and_roll_back() -> None:
    """fill_drafts: row i is the mask after drafts[:i]; a refused draft is masked out of its
    own row; the matcher ends where it began."""
    info = tokenizer_info(ByteTokenizer(VOCAB, 1, [EOS]), VOCAB, [EOS])
    compiled = GrammarCache(info).get(StructuredSpec(StructuredKind.REGEX, "ab+c"))
    state, ref = GrammarState(compiled), GrammarState(compiled)
    state.advance([ord("a")])
    ref.advance([ord("a")])
    drafts = [ord("b"), ord("b"), ord("x")]
    got = xgr.allocate_token_bitmask(4, VOCAB)
    state.fill_drafts(got, 0, drafts)
    want = xgr.allocate_token_bitmask(4, VOCAB)
    for i, d in enumerate(drafts[:2]):
        ref.fill(want, i)
        ref.advance([d])
    ref.fill(want, 2)
    assert got[:3].tolist() == want[:3].tolist()

    def allowed(mask, row: int, token: int) -> bool:
        return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)

    assert not allowed(got, 2, ord("x")) and allowed(got, 2, ord("c"))
    assert got[3].tolist() == [-1] * got.shape[1]  # after a refused draft: never read
    after = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(after, 0)
    assert allowed(after, 0, ord("b")) and not allowed(after, 0, ord("c"))  # back after "a"
    assert state.consumed == 1


def test_cache_compiles_a_spec_once(engine: LLMEngine) -> None:
    cache = engine.structured.cache
    spec = _json_spec({"type": "object", "properties": {"q": {"type": "boolean"}},
                       "required": ["q"], "additionalProperties": False})
    misses = cache.misses
    outs, _ = _run(engine, [[3, 4]] * 3, [SamplingParams(temperature=1.0, seed=i,
                                                         max_tokens=30, structured=spec)
                                          for i in range(3)])
    assert cache.misses == misses + 1
    assert {json.loads(bytes(o[:-1])) == {"q": True} or json.loads(bytes(o[:-1])) == {"q": False}
            for o in outs} == {True}


def test_uncompilable_grammar_is_refused_by_the_engine(engine: LLMEngine) -> None:
    bad = SamplingParams(structured=StructuredSpec(StructuredKind.REGEX, "[a-"))
    with pytest.raises(ValueError, match="regex: .*Unclosed"):
        engine.add_request("bad-regex", [3], bad)


# ---- the request parser --------------------------------------------------------------------

TOK = ByteTokenizer(VOCAB, 1, [EOS])


def _chat(**extra: Any):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return chat_request(body, TOK, "m", 1024, VOCAB)


def _completion(**extra: Any):
    return completion_request({"model": "m", "prompt": "hi", **extra}, TOK, "m", 1024, VOCAB)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("extra", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, StructuredKind.JSON_OBJECT, ""),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredKind.JSON, json.dumps(SCHEMA, sort_keys=True)),
    ({"guided_json": SCHEMA}, StructuredKind.JSON, json.dumps(SCHEMA, sort_keys=True)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredKind.JSON,
     json.dumps(SCHEMA, sort_keys=True)),
    ({"guided_regex": "a+"}, StructuredKind.REGEX, "a+"),
    ({"guided_choice": ["a", "b"]}, StructuredKind.CHOICE, '["a", "b"]'),
    ({"guided_grammar": 'root ::= "x"'}, StructuredKind.GRAMMAR, 'root ::= "x"'),
    ({"structured_outputs": {"regex": "b+"}}, StructuredKind.REGEX, "b+"),
    ({"structured_outputs": {"json_object": True}}, StructuredKind.JSON_OBJECT, ""),
])
def test_request_fields_become_one_spec(extra, kind, value) -> None:
    for req in (_chat(**extra), _completion(**extra)):
        assert req.params.structured == StructuredSpec(kind, value)
    assert _chat(response_format={"type": "text"}).params.structured is None


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "objec"}}}}}},
     "response_format", "response_format.json_schema.schema.properties.a.type: 'objec'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format", "json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema"),
    ({"guided_json": {"required": "a"}}, "guided_json", "guided_json.required"),
    ({"guided_json": "{bad"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "[a-"}, "guided_regex", "cannot be compiled: regex: Regex parsing"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", 'Rule "foo" is not defined'),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
])
def test_bad_constraints_are_400s_naming_the_field(extra, param, words) -> None:
    for parse in (_chat, _completion):
        with pytest.raises(APIError) as err:
            parse(**extra)
        assert err.value.status == 400 and err.value.param == param, err.value
        assert words in str(err.value), err.value


def test_uncompilable_schema_gives_the_backends_reason() -> None:
    spec = _json_spec({"type": "string", "pattern": "(?<=a)b"})
    with pytest.raises(ValueError, match="json: "):
        build_grammar(spec)
