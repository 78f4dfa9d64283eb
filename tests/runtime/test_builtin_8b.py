"""The 8B-class built-in shapes (issue 47): the released configs' mapping, their parameter
counts, and the untied-embedding Qwen3 path against transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_parity import COMMON, _check, _engine  # noqa: E402

from atom.config import Config  # noqa: E402
from atom.models.llama import LlamaForCausalLM  # noqa: E402
from atom.models.registry import load_model_config, model_config_from_hf  # noqa: E402

# The released config.json values (meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B), as transformers
# configs: our mapping of each must be the built-in shape.
HF_CONFIGS = {
    "llama-3.1-8b": lambda: transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], torch_dtype="bfloat16"),
    "qwen3-8b": lambda: transformers.Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16"),
}
# Published parameter counts (the model cards' safetensors totals).
PARAMS = {"llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_builtin_8b_shape_is_the_released_config(name: str) -> None:
    ours = load_model_config(name).to_dict()
    mapped = model_config_from_hf(HF_CONFIGS[name]().to_dict(), name=name).to_dict()
    for key in ("name", "path"):
        ours.pop(key), mapped.pop(key)
    assert ours == mapped
    # Built on the meta device: the shapes alone, no 16 GB of weights.
    cfg = Config(model=name, load_format="dummy", device="cpu", enforce_eager=True,
                 max_model_len=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, load_model_config(name))
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]


def test_untied_qwen3_matches_transformers(tmp_path) -> None:
    """qwen3-8b unties its embeddings (the 0.6B ties them): prompt logits, per-step decode
    logits and greedy tokens equal transformers' Qwen3 with a separate lm_head."""
    torch.manual_seed(4321)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False)).eval().float()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _check(_engine(str(tmp_path), level=0), hf)
