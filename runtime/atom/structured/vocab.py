"""The served tokenizer's vocabulary as xgrammar's TokenizerInfo.

Three shapes (atom.tokenizer): a GGUF or tokenizer.json `tokenizers.Tokenizer` (byte-level BPE,
tokens spelled in GPT-2's byte alphabet, or SentencePiece pieces with <0xNN> byte fallback), and
the byte tokenizer of dummy and built-in models (id i < 256 is byte i; its specials and ids past
255 get an empty spelling, which xgrammar treats as special: never allowed by a grammar).
The mask covers the model's vocab_size (it may be padded past the tokenizer's).
"""

from __future__ import annotations

import xgrammar as xgr

from atom.tokenizer import BaseTokenizer, ByteTokenizer, FastTokenizer


def tokenizer_info(tok: BaseTokenizer, vocab_size: int, stop_ids: list[int]) -> xgr.TokenizerInfo:
    if isinstance(tok, ByteTokenizer):
        byte_specials = {tok.bos_token_id, *tok.eos_token_ids}
        raw = [b"" if i in byte_specials else bytes([i]) for i in range(min(256, vocab_size))]
        raw += [b""] * (vocab_size - len(raw))
        return xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=stop_ids)
    if isinstance(tok, FastTokenizer):
        backend = tok._tok  # noqa: SLF001 (the tokenizer's own vocabulary)
        by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        encoded = ["" if by_id.get(i, "") in specials else by_id.get(i, "")
                   for i in range(min(len(by_id), vocab_size))]
        vocab_type = _vocab_type(encoded)
        return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size,
                                 stop_token_ids=stop_ids,
                                 add_prefix_space=vocab_type is xgr.VocabType.BYTE_FALLBACK)
    raise TypeError(f"structured output does not support the tokenizer {type(tok).__name__}")


def _vocab_type(encoded: list[str]) -> xgr.VocabType:
    """Byte fallback spells bytes <0x0A>; byte-level BPE spells a space Ġ (xgrammar's rule)."""
    if "<0x0A>" in encoded:
        return xgr.VocabType.BYTE_FALLBACK
    if "Ġ" in encoded or "Ċ" in encoded:
        return xgr.VocabType.BYTE_LEVEL
    return xgr.VocabType.RAW
