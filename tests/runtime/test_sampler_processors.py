"""Penalties, logit_bias and top logprobs on the sampler's path, against transformers' own
logits processors (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
LogitNormalization) on the same inputs, and end to end against transformers' generate().

OpenAI's frequency and presence penalties have no transformers processor: they are checked
against OpenAI's published formula (logit -= frequency * count + presence * [count > 0]).
"""

from __future__ import annotations

import pytest
import torch

from atom.engine.params import SamplingError, SamplingParams
from atom.engine.sampler import Sampler
from atom.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitNormalization,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

VOCAB = 64


def _seq(prompt: list[int], outputs: list[int], params: SamplingParams, rid: str = "r",
         sampler: Sampler | None = None) -> Sequence:
    params.validate(VOCAB)
    seq = Sequence(rid, prompt, params)
    seq.token_ids += outputs
    if params.seed is not None and sampler is not None:
        seq.generator = sampler.make_generator(params.seed)
    return seq


def _rows(n: int, seed: int = 0) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    prompts = [torch.randint(0, VOCAB, (7,), generator=g).tolist() for _ in range(n)]
    outputs = [torch.randint(0, VOCAB, (5,), generator=g).tolist() for _ in range(n)]
    return logits, prompts, outputs


def test_repetition_penalty_and_logit_bias_match_transformers() -> None:
    logits, prompts, outputs = _rows(4)
    bias = {3: 5.0, 9: -100.0, prompts[0][0]: 2.5}
    for penalty in (1.3, 0.7):
        sampler = Sampler()
        seqs = [_seq(p, o, SamplingParams(repetition_penalty=penalty, logit_bias=bias), str(i))
                for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
        ours = sampler.processors.apply(logits, seqs)
        hf = LogitsProcessorList([
            SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()}),
            RepetitionPenaltyLogitsProcessor(penalty),
        ])
        ids = torch.tensor([p + o for p, o in zip(prompts, outputs, strict=True)])
        torch.testing.assert_close(ours, hf(ids, logits.clone()))


def test_frequency_and_presence_follow_openais_formula() -> None:
    logits, prompts, outputs = _rows(3, seed=1)
    outputs[0] = [5, 5, 5, 7, 7]  # counts of 3 and 2
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.5),
              SamplingParams(frequency_penalty=-2.0),
              SamplingParams(presence_penalty=2.0)]
    seqs = [_seq(p, o, q, str(i))
            for i, (p, o, q) in enumerate(zip(prompts, outputs, params, strict=True))]
    ours = Sampler().processors.apply(logits, seqs)
    ref = logits.clone()
    for row, (out, q) in enumerate(zip(outputs, params, strict=True)):
        counts = torch.bincount(torch.tensor(out), minlength=VOCAB).float()
        ref[row] -= q.frequency_penalty * counts + q.presence_penalty * (counts > 0).float()
    torch.testing.assert_close(ours, ref)
    assert ours[0, 5] == pytest.approx(float(logits[0, 5]) - 0.5 * 3 - 1.5)


def test_counts_grow_with_each_step_and_rows_without_processors_are_untouched() -> None:
    logits, prompts, outputs = _rows(2, seed=2)
    sampler = Sampler()
    seq = _seq(prompts[0], [], SamplingParams(frequency_penalty=1.0))
    plain = _seq(prompts[1], outputs[1], SamplingParams(), "plain")
    for step in range(4):  # the sequence's outputs grow as the engine appends them
        ours = sampler.processors.apply(logits, [seq, plain])
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long),
                                minlength=VOCAB).float()
        torch.testing.assert_close(ours[0], logits[0] - counts)
        assert torch.equal(ours[1], logits[1])
        seq.token_ids.append(11 if step % 2 else 40)


def test_greedy_and_seeded_tokens_are_those_of_the_processed_logits() -> None:
    """The sampler's tokens equal those drawn from transformers-processed logits by a plain
    sampler with the same seeds: penalties change the distribution, nothing else."""
    logits, prompts, outputs = _rows(6, seed=3)
    hf = RepetitionPenaltyLogitsProcessor(1.5)
    ids = torch.tensor([p + o for p, o in zip(prompts, outputs, strict=True)])
    processed = hf(ids, logits.clone())
    kinds = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=1.0, seed=8,
                                                                        top_k=10)] * 2
    a, b = Sampler(seed=1), Sampler(seed=1)
    pen = [_seq(p, o, SamplingParams(repetition_penalty=1.5, **k), str(i), a)
           for i, (p, o, k) in enumerate(zip(prompts, outputs, kinds, strict=True))]
    plain = [_seq(p, o, SamplingParams(**k), str(i), b)
             for i, (p, o, k) in enumerate(zip(prompts, outputs, kinds, strict=True))]
    assert not torch.equal(processed, logits)
    tokens, _ = a(logits, pen)
    assert tokens == b(processed, plain)[0]


def test_top_logprobs_are_a_device_top_k_of_the_raw_distribution() -> None:
    logits, prompts, outputs = _rows(3, seed=4)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2,
                             logit_bias={0: 100.0}),
              SamplingParams(temperature=0.0)]
    seqs = [_seq(p, o, q, str(i))
            for i, (p, o, q) in enumerate(zip(prompts, outputs, params, strict=True))]
    out = Sampler().sample(logits, seqs)
    assert out.top is not None and out.top.ids.shape == (3, 5)  # k: the most any row asked for
    norm = LogitNormalization()(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    values, ids = norm.topk(5, dim=-1)
    assert torch.equal(out.top.ids, ids)
    torch.testing.assert_close(out.top.logprobs, values)
    assert out.tokens.tolist()[1] == 0  # the bias chose it; its logprob is the raw one
    assert out.logprobs is not None
    assert float(out.logprobs[1]) == pytest.approx(float(norm[1, 0]))


def test_a_batch_without_processors_takes_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = Sampler()

    def boom(*args: object) -> None:
        raise AssertionError("the plain path ran the processors")

    monkeypatch.setattr(sampler.processors, "apply", boom)
    logits, prompts, outputs = _rows(2, seed=5)
    seqs = [_seq(prompts[0], outputs[0], SamplingParams(temperature=0.0)),
            _seq(prompts[1], outputs[1], SamplingParams(temperature=1.0, logprobs=True), "b")]
    out = sampler.sample(logits, seqs)
    assert not out.processed and out.top is None


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(repetition_penalty=0.0),
    dict(repetition_penalty=-1.0), dict(logit_bias={VOCAB: 1.0}), dict(logit_bias={1: 101.0}),
    dict(logit_bias={i: 1.0 for i in range(301)}), dict(top_logprobs=21),
    dict(top_logprobs=-1)])
def test_out_of_range_values_name_the_field(bad: dict) -> None:
    field = next(iter(bad))
    with pytest.raises(SamplingError, match=field) as err:
        SamplingParams(**bad).validate(VOCAB if field != "logit_bias" or len(bad[field]) < 300
                                       else 1000)
    assert err.value.field == field


# ---- end to end: the engine (asynchronous scheduling) against transformers' generate() ------
@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory: pytest.TempPathFactory):
    from test_hf_parity import _checkpoint, _engine

    path, hf = _checkpoint(tmp_path_factory, "llama")
    engine = _engine(path)
    assert engine.async_scheduling
    return engine, hf


def test_engine_greedy_with_penalty_and_bias_matches_transformers_generate(hf_pair) -> None:
    engine, hf = hf_pair
    prompts = [[1, 17, 33, 5, 90, 12, 7], [1, 100, 3]]
    n_new, bias = 10, {(40,): 3.0, (41,): -50.0}
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True,
                            repetition_penalty=1.4, logit_bias={40: 3.0, 41: -50.0})
    plain = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    # A batch mixing processed and plain rows; the plain row keeps its own tokens.
    outs = engine.generate([prompts[0], prompts[1], prompts[0]], [params, params, plain])
    saved = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None
    try:
        for prompt, out in zip(prompts, outs, strict=False):
            gen = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n_new,
                              pad_token_id=0, repetition_penalty=1.4, sequence_bias=bias)
            assert out == gen[0, len(prompt):].tolist()
        ref = hf.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=n_new,
                          pad_token_id=0)
        assert outs[2] == ref[0, len(prompts[0]):].tolist()
    finally:
        hf.generation_config.eos_token_id = saved


def test_engine_seeded_penalised_request_is_exact_under_batching(hf_pair) -> None:
    engine, _ = hf_pair
    p = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True,
                       frequency_penalty=1.5, presence_penalty=0.5, logprobs=True,
                       top_logprobs=3)
    alone = engine.generate([[1, 17, 33, 5]], [p])[0]
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
    batched = engine.generate([[1, 100, 3], [1, 17, 33, 5], [1, 2, 3, 4, 5], [1, 9]],
                              [others[0], p, others[1], others[2]])
    assert batched[1] == alone
    assert len(set(alone)) > 3  # sampled, and pushed away from repeats
