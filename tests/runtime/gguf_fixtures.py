"""Small GGUF files for the tests, written with gguf.GGUFWriter the way llama.cpp's converter
writes them: Hugging Face weights under GGUF names, q/k rows permuted for the llama
architecture, each tensor in a chosen quantization type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                     "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest]}.{kind}"
    return f"{HF_TO_GGUF_GLOBAL[base]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute (what the loader must undo)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_k_quant_bytes(shape: tuple[int, ...], qtype: object, seed: int) -> np.ndarray:
    """Random blocks of a type gguf cannot quantize to: every byte below 0x7C keeps every
    fp16 scale finite."""
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    rng = np.random.default_rng(seed)
    return rng.integers(0, 0x7C, size=byte_shape, dtype=np.uint8)


def encode_tensor(w: np.ndarray, qtype_name: str, seed: int) -> tuple[np.ndarray, object]:
    """(data to write, raw dtype) for a float32 tensor in the named type."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name == "F32":
        return w.astype(np.float32), qtype
    if qtype_name == "F16":
        return w.astype(np.float16), qtype
    try:
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    except NotImplementedError:
        return random_k_quant_bytes(w.shape, qtype, seed), qtype


GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a tiny byte-level BPE: 3 control tokens, the 256
    byte characters, and a few merges."""
    from atom.gguf_tokenizer import _bytes_to_unicode

    chars = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = GPT2_SPECIALS + chars + merged
    types = [3] * len(GPT2_SPECIALS) + [1] * (len(chars) + len(merged))
    return tokens, types, merges


def write_gguf(path: Path, hf_model: torch.nn.Module, arch: str, qtype: str = "F32",
               tokenizer_model: str = "gpt2", quant_norms: bool = False,
               extra: dict[str, object] | None = None) -> Path:
    """The model's weights (fp32) as a GGUF file of architecture `arch`; matrices in qtype,
    norms and biases in F32 (as llama.cpp keeps them)."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    w.add_rope_freq_base(float(theta))
    w.add_tokenizer_model(tokenizer_model)
    if tokenizer_model == "gpt2":
        tokens, types, merges = byte_level_vocab()
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    else:
        w.add_token_list(["<unk>", "<s>", "</s>", "a"])
        w.add_token_types([2, 3, 3, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (extra or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, int(value))
    permute = arch in ("llama", "mistral")
    for i, (name, p) in enumerate(hf_model.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = p.detach().float().numpy()
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        if permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        keep_f32 = t.ndim == 1 and not quant_norms
        data, raw = encode_tensor(t, "F32" if keep_f32 else qtype, seed=i)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected_weights(path: Path, arch: str, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """GGUF name -> what the loader must produce: the file's values dequantized by gguf, with
    llama.cpp's permutation undone by the inverse of the writer's own permute."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.array(arr).reshape(tuple(reversed([int(d) for d in t.shape])))
        heads = {"attn_q": n_heads, "attn_k": n_kv_heads}.get(t.name.split(".")[-2])
        if arch in ("llama", "mistral") and heads:
            n = heads
            arr = arr.reshape(n, arr.shape[0] // n // 2, 2, *arr.shape[1:]).swapaxes(1, 2)
            arr = arr.reshape(-1, *arr.shape[3:]) if arr.ndim > 3 else arr.reshape(-1)
        out[t.name] = torch.from_numpy(np.ascontiguousarray(arr))
    return out
