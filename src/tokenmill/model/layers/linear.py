"""CPU linear layers with weights pre-packed: for oneDNN (prompt steps) and in panels for the
engine's own kernel (decode steps of up to SMALL_BATCH rows; every step when batch-invariant).

torch's bfloat16 F.linear re-lays out the weight on every call; packing it once at load time
(the layout oneDNN's AMX kernels read) is 1.3-2x faster for decode-sized batches and no slower
for prefill, with bit-identical results.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from tokenmill import envs
from tokenmill.kernels import cpu_kernels

logger = logging.getLogger("tokenmill")

_BATCH_HINT = 64  # oneDNN picks the packed layout for this batch size; any size still works

# Rows up to which the engine's panel kernel runs a linear instead of oneDNN (it is faster up to
# ~128 rows on SmolLM2's shapes; past 64 rows a step is a prompt step, where oneDNN's blocking
# for large batches is the safer choice).
SMALL_BATCH = 64


class PackedLinear(nn.Module):
    """oneDNN-packed bf16 linear (float32 too, for models that opt in). `panels` (when kept, see
    pack_linears): the weight packed in panels of 32 rows for the engine's own kernel
    (csrc/panel_linear.cpp), which batches of up to SMALL_BATCH rows run: it streams weights
    ~10-30% faster than a row-by-row GEMV at 1 row and beats oneDNN's packed GEMM at 8-128 rows
    (2 cores, AVX512-BF16, SmolLM2 shapes). On AVX2 CPUs (no bf16 GEMM in oneDNN,
    onednn_bf16_fast) it runs every batch size.

    `onednn=False` (batch-invariant models): panels only, for every batch size. The panel kernel
    sums each output over the inputs in one fixed order, so a row's result does not depend on how
    many rows are in the call; oneDNN picks its blocking (and the order of its sums) by batch size.
    Without AVX512-AMX it is no slower than oneDNN at prompt sizes either (benchmarks/panel_linear.py:
    1.0-1.4x at 64-2048 rows on SmolLM2's shapes, 2 cores); with AMX-BF16 the panels run on AMX
    tiles at every batch size, on par with oneDNN's AMX GEMM (one core, SmolLM2's gate/up and down:
    633-837 GFLOP/s at 64-512 rows against 423-947).

    `ops`: the panel kernel's module (taken when made, with panels; bound again at load:
    layers/bind.py); `fuses_silu`: whether silu_and_mul runs in the AMX path's epilogue."""

    def __init__(self, linear: nn.Linear, panels: torch.Tensor | None = None, onednn: bool = True):
        super().__init__()
        if not onednn and panels is None:
            raise ValueError("PackedLinear: without oneDNN's copy the panels are needed")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT) if onednn else None
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.panels = panels  # not a buffer: the weight arena owns it (weight_arena.py)
        self.bind_kernels(None)

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        # Panels have no torch path: they run the kernels that packed them, whatever the binding.
        self.ops = cpu_kernels.load() if self.panels is not None else ops
        self.fuses_silu = bool(
            self.packed_weight is None and self.panels is not None and not self.out_features % 64 and _amx_glu(self.ops)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:  # panels at every batch size
            x2 = x.reshape(-1, self.in_features)
            y = self.ops.panel_linear(x2, self.panels, self.out_features, self.bias)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        if self.panels is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH:
            return self.ops.panel_linear(x, self.panels, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate/up projection (gate's rows first) on panels at every batch size:
        silu(gate) * up in the AMX path's epilogue (panel_linear_silu_mul), the bits of forward()
        then silu_and_mul without writing the [T, 2 I] product. None elsewhere (oneDNN's copy, no
        AMX-BF16, I not a multiple of 32: fuses_silu): the caller runs the two ops."""
        if not self.fuses_silu:
            return None
        x2 = x.reshape(-1, self.in_features)
        y = self.ops.panel_linear_silu_mul(x2, self.panels, self.out_features, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features // 2)


@functools.cache
def _amx_glu(kernels) -> bool:
    return kernels is not None and hasattr(kernels, "panel_linear_silu_mul") and kernels.panel_isa() == "amx-bf16"


# Keep every linear's panels too (for the small-batch kernel) while that costs at most this
# much memory: 1 GiB, models up to ~0.5B parameters. TOKENMILL_PANEL_WEIGHTS=1 / 0 forces it.
PANEL_WEIGHTS_MAX_BYTES = 1 << 30


def pack_linears(model: nn.Module, dtype: torch.dtype, batch_invariant: bool | None = None) -> int:
    """Swap the model's bf16 CPU nn.Linear layers for PackedLinear when oneDNN can run them, each
    also keeping its weight in panels while all of them together fit PANEL_WEIGHTS_MAX_BYTES.
    Batch-invariant (the default, cpu_kernels.batch_invariant()), or where oneDNN has no bf16
    GEMM of its own (AVX2 CPUs: onednn_bf16_fast): panels only, whatever their size, run at every
    batch size (no oneDNN copy: less memory, too). float32: only for models that opt in
    (PACK_FLOAT32_LINEARS), see _pack_float32."""
    if dtype == torch.float32 and getattr(model, "PACK_FLOAT32_LINEARS", False):
        return _pack_float32(model) if torch.backends.mkldnn.is_available() else 0
    if dtype != torch.bfloat16:
        return 0
    onednn = onednn_bf16_fast() and _works(torch.bfloat16)
    if batch_invariant is None:
        batch_invariant = cpu_kernels.batch_invariant()
    forced = envs.TOKENMILL_PANEL_WEIGHTS
    panel_ok = forced != "0" and _panel_kernel_works()
    only_panels = panel_ok and (batch_invariant or not onednn)
    if not onednn and not only_panels:
        logger.info(
            "bf16 linears run torch's own kernels (no oneDNN bf16 GEMM, %s)",
            "TOKENMILL_PANEL_WEIGHTS=0"
            if forced == "0"
            else "and the panel kernel needs the C++ kernels with AVX512-BF16 or AVX2 + FMA",
        )
        return 0
    linears = _cpu_linears(model)
    extra = sum(c.weight.numel() * c.weight.element_size() for _, _, c in linears)
    keep = panel_ok and (only_panels or forced == "1" or extra <= PANEL_WEIGHTS_MAX_BYTES)
    kernels = cpu_kernels.load() if keep else None
    for parent, name, child in linears:
        panels = kernels.pack_panels(child.weight.detach()) if keep else None
        setattr(parent, name, PackedLinear(child, panels, onednn=not only_panels))
    if only_panels:
        logger.info(
            "bf16 linears: in panels for every batch size (%s; %s)",
            "batch-invariant" if batch_invariant else "oneDNN has no bf16 GEMM of its own on this CPU",
            kernels.panel_isa(),
        )
    elif keep:
        logger.info(
            "bf16 linears: oneDNN-packed, and in panels for batches of <= %d rows (+%.0f MB; %s)",
            SMALL_BATCH,
            extra / 1e6,
            kernels.panel_isa(),
        )
    if batch_invariant and not only_panels and linears:
        logger.info(
            "bf16 linears are not batch-invariant here (%s)",
            "TOKENMILL_PANEL_WEIGHTS=0"
            if forced == "0"
            else "the panel kernel needs the C++ kernels built with AVX512-BF16 or AVX2 + FMA",
        )
    return len(linears)


def _pack_float32(model: nn.Module) -> int:
    """float32 linears packed for oneDNN (no panels: the panel kernel is bf16's). oneDNN runs its
    own GEMM where torch's float32 linear calls MKL, which on the AMD EPYC measured was ~1.4x
    slower at a sentence's rows (~30), and re-lays out the weight on every call. The sums differ
    from MKL's in the last bits, so a model opts in: BERT encoders, whose vectors are compared by
    cosine, not decoders held to transformers' greedy tokens."""
    linears = _cpu_linears(model)
    if not linears or not _works(torch.float32):
        return 0
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    logger.info("float32 linears: oneDNN-packed (%d)", len(linears))
    return len(linears)


def _cpu_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every plain nn.Linear on the CPU."""
    return [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]


@functools.cache
def onednn_bf16_fast() -> bool:
    """Whether oneDNN has bf16 GEMMs of its own here (AVX-512 or AMX: torch's own check). On AVX2
    CPUs it cannot pack bf16 weights, and torch's bf16 matmul there runs several times slower than
    float32's (SmolLM2 bf16 decode: 0.4 tok/s against float32's 2.4 on the AMD EPYC helpers' machine)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _panel_kernel_works() -> bool:
    """The panel kernel needs the C++ kernels built with AVX512-BF16 or AVX2 + FMA."""
    kernels = cpu_kernels.load() if cpu_kernels.enabled() else None
    if kernels is None:
        return False
    try:
        w, x = torch.randn(40, 64).bfloat16(), torch.randn(3, 64).bfloat16()
        y = kernels.panel_linear(x, kernels.pack_panels(w), 40)
        # The result is rounded to bf16: compare within its relative precision.
        return torch.allclose(y.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2)
    except RuntimeError:  # built without AVX512-BF16 or AVX2 + FMA
        return False


def _works(dtype: torch.dtype) -> bool:
    try:
        lin = nn.Linear(64, 32, bias=True).to(dtype)
        x = torch.randn(3, 64, dtype=dtype)
        return torch.allclose(PackedLinear(lin)(x).float(), lin(x).float(), atol=1e-2)
    except Exception as e:  # noqa: BLE001 - no oneDNN support for this dtype here: plain nn.Linear it is
        logger.info("oneDNN packed linear unavailable: %s", e)
        return False
