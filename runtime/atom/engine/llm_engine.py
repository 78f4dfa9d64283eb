"""LLMEngine: requests in, tokens out, one scheduler step at a time (docs/architecture.md).

Asynchronous scheduling (Config.async_scheduling, default on): `step()` schedules and launches
a step, then reads the tokens of the step launched before it, so the host's scheduling, input
preparation and output handling overlap the GPU's forward. A sequence that goes on after the
launched step gets PENDING_TOKEN in its token ids; the next step reads the real token on the
device. Whether the launched step ends a sequence by length is known at launch (such a
sequence gets no placeholder and is not scheduled again); a stop token is known only when the
step is read, so a step already launched may compute one row more for that sequence, which is
discarded.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from atom.config import Config, SpecMethod
from atom.disagg.holds import KVHoldRegistry
from atom.disagg.kv_blocks import scatter_blocks
from atom.disagg.layout import model_identity
from atom.engine.api import EngineAPI, EngineFacts
from atom.engine.batch import StepBatch
from atom.engine.block_manager import BlockManager
from atom.engine.eos import model_eos_ids
from atom.engine.model_runner import ModelRunner
from atom.engine.params import RequestOutput, SamplingParams, TopLogprobs
from atom.engine.prefix_cache import BlockHash, root_hash
from atom.engine.sampled_copy import SampledCopier, SampledCopy
from atom.engine.sampler import Sampler
from atom.engine.scheduler import Scheduler, SchedulerOutput
from atom.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from atom.engine.token_check import out_of_vocab
from atom.engine.warmup import warm_up
from atom.executor.protocol import ModelExecutor
from atom.lora.service import LoRAService
from atom.models.registry import load_model_config
from atom.spec_decode.decoder import SpecDecoder
from atom.structured.host import StructuredHost
from atom.utils.counters import counters

if TYPE_CHECKING:
    from atom.executor.executor import MultiprocExecutor

logger = logging.getLogger(__name__)

DEFAULT_KV_HOLD_S = 30.0
FINISHED = SequenceStatus.FINISHED


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the GPU and not yet read."""

    seqs: list[Sequence]  # the sampled sequences, in the order of `tokens`
    slots: list[int | None]  # each one's PENDING_TOKEN index in token_ids (None: appended when read)
    tokens: torch.Tensor  # sampled ids on the device: the next step's pending rows read them
    copy: SampledCopy
    first_tokens: bool = False  # every sampled sequence gets its first output token
    # Penalties read its rows' output tokens on the host: read it before the next launch.
    read_first: bool = False


class LLMEngine:
    def __init__(self, config: Config, *, on_fatal: Callable[[str], None] | None = None) -> None:
        """on_fatal(reason): a tensor-parallel rank died (default: exit the process)."""
        self.config = config
        self.hf_config = load_model_config(config.model)
        limits = config.finalize_model_len(self.hf_config.max_position_embeddings)
        self.max_model_len = limits.max_model_len
        if self.max_model_len > self.hf_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.hf_config.max_position_embeddings}"
            )
        window = self.hf_config.sliding_window
        if window is not None and self.max_model_len > window:
            # Attention here is always full; within the window that is exactly sliding attention.
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's sliding_window={window} "
                "(sliding-window attention is not implemented): set max_model_len <= the window"
            )
        # runner: the lock-step calls (every rank makes them); local_runner: rank 0's own
        # ModelRunner, for what only rank 0 holds (KV cache, graphs). One rank: the same object.
        self._workers: MultiprocExecutor | None = None
        self.runner: ModelExecutor
        if config.tensor_parallel_size == 1:
            self.local_runner = ModelRunner(config, self.hf_config)
            self.runner = self.local_runner
        else:  # ranks 1..N-1 in worker processes, mirroring this runner (atom.executor)
            from atom.executor.executor import MultiprocExecutor

            self._workers = MultiprocExecutor.start(config, self.hf_config, on_fatal)
            self.runner, self.local_runner = self._workers, self._workers.local
        spec = config.speculative_config
        self.draft_runner = self._draft_runner(config) if spec is not None else None
        num_blocks = self.runner.determine_num_blocks()
        if self.draft_runner is not None and config.num_kv_blocks is None:
            from atom.spec_decode.draft_model import draft_kv_share

            # The draft cache has as many blocks (it shares the block tables): split the budget.
            num_blocks = draft_kv_share(self.local_runner.kv_block_bytes(),
                                        self.draft_runner.kv_block_bytes(), num_blocks)
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks x {config.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len}; lower max_model_len or add blocks"
            )
        self.runner.allocate_kv_cache(num_blocks)
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(
            num_blocks, config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            root=self._prefix_root())
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   limits.max_num_batched_tokens, self.max_model_len)
        self.sampler = Sampler(seed=int(config.seed), device=self.runner.device)
        self.async_scheduling = config.async_scheduling
        self.spec: SpecDecoder | None = None
        if spec is not None:  # one rank only (atom.executor.checks refuses it with N)
            self.spec = SpecDecoder.build(spec, self.local_runner, self.draft_runner,
                                          self.block_manager,
                                          self.max_model_len, int(config.seed))
            # Speculative steps are synchronous (atom.spec_decode.decoder): the next step's
            # drafts need this step's accepted tokens on the host (/status reports it too).
            self.async_scheduling = config.async_scheduling = False
        self._copier = SampledCopier(self.local_runner.max_num_seqs, self.runner.device)
        self._launched: LaunchedStep | None = None
        self.last_batch: StepBatch | None = None  # the last step() launched (None: none)
        self.last_launch_s = 0.0  # how long its scheduling and launch took (the rest: reading)
        self.eos_token_ids = model_eos_ids(self.hf_config)  # the one EOS rule (atom.engine.eos)
        hf = self.hf_config  # structured output: matchers and masks (atom.structured.host)
        self.structured = StructuredHost(
            config.model, hf.vocab_size, sorted(self.eos_token_ids),
            self.local_runner.max_num_seqs * (1 + (spec.k if spec is not None else 0)),
            self.runner.device, (hf.bos_token_id, hf.eos_token_id))
        if self.spec is not None:
            self.spec.structured = self.structured
        # Prompt blocks of finished prefill-role sequences, kept until pulled (atom.disagg).
        self.kv_holds = KVHoldRegistry(DEFAULT_KV_HOLD_S)
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        # Multi-LoRA (atom.lora): None when no adapters are served.
        manager = self.local_runner.lora
        self.lora: LoRAService | None = (LoRAService(manager, self.scheduler)
                                         if manager is not None else None)
        self._arrival = itertools.count()
        self.warmed_up = False
        self.warmup_summary: dict[str, Any] = {}

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (one rank: nothing to stop)."""
        if self._workers is not None:
            self._workers.shutdown()

    def rank_failure(self, timeout: float) -> str | None:
        """Why a tensor-parallel rank died, if one did (one rank: never)."""
        return self._workers.failure(timeout) if self._workers is not None else None

    def facts(self) -> EngineFacts:
        graphs: dict[str, Any] = {"effective_mode": "NONE"}
        graph_runner = self.local_runner.graph_runner
        if graph_runner is not None:
            try:
                stats = dict(graph_runner.stats())
                graphs = {"effective_mode": stats.get("cudagraph_mode", "NONE"), "graphs": stats}
            except Exception:  # introspection must never break /status
                graphs = {}
        pids = self._workers.tp_pids if self._workers is not None else [os.getpid()]
        return EngineFacts(
            max_model_len=self.max_model_len,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            config=self.config,
            graphs=graphs,
            tp_pids=pids,
        )

    def _prefix_root(self) -> BlockHash:
        """Start of every block key: the model identity (as P/D compares it) and the dtype."""
        cfg = self.config
        identity = model_identity(cfg.model, cfg.load_format, cfg.seed, self.hf_config.to_dict())
        return root_hash(identity, str(cfg.dtype))

    def _draft_runner(self, config: Config) -> ModelRunner | None:
        spec = config.speculative_config
        assert spec is not None
        if spec.method != SpecMethod.DRAFT_MODEL:
            return None
        from atom.spec_decode.draft_model import check_draft_model, draft_config

        assert spec.model is not None  # SpeculativeConfig requires it for draft_model
        draft_hf = check_draft_model(self.hf_config, spec.model)
        if draft_hf.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"speculative_config.model {spec.model!r} has max_position_embeddings="
                f"{draft_hf.max_position_embeddings} < max_model_len={self.max_model_len}"
            )
        return ModelRunner(draft_config(config), draft_hf, is_draft=True)

    # ---- lifecycle -----------------------------------------------------------------------
    def warmup(self) -> dict[str, Any]:
        """Compile (levels 2-3) and capture graphs; returns a summary for logs and /status."""
        self.warmup_summary = warm_up(self)
        self.warmed_up = True
        return self.warmup_summary

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, *, hold_kv: bool = False,
                    lora_name: str | None = None) -> None:
        """hold_kv: when the sequence finishes, keep its prompt's blocks in `kv_holds` under
        request_id (a prefill instance's handle) instead of freeing them. lora_name: a loaded
        LoRA adapter to run it under (None: the base model)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        if lora_name is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora_name!r} requested, but this engine "
                                 "serves none (--lora-modules / --max-loras)")
            self.lora.assign(seq, lora_name)
        seq.hold_kv = hold_kv
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int],
                              first_token: int, params: SamplingParams | None,
                              kv_blocks: torch.Tensor | None,
                              first_logprob: float | None = None, *,
                              cached_tokens: int = 0,
                              first_top: TopLogprobs | None = None) -> None:
        """A sequence whose prompt ran elsewhere: `kv_blocks` holds the prompt's KV (host tensor
        [n, 2, layers, block, heads, dim], atom.disagg.kv_blocks) and `first_token` was sampled
        from it. The first token is reported at once; decoding continues from it. kv_blocks may
        be None only when the first token already ends the request. cached_tokens: prompt
        tokens the prefill instance found in its prefix cache (reported, not looked up here)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        seq.num_cached_tokens = cached_tokens
        if not 0 <= first_token < self.hf_config.vocab_size:
            raise ValueError(f"first token id {first_token} is outside the vocabulary")
        seq.token_ids.append(first_token)
        if first_logprob is not None and seq.params.logprobs:
            seq.output_logprobs.append(first_logprob)
        if seq.generator is not None and not seq.params.greedy:
            # The prefill instance drew the first token's noise from a generator seeded alike;
            # skip that draw so the following tokens match a unified instance's.
            vocab = self.hf_config.vocab_size
            torch.empty(vocab, device=self.runner.device).exponential_(generator=seq.generator)
        reason = self._stop_reason(seq, first_token, seq.num_tokens)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        else:
            need = self.block_manager.blocks_needed(seq.num_prompt_tokens)
            if kv_blocks is None or kv_blocks.shape[0] != need:
                got = "none" if kv_blocks is None else kv_blocks.shape[0]
                raise ValueError(f"the prompt's KV needs {need} blocks, got {got}")
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.kv_payload = kv_blocks
            self._seqs[request_id] = seq
            self.scheduler.add(seq)
        lp: list[float | None] = [first_logprob] if first_logprob is not None else [None]
        k = seq.params.top_logprobs if seq.params.logprobs else 0
        top = [first_top[:k]] if k and first_top is not None else None
        self._pending.append(self._output(seq, [first_token], lp, top=top))

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams | None) -> Sequence:
        params = params or SamplingParams()
        params.validate(self.hf_config.vocab_size)
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty (at least one token is needed)")
        if n > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, more than max_model_len={self.max_model_len}"
            )
        vocab = self.hf_config.vocab_size
        bad = out_of_vocab(prompt_token_ids, vocab)
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:3]}")
        seq = Sequence(request_id, prompt_token_ids, params, arrival=next(self._arrival))
        if params.seed is not None:
            seq.generator = self.sampler.make_generator(params.seed)
        if params.structured is not None:  # compiled (cached); refused: a ValueError, a 400
            self.structured.attach(seq, params.structured)
        return seq

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        _drop_pending(seq, len(seq.token_ids))
        self._pending.append(self._output(seq, [], []))

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending)
                or self._launched is not None)

    # ---- stepping ------------------------------------------------------------------------
    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """Why `token`, the sequence's num_tokens-th, ends it (None: it goes on)."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if self._ends_by_length(seq, num_tokens):
            return "length"
        return None

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        return (num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens
                or num_tokens >= self.max_model_len)

    def _output(self, seq: Sequence, tokens: list[int], lps: list[float | None],
                num_tokens: int | None = None,
                top: list[TopLogprobs] | None = None) -> RequestOutput:
        """num_tokens: the sequence's tokens up to the last of `tokens` (default: all);
        top: the tokens' alternatives, when the request asked for them."""
        if num_tokens is None:
            num_tokens = seq.num_tokens
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_logprobs=[float(x) for x in lps if x is not None] if seq.params.logprobs else None,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=num_tokens - seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            new_top_logprobs=top,
        )

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; outputs for every request that moved: those of the step
        launched before (asynchronous scheduling) or of this one."""
        self.reclaim_kv()
        if self._launched is not None and self._launched.read_first:
            self.read_launched()
        outputs, self._pending = self._pending, []
        self.last_batch = None
        self.last_launch_s = 0.0  # a speculative step launches nothing of its own here
        sched = self.scheduler.schedule()
        if self.spec is not None and sched and self._speculates(self.spec, sched):
            self.spec.step(sched.seqs, lambda seq, toks, lps: self._emit(seq, toks, lps, outputs))
            for seq in sched.seqs:
                seq.num_scheduled_tokens = 0
            return outputs
        idle = self._launched is None  # no step in flight: nothing to overlap with
        t0 = time.perf_counter()
        launched = self._launch(sched, check_first=idle) if sched else None
        self.last_launch_s = time.perf_counter() - t0
        if self._launched is not None:
            outputs.extend(self._read(self._launched))
        self._launched = launched
        # A step of new prompts only on an idle engine is read at once: left in flight, its
        # first tokens would wait for the next step's scheduling and input preparation
        # (TTFT), which then runs after the read instead (the second token's gap only).
        if launched is not None and (not self.async_scheduling or (idle and launched.first_tokens)):
            outputs.extend(self._read(launched))
            self._launched = None
        return outputs

    def _speculates(self, spec: SpecDecoder, sched: SchedulerOutput) -> bool:
        """A pure decode step of sequences with every token on the host, room for k drafts."""
        if sched.is_prefill or self._launched is not None or sched.shared_kv:
            return False  # a verify stores every row's KV: a shared block must not be written
        if any(s.params.processed or s.params.top_logprobs for s in sched.seqs):
            return False  # the verifier samples neither (the plain step does)
        if any(s.num_computed_tokens + 1 != s.num_tokens or s.kv_payload is not None
               for s in sched.seqs):
            return False
        return spec.reserve(sched.seqs)

    def _emit(self, seq: Sequence, tokens: list[int], lps: list[float] | None,
              outputs: list[RequestOutput]) -> int:
        """Append a verify step's tokens up to the first that ends the request; how many."""
        kept: list[int] = []
        for i, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            kept.append(tok)
            if lps is not None:
                seq.output_logprobs.append(lps[i])
            reason = self._stop_reason(seq, tok, seq.num_tokens)
            if reason is not None:
                if seq.hold_kv:
                    self._hold_prompt_blocks(seq)
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
                break
        outputs.append(self._output(seq, kept, list(lps[:len(kept)]) if lps else [None]))
        return len(kept)

    def read_launched(self) -> None:
        """Read the step in flight now (every sampled token on the host); its outputs come
        with the next step()."""
        if self._launched is not None:
            self._pending.extend(self._read(self._launched))
            self._launched = None

    def _launch(self, sched: SchedulerOutput, check_first: bool) -> LaunchedStep | None:
        """Queue the step's forward and sampling; placeholders for the sequences that go on."""
        self._place_pulled_kv(sched.seqs)
        before = self._launched.tokens if self._launched is not None else None
        batch = StepBatch.of(sched.seqs, sched.is_prefill, tuple(sched.shared_kv))
        self.last_batch = batch  # what the step ran (atom.entrypoints.core.step_trace)
        logits, sampled = self.runner.execute_model(batch, before)
        seqs = sched.seqs
        to_sample = seqs if len(sampled) == len(seqs) else [seqs[i] for i in sampled]
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
        # Launched: any later step reads these blocks after this one wrote them.
        self.block_manager.cache_blocks_of(seqs)
        if not to_sample:
            return None
        # Only an idle engine's step may be read at once (step()): no per-row check under load.
        first = check_first and all(len(s.token_ids) == s.num_prompt_tokens for s in to_sample)
        host_tokens = self._copier.next_tokens(len(to_sample))
        prev = self._launched  # its tokens, for constrained rows still pending on it
        mask = self.structured.step_mask(  # filled while the forward runs
            to_sample, None if prev is None else lambda: prev.copy.result()[0])
        drawn = self.sampler.sample(logits, to_sample, host_tokens, mask)
        slots: list[int | None] = []
        for i, seq in enumerate(to_sample):
            n = len(seq.token_ids)  # this step's token is the (n + 1)-th
            if self._ends_by_length(seq, n + 1):
                slots.append(None)  # its last token: not scheduled again
            else:
                slots.append(n)
                seq.token_ids.append(PENDING_TOKEN)
                seq.pending_src = i
        copy = self._copier.start(drawn, tokens_on_host=host_tokens is not None)
        return LaunchedStep(to_sample, slots, drawn.tokens, copy, first, drawn.processed)

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        """Put a launched step's tokens in their sequences; finish those they end."""
        tokens, read = step.copy.result()
        lps: list[float | None] = [None] * len(tokens) if read is None else list(read)
        tops = step.copy.top_logprobs()
        outputs = []
        for i, (seq, slot, tok, lp) in enumerate(zip(step.seqs, step.slots, tokens, lps,
                                                     strict=True)):
            if seq.status is FINISHED:
                continue  # aborted, or stopped by a token read after this step was launched
            if slot is None:
                slot = len(seq.token_ids)
                seq.token_ids.append(tok)
            else:
                seq.token_ids[slot] = tok
            p = seq.params
            if not p.logprobs:
                lp = None
            elif lp is not None:
                seq.output_logprobs.append(lp)
            n = slot + 1
            reason = self._stop_reason(seq, tok, n)
            if reason is not None:
                _drop_pending(seq, n)
                if seq.hold_kv:
                    self._hold_prompt_blocks(seq)
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
            k = p.top_logprobs if p.logprobs else 0
            top = [tops[i][:k]] if k and tops is not None else None
            outputs.append(self._output(seq, [tok], [lp], n, top))
        return outputs

    # ---- disaggregation ------------------------------------------------------------------------
    def _hold_prompt_blocks(self, seq: Sequence) -> None:
        """kv_holds takes its own reference to the prompt's blocks (in use, so never evicted;
        they may be cached blocks other sequences share); the sequence frees its own as usual."""
        n = self.block_manager.blocks_needed(seq.num_prompt_tokens)
        held = seq.block_table[:n]
        if self.kv_holds.hold(seq.request_id, held, seq.num_prompt_tokens):
            self.block_manager.acquire(held)
        else:
            logger.warning("KV handle %s is already held; freeing these blocks", seq.request_id)

    def _place_pulled_kv(self, seqs: list[Sequence]) -> None:
        """Write pulled prompt blocks into the blocks the scheduler just gave their sequence."""
        for seq in seqs:
            if seq.kv_payload is not None:
                n = seq.kv_payload.shape[0]
                scatter_blocks(self.local_runner.kv_cache, seq.block_table[:n], seq.kv_payload)
                seq.kv_payload = None

    def reclaim_kv(self) -> int:
        """Free the blocks of holds that were pulled, released or timed out; returns how many."""
        blocks = self.kv_holds.reclaim()
        if blocks:
            self.block_manager.release(blocks)
        return len(blocks)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.block_manager.num_used_blocks,
            "kv_blocks_total": self.block_manager.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_held": self.kv_holds.num_blocks_held,
            **self.prefix_cache_stats(),
        }
        if self.spec is not None:
            out.update(self.spec.stats.as_dict())
        out.update(counters.snapshot())
        return out

    def prefix_cache_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        st = bm.stats
        return {
            "prefix_caching": bm.enable_prefix_caching,
            "prefix_cache_queries": st.queries,
            "prefix_cache_hits": st.hits,
            "prefix_cache_requests": st.requests,
            "prefix_cache_requests_hit": st.requests_hit,
            "prefix_cache_hit_rate": round(st.hit_rate, 4),
            "prefix_cache_evicted_blocks": st.evicted_blocks,
            "kv_blocks_cached": bm.num_cached_blocks,
            "kv_blocks_cached_idle": len(bm.evictable),
        }

    # ---- convenience ---------------------------------------------------------------------
    def generate(self, prompts_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Run prompts to completion; output token ids per prompt, in prompt order."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts_token_ids)
        ids = [f"gen-{next(self._arrival)}-{i}" for i in range(len(prompts_token_ids))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts_token_ids, params, strict=True):
            self.add_request(rid, prompt, p)
        while any(rid in self._seqs for rid in ids) or self._pending:
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]


def _drop_pending(seq: Sequence, keep: int) -> None:
    """A finished sequence keeps its first `keep` tokens, less any still pending."""
    del seq.token_ids[keep:]
    while seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
        seq.token_ids.pop()


if TYPE_CHECKING:  # LLMEngine is the engine core's engine (checked by the type checker)
    _: type[EngineAPI] = LLMEngine
