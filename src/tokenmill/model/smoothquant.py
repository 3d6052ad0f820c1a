"""SmoothQuant for `--quantization w8a8`: calibration statistics, smoothing factors, folding.

Int8 activations lose the channels that carry outliers (a few input channels of a decoder's
linears hold values 10-100x the rest); SmoothQuant (Xiao et al., 2022) moves that range into the
weights: for each input channel j of a linear, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), the
activations are divided by s_j and the weight's column j multiplied by it, so the product is
unchanged and both sides quantize with less error. The division is folded into what produces the
activations, so it costs nothing at run time:

- q/k/v (qkv_proj) and gate/up (gate_up_proj): into the RMSNorm weight before them.
- o_proj: into v's rows of qkv_proj. Attention output head h is a convex combination of its kv
  head's V rows, so dividing v's output channel (g, d) by s scales the output channel (h, d) of
  every query head h of group g alike; the factor is computed per (kv head, channel) from the
  group's columns together.
- down_proj: into up's rows of gate_up_proj (silu(gate) * up is linear in up).

max|X_j| comes from running the float model over a calibration set: by default a few KB of text
shipped with the package (data/w8a8_calibration.jsonl: public-domain prose, Python docstrings, code,
short chats), or the user's file (--quantization-calibration PATH: .jsonl lines {"text": ...},
{"prompt": ...} or {"messages": [...]}, or plain text). The statistics are cached per model
folder, calibration set and dtype under <$TOKENMILL_CACHE_DIR or ~/.cache/tokenmill>/w8a8/.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from tokenmill import envs
from tokenmill.model.layers.attention import AttentionBackend, SeqChunk
from tokenmill.model.layers.bind import bind_kernels
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.w8a8 import W8A8Linear
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger("tokenmill")

DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "w8a8_calibration.jsonl"
DEFAULT_ALPHA = 0.5
SEGMENT_TOKENS = 512  # longer calibration documents are cut into prompts of this many tokens
STATS_VERSION = 1  # part of the cache key: bump when what is collected changes


# Each site's linear: (the layer's submodule, its attribute).
_SITE_LINEARS = {
    "qkv": ("self_attn", "qkv_proj"),
    "o": ("self_attn", "o_proj"),
    "gate_up": ("mlp", "gate_up_proj"),
    "down": ("mlp", "down_proj"),
}


def _site_modules(layer: nn.Module) -> dict[str, nn.Module]:
    return {site: getattr(getattr(layer, sub), name) for site, (sub, name) in _SITE_LINEARS.items()}


def check_model(model: nn.Module) -> None:
    """Refuses models whose layers this module cannot smooth (other norms, other layer shapes)."""
    layers = getattr(model, "layers", None)
    ok = layers is not None and all(
        type(getattr(layer, n, None)) is RMSNorm
        for layer in layers
        for n in ("input_layernorm", "post_attention_layernorm")
    )
    if not ok or not all(type(m) is nn.Linear for layer in layers for m in _site_modules(layer).values()):
        raise ValueError(
            f"--quantization w8a8 is not supported for {type(model).__name__}: it needs Llama-style "
            f"layers (RMSNorm, fused qkv_proj / gate_up_proj, o_proj, down_proj)"
        )


# ---- calibration set ----------------------------------------------------------------------------
def read_calibration(path: str | os.PathLike | None) -> list[dict]:
    """The calibration documents: .jsonl lines ({"text"}, {"prompt"} or {"messages"}, or a JSON
    string), or any other file as one text."""
    p = Path(path) if path else DEFAULT_CALIBRATION
    if not p.is_file():
        raise ValueError(f"calibration file {str(p)!r} does not exist")
    raw = p.read_text(encoding="utf-8")
    if p.suffix != ".jsonl":
        return [{"text": raw}]
    docs = []
    for i, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration file {str(p)!r}, line {i}: not JSON ({e})") from e
        if isinstance(obj, str):
            obj = {"text": obj}
        if not isinstance(obj, dict) or not ({"text", "prompt", "messages"} & obj.keys()):
            raise ValueError(
                f"calibration file {str(p)!r}, line {i}: expected a string or an object with "
                f'"text", "prompt" or "messages"'
            )
        docs.append(obj)
    if not docs:
        raise ValueError(f"calibration file {str(p)!r} has no documents")
    return docs


def calibration_prompts(tokenizer, docs: list[dict], segment: int = SEGMENT_TOKENS) -> list[list[int]]:
    """Token ids of each calibration prompt: chats through the chat template, texts cut into
    segments of at most `segment` tokens."""
    prompts = []
    for d in docs:
        if "messages" in d:
            ids = tokenizer.apply_chat_template(d["messages"], tokenize=True, add_generation_prompt=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer.encode(d.get("text", d.get("prompt", "")))
        prompts += [ids[i : i + segment] for i in range(0, len(ids), segment) if len(ids[i : i + segment]) > 1]
    return prompts


# ---- statistics -----------------------------------------------------------------------------------
@torch.no_grad()
def collect_input_maxima(model: nn.Module, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| (float32) over every calibration token at each layer's four linear inputs, keyed
    "<layer>.<site>": the model run prompt by prompt on a throwaway KV cache, torch attention."""

    maxima: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        for site, module in _site_modules(layer).items():

            def record(mod, args, key=f"{i}.{site}"):
                m = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
                maxima[key] = m if key not in maxima else torch.maximum(maxima[key], m)

            hooks.append(module.register_forward_pre_hook(record))
    a0, bs = model.layers[0].self_attn, 16
    dtype = next(model.parameters()).dtype
    # The model's kernels (its norms, the activation), bound now: calibration runs before the loader binds it.
    bind_kernels(model, next(model.parameters()).device, dtype)
    try:
        for ids in prompts:
            n = len(ids)
            blocks = -(-n // bs)
            cache = torch.zeros(len(model.layers), 2, blocks * bs, a0.num_kv_heads, a0.head_dim, dtype=dtype)
            attn = AttentionBackend(
                cache, a0.num_heads, a0.num_kv_heads, a0.head_dim, use_cpp_kernels=False, batch_invariant=False
            )
            meta = AttentionBackend.build_metadata([SeqChunk(0, n, 0, list(range(blocks)))], list(range(n)), bs)
            model(torch.tensor(ids), torch.arange(n), attn, meta)
    finally:
        for h in hooks:
            h.remove()
    return maxima


def _cache_key(path: str, docs: list[dict], dtype: torch.dtype) -> str:
    h = hashlib.sha256(f"v{STATS_VERSION}|{os.path.realpath(path)}|{dtype}|".encode())
    for f in sorted(
        glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*", "*.safetensors"))
    ):
        st = os.stat(f)
        h.update(f"{os.path.relpath(f, path)}:{st.st_size}:{st.st_mtime_ns}|".encode())
    h.update(json.dumps(docs, sort_keys=True).encode())
    return h.hexdigest()[:16]


def cached_input_maxima(model: nn.Module, path: str, calibration: str | None) -> dict[str, torch.Tensor]:
    """collect_input_maxima over the calibration set, cached per model folder, set and dtype."""
    from safetensors.torch import load_file, save_file

    docs = read_calibration(calibration)
    dtype = next(model.parameters()).dtype
    root = Path(envs.TOKENMILL_CACHE_DIR) / "w8a8"
    file = root / f"{_cache_key(path, docs, dtype)}.safetensors"
    if file.exists():
        logger.info("w8a8: calibration statistics from %s", file)
        return load_file(str(file))
    t0 = time.perf_counter()
    prompts = calibration_prompts(load_tokenizer(path), docs)
    maxima = collect_input_maxima(model, prompts)
    root.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in maxima.items()}, str(tmp))
    os.replace(tmp, file)  # atomic: a concurrent loader reads a whole file or none
    logger.info(
        "w8a8: calibrated on %d prompts (%d tokens) from %s in %.1f s; cached in %s",
        len(prompts),
        sum(map(len, prompts)),
        calibration or "the packaged set",
        time.perf_counter() - t0,
        file,
    )
    return maxima


# ---- smoothing ------------------------------------------------------------------------------------
def smoothing_factors(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), 1 where a channel is all zeros."""
    x_max, w_max = x_max.float().clamp_min(1e-5), w_max.float().clamp_min(1e-5)
    s = x_max.pow(alpha) / w_max.pow(1 - alpha)
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


@torch.no_grad()
def smooth(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA) -> None:
    """Folds the smoothing factors of every layer's four linear inputs into the model in place
    (function-preserving up to the rounding of the norm weights in the model's dtype). The four
    linears' weights (and biases) become float32 first: they are quantized next, from these."""
    for i, layer in enumerate(model.layers):
        mods = _site_modules(layer)
        for m in mods.values():
            m.weight.data = m.weight.data.float()
            if m.bias is not None:
                m.bias.data = m.bias.data.float()
        attn, mlp = layer.self_attn, layer.mlp
        # o_proj first: it reads qkv_proj's v rows, which the qkv fold below also scales (by column).
        g, d = attn.num_kv_heads, attn.head_dim
        group = attn.num_heads // g
        x_o = maxima[f"{i}.o"].view(g, group, d).amax(1)
        w_o = mods["o"].weight.detach().float().abs().amax(0).view(g, group, d).amax(1)
        s_o = smoothing_factors(x_o, w_o, alpha)  # [g, d]: per kv head and channel
        v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
        _scale_rows(mods["qkv"], v_rows, 1 / s_o.reshape(-1))
        _scale_cols(mods["o"], s_o.unsqueeze(1).expand(g, group, d).reshape(-1))
        inter = mlp.intermediate
        s_d = smoothing_factors(maxima[f"{i}.down"], mods["down"].weight.detach().float().abs().amax(0), alpha)
        _scale_rows(mods["gate_up"], slice(inter, 2 * inter), 1 / s_d)
        _scale_cols(mods["down"], s_d)
        for site, norm in (("qkv", layer.input_layernorm), ("gate_up", layer.post_attention_layernorm)):
            s = smoothing_factors(maxima[f"{i}.{site}"], mods[site].weight.detach().float().abs().amax(0), alpha)
            norm.weight.copy_((norm.weight.float() / s).to(norm.weight.dtype))
            _scale_cols(mods[site], s)


def _scale_rows(linear: nn.Linear, rows: slice, f: torch.Tensor) -> None:
    linear.weight[rows] *= f.unsqueeze(1)
    if linear.bias is not None:
        linear.bias[rows] *= f


def _scale_cols(linear: nn.Linear, f: torch.Tensor) -> None:
    linear.weight.mul_(f.unsqueeze(0))


def quantize_model_w8a8(
    model: nn.Module, path: str, calibration: str | None = None, alpha: float = DEFAULT_ALPHA
) -> int:
    """--quantization w8a8: calibrate (or read the cached statistics), fold the smoothing factors,
    and replace each layer's four linears and the lm_head by W8A8Linear (the embeddings stay in the
    model's dtype). Returns the number of layers replaced.

    The lm_head is SmoothQuant's exception (it keeps it in fp16); here it is int8, as the packaged
    GGUF's output layer is (Q8_0), because at every generated token it is ~21% of SmolLM2's linear work (576 x
    49,152 against 30 x 3.5 M): ~5% more output tok/s at 32 concurrent, ~20% less time per token at
    batch 1, perplexity +0.1-0.2% (README "W8A8 int8 compute"). Unsmoothed: its input is the final
    norm's output, which pooling reads too (and smoothing it at alpha 0.5 measured worse).
    TOKENMILL_W8A8_LM_HEAD=0 keeps it in the model's dtype."""

    check_model(model)
    smooth(model, cached_input_maxima(model, path, calibration), alpha)
    count = 0
    for layer in model.layers:
        for sub, name in _SITE_LINEARS.values():
            parent = getattr(layer, sub)
            setattr(parent, name, W8A8Linear.from_linear(getattr(parent, name)))
            count += 1
    if envs.TOKENMILL_W8A8_LM_HEAD and type(getattr(model, "lm_head", None)) is nn.Linear:
        model.lm_head = W8A8Linear.from_linear(model.lm_head)  # a tied embedding table keeps its weights
        count += 1
    return count
