"""Pre-quantized checkpoints: compressed-tensors (llm-compressor's format) and FP8.

Read from config.json's `quantization_config`:

- `quant_method: compressed-tensors`, each config group's format
  - `int-quantized` W8A8 INT8 (int8 weights per output channel, `weight_scale` [out, 1], input
    activations dynamic per token): loaded into W8A8Linear with the checkpoint's int8 weights and
    scales as they are (no calibration; smoothing, if any, is already folded into the norms).
    Activations are quantized per token by our kernel (8-bit asymmetric, a zero point per token:
    never coarser than the checkpoint's symmetric per-token scheme).
  - `pack-quantized` int4 in groups of 32k or per channel, without act-order: our int4 layers
    (QuantLinear, groups of 32: install_int4).
  - `float-quantized` FP8 (float8_e4m3fn weights, `weight_scale` per tensor or per channel; W8A8
    dynamic or W8A16), `naive-quantized` (the unpacked int8 / fp8 layout) and the other
    `pack-quantized` (int8 packed 4 per int32, other group sizes, `weight_g_idx` act-order):
    dequantized once at load into the model's dtype (the dense, packed linears). Correct; these
    save no memory or bandwidth at run time yet.
- `quant_method: fp8` (vLLM / transformers' FineGrainedFP8: e4m3 weights with `weight_scale_inv`
  per tensor, per channel or per [128, 128] block, or `weight_scale`): dequantized likewise.
- `--quantization fp8` on a full-precision checkpoint: weights rounded to e4m3 with per-channel
  scales at load, then widened back (the values an FP8 checkpoint would hold; nothing on disk).

Anything else (other bit widths, float types, strategies, activation schemes) is a ValueError at
load naming the setting and what is supported.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.model.layers.quantization import GROUP, QuantLinear
from tokenmill.model.layers.w8a8 import W8A8Linear
from tokenmill.model.quantized_checkpoint import read_quantization_config

logger = logging.getLogger("tokenmill")

FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_AUX = ("weight_scale", "weight_scale_inv", "weight_zero_point", "weight_g_idx", "weight_shape", "input_scale")
SUPPORTED = (
    "compressed-tensors int-quantized W8A8 INT8 (channel weights, dynamic per-token activations), "
    "float-quantized FP8 (tensor or channel weight scales; W8A8 dynamic or W8A16), pack-quantized / "
    "naive-quantized int4 / int8 weight-only (W4A16, W8A16; channel or group strategy, symmetric or "
    "with zero points, act-order), and quant_method fp8 checkpoints (e4m3 weights with scales)"
)


@dataclass
class Group:
    """One config group: which linears, and how their weights are stored."""

    targets: list[str]
    format: str
    num_bits: int
    type: str  # "int" or "float"
    strategy: str  # "tensor", "channel" or "group"
    symmetric: bool
    group_size: int | None
    w8a8_int8: bool  # int8 channel weights with dynamic per-token int8 activations: W8A8Linear


@dataclass
class Scheme:
    method: str  # "compressed-tensors" or "fp8"
    groups: list[Group] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    block: tuple[int, int] | None = None  # quant_method fp8: weight_block_size


def _unsupported(what: str) -> ValueError:
    return ValueError(f"unsupported quantized checkpoint: {what}; supported: {SUPPORTED}")


def _group(name: str, g: dict, default_format: str | None) -> Group:
    fmt = g.get("format") or default_format
    if fmt not in FORMATS:
        raise _unsupported(f"compressed-tensors format {fmt!r} (config group {name!r})")
    w = g.get("weights")
    if not w:
        raise _unsupported(f"config group {name!r} quantizes no weights")
    bits, typ, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy", "tensor")
    symmetric, group_size = bool(w.get("symmetric", True)), w.get("group_size")
    if typ == "float":
        if bits != 8:
            raise _unsupported(f"float weights of {bits} bits (config group {name!r}; FP8 is 8 bits, e4m3)")
        if strategy not in ("tensor", "channel"):
            raise _unsupported(f"FP8 weight strategy {strategy!r} (config group {name!r})")
    elif typ == "int":
        if bits not in (4, 8):
            raise _unsupported(f"int weights of {bits} bits (config group {name!r}; 4 and 8 are run)")
        if strategy not in ("channel", "group", "tensor"):
            raise _unsupported(f"int weight strategy {strategy!r} (config group {name!r})")
        if strategy == "group" and not group_size:
            raise _unsupported(f"group strategy without group_size (config group {name!r})")
    else:
        raise _unsupported(f"weight type {typ!r} (config group {name!r})")
    a = g.get("input_activations")
    w8a8_int8 = False
    if a:
        if not a.get("dynamic", False) and typ == "int":
            raise _unsupported(f"static input activation scales on int weights (config group {name!r})")
        if a.get("num_bits") != 8 or a.get("type", "int") != typ:
            raise _unsupported(
                f"input activations {a.get('type')}{a.get('num_bits')} with {typ}{bits} weights (config group {name!r})"
            )
        if typ == "int":
            if bits != 8 or strategy != "channel" or not symmetric or a.get("strategy") != "token":
                raise _unsupported(
                    f"INT8 activations with {bits}-bit {strategy} weights (symmetric={symmetric}) and "
                    f"{a.get('strategy')!r} activations (config group {name!r}); W8A8 INT8 needs channel-wise "
                    f"symmetric int8 weights and per-token activations"
                )
            w8a8_int8 = True
        # FP8 activations (dynamic per token or static per tensor): the weights are widened and the
        # activations run in the model's dtype (at least as precise as the checkpoint's scheme)
    return Group(list(g.get("targets", ["Linear"])), fmt, bits, typ, strategy, symmetric, group_size, w8a8_int8)


def parse(qc: dict | None) -> Scheme | None:
    """config.json's quantization_config -> Scheme, None for none, ValueError for one we cannot run."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        if qc.get("sparsity_config"):
            raise _unsupported("compressed-tensors sparsity_config (sparse checkpoints)")
        if qc.get("transform_config"):
            raise _unsupported("compressed-tensors transform_config (rotations)")
        if qc.get("kv_cache_scheme"):
            raise _unsupported("compressed-tensors kv_cache_scheme (use --kv-cache-dtype)")
        groups = [_group(n, g, qc.get("format")) for n, g in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise _unsupported("compressed-tensors config without config_groups")
        return Scheme(method, groups, list(qc.get("ignore") or []))
    if method == "fp8":
        fmt = qc.get("fmt") or "e4m3"
        if fmt != "e4m3":
            raise _unsupported(f"fp8 fmt {fmt!r} (e4m3 is run)")
        block = qc.get("weight_block_size")
        return Scheme(
            method,
            [Group(["Linear"], "float-quantized", 8, "float", "tensor", True, None, False)],
            list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []),
            tuple(block) if block else None,
        )
    return None  # another quant_method: not this module's (AWQ / GPTQ)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _ignored(scheme: Scheme, stem: str) -> bool:
    return any(_matches(p, stem) for p in scheme.ignore)


def _group_of(scheme: Scheme, stem: str) -> Group:
    for g in scheme.groups:  # class names ("Linear") match every linear; names and re: patterns by name
        if any(t in ("Linear", "nn.Linear") or _matches(t, stem) for t in g.targets):
            return g
    raise _unsupported(f"{stem!r} holds quantized weights that no config group targets")


# ---- dequantization ------------------------------------------------------------------------------


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized layout: [rows, ceil(cols * bits / 32)] int32, value i of a
    word in bits [i * bits, (i + 1) * bits), stored offset by 2^(bits - 1) (unsigned) -> int8 [rows, cols]."""
    per = 32 // bits
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    vals = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    vals = vals.reshape(packed.shape[0], -1)[:, :cols]
    return (vals - (1 << (bits - 1))).to(torch.int8)


def _expand_groups(t: torch.Tensor, cols: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """[out, groups] -> [out, cols]: column j takes group g_idx[j] (act-order) or j // group_size."""
    idx = g_idx.long() if g_idx is not None else torch.arange(cols) // group_size
    return t[:, idx]


def dequantize(stem: str, t: dict[str, torch.Tensor], g: Group, block: tuple[int, int] | None) -> torch.Tensor:
    """One linear's stored tensors (by suffix: weight / weight_packed, weight_scale, ...) -> float32 [out, in]."""
    scale = t.get("weight_scale", t.get("weight_scale_inv"))
    if scale is None:
        raise ValueError(f"quantized checkpoint: {stem!r} has no weight_scale (a {g.format} weight needs one)")
    scale = scale.float()
    if "weight_packed" in t:
        if "weight_shape" not in t:
            raise ValueError(f"quantized checkpoint: {stem!r} has weight_packed without weight_shape")
        rows, cols = (int(v) for v in t["weight_shape"].tolist())
        q = unpack_int32(t["weight_packed"], g.num_bits, cols).float()
    elif "weight" in t:
        q = t["weight"].float()
        rows, cols = q.shape
    else:
        raise ValueError(f"quantized checkpoint: {stem!r} has scales but no weight")
    if g.type == "int" and q.shape != (rows, cols):
        raise ValueError(
            f"quantized checkpoint: {stem!r} unpacks to {tuple(q.shape)}, weight_shape says {(rows, cols)}"
        )
    zp = t.get("weight_zero_point")
    if zp is not None and g.format == "pack-quantized" and zp.dtype == torch.int32 and zp.shape[0] != rows:
        zp = unpack_int32(zp.T.contiguous(), g.num_bits, rows).T  # packed along the output dimension
    if block is not None and scale.dim() == 2 and scale.shape != (rows, 1) and g.type == "float":
        bo, bi = block  # quant_method fp8's [128, 128] blocks
        if scale.shape != (-(-rows // bo), -(-cols // bi)):
            raise ValueError(
                f"quantized checkpoint: {stem!r} block scales {tuple(scale.shape)} do not fit {(rows, cols)}"
            )
        full = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
        return q * full
    if scale.numel() == 1:
        s = scale.reshape(1, 1)
    elif scale.shape in ((rows,), (rows, 1)):
        s = scale.reshape(rows, 1)
    elif scale.dim() == 2 and scale.shape[0] == rows and g.group_size:
        if scale.shape[1] != -(-cols // g.group_size):
            raise ValueError(
                f"quantized checkpoint: {stem!r} weight_scale {tuple(scale.shape)} does not fit "
                f"{cols} inputs in groups of {g.group_size}"
            )
        s = _expand_groups(scale, cols, g.group_size, t.get("weight_g_idx"))
        if zp is not None:
            zp = _expand_groups(zp.float(), cols, g.group_size, t.get("weight_g_idx"))
    else:
        raise ValueError(
            f"quantized checkpoint: {stem!r} weight_scale {tuple(scale.shape)} does not fit {(rows, cols)}"
        )
    if zp is not None and not g.symmetric:
        q = q - zp.float().reshape(rows, -1) if zp.numel() > 1 else q - zp.float()
    return q * s


def int4_groups(stem: str, t: dict[str, torch.Tensor], g: Group) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A pack-quantized int4 weight as our int4 groups of 32 (QuantLinear's Q4_1: w = c * d + m,
    c in 0..15): codes uint8 [rows, cols] and (d, m) float32 [rows, cols / 32, 2]; None where the
    structure is not ours (act-order, groups that are not a multiple of 32). The stored q in -8..7
    with zero point z: c = q + 8, d = s, m = -(z + 8) * s (exact but for d and m in float16)."""
    if g.format != "pack-quantized" or g.type != "int" or g.num_bits != 4 or "weight_g_idx" in t:
        return None
    rows, cols = (int(v) for v in t["weight_shape"].tolist())
    gs = cols if g.strategy == "channel" else g.group_size
    if g.strategy not in ("channel", "group") or not gs or gs % GROUP or cols % GROUP:
        return None
    q = unpack_int32(t["weight_packed"], 4, cols)
    s = t["weight_scale"].float().reshape(rows, -1)
    zp = t.get("weight_zero_point")
    z = torch.zeros_like(s)
    if zp is not None and not g.symmetric:
        z = (unpack_int32(zp.T.contiguous(), 4, rows).T if zp.shape[0] != rows else zp).float().reshape(rows, -1)
    per = gs // GROUP  # our groups per stored group
    d = s.repeat_interleave(per, 1)
    m = (-(z + 8) * s).repeat_interleave(per, 1)
    return (q + 8).to(torch.uint8), torch.stack([d, m], -1)


def dequantizing(
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme: Scheme,
    int8_rows: dict[str, torch.Tensor],
    int4: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, stored tensor) -> (name, float weight): quantized linears' tensors gathered by module
    and dequantized; everything else passed through. int8_rows: filled, for the W8A8 INT8 linears,
    with each weight's per-row scales (the int8 values are round(w / scale), exactly: load_int8)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        stem, _, suffix = name.rpartition(".")
        if suffix in _AUX or suffix == "weight_packed" or (suffix == "weight" and w.dtype in _QDTYPES):
            pending.setdefault(stem, {})[suffix] = w
            continue
        yield name, w
    for stem, t in pending.items():
        if "weight" not in t and "weight_packed" not in t:
            if set(t) <= {"input_scale"}:
                continue  # a static activation scale of a layer we run in float
            raise ValueError(f"quantized checkpoint: {stem!r} has {sorted(t)} but no weight")
        if set(t) <= {"weight"}:
            raise ValueError(f"quantized checkpoint: {stem!r} stores {t['weight'].dtype} weights without weight_scale")
        g = _group_of(scheme, stem)
        w = dequantize(stem, t, g, scheme.block)
        if g.w8a8_int8 and not _ignored(scheme, stem.removeprefix("model.")):
            int8_rows[stem + ".weight"] = t["weight_scale"].float().reshape(-1).expand(w.shape[0]).clone()
        elif int4 is not None and not _ignored(scheme, stem.removeprefix("model.")):
            groups = int4_groups(stem, t, g)
            if groups is not None:
                int4[stem + ".weight"] = groups
        yield stem + ".weight", w


_QDTYPES = (torch.int8, torch.float8_e4m3fn, torch.int32, torch.uint8)


def install_w8a8(model: nn.Module, int8_rows: dict[str, torch.Tensor]) -> int:
    """Replace the linears whose checkpoint weights were W8A8 INT8 by W8A8Linear holding those int8
    values and scales (a fused projection: its parts' rows and scales in order). Returns the count."""
    scales: dict[str, torch.Tensor] = {}
    for name, s in int8_rows.items():
        target, shard = model.fused_target(name.removeprefix("model."))
        mod_name = target.removesuffix(".weight")
        linear = model.get_submodule(mod_name)
        if mod_name not in scales:
            scales[mod_name] = torch.full((linear.weight.shape[0],), float("nan"))
        if shard is None:
            scales[mod_name].copy_(s)
        else:
            scales[mod_name].narrow(0, shard[0], shard[1]).copy_(s)
    clamped = 0
    for mod_name, s in scales.items():
        if torch.isnan(s).any():  # part of a fused projection quantized, part not
            raise ValueError(f"quantized checkpoint: {mod_name!r} fuses W8A8 INT8 and other weights")
        parent, _, child = mod_name.rpartition(".")
        linear = model.get_submodule(mod_name)
        q = (linear.weight.detach().float() / s.unsqueeze(1)).round_()
        if q.max() > 127 or q.min() < -128:
            raise ValueError(f"quantized checkpoint: {mod_name!r} int8 weights out of range")
        # compressed-tensors' int8 is -128..127; our kernel's AVX2 sign trick needs -127..127, so a
        # -128 (at most one per row and sign in a min-max scheme) moves one step: counted, logged
        clamped += int((q == -128).sum())
        q.clamp_(min=-127)
        setattr(model.get_submodule(parent), child, W8A8Linear.from_int8(q.to(torch.int8), s, linear.bias))
    if clamped:
        logger.info("W8A8 INT8: %d weights of -128 run as -127 (the kernel's range is symmetric)", clamped)
    return len(scales)


def install_int4(model: nn.Module, int4: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Replace the linears whose every part is a pack-quantized int4 weight in groups of 32k by
    QuantLinear (the int4 kernels) with those codes; the rest stay dense. Returns the count."""
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for name, (codes, dm) in int4.items():
        target, shard = model.fused_target(name.removeprefix("model."))
        parts.setdefault(target.removesuffix(".weight"), []).append((shard[0] if shard else 0, codes, dm))
    n = 0
    for mod_name, ps in parts.items():
        linear = model.get_submodule(mod_name)
        if type(linear) is not nn.Linear or sum(c.shape[0] for _, c, _ in ps) != linear.weight.shape[0]:
            continue  # a fused projection with a part not in int4 groups: dense
        ps.sort(key=lambda p: p[0])
        codes = torch.cat([c for _, c, _ in ps])
        dm = torch.cat([x for _, _, x in ps])
        N, K = codes.shape
        c = codes.view(N, K // GROUP, GROUP)
        qweight = (c[..., :16] | (c[..., 16:] << 4)).reshape(N, K // 2).contiguous()
        bias = linear.bias.detach() if linear.bias is not None else None
        parent, _, child = mod_name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantLinear(qweight, dm.half().contiguous(), 4, bias))
        n += 1
    return n


# ---- --quantization fp8 on a full-precision checkpoint ---------------------------------------------


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the float32 values of e4m3 weights with per-output-channel scales (amax / 448)."""
    wf = w.detach().float()
    amax = wf.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


@torch.no_grad()
def quantize_model_fp8(model: nn.Module) -> int:
    """--quantization fp8 on a full-precision checkpoint: every decoder linear's weights rounded to
    e4m3 (per-channel scales) and widened back into the model's dtype. The lm_head and embeddings stay."""
    n = 0
    for name, m in model.named_modules():
        if type(m) is nn.Linear and name.startswith("layers."):
            m.weight.copy_(fp8_round_trip(m.weight).to(m.weight.dtype))
            n += 1
    return n


def load_notice(scheme: Scheme, dtype: torch.dtype, w8a8: int, int4: int = 0) -> str:
    kinds = sorted({f"{g.format} {g.type}{g.num_bits} {g.strategy}" for g in scheme.groups})
    return (
        f"{scheme.method} checkpoint ({', '.join(kinds)}): {w8a8} linears in W8A8 int8, {int4} in int4 groups "
        f"of 32; the other quantized weights widened once to {dtype} (dense at run time, no memory saved)"
    )


# ---- the loader's entry points ----------------------------------------------------------------------


def check(path: str, quantization: str | None, tp_size: int) -> Scheme | None:
    """The checkpoint's scheme (None: not a compressed-tensors / fp8 checkpoint), checked against
    --quantization: another method on such a checkpoint, or compressed-tensors on a plain one, is refused."""
    scheme = parse(read_quantization_config(path))
    if scheme is None:
        if quantization == "compressed-tensors":
            raise ValueError(
                f"--quantization compressed-tensors: {path!r} has no compressed-tensors quantization_config"
            )
        return None
    if quantization not in (None, scheme.method):
        raise ValueError(
            f"--quantization {quantization}: {path!r} is a pre-quantized {scheme.method} checkpoint; "
            f"drop --quantization or pass --quantization {scheme.method}"
        )
    if tp_size > 1:
        raise ValueError(f"{scheme.method} checkpoints do not run under --tensor-parallel-size yet")
    return scheme


def finish(
    model: nn.Module,
    scheme: Scheme,
    int8_rows: dict[str, torch.Tensor],
    dtype: torch.dtype,
    on_cpu: bool,
    int4: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """After load_weights: the W8A8 INT8 linears into W8A8Linear and int4 groups of 32k into
    QuantLinear (CPU), and the log line saying what runs how."""
    if (int8_rows or int4) and not on_cpu:
        logger.warning(
            "%s checkpoint on a GPU: no int8 / int4 GPU kernel yet, the weights run dequantized", scheme.method
        )
        int8_rows, int4 = {}, {}
    n4 = install_int4(model, int4) if int4 else 0
    logger.info(load_notice(scheme, dtype, install_w8a8(model, int8_rows) if int8_rows else 0, n4))
