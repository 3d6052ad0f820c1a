"""Find a model (HF folder, .gguf file, hub id, or the built-in default) and load its weights."""

from __future__ import annotations

import glob
import json
import logging
import os
import time

import torch

from tokenmill import envs, hf_cache, progress
from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.kernels import cpu_kernels
from tokenmill.model import compressed_tensors, quantized_checkpoint
from tokenmill.model.gguf_loader import QUANTIZED_FILE, dequantize_rows
from tokenmill.model.layers.bind import bind_kernels
from tokenmill.model.layers.linear import pack_linears
from tokenmill.model.layers.quantization import BITS, GROUP, dequantize, pack_quantized, quantize_model
from tokenmill.model.layers.weight_arena import place_decode_weights
from tokenmill.model.models.bert import BertModel
from tokenmill.model.models.gemma import GemmaForCausalLM
from tokenmill.model.models.llama import LlamaForCausalLM
from tokenmill.model.models.mixtral import MixtralForCausalLM
from tokenmill.model.models.phi3 import Phi3ForCausalLM
from tokenmill.model.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tokenmill.model.models.qwen3 import Qwen3ForCausalLM
from tokenmill.model.sharding import Shard, shard_for
from tokenmill.model.smoothquant import quantize_model_w8a8

logger = logging.getLogger("tokenmill")

# Model classes, one per family; each lists the config.json architecture names it serves.
_MODEL_CLASSES = (
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    Phi3ForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    GemmaForCausalLM,
    BertModel,  # an encoder: embeddings only
)
MODEL_REGISTRY = {arch: cls for cls in _MODEL_CLASSES for arch in cls.ARCHITECTURES}
# GGUF architecture names map onto the same classes through gguf_loader's config writer.


def resolve_model_path(model: str | None) -> str:
    """Return a local HF-style folder for `model`, converting GGUF once (cached)."""
    if model is not None and os.path.isdir(model) and os.path.exists(os.path.join(model, "config.json")):
        return model
    from importlib import import_module

    gguf_loader = import_module("tokenmill.model.gguf_loader")  # heavy (gguf); only when needed
    if model is None:
        model = gguf_loader.default_model_path()
    if os.path.isfile(model):
        if model.endswith(".gguf"):
            return gguf_loader.gguf_to_hf_folder(model, dense_dtype="bfloat16")
        raise ValueError(f"model file {model!r} is not a .gguf file; give a GGUF file or a Hugging Face folder")
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            ggufs = sorted(glob.glob(os.path.join(model, "*.gguf")))
            if ggufs:
                return gguf_loader.gguf_to_hf_folder(ggufs[0], dense_dtype="bfloat16")
            raise ValueError(f"model folder {model!r} has no config.json (nor a .gguf file)")
        return model
    # Not local: a hub id, for users who have a hub. Offline machines get a clear error.
    if "/" in model and not model.startswith((".", "/")) and model.count("/") == 1:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
            raise ValueError(f"model {model!r} is not a local path and could not be downloaded: {e}") from e
    raise ValueError(f"model path {model!r} does not exist")


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the built-in default model's served name


def served_names(model: str | None, served_model_name: str | None = None) -> tuple[str, tuple[str, ...]]:
    """The name the API serves a model under, and other names requests may give for it:
    --served-model-name; else for a .gguf file its metadata's or file's name (gguf_loader.served_name),
    with the file's stem and --model itself still accepted; else --model as given (vLLM's rule),
    or the default model's name."""
    if served_model_name:
        return served_model_name, ()
    if model is None:
        return DEFAULT_MODEL_NAME, ()
    if model.endswith(".gguf") and os.path.isfile(model):
        from importlib import import_module

        name = import_module("tokenmill.model.gguf_loader").served_name(model)
        others = (os.path.basename(model).removesuffix(".gguf"), model, os.path.abspath(model))
        return name, tuple(dict.fromkeys(a for a in others if a != name))
    return model, ()


def model_class(hf_config) -> type:
    """The model class serving this config's architecture (load_hf_config has checked it)."""
    return MODEL_REGISTRY[hf_config.architectures[0]]


def model_skeleton(hf_config) -> torch.nn.Module:
    """The model's modules on the meta device (no weights, no memory). What the engine may do with
    a model follows from the modules it is built from: tensor parallelism where a sharding rule
    covers every one (sharding.check_shardable), LoRA where the adapters' linears are the shared
    ones (lora/layers.py check_adaptable), the fused decode step where the C++ step implements
    every decoder layer's modules (worker/fused_decode.py)."""
    with torch.device("meta"):
        return model_class(hf_config)(hf_config, torch.bfloat16, 64, NO_TP)


def load_hf_config(path: str):
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else raw.get('model_type')!r}; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return hf_cache.load_config(path)  # AutoConfig's, remembered across starts


def _iter_safetensors(path: str, skip: set[str] = frozenset(), blocks: str | None = None, shard_of=lambda name: None):
    """(name, tensor) over the folder's *.safetensors, with progress (a bar on a terminal, else log
    lines: progress.track). blocks: a
    GGUF cache's gguf_blocks file; weights it holds that the folder stores in bfloat16 are rebuilt
    from it exactly (the float32 values the GGUF's Q4_0 / Q4_1 / Q8_0 / k-quant blocks stand for).
    shard_of(name) -> Shard | None: under tensor parallelism, read only this rank's slice."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}")
    names = [
        (st, name) for st in (safe_open(f, framework="pt") for f in files) for name in st.keys() if name not in skip
    ]
    q = safe_open(blocks, framework="pt") if blocks else None
    qkeys = set(q.keys()) if q is not None else set()
    for st, name in progress.track(names, "Loading weights", "tensor"):
        shard: Shard | None = shard_of(name)
        stem = name.removesuffix(".weight")
        if shard is not None and shard.zero:
            yield name, torch.zeros(st.get_slice(name).get_shape(), dtype=torch.float32)
            continue
        if _is_bf16(st, name) and (stem + ".qweight" in qkeys or stem + ".ggml" in qkeys):
            if stem + ".ggml" in qkeys:  # k-quants: the raw GGUF rows, dequantized by the gguf package
                w = dequantize_rows(q.get_tensor(stem + ".ggml"), int(q.get_tensor(stem + ".ggml_type")))
            else:
                qweight = q.get_tensor(stem + ".qweight")
                w = dequantize(qweight, q.get_tensor(stem + ".scales"), 4 if qweight.dtype == torch.uint8 else 8)
            if shard is not None:
                w = w.narrow(shard.dim, shard.start, shard.size)
        elif shard is not None:  # read just the slice from the file
            part = st.get_slice(name)
            index = (slice(shard.start, shard.start + shard.size),)
            w = part[index] if shard.dim == 0 else part[(slice(None),) + index]
        else:
            w = st.get_tensor(name)
        yield name, w


def _is_bf16(st, name: str) -> bool:
    return st.get_slice(name).get_dtype() == "BF16"


def _load_gguf_quantized(model: torch.nn.Module, path: str, dtype: torch.dtype) -> set[str]:
    """--quantization gguf: install the GGUF's Q4_0 / Q4_1 / Q8_0 blocks as they are."""
    from safetensors.torch import load_file

    qpath = os.path.join(path, QUANTIZED_FILE)
    if not os.path.exists(qpath):
        raise ValueError(
            "--quantization gguf needs a .gguf model with Q4_0, Q4_1 or Q8_0 tensors; "
            "for a Hugging Face checkpoint use --quantization int4 or int8"
        )
    tensors = load_file(qpath)
    used = model.load_quantized(tensors, dtype)
    # k-quants other than Q4_K (and Q4_K parts of a fused layer whose other parts are not) stay dense
    dense = sum(key.endswith(".ggml") and key.replace(".ggml", ".weight") not in used for key in tensors)
    logger.info(
        "GGUF quantized weights kept for %d tensors%s",
        len(used),
        f"; {dense} other quantized tensors run dequantized ({dtype})" if dense else "",
    )
    return used


def load_model(
    path: str,
    hf_config,
    dtype: torch.dtype,
    max_position: int,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    tp: TPGroup = NO_TP,
    load_format: str = "auto",
    calibration: str | None = None,
) -> torch.nn.Module:
    """quantization: None (weights in `dtype`), "int4" / "int8" (quantized here, groups of 32),
    "gguf" (a GGUF's Q4_0 / Q4_1 / Q8_0 tensors kept quantized) or "w8a8" (int8 weights and
    activations, smoothed on `calibration`, a file, or the packaged set). tp: this rank's group; the
    model is built with its share of the heads and reads only its slices. load_format "dummy":
    random weights, nothing read (vLLM's name; for benchmarks of shapes without their files)."""
    on_cpu = torch.device(device).type == "cpu"
    # A pre-quantized checkpoint, from its config.json: compressed-tensors / fp8 (model/compressed_tensors.py),
    # else AWQ / GPTQ (model/quantized_checkpoint.py); each refuses a --quantization that is not its format.
    scheme = compressed_tensors.check(path, quantization, tp.size) if load_format != "dummy" else None
    prequantized = None
    if scheme is None and load_format != "dummy":
        prequantized = quantized_checkpoint.detect(path, quantization)
    if prequantized is not None:
        quantization = None  # the checkpoint's own codes (quantized_checkpoint.py), nothing quantized here
    if on_cpu and cpu_kernels.enabled():
        progress.set_phase("loading the CPU kernels")
        cpu_kernels.load()  # before the clock: a first run's compile takes minutes and logs its own time
    if quantization and not on_cpu:  # the quantized kernels are C++ CPU kernels
        logger.warning(
            "--quantization %s: the GPU path has no dequantizing kernels yet; running the weights as %s instead",
            quantization,
            dtype,
        )
        quantization = None
    t0 = time.perf_counter()
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, dtype, max_position, tp)
    # dtype first, on meta: to_empty then allocates the weights once, in dtype (the other way round
    # allocated them in float32 and converted them: ~1 s of a warm start for SmolLM2)
    model = model.to(dtype).to_empty(device=device)
    if hasattr(model, "make_rope"):
        model.rope = model.make_rope(dtype).to(device)  # buffers were created on meta
    if model.tie_word_embeddings and tp.size == 1:
        model.lm_head.weight = model.embed_tokens.weight
    int8_rows: dict[str, torch.Tensor] = {}  # W8A8 INT8 checkpoint weights' row scales
    int4: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # int4 checkpoint weights in our groups
    if load_format == "dummy":
        _init_dummy(model)
    elif prequantized is not None:
        quantized_checkpoint.load_prequantized(
            model,
            path,
            prequantized,
            dtype,
            on_cpu and tp.size == 1,
            lambda name: shard_for(name, hf_config, tp.rank, tp.size),
        )
    else:
        skip = _load_gguf_quantized(model, path, dtype) if quantization == "gguf" else set()
        blocks = os.path.join(path, QUANTIZED_FILE)
        exact = dtype != torch.bfloat16 and os.path.exists(blocks)  # the bf16 copy would lose precision
        weights = _iter_safetensors(
            path, skip, blocks if exact else None, lambda name: shard_for(name, hf_config, tp.rank, tp.size)
        )
        if scheme is not None:
            weights = compressed_tensors.dequantizing(weights, scheme, int8_rows, int4)
        model.load_weights(weights)
    model.eval().requires_grad_(False)
    progress.set_phase("preparing the weights")  # quantizing, packing for the kernels
    if scheme is not None:
        compressed_tensors.finish(model, scheme, int8_rows, dtype, on_cpu, int4)
    elif quantization == "fp8":
        n = compressed_tensors.quantize_model_fp8(model)
        logger.info("fp8: %d linear layers rounded to e4m3 (per-channel scales), run widened to %s", n, dtype)
    elif quantization in BITS:
        n = quantize_model(model, BITS[quantization])
        logger.info("quantized %d linear layers to %s (groups of %d)", n, quantization, GROUP)
    elif quantization == "w8a8":
        logger.info(
            "w8a8: %d linear layers in int8, activations quantized per token",
            quantize_model_w8a8(model, path, calibration),
        )
    if on_cpu and not envs.TOKENMILL_NO_PACKED_LINEAR:
        pack_linears(model, dtype)
    if on_cpu and cpu_kernels.enabled():
        pack_quantized(model)
    if on_cpu:
        moved = place_decode_weights(model)
        logger.debug("%.0f MB of decode weights in one huge-page arena", moved / 1e6)
    bind_kernels(model, device, dtype)  # last: the modules the transforms above swapped in included
    logger.info(
        "loaded weights from %s in %.2fs (%s, %s)",
        "nowhere (random: --load-format dummy)" if load_format == "dummy" else path,
        time.perf_counter() - t0,
        dtype,
        device,
    )
    return model


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded random weights: N(0, 0.02) matrices and biases (transformers' Llama init), ones for norms."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.empty(p.shape, dtype=torch.float32, device=p.device).normal_(0.0, 0.02, generator=gen))
