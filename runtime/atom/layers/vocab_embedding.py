"""The vocabulary-parallel token embedding: each rank holds an equal range of the rows.

A rank looks up the ids in its range, writes zeros for the others, and the all-reduce
assembles every row (exactly one rank contributes each). The same rows serve as the
vocab-parallel logits weight when the embeddings are tied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.distributed.communication import tensor_parallel_all_reduce
from atom.layers.sharding import Piece, Shard, WeightTarget, mark_sharded, split_evenly


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int, tp_rank: int) -> None:
        super().__init__()
        self.vocab_start, self.vocab_local = split_evenly(vocab_size, tp_size, tp_rank,
                                                          "vocab_size")
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden_size))
        mark_sharded(self.weight, (vocab_size, hidden_size),
                     [Piece(0, self.vocab_start, 0, self.vocab_local)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_local)
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return tensor_parallel_all_reduce(rows.masked_fill(~mine.unsqueeze(-1), 0))

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        shard = Shard(0, self.vocab_start, self.vocab_local)
        return {f"{prefix}.weight": WeightTarget(self.weight.data,
                                                 (self.vocab_size, self.hidden_size), shard)}
