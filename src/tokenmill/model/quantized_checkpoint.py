"""Pre-quantized checkpoints: AWQ and GPTQ folders, detected from config.json's `quantization_config`.

Layouts read (as AutoAWQ, auto-gptq, GPTQModel and optimum write them):

- GPTQ: `qweight` int32 [in * bits / 32, out], codes packed along the input rows (row r holds
  inputs r * 32 / bits + j at bit j * bits); `qzeros` int32 [groups, out * bits / 32] packed
  along the output columns; `scales` float16 [groups, out]; `g_idx` int32 [in] (each input's
  group; act-order / desc_act checkpoints permute it). w = (q - z) * s with z the stored zero
  plus one (`checkpoint_format: gptq`, v1) or as stored (`gptq_v2`). bits 4 or 8.
- AWQ (AutoAWQ GEMM): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], eight
  4-bit codes per word in the order [0, 2, 4, 6, 1, 3, 5, 7] of the columns; `scales` float16
  [groups, out]; w = (q - z) * s, groups of `group_size` consecutive inputs.

What runs how (logged at load), on the CPU without tensor parallelism, for linears whose groups
are consecutive runs of a multiple of 32 inputs (no act-order permutation in g_idx): 4 bits become
a QuantLinear on our int4 kernels (GGUF Q4_1's w = q * d + m per 32 inputs, d = s and m = -z * s:
the codes and scales kept, the offset rounded to float16), symmetric 8 bits (zeros 128) one on our
int8 kernels (Q8_0's w = q * d, q - 128 and d = s: exact). Every other linear (asymmetric 8 bits,
act-order, other group sizes, tensor parallelism, a GPU) is dequantized once at load into a dense
weight of the model's dtype: the checkpoint's exact values, at dense speed.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tokenmill.model.layers.quantization import GROUP

logger = logging.getLogger("tokenmill")

SUPPORTED_METHODS = ("awq", "gptq")
GPTQ_BITS = (4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column AWQ_ORDER[i] of its 8
PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization_config, as far as loading it needs."""

    method: str  # awq | gptq
    bits: int
    group_size: int  # -1: one group over all inputs
    sym: bool  # GPTQ's sym; AWQ: not zero_point
    desc_act: bool  # GPTQ act-order (g_idx permuted)
    checkpoint_format: str = "gptq"  # GPTQ: gptq (zeros stored minus one) | gptq_v2; AWQ: gemm


def _supported() -> str:
    return (
        "supported: awq (AutoAWQ GEMM, 4 bits, zero points), gptq (4 or 8 bits, any group size, "
        "sym or not, desc_act, checkpoint_format gptq or gptq_v2), and compressed-tensors / fp8 "
        "(docs/quantization.md)"
    )


def read_quantization_config(path: str) -> dict | None:
    """The folder's quantization_config (config.json's, else an old auto-gptq quantize_config.json)."""
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    if qc is None and os.path.exists(os.path.join(path, "quantize_config.json")):
        with open(os.path.join(path, "quantize_config.json")) as f:
            qc = json.load(f)
        qc.setdefault("quant_method", "gptq")
    return qc


def parse_quantization_config(qc: dict) -> CheckpointQuantization:
    """ValueError naming the format or setting when tokenmill does not run it."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"checkpoint quantization_config quant_method {method!r} is not supported; {_supported()}")
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"AWQ checkpoint with bits={bits} is not supported; {_supported()}")
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint version {version!r} is not supported (only 'gemm'); {_supported()}")
        if not qc.get("zero_point", True):
            raise ValueError(f"AWQ checkpoint with zero_point=false is not supported; {_supported()}")
        if group <= 0:
            raise ValueError(f"AWQ checkpoint with group_size={group} is not supported; {_supported()}")
        return CheckpointQuantization("awq", 4, group, False, False, "gemm")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ checkpoint with bits={bits} is not supported; {_supported()}")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; {_supported()}")
    if group == 0 or group < -1:
        raise ValueError(f"GPTQ checkpoint with group_size={group} is not supported; {_supported()}")
    return CheckpointQuantization("gptq", bits, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), fmt)


def detect(path: str, flag: str | None) -> CheckpointQuantization | None:
    """The folder's pre-quantized format, checked against --quantization (`flag`): a quantized
    checkpoint needs no flag, and a flag other than its format is refused."""
    qc = read_quantization_config(path)
    if qc is None:
        if flag in SUPPORTED_METHODS:
            raise ValueError(
                f"--quantization {flag} needs a {flag.upper()} checkpoint; {path!r} has no quantization_config"
            )
        return None
    found = parse_quantization_config(qc)
    if flag is not None and flag != found.method:
        raise ValueError(
            f"--quantization {flag} does not match the checkpoint, which is {found.method.upper()}-quantized "
            f"(quantization_config); pass --quantization {found.method} or no --quantization"
        )
    return found


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int64 [R * 32 / bits, C]: row r's word holds rows r * n + j at bit j * bits."""
    n, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    q = (packed.to(torch.int64).unsqueeze(1) >> shifts.view(1, n, 1)) & mask
    return q.reshape(packed.shape[0] * n, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> int64 [R, C * 32 / bits]: a word's codes at bit j * bits are columns
    j (GPTQ) or order[j] (AWQ) of its group of 32 / bits."""
    n, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    q = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & mask  # [R, C, n]: nibble j
    if order is not None:
        q = q[..., [order.index(c) for c in range(n)]]
    return q.reshape(packed.shape[0], packed.shape[1] * n)


@dataclass
class QuantizedWeight:
    """One linear's codes as the checkpoint holds them, unpacked: w[n, k] = (q[k, n] - z[g[k], n]) * s[g[k], n]."""

    q: torch.Tensor  # int64 [in, out]
    zeros: torch.Tensor  # int64 [groups, out]
    scales: torch.Tensor  # float16 [groups, out]
    g_idx: torch.Tensor  # int64 [in]

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight."""
        z, s = self.zeros[self.g_idx], self.scales.float()[self.g_idx]
        return ((self.q - z).float() * s).T.contiguous()

    def contiguous_groups(self) -> int | None:
        """The group size when group g is inputs [g * size, (g + 1) * size), else None."""
        K, G = self.q.shape[0], self.scales.shape[0]
        if K % G:
            return None
        size = K // G
        return size if torch.equal(self.g_idx, torch.arange(K) // size) else None

    def to_q4_1(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Our int4 format (layers/quantization.py): uint8 [out, in / 2], float16 [out, in / 32, 2]
        (d, m) with w = q * d + m; needs contiguous groups of a multiple of 32 inputs."""
        size = self.contiguous_groups()
        assert size is not None and size % GROUP == 0
        q = self.q.T.to(torch.uint8).reshape(self.q.shape[1], -1, GROUP)  # [out, in / 32, 32]
        packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)
        d = self.scales.T.repeat_interleave(size // GROUP, dim=1)  # [out, in / 32]
        z = self.zeros.T.repeat_interleave(size // GROUP, dim=1)
        m = (-(z.float() * d.float())).half()
        return packed.contiguous(), torch.stack([d, m], -1).contiguous()

    def to_q8_0(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Our int8 format (GGUF Q8_0: int8 [out, in], float16 d [out, in / 32], w = q * d) when the
        zeros are all 128 (symmetric 8-bit GPTQ) and the groups contiguous multiples of 32: exact."""
        size = self.contiguous_groups()
        if size is None or size % GROUP or not bool((self.zeros == 128).all()):
            return None
        q = (self.q.T - 128).to(torch.int8)  # -128..127: the kernels' products take -128 (tests/model)
        return q.contiguous(), self.scales.T.repeat_interleave(size // GROUP, dim=1).contiguous()


def unpack(qc: CheckpointQuantization, stem: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    """A linear's checkpoint tensors -> its codes, zeros, scales, groups; ValueError naming what is wrong."""
    for part in ("qweight", "scales") + (("qzeros",) if qc.method == "awq" or not qc.sym else ()):
        if part not in parts:
            raise ValueError(f"{qc.method.upper()} checkpoint: {stem}.{part} is missing")
    qweight, scales = parts["qweight"], parts["scales"]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{stem}.qweight: expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    bits, per = qc.bits, 32 // qc.bits
    if qc.method == "awq":
        q = _unpack_cols(qweight, 4, AWQ_ORDER)  # [in, out]
    else:
        q = _unpack_rows(qweight, bits)
    K, N = q.shape
    groups = 1 if qc.group_size == -1 else -(-K // qc.group_size)
    if tuple(scales.shape) != (groups, N):
        raise ValueError(
            f"{stem}.scales has shape {tuple(scales.shape)}, expected {(groups, N)} for a [{K} in, {N} out] "
            f"{qc.method.upper()} weight with group_size {qc.group_size}"
        )
    if "qzeros" in parts:
        qzeros = parts["qzeros"]
        if tuple(qzeros.shape) != (groups, N // per):
            raise ValueError(f"{stem}.qzeros has shape {tuple(qzeros.shape)}, expected {(groups, N // per)}")
        zeros = _unpack_cols(qzeros, bits, AWQ_ORDER if qc.method == "awq" else None)
        if qc.method == "gptq" and qc.checkpoint_format == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1; read as GPTQ's kernels (exllama, vLLM) read it: code + 1
    else:  # symmetric GPTQ without zeros: the middle code
        zeros = torch.full((groups, N), 1 << (bits - 1), dtype=torch.int64)
    if qc.method == "gptq" and "g_idx" in parts:
        g_idx = parts["g_idx"].to(torch.int64)
        if tuple(g_idx.shape) != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(
                f"{stem}.g_idx: expected {K} group indices in [0, {groups}), got shape {tuple(g_idx.shape)}"
            )
    else:
        if qc.desc_act and qc.method == "gptq":
            raise ValueError(f"GPTQ checkpoint with desc_act: {stem}.g_idx is missing")
        g_idx = torch.arange(K) // (K if qc.group_size == -1 else qc.group_size)
    return QuantizedWeight(q, zeros, scales.to(torch.float16), g_idx)


def _read(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # lazy: the loader's import of this module stays cheap

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def load_prequantized(
    model: torch.nn.Module,
    path: str,
    qc: CheckpointQuantization,
    dtype: torch.dtype,
    kernels: bool,
    shard_of: Callable[[str], object] = lambda name: None,
) -> None:
    """Load an AWQ / GPTQ folder into `model`: 4-bit linears with contiguous groups of a multiple of
    32 as QuantLinear (when `kernels`: the CPU, no tensor parallelism), the rest dequantized once
    into dense weights. Every linear is unpacked and checked before any is installed."""
    tensors = _read(path)
    stems = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")})
    if not stems:
        raise ValueError(f"{qc.method.upper()} checkpoint (quantization_config) has no *.qweight tensors in {path!r}")
    for k in tensors:
        stem, _, part = k.rpartition(".")
        if part in ("qzeros", "scales", "g_idx") and stem not in stems:
            raise ValueError(f"{qc.method.upper()} checkpoint: {k} has no {stem}.qweight")
    weights = {s: unpack(qc, s, {p: tensors[f"{s}.{p}"] for p in PARTS if f"{s}.{p}" in tensors}) for s in stems}
    native: dict[str, torch.Tensor] = {}
    for s, w in weights.items() if kernels else ():
        size = w.contiguous_groups()
        if qc.bits == 4 and size is not None and size % GROUP == 0:
            native[s + ".qweight"], native[s + ".scales"] = w.to_q4_1()
        elif qc.bits == 8 and (q8 := w.to_q8_0()) is not None:
            native[s + ".qweight"], native[s + ".scales"] = q8
    used = model.load_quantized(native, dtype) if native else set()  # type: ignore[operator]
    dense = [s for s in stems if s + ".weight" not in used]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for s in dense:
            w, shard = weights[s].dequantize(), shard_of(s + ".weight")
            if shard is not None and shard.zero:  # type: ignore[attr-defined]
                w = torch.zeros_like(w)
            elif shard is not None:
                w = w.narrow(shard.dim, shard.start, shard.size)  # type: ignore[attr-defined]
            yield s + ".weight", w
        for name, t in tensors.items():
            if name.rpartition(".")[2] in PARTS:
                continue
            shard = shard_of(name)
            if shard is not None and shard.zero:  # type: ignore[attr-defined]
                t = torch.zeros_like(t)
            elif shard is not None:
                t = t.narrow(shard.dim, shard.start, shard.size)  # type: ignore[attr-defined]
            yield name, t

    model.load_weights(stream())  # type: ignore[operator]
    log = logger.info if kernels else logger.warning
    log(
        "%s checkpoint (%d bits, group size %d%s): %d linear layers run quantized (int4 / int8 kernels), "
        "%d dequantized at load to %s%s",
        qc.method.upper(),
        qc.bits,
        qc.group_size,
        ", act-order" if qc.desc_act else "",
        len(used),
        len(dense),
        dtype,
        "" if kernels else " (no int4 kernels on a GPU or under tensor parallelism yet: dense weights, dense speed)",
    )
