"""Prompt token ids checked against the vocabulary without a Python step per token (a
4,096-token prompt is checked at every request, cached or not)."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any

import msgspec


@lru_cache(maxsize=8)
def _ids_type(vocab_size: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def out_of_vocab(ids: Any, vocab_size: int) -> list[Any]:
    """The ids that are not ints in [0, vocab_size); empty when all are. msgspec passes a list
    of plain ints in range in C; anything else (a bool, a float, a numpy int, an id out of
    range) goes to the loop, which judges it as it always did."""
    if type(ids) is list:
        try:
            msgspec.convert(ids, _ids_type(vocab_size))  # strict: plain ints only
        except msgspec.ValidationError:
            pass
        else:
            return []
    return [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
