"""A `tokenizers.Tokenizer` built from a GGUF file's metadata (no tokenizer.json there).

Two models, as llama.cpp names them in `tokenizer.ggml.model`:
- `gpt2`: byte-level BPE (tokens + merges), split first by the regex `tokenizer.ggml.pre` names;
- `llama`: SentencePiece-style BPE over "▁"-spelled pieces with byte fallback (merges from the
  file, or derived from the token scores when it has none).
Tokens typed CONTROL become special tokens (dropped by decode(skip_special_tokens=True)), those
typed USER_DEFINED plain added tokens; both always match whole in the input text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from atom.models.gguf_file import GGUFError, GGUFInfo

logger = logging.getLogger(__name__)

TOKENIZER_MODELS = ("gpt2", "llama")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_PRES = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_PRES = ("default", "gpt2", "gpt-2", "")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's split (SmolLM's tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_PRES:
        logger.warning("GGUF pre-tokenizer %r is not known here: splitting as GPT-2 does", pre)
    return byte_level


def _gpt2(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet (a raw added token) gets its bytes' spelling.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))  # type: ignore[arg-type]
    tok.pre_tokenizer = _byte_level_pre(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _derived_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece vocabularies without merges: every split of a token into two tokens,
    best (highest-scored) merged token first."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, score in zip(tokens, scores, strict=True):
        local = [(t[:k], t[k:], score) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
        found += sorted(local, key=lambda m: (ids[m[0]], ids[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _llama(info: GGUFInfo, tokens: list[str]) -> Tokenizer:
    merges = info.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = info.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        pairs = _derived_merges(tokens, [float(s) for s in scores])
    unk_id = info.get("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk_id] if unk_id is not None else None))
    prefix = bool(info.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


@dataclass(frozen=True)
class GGUFVocab:
    """What the server needs besides the tokenizer itself."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos: bool
    chat_template: str | None


def _token_at(tokens: list[str], index: Any) -> str | None:
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def _add_specials(tok: Tokenizer, tokens: list[str], types: list[int], byte_level: bool) -> None:
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               # a byte-level "control" token outside the byte alphabet is a converter mislabel
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def gguf_vocab(info: GGUFInfo) -> GGUFVocab:
    """The tokenizer, specials and chat template of a GGUF file; an unsupported tokenizer
    model is a one-line GGUFError."""
    kind = info.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported "
                        f"(supported: {', '.join(TOKENIZER_MODELS)})")
    tokens: list[str] = list(info.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFError(f"{info.path.name}: metadata has no tokenizer.ggml.tokens")
    if kind == "gpt2":
        tok = _gpt2(tokens, list(info.get("tokenizer.ggml.merges") or []),
                    str(info.get("tokenizer.ggml.pre", "default")))
    else:
        tok = _llama(info, tokens)
    _add_specials(tok, tokens, list(info.get("tokenizer.ggml.token_type") or []), kind == "gpt2")
    bos_id = info.get("tokenizer.ggml.bos_token_id")
    bos = _token_at(tokens, bos_id)
    eos = _token_at(tokens, info.get("tokenizer.ggml.eos_token_id"))
    # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise.
    add_bos = bool(info.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(info.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    eos_id = info.get("tokenizer.ggml.eos_token_id")
    if add_bos or add_eos:
        head = [(bos, int(bos_id))] if add_bos and bos is not None else []
        tail = [(eos, int(eos_id))] if add_eos and eos is not None else []
        single = [t for t, _ in head] + ["$A"] + [t for t, _ in tail]
        pair = single + [t for t, _ in head] + ["$B:1"] + [t for t, _ in tail]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(dict(head + tail).items()))
    eos_ids = [int(i) for i in (eos_id,
                                info.get("tokenizer.ggml.eot_token_id"),
                                info.get("tokenizer.ggml.eom_token_id")) if i is not None]
    return GGUFVocab(
        tokenizer=tok, bos_token=bos, eos_token=eos,
        bos_token_id=int(bos_id) if bos_id is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)), add_bos=add_bos,
        chat_template=info.get("tokenizer.chat_template"),
    )
