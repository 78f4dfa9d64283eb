"""GGUF loading on small synthetic files (gguf.GGUFWriter): config from metadata, weights
equal to the checkpoint's after dequantization and the q/k permutation is undone, the
tokenizer, and the one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_fixtures import (  # noqa: E402
    expected_weights,
    gguf_name,
    llama_cpp_permute,
    write_gguf,
)

from atom.config import Config  # noqa: E402
from atom.engine import LLMEngine, SamplingParams  # noqa: E402
from atom.models import gguf_file  # noqa: E402
from atom.models.gguf_config import llama3_scaling_from_freqs  # noqa: E402
from atom.models.gguf_file import GGUFError, PackagedModel, find_gguf  # noqa: E402
from atom.models.gguf_loader import SUPPORTED_TYPES, hf_name, unpermute_rows  # noqa: E402
from atom.models.loader import build_model  # noqa: E402
from atom.models.registry import load_model_config  # noqa: E402
from atom.tokenizer import GGUFTokenizer, load_tokenizer  # noqa: E402

SMALL = dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2)
# K-quants need rows of 256 values.
WIDE = dict(SMALL, hidden_size=256, intermediate_size=256, num_hidden_layers=1)


def _hf(arch: str, tied: bool = False, **shape: int) -> torch.nn.Module:
    kw = dict(SMALL, **shape)
    torch.manual_seed(0)
    if arch in ("llama", "mistral"):
        cls, cfg_cls = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if arch == "llama"
                        else (transformers.MistralForCausalLM, transformers.MistralConfig))
        cfg = cfg_cls(**kw, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    elif arch == "qwen2":
        cls = transformers.Qwen2ForCausalLM
        cfg = transformers.Qwen2Config(**kw, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=tied)
    else:
        cls = transformers.Qwen3ForCausalLM
        cfg = transformers.Qwen3Config(**kw, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
                                       tie_word_embeddings=tied)
    model = cls(cfg).eval().float()
    with torch.no_grad():  # decisive logits: greedy tokens must not hinge on rounding
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    return model


def _load(path: Path):
    cfg = Config(model=str(path), dtype="float32", device="cpu", max_model_len=128)
    return build_model(cfg, load_model_config(str(path)))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("mistral", False),
                                       ("qwen2", False), ("qwen3", True)])
def test_f32_weights_equal_the_checkpoint(tmp_path: Path, arch: str, tied: bool) -> None:
    """F32 GGUF: every parameter equals the Hugging Face weight it came from (the q/k
    permutation undone exactly), and the config matches config.json's."""
    hf = _hf(arch, tied)
    path = write_gguf(tmp_path / "m.gguf", hf, arch)
    cfg = load_model_config(str(path))
    assert (cfg.model_type, cfg.tie_word_embeddings) == (arch, tied)
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 32 if arch == "qwen3" else 16)
    assert cfg.max_position_embeddings == 256 and cfg.path == str(path)
    model = _load(path)
    sd = hf.state_dict()
    for name, target in model.hf_weight_targets().items():
        assert torch.equal(target, sd[name]), name


def test_llama_greedy_tokens_equal_transformers(tmp_path: Path) -> None:
    """End to end through the engine: the rotary layout after the unpermute is transformers'."""
    hf = _hf("llama")
    path = write_gguf(tmp_path / "m.gguf", hf, "llama")
    engine = LLMEngine(Config(model=str(path), dtype="float32", device="cpu", max_model_len=128,
                              num_kv_blocks=64, max_num_seqs=4))
    prompts = [[1, 17, 33, 5, 90, 12, 7], [1, 100, 3, 250]]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                              pad_token_id=0)
        assert out == gen[0, len(prompt):].tolist()


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_weights_dequantize_like_gguf(tmp_path: Path, qtype: str) -> None:
    hf = _hf("llama", **{k: v for k, v in WIDE.items() if k in ("hidden_size",
                                                              "intermediate_size",
                                                              "num_hidden_layers")})
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", qtype=qtype)
    model = _load(path)
    want = expected_weights(path, "llama", 4, 2)
    got = model.hf_weight_targets()
    for name in got:
        g = gguf_name(name)
        assert torch.equal(got[name], want[g]), (name, g)
    if qtype in ("F16", "BF16", "Q8_0"):  # close to the checkpoint too (the permutation)
        sd = hf.state_dict()
        for name in got:
            torch.testing.assert_close(got[name], sd[name], rtol=0.02, atol=0.01)


def test_bf16_serving_dtype(tmp_path: Path) -> None:
    hf = _hf("qwen3")
    path = write_gguf(tmp_path / "m.gguf", hf, "qwen3", qtype="Q8_0")
    cfg = Config(model=str(path), dtype="bfloat16", device="cpu", max_model_len=128)
    model = build_model(cfg, load_model_config(str(path)))
    want = expected_weights(path, "qwen3", 4, 2)
    for name, t in model.hf_weight_targets().items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, want[gguf_name(name)].to(torch.bfloat16)), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        back = unpermute_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))
    bias = np.arange(64, dtype=np.float32)
    assert torch.equal(unpermute_rows(torch.from_numpy(llama_cpp_permute(bias, 4)), 4),
                       torch.from_numpy(bias))


def test_tensor_names_map_to_hugging_face() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.0.ssm_a") is None


def _one_line_error(exc: pytest.ExceptionInfo[BaseException], *words: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", _hf("llama"), "gpt2")
    with pytest.raises(GGUFError) as exc:
        load_model_config(str(path))
    _one_line_error(exc, "'gpt2'", "llama", "qwen3")


def test_unsupported_quant_type_is_one_line(tmp_path: Path) -> None:
    hf = _hf("llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama")
    # Rewrite one matrix as Q8_1 (a type llama.cpp uses only for activations).
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        if t.name == "blk.1.ffn_up.weight":
            data = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType.Q8_1),
                            dtype=np.uint8)
            w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError) as exc:
        _load(tmp_path / "q.gguf")
    _one_line_error(exc, "Q8_1", "blk.1.ffn_up.weight")
    assert "Q4_K" in SUPPORTED_TYPES


def test_unsupported_tokenizer_model_is_one_line(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", _hf("llama"), "llama", tokenizer_model="bert")
    with pytest.raises(GGUFError) as exc:
        load_tokenizer(str(path), 264)
    _one_line_error(exc, "'bert'", "gpt2", "llama")


def test_gguf_directory_and_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "m.gguf", _hf("llama"), "llama")
    assert find_gguf(str(tmp_path)) == path
    assert load_model_config(str(tmp_path)).path == str(path)
    (tmp_path / "second.gguf").write_bytes(path.read_bytes())
    with pytest.raises(GGUFError, match="2 GGUF files"):
        find_gguf(str(tmp_path))
    monkeypatch.setitem(gguf_file.PACKAGED_MODELS, "nope-model",
                        PackagedModel("atom_no_such_module", "x.gguf", "llm-nope"))
    with pytest.raises(GGUFError) as exc:
        load_model_config("nope-model")
    _one_line_error(exc, "pip install 'atom-serving[models]'", "llm-nope")


def test_llama3_rope_freqs_become_llama3_scaling() -> None:
    from atom.kernels.rotary import rope_inv_freq

    head_dim, theta = 64, 500000.0
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain = rope_inv_freq(head_dim, theta, None)
    scaled = rope_inv_freq(head_dim, theta, scaling)
    factors = (plain / scaled).tolist()  # what llama.cpp's converter stores
    got = llama3_scaling_from_freqs(factors, head_dim, theta)
    assert got == scaling
    factors[3] *= 1.5
    with pytest.raises(GGUFError, match="rope_freqs"):
        llama3_scaling_from_freqs(factors, head_dim, theta)


def test_byte_level_tokenizer_from_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", _hf("llama"), "llama")
    tok = load_tokenizer(str(path), 264)
    assert isinstance(tok, GGUFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [2], False)
    ids = tok.encode("<|im_start|>the cat<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # control tokens match whole
    assert tok.decode(ids) == "the cat"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the cat<|im_end|>"
    text = "héllo wörld 日本 👋"
    assert tok.decode(tok.encode(text)) == text
