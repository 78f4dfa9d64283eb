"""Sampling: greedy, temperature, top-k, top-p, seeds, chosen-token logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from atom.engine.params import SamplingParams
from atom.engine.sampler import Sampler, apply_top_k_top_p
from atom.engine.sequence import Sequence

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _seqs(*params: SamplingParams, sampler: Sampler | None = None) -> list[Sequence]:
    out = []
    for i, p in enumerate(params):
        s = Sequence(str(i), [1], p)
        if p.seed is not None and sampler is not None:
            s.generator = sampler.make_generator(p.seed)
        out.append(s)
    return out


def _draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(seed=seed)
    seqs = _seqs(*([params] * n))
    tokens, _ = sampler(LOGITS.expand(n, 4).clone(), seqs)
    return torch.bincount(torch.tensor(tokens), minlength=4).float() / n


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    tokens, lps = Sampler()(logits, _seqs(*[SamplingParams(temperature=0.0)] * 5))
    assert tokens == logits.argmax(-1).tolist() and lps == [None] * 5


def test_temperature_one_follows_the_distribution() -> None:
    freq = _draw(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, PROBS, atol=0.03), freq


def test_low_temperature_sharpens() -> None:
    freq = _draw(SamplingParams(temperature=0.25))
    expected = (LOGITS / 0.25).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.03), freq
    assert freq[0] > 0.85


def test_top_k_and_top_p_cut_the_tail() -> None:
    freq = _draw(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.03)
    freq = _draw(SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert freq[2:].sum() == 0 and freq[1] > 0.3
    freq = _draw(SamplingParams(temperature=1.0, top_p=0.4))  # the top token alone
    assert freq[0] == 1.0


def test_apply_top_k_top_p_mixed_rows() -> None:
    logits = LOGITS.expand(3, 4).clone()
    out = apply_top_k_top_p(logits, torch.tensor([-1, 3, 1]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.isfinite(out[0]).all()
    assert torch.isinf(out[1]).tolist() == [False, False, False, True]
    assert torch.isinf(out[2]).tolist() == [False, True, True, True]


def test_per_request_seed_is_reproducible_whatever_the_batch() -> None:
    sampler = Sampler(seed=123)
    logits = torch.randn(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(batch_extra: int) -> list[int]:
        seq = _seqs(seeded, sampler=sampler)[0]
        others = _seqs(*[SamplingParams(temperature=1.0)] * batch_extra)
        got = []
        for _ in range(20):
            toks, _ = sampler(torch.cat([logits.expand(batch_extra, -1), logits]), others + [seq])
            got.append(toks[-1])
        return got

    first = run(0)
    assert run(3) == first
    assert len(set(first)) > 5  # really sampling, not argmax


def test_chosen_token_logprob() -> None:
    logits = torch.randn(2, 30)
    seqs = _seqs(SamplingParams(temperature=0.0, logprobs=True),
                 SamplingParams(temperature=1.0, logprobs=True, seed=1))
    sampler = Sampler()
    seqs[1].generator = sampler.make_generator(1)
    tokens, lps = sampler(logits, seqs)
    ref = logits.log_softmax(-1)
    for row, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert lp == pytest.approx(float(ref[row, t]), abs=1e-5)
        assert lp <= 0 and not math.isnan(lp)


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0),
                                 dict(top_k=0), dict(top_k=-5), dict(seed="x"),
                                 dict(max_tokens=True)])
def test_invalid_params_name_the_field(bad: dict) -> None:
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad).validate()


def test_bf16_logits_sample_as_their_fp32_widening() -> None:
    """Logits come in the model's dtype: greedy takes their argmax as is, sampled rows and
    logprobs widen them to fp32 first, so each result equals that of the fp32 copy."""
    logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    params = [SamplingParams(temperature=0.0, logprobs=True)] * 3 + [
        SamplingParams(temperature=0.8, top_k=20, seed=s, logprobs=True) for s in range(3)]
    sampler = Sampler()
    tokens, lps = sampler(logits, _seqs(*params, sampler=sampler))
    wide = Sampler()
    wide_tokens, wide_lps = wide(logits.float(), _seqs(*params, sampler=wide))
    assert tokens == wide_tokens
    assert tokens[:3] == logits.float()[:3].argmax(-1).tolist()
    assert lps == wide_lps and all(isinstance(v, float) for v in lps)


def test_argmax_kernel_compiles_for_hopper_with_its_early_launch() -> None:
    """The row argmax with and without the early launch's wait, and the host copy, to sm_90
    PTX and SASS without a GPU."""
    pytest.importorskip("triton")
    from atom.kernels import triton_argmax
    from atom.kernels.testing import compile_for_hopper

    sig = {"x_ptr": "*bf16", "row_stride": "i32", "n_cols": "i32", "max_ptr": "*fp32",
           "idx_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*i64", "host_ptr": "*i64",
           "n_slices": "i32", "CHUNK": "constexpr", "SLICES": "constexpr", "HOST": "constexpr",
           "PDL": "constexpr"}
    for host in (False, True):
        for pdl in (False, True):
            compiled = compile_for_hopper(triton_argmax._argmax_kernel, sig, {
                "CHUNK": triton_argmax.CHUNK, "SLICES": 128, "HOST": host, "PDL": pdl},
                num_warps=4)
            assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == pdl


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 9e-6])
def test_a_vanishing_temperature_runs_greedy(temperature: float) -> None:
    """Issue 48: 1e-45 divided the logits into inf/NaN; validate() makes it greedy."""
    p = SamplingParams(temperature=temperature, seed=3)
    p.validate()
    assert p.greedy and p.temperature == 0.0
    logits = torch.randn(3, 50) * 30
    sampler = Sampler(seed=1)
    tokens, _ = sampler(logits, _seqs(p, p, p, sampler=sampler))
    assert tokens == logits.argmax(-1).tolist()
    kept = SamplingParams(temperature=1e-5)
    kept.validate()
    assert kept.temperature == 1e-5 and not kept.greedy  # the bound itself still samples
