"""Prompt token ids checked against the vocabulary without a Python step per token (a
4,096-token prompt is checked at every request, cached or not)."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any

import msgspec


@lru_cache(maxsize=8)
def _ids_type(vocab_size: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def all_in_vocab(ids: Any, vocab_size: int) -> bool:
    """Whether ids is a list of plain ints (no bool, float or numpy int) in [0, vocab_size),
    checked by msgspec in C; False says only that the slower checks must judge it."""
    if type(ids) is not list:
        return False
    try:
        msgspec.convert(ids, _ids_type(vocab_size))  # strict: plain ints only
    except msgspec.ValidationError:
        return False
    return True


def out_of_vocab(ids: Any, vocab_size: int) -> list[Any]:
    """The ids that are not ints in [0, vocab_size); empty when all are. A list of plain ints
    in range passes in C (all_in_vocab); anything else (a bool, a float, a numpy int, an id out
    of range) goes to the loop, which judges it as it always did."""
    if all_in_vocab(ids, vocab_size):
        return []
    return [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
