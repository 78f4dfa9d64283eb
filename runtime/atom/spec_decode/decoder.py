"""One speculative step of the engine: draft k tokens per request, verify them in one target
forward of k + 1 rows per request, accept, and roll back the rejected tokens' KV.

The verify forward is a decode step. Request r's k + 1 rows (its last token and its k
drafts, at positions base .. base + k) are k + 1 one-token decode rows: row i has context
length base + i + 1 and the request's block table, so a verify of bs requests is a pure decode
StepBatch of bs * (k + 1) rows, run by the decode kernels and replaying the decode graphs of
that padded size. Within each layer every row's key and value are stored before any row
attends (atom.layers.attention: the store kernel, then the decode kernel, in stream order in
a graph too), so row i sees the drafts before it.

The decode kernels are not batch-invariant by themselves: they pick their launch by the row
count, and a row's sums run in a different order in each (one row: the preloading qkv kernel
and the fused attention + o_proj, a one-pass fp32 tree per row; 2-16 rows: the tiled GEMV, on
the tensor cores BLOCK_K at a time; above 16: cuBLAS; the decode attention splits each row's
keys over fewer programs as rows grow). So every kernel of a verify step launches for its bs
requests, not its bs * (k + 1) rows (atom.utils.forward_context.launch_rows: the GEMV plan,
applied to the rows in blocks of 16; the one-row kernels at bs = 1; the split count): each row
then computes what a plain decode step of the bs requests computes, bit for bit while that
step runs the GEMV kernels (running_bs <= tuning.GEMV_MAX_ROWS; tests/runtime/
test_spec_decode_gpu.py checks it on CUDA). Greedy verification reproduces decoding without
speculation, and a self-draft accepts every token in bf16 as in fp32 on the CPU.

Graph buckets keep the guide's key: request_bucket(running_bs, max_seqlen_q) ==
(running_bs, draft_num), where running_bs counts requests (Context.running_bs; running_tokens
counts the bs * (k + 1) rows) and max_seqlen_q is a request's query rows, k + 1
(AttentionMetaData.request_q_len: the attention metadata itself has one row per sequence,
max_seqlen_q 1, and verify_rows = k + 1). The (bs, k) recording is the decode forward of
bs * (k + 1) one-token rows, recorded with that layout (FULL: a ReqGraph per bucket;
TR_HYBRID: the token graph of bs * (k + 1) rows, its attention inline as in any decode bucket).

Speculative steps run synchronously: a step's accepted tokens are read on the host before the
next step is prepared (the drafts of the next step depend on them, and how many tokens a
request gained is known only then). The engine therefore schedules without the one-step lag
of asynchronous scheduling while speculation is on; prefill and mixed steps run as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from atom.config import SpecMethod, SpeculativeConfig
from atom.engine.batch import SeqRows, StepBatch
from atom.engine.block_manager import BlockManager
from atom.engine.model_runner import ModelRunner
from atom.engine.sequence import Sequence
from atom.spec_decode.ngram import NgramDrafter
from atom.spec_decode.rejection import Verdict, verify
from atom.utils.counters import counters
from atom.utils.forward_context import SpecDecodeMetadata

if TYPE_CHECKING:
    from atom.structured.host import StructuredHost


class Drafter(Protocol):
    """NgramDrafter, DraftModelDrafter: k draft ids per sequence (host lists)."""

    k: int

    def has_drafts(self, seqs: list[Sequence]) -> bool: ...

    def propose_batch(self, seqs: list[Sequence]) -> list[list[int]]: ...


@dataclass
class SpecStats:
    """Totals since start: /metrics and /status read them through LLMEngine.stats()."""

    steps: int = 0  # verify forwards
    no_draft_steps: int = 0  # decode steps run plainly: the drafter had nothing to propose
    seq_steps: int = 0  # requests verified, summed over steps
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the verified requests gained (accepted + one, less cut runs)
    per_position: list[int] = field(default_factory=list)  # accepted at draft position i

    def as_dict(self) -> dict[str, float | int | list[int]]:
        return {
            "spec_decode_steps": self.steps,
            "spec_decode_no_draft_steps": self.no_draft_steps,
            "spec_decode_num_drafts": self.seq_steps,
            "spec_decode_num_draft_tokens": self.drafted,
            "spec_decode_num_accepted_tokens": self.accepted,
            "spec_decode_num_emitted_tokens": self.emitted,
            "spec_decode_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_decode_accepted_per_position": list(self.per_position),
            # Tokens a request gains per verify step (1 + accepted drafts), before stops cut runs.
            "spec_decode_mean_accepted_tokens": (
                (self.accepted + self.seq_steps) / self.seq_steps if self.seq_steps else 0.0
            ),
        }


def verify_batch(seqs: list[Sequence], drafts: list[list[int]]) -> StepBatch:
    """The verify forward's decode rows: request r's token at position base + i (its last token,
    then its drafts), context base + i + 1, its block table; every row gives logits."""
    rows = []
    for s, d in zip(seqs, drafts, strict=True):
        base = s.num_tokens - 1
        for i, tok in enumerate([s.token_ids[-1], *d]):
            rows.append(SeqRows(s.request_id, [tok], base + i, s.block_table, None, True))
    return StepBatch(rows, is_prefill=False)


class SpecDecoder:
    def __init__(
        self,
        spec: SpeculativeConfig,
        runner: ModelRunner,
        drafter: Drafter,
        block_manager: BlockManager,
        max_model_len: int,
        seed: int,
    ) -> None:
        self.spec = spec
        self.k = spec.k
        self.runner = runner
        self.drafter = drafter
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.generator = torch.Generator().manual_seed(seed)  # unseeded requests' draws (host)
        self.stats = SpecStats(per_position=[0] * spec.k)
        self.structured: StructuredHost | None = None  # the engine's, for constrained rows

    @classmethod
    def build(
        cls,
        spec: SpeculativeConfig,
        runner: ModelRunner,
        draft_runner: ModelRunner | None,
        block_manager: BlockManager,
        max_model_len: int,
        seed: int,
    ) -> SpecDecoder:
        if spec.method == SpecMethod.NGRAM:
            drafter: Drafter = NgramDrafter(spec.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            from atom.spec_decode.draft_model import DraftModelDrafter

            if draft_runner is None:
                raise ValueError("speculative_config.method draft_model needs the draft runner")
            drafter = DraftModelDrafter(draft_runner, spec.k)
        return cls(spec, runner, drafter, block_manager, max_model_len, seed)

    def reserve(self, seqs: list[Sequence]) -> bool:
        """Whether this scheduled pure-decode step can verify k drafts per request: the
        drafter has something to propose, and every request has room for k more tokens
        (length limit and KV blocks). True: the blocks for the k draft rows are taken; False:
        nothing changed (the step decodes one token)."""
        k = self.k
        if any(s.num_tokens + k > self.max_model_len for s in seqs):
            return False
        if self._plain_is_cheap() and not self.drafter.has_drafts(seqs):
            self.stats.no_draft_steps += 1
            counters.inc("spec_no_draft_steps")
            return False
        need = sum(self.bm.extra_blocks(s, s.num_tokens + k) for s in seqs)
        if need > self.bm.num_free_blocks:
            return False
        for s in seqs:
            self.bm.grow(s, s.num_tokens + k)
        return True

    def _plain_is_cheap(self) -> bool:
        """A plain decode step replays a graph (FULL records plain buckets beside the verify
        ones) or everything runs eagerly; under TR_HYBRID decode it would run eagerly while a
        verify step replays, so a step without drafts still verifies padded ones there."""
        gr = self.runner.graph_runner
        return gr is None or gr.covers_plain_decode

    def step(
        self, seqs: list[Sequence], apply: Callable[[Sequence, list[int], list[float] | None], int]
    ) -> None:
        """Draft, verify, accept. `apply(seq, tokens, logprobs)` appends the tokens up to the
        first that ends the request and returns how many it kept; rejected and cut tokens' KV
        is then rolled back (lengths and block tables)."""
        k = self.k
        drafts = self.drafter.propose_batch(seqs)
        meta = SpecDecodeMetadata(
            draft_token_ids=torch.tensor(drafts, dtype=torch.long),  # host: nothing reads it there
            num_draft_tokens=[k] * len(seqs),
            # Every row: the k + 1 rows of each request, in order (no gather).
            logits_indices=torch.arange(len(seqs) * (k + 1), device=self.runner.device),
        )
        logits, _ = self.runner.execute_model(verify_batch(seqs, drafts), spec=meta)
        host = self.structured
        mask = host.verify_mask(seqs, drafts) if host is not None else None
        if mask is not None:  # row i of a request: its grammar after drafts[:i]
            logits = mask.apply(logits[: len(seqs) * (k + 1)])
        gens = [self._generator(s) for s in seqs]
        verdicts = verify(logits, drafts, [s.params for s in seqs], gens, self.generator)
        self.stats.steps += 1
        for seq, v in zip(seqs, verdicts, strict=True):
            self._account(v)
            kept = apply(seq, v.tokens, v.logprobs)
            self.stats.emitted += kept
            if not seq.is_finished:
                self.rollback(seq)
        counters.inc("spec_verify_steps")

    def _account(self, v: Verdict) -> None:
        st = self.stats
        st.seq_steps += 1
        st.drafted += self.k
        st.accepted += v.num_accepted
        for i in range(v.num_accepted):
            st.per_position[i] += 1

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        if seq.spec_generator is None:
            seq.spec_generator = torch.Generator().manual_seed(int(seq.params.seed))
        return seq.spec_generator

    def rollback(self, seq: Sequence) -> None:
        """The cache keeps the tokens before the last one; blocks past the length are freed."""
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        keep = self.bm.blocks_needed(seq.num_tokens)
        if len(seq.block_table) > keep:
            extra = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.bm.release(extra)
