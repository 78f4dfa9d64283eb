"""Tokenizers, chat templates, streaming detokenisation and stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from atom.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    StopStringChecker,
    load_tokenizer,
)

CORPUS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld ünïcode ✓ 日本語",
] * 20

LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_bpe_model_dir(path: Path, template: str | None = LLAMA3_STYLE_TEMPLATE) -> Path:
    """A real byte-level BPE tokenizer trained on a toy corpus, saved the way HF checkpoints are."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path / "tokenizer.json"))
    cfg: dict = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    return path


def test_byte_tokenizer_roundtrip_and_specials() -> None:
    tok = ByteTokenizer(vocab_size=1000)
    text = "héllo ✓ 日本"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    assert all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
    assert tok.eos_token_ids == [257]
    # ids beyond the specials (a dummy model samples the whole vocab) still decode
    assert tok.decode([512 + ord("a")]) == "a"


def test_byte_tokenizer_refuses_small_vocab_and_bad_specials() -> None:
    with pytest.raises(ValueError, match="at least 256"):
        ByteTokenizer(vocab_size=100)
    with pytest.raises(ValueError, match="outside the model vocab"):
        ByteTokenizer(vocab_size=300, eos_token_ids=[300])


def test_byte_tokenizer_uses_model_specials_in_small_vocab() -> None:
    # tiny-llama: vocab 256, BOS 1, EOS 2: every id the tokenizer produces is < 256
    tok = ByteTokenizer(vocab_size=256, bos_token_id=1, eos_token_ids=[2])
    ids = tok.encode("hi ✓")
    assert ids[0] == 1 and max(ids) < 256
    assert tok.eos_token_ids == [2]
    assert tok.decode([*ids, 2]) == "hi ✓"  # specials are skipped
    # a vocab without room for specials and none given: no BOS, no EOS
    bare = ByteTokenizer(vocab_size=256)
    assert bare.encode("a") == [97] and bare.eos_token_ids == []


def test_load_tokenizer_picks_by_directory(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("tiny-llama", 512), ByteTokenizer)
    assert isinstance(
        load_tokenizer(str(tmp_path), 512), ByteTokenizer
    )  # dir without tokenizer.json
    write_bpe_model_dir(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path), 512), HFTokenizer)


def test_hf_tokenizer_encode_decode_specials(tmp_path: Path) -> None:
    tok = load_tokenizer(str(write_bpe_model_dir(tmp_path)), 512)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id == 0
    assert tok.add_bos
    assert tok.decode(ids) == "hello world"
    # eos from tokenizer_config plus generation_config's list, deduplicated
    assert tok.eos_token_ids == [1, 7]


def test_chat_template_from_tokenizer_config(tmp_path: Path) -> None:
    tok = load_tokenizer(str(write_bpe_model_dir(tmp_path)), 512)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert (
        tok.apply_chat_template(messages)
        == "<s><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|end|>")


def test_chat_template_fallback(tmp_path: Path) -> None:
    tok = load_tokenizer(str(write_bpe_model_dir(tmp_path, template=None)), 512)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    assert prompt == "user: hi\nassistant: yo\nassistant:"
    assert (
        ByteTokenizer().apply_chat_template([{"role": "user", "content": "x"}])
        == "user: x\nassistant:"
    )


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_incremental_detokenizer_matches_full_decode(kind: str, tmp_path: Path) -> None:
    tok = (
        ByteTokenizer(1000)
        if kind == "byte"
        else load_tokenizer(str(write_bpe_model_dir(tmp_path)), 512)
    )
    text = "héllo wörld ✓ 日本語 the lazy dog"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    # no delta ever carries half a character
    assert all("\ufffd" not in d for d in deltas)
    if kind == "byte":
        # "✓" is 3 bytes: the first two add nothing, the third emits the character
        start = len("héllo wörld ".encode())
        assert deltas[start : start + 3] == ["", "", "✓"]


def test_incremental_detokenizer_flushes_incomplete_tail() -> None:
    tok = ByteTokenizer(1000)
    detok = IncrementalDetokenizer(tok)
    assert detok.add(list(b"a")) == "a"
    assert detok.add(list("✓".encode())[:2]) == ""
    assert detok.flush() == "\ufffd"


def test_stop_strings_hold_back_and_truncate() -> None:
    checker = StopStringChecker(["STOP", "\n\n"])
    assert checker.feed("hello S") == ("hello ", False)  # "S" might begin "STOP"
    assert checker.feed("T") == ("", False)
    assert checker.feed("x") == ("STx", False)  # not a stop after all: released
    assert checker.feed(" ok STO") == (" ok ", False)
    assert checker.feed("P and more") == ("", True)
    assert checker.feed("later") == ("", True)
    assert checker.flush() == ""


def test_stop_string_earliest_match_wins_and_flush() -> None:
    checker = StopStringChecker(["world", "lo"])
    assert checker.feed("hello world") == ("hel", True)
    free = StopStringChecker(["END"])
    assert free.feed("abc E") == ("abc ", False)
    assert free.flush() == "E"
    assert StopStringChecker([]).feed("anything") == ("anything", False)
