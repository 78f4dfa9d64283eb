"""Weight loading: sharded safetensors, tied embeddings, precise errors, dummy weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from atom.config import Config  # noqa: E402
from atom.models.loader import WeightLoadError, build_model  # noqa: E402
from atom.models.registry import load_model_config  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _save(path, tied: bool, **save_kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied)
    hf = transformers.LlamaForCausalLM(cfg).float()
    hf.save_pretrained(path, safe_serialization=True, **save_kw)
    return hf


def _build(path, **kw):
    cfg = Config(model=str(path), load_format="safetensors", dtype="float32", device="cpu", **kw)
    return build_model(cfg, load_model_config(str(path)))


def _same_weights(ours, hf) -> None:
    sd = hf.state_dict()
    for name, target in ours.hf_weight_targets().items():
        assert torch.equal(target, sd[name]), name


def test_sharded_checkpoint_loads_every_shard(tmp_path) -> None:
    hf = _save(tmp_path, tied=False, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2, "the test needs a really sharded checkpoint"
    model = _build(tmp_path)
    _same_weights(model, hf)
    assert not model.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def test_tied_embeddings_share_the_embedding_matrix(tmp_path) -> None:
    hf = _save(tmp_path, tied=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = _build(tmp_path)
    assert not hasattr(model, "lm_head")
    hidden = torch.randn(3, SMALL["hidden_size"])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ hf.model.embed_tokens.weight.T)


def test_missing_tensor_is_named(tmp_path) -> None:
    _save(tmp_path, tied=False)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        _build(tmp_path)


def test_misshapen_tensor_is_named_with_shapes(tmp_path) -> None:
    _save(tmp_path, tied=False)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError) as err:
        _build(tmp_path)
    msg = str(err.value)
    assert "model.layers.0.mlp.up_proj.weight" in msg and "[47, 32]" in msg and "[48, 32]" in msg


def test_index_pointing_at_missing_shard(tmp_path) -> None:
    _save(tmp_path, tied=False, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    os.remove(tmp_path / victim)
    with pytest.raises(WeightLoadError, match=victim):
        _build(tmp_path)


def test_no_weights_in_directory(tmp_path) -> None:
    _save(tmp_path, tied=False)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        _build(tmp_path)


def test_dummy_weights_are_seeded_and_finite() -> None:
    def make(seed: int):
        cfg = Config(model="tiny-qwen3", load_format="dummy", dtype="bfloat16", device="cpu", seed=seed)
        return build_model(cfg, load_model_config("tiny-qwen3"))

    a, b, c = make(1), make(1), make(2)
    wa, wb, wc = (m.model.layers[0].mlp.down_proj.weight for m in (a, b, c))
    assert wa.dtype == torch.bfloat16
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.isfinite(wa).all() and wa.float().std() > 0.01


def test_builtin_shape_has_no_weights_to_load() -> None:
    cfg = Config(model="tiny-llama", load_format="safetensors", dtype="float32", device="cpu")
    with pytest.raises(WeightLoadError, match="--load-format dummy"):
        build_model(cfg, load_model_config("tiny-llama"))


def test_dtypes(tmp_path) -> None:
    _save(tmp_path, tied=False)
    for name, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
        cfg = Config(model=str(tmp_path), load_format="auto", dtype=name, device="cpu")
        model = build_model(cfg, load_model_config(str(tmp_path)))
        assert model.model.embed_tokens.weight.dtype == want
        # RoPE tables stay fp32 whatever the weights' dtype, one table for every layer
        assert model.model.layers[0].self_attn.rotary_emb.cos_cache.dtype == torch.float32
        tables = {layer.self_attn.rotary_emb.cos_cache.data_ptr() for layer in model.model.layers}
        assert tables == {model.model.rotary_emb.cos_cache.data_ptr()}
