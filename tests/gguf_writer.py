"""Test utility: write a GGUF from a tiny Hugging Face llama / qwen2 / qwen3 / phi3 / gemma2 / gemma3 folder, the way
llama.cpp's convert_hf_to_gguf.py does (same metadata keys, Q/K permutation for llama, llama3 rope
as a `rope_freqs` tensor, Phi-3's LongRoPE factors as `rope_factors_long` / `rope_factors_short`,
byte-level BPE vocabulary as tokenizer.ggml.model "gpt2"). Mixtures of experts (mixtral as
llama.cpp's "llama", qwen2_moe, qwen3_moe) get their experts stacked per layer
(ffn_{gate,up,down}_exps [E, rows, cols]) and the expert metadata.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.numpy import load_file

_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # qwen3
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3: fused, gate rows first
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip
# model_type -> llama.cpp architecture (Mixtral is "llama" with experts)
ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PART = {
    "w1": "ffn_gate_exps",
    "gate_proj": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "up_proj": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "down_proj": "ffn_down_exps",
}
# Gemma's four norms a layer (convert_hf_to_gguf.py stores every Gemma norm weight as 1 + w).
_GEMMA_NAMES = {**_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip


def _gguf_name(hf: str, names: dict[str, str] = _NAMES) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{names[rest]}.{kind}"
    return f"{names[stem]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half layout -> ggml interleaved pairs
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict, theta: float, dim: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (reads the context length from the
    # rope parameters, as older llama.cpp did; newer reads a top-level hparam that HF does not write)
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _vocab(hf_dir: Path) -> tuple[list[str], list[int]]:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    id_to_tok = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    for i, a in added.items():
        id_to_tok[i] = a["content"]
    tokens, types = [], []
    for i in range(max(id_to_tok) + 1):
        if i not in id_to_tok:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.USER_DEFINED)
        elif i in added:
            tokens.append(id_to_tok[i])
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(id_to_tok[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def random_kquant(t: np.ndarray, qt: gguf.GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Raw rows of a k-quant type (Q2_K ... Q6_K) for a tensor shaped like `t`, with its spread and
    about zero mean: random, seeded blocks, since the gguf package dequantizes k-quants but cannot
    quantize to them. Only the float16 super-block scales (d, and dmin where the type has one) are
    chosen; every other byte is random, as any byte is valid."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = np.random.default_rng(seed).integers(0, 256, (t.shape[0], t.shape[1] // block, size), dtype=np.uint8)
    offsets = _KQUANT_SCALES[qt.name]

    def dequant(*scales: float) -> np.ndarray:
        for off, v in zip(offsets, scales):
            raw[..., off : off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
        return gguf.quants.dequantize(raw.reshape(t.shape[0], -1), qt)

    # w = d * a + dmin * b: pick dmin / d for a zero mean, then d for t's standard deviation.
    a = dequant(1.0, 0.0)
    ratio = -a.mean() / dequant(0.0, 1.0).mean() if len(offsets) == 2 else 0.0
    d = float(t.std() / dequant(1.0, ratio).std())
    dequant(d, d * ratio)
    return raw.reshape(t.shape[0], -1)


# byte offsets of the float16 super-block scale d (and dmin) in each k-quant block (ggml-common.h)
_KQUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def write_gguf_from_hf(
    hf_dir: str | Path,
    out_path: str | Path,
    qtype: str | dict[str, str] = "F32",
    pre: str = "gpt-2",
    name: str | None = None,
) -> Path:
    """Write `hf_dir` (a model_type in ARCHS) as a GGUF at `out_path`; 2-D weights are stored as `qtype`
    (e.g. "F32", "F16", "Q8_0"; or per llama.cpp tensor kind, {"attn_v": "Q6_K", ...}, the rest F32)
    where their rows fit its block size, norms stay F32 as in llama.cpp. k-quant tensors get
    random_kquant blocks: the file then holds another model than `hf_dir`, with its shapes. A
    Qwen2-MoE shared expert's gate is written 1-D ([hidden]), as llama.cpp may store it. `name`:
    general.name (default: the folder's name)."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg["model_type"] not in ARCHS:
        raise ValueError(f"write_gguf_from_hf supports {sorted(ARCHS)}, not {cfg['model_type']}")
    arch = ARCHS[cfg["model_type"]]
    gemma = arch.startswith("gemma")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if arch == "gemma3":  # the global layers' rope; llama.cpp fixes the local layers' base at 10000
        assert rope["sliding_attention"]["rope_theta"] == 10000.0
        rope = rope["full_attention"]
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    kinds = qtype if isinstance(qtype, dict) else None

    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(hf_dir.name if name is None else name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(str(qtype), gguf.LlamaFileType.GUESSED))  # fmt: skip
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(int(partial * cfg["hidden_size"]) // heads)
        w.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"]))
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if gemma:  # Gemma2Model / Gemma3Model.set_gguf_parameters; llama.cpp fixes the layer pattern itself
        assert cfg["layer_types"] == [
            "sliding_attention" if (i + 1) % (2 if arch == "gemma2" else 6) else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ], "llama.cpp's sliding pattern"
        w.add_sliding_window(cfg["sliding_window"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "longrope" and arch == "phi3":  # Phi3MiniModel.generate_extra_tensors
        orig = rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    elif rope_type not in ("default", "llama3"):
        raise ValueError(f"rope type {rope_type} not handled by this test writer")

    tokens, types = _vocab(hf_dir)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    if arch == "llama" and rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, theta, head_dim))
    stacked: dict[str, dict[int, np.ndarray]] = {}  # llama.cpp name -> expert -> tensor
    for i, (name, t) in enumerate(load_file(str(hf_dir / "model.safetensors")).items()):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = t.astype(np.float32)
        if m := _EXPERT.match(name):
            stacked.setdefault(f"blk.{m.group(1)}.{_EXPERT_PART[m.group(3)]}.weight", {})[int(m.group(2))] = t
            continue
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, kv_heads)
        elif gemma and name.endswith("norm.weight"):
            t = t + np.float32(1)
        gname = _gguf_name(name, _GEMMA_NAMES if gemma else _NAMES)
        qt = gguf.GGMLQuantizationType[kinds.get(gname.split(".")[-2], "F32") if kinds else qtype]
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if t.ndim == 2 and qt != gguf.GGMLQuantizationType.F32 and t.shape[-1] % block == 0:
            data = random_kquant(t, qt, seed=i) if qt.name in _KQUANT_SCALES else gguf.quants.quantize(t, qt)
            w.add_tensor(gname, data, raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t))
    for name, experts in stacked.items():
        w.add_tensor(name, np.stack([experts[e] for e in sorted(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
