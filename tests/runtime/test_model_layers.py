"""Model building blocks and built-in shapes."""

from __future__ import annotations

import pytest
import torch

from atom.config import Config
from atom.layers.rmsnorm import RMSNorm
from atom.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from atom.models.llama import LlamaForCausalLM
from atom.models.registry import load_model_config, model_config_from_hf

transformers = pytest.importorskip("transformers")


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0,
                                      rope_scaling=scaling, max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(64, 500000.0, scaling)
    torch.testing.assert_close(ours, ref)
    # the scaling really changes the low frequencies (the test would catch a no-op)
    assert not torch.allclose(ours, rope_inv_freq(64, 500000.0, None))


def test_rotary_is_a_rotation_per_head_pair() -> None:
    table = RotaryEmbedding(head_dim=8, max_positions=32, theta=10000.0)

    def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return tuple(apply_rotary(x, positions, table.cos_cache, table.sin_cache, 8)
                     for x in (q, k))

    q = torch.randn(5, 2 * 8)
    k = torch.randn(5, 1 * 8)
    pos = torch.tensor([0, 1, 7, 31, 3])
    q2, k2 = rope(pos, q, k)
    torch.testing.assert_close(q2[0], q[0])  # position 0 is the identity
    torch.testing.assert_close(q2.view(5, 2, 8).norm(dim=-1), q.view(5, 2, 8).norm(dim=-1))
    # relative property: <R(m)q, R(n)k> depends on m - n only
    a, b = torch.randn(1, 8), torch.randn(1, 8)
    def dot(m: int, n: int) -> float:
        qa, _ = rope(torch.tensor([m]), a, a)
        kb, _ = rope(torch.tensor([n]), b, b)
        return float((qa * kb).sum())
    assert dot(10, 7) == pytest.approx(dot(5, 2), rel=1e-4)


def test_rmsnorm_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    ours, ref = RMSNorm(16, 1e-5), LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        w = torch.rand(16) + 0.5
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    torch.testing.assert_close(ours.float()(x.float()), ref.float()(x.float()))


def test_llama_3_2_1b_shape() -> None:
    cfg = load_model_config("llama-3.2-1b")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (16, 2048, 32, 8, 8192, 128256, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3"
    with torch.device("meta"):
        model = LlamaForCausalLM(Config(model="llama-3.2-1b", device="cpu", max_model_len=64), cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == 1_235_814_400  # Llama-3.2-1B's published parameter count


def test_qwen3_shape_and_hf_config_parsing() -> None:
    cfg = load_model_config("qwen3-0.6b")
    assert cfg.qk_norm and cfg.head_dim == 128 and cfg.num_hidden_layers == 28
    hf = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=40,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  rope_theta=12345.0)
    parsed = model_config_from_hf(hf.to_dict())
    assert parsed.model_type == "qwen2" and parsed.attention_bias and not parsed.o_proj_bias
    assert parsed.rope_theta == 12345.0 and parsed.head_dim == 8


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="built-in shape"):
        load_model_config("no-such-model")
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_hf({"model_type": "gpt2", "hidden_size": 8, "num_attention_heads": 2,
                              "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1})


def test_attention_op_refuses_o_weight_without_proj_out() -> None:
    """The output projection's weight and its destination go together: either alone is a
    caller's mistake, named in the error, before anything is computed."""
    import atom.layers.attention  # noqa: F401  (registers the op)

    q = torch.zeros(1, 8)
    kv = torch.zeros(1, 4)
    out = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="o_weight given, proj_out missing"):
        torch.ops.aiter.unified_attention_with_output(q, kv, kv, out, 0, None, None, None,
                                                      torch.zeros(8, 8))
    with pytest.raises(ValueError, match="o_weight missing, proj_out given"):
        torch.ops.aiter.unified_attention_with_output(q, kv, kv, out, 0, None, None, None, None,
                                                      None, None, torch.zeros(1, 8))
