"""atom.engine.token_check: the fast prompt check judges every input as the per-token loop."""

from __future__ import annotations

import numpy as np
import pytest

from atom.engine.token_check import out_of_vocab

VOCAB = 256


def _loop(ids):  # the check LLMEngine made per token before
    return [t for t in ids if not isinstance(t, int) or not 0 <= t < VOCAB]


@pytest.mark.parametrize(
    "ids",
    [
        list(range(VOCAB)),
        [0, 255, 7] * 1000,
        [1, 256],
        [-1, 3],
        [True, False, 5],  # bools are ints to the loop
        [1.0, 2],
        [np.int64(3)],
        ["a", 1],
        [None],
        [2**70],
        (1, 2, 300),  # a tuple: the loop's path
        [],
    ],
)
def test_out_of_vocab_is_the_loops_answer(ids) -> None:
    assert out_of_vocab(ids, VOCAB) == _loop(ids)
