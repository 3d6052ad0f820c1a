"""Weight-only quantization: int4 / int8 weights in groups of 32, run by the C++ CPU kernel.

The format is GGUF's: int4 stores per group of 32 inputs a float16 scale d and offset m with
w = q * d + m, q in 0..15 (Q4_1; Q4_0 is m = -8d), and byte j of a group packs elements j (low
nibble) and j + 16 (high nibble); int8 stores w = q * d (Q8_0). llama.cpp files therefore load
as they are (gguf_loader), and `--quantization int4|int8` quantizes an HF checkpoint at load
time the way llama.cpp's quantizer would (min/max for int4, absmax for int8).

Each weight byte is read once per step, a quarter (int4) or half (int8) of the bfloat16 traffic.
On CPUs with AVX2 + FMA + F16C the loader repacks the codes once into output panels of 32 rows
(pack_quantized: the same bytes reordered, csrc/quant_panels.cpp: 256-bit integer products, or
AVX-512 VNNI's on 512 bits, the same numbers), which the kernel unpacks once per weight for all
input rows; there the weights multiply activations quantized per group of 32 to int8 (W4A8 / W8A8
per group, llama.cpp's Q4 x Q8 and Q8 x Q8 dot products: quantize_activation_groups, a8_linear)
at every batch size; where the CPU has AMX-BF16, steps of many rows (AMX_ROWS) dequantize each
panel once into bf16 and run it on AMX tiles with the activations as they are. Elsewhere
activations stay in the model's dtype and the kernel dequantizes a few weight rows at a time into L1
(csrc/quant_linear.cpp).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import envs
from tokenmill.kernels import cpu_kernels
from tokenmill.model.layers.bind import kernels_for
from tokenmill.model.layers.linear import onednn_bf16_fast

logger = logging.getLogger("tokenmill")

GROUP = 32
# Rows from which a step dequantizes each weight once and runs oneDNN's GEMM on it (prompt
# steps: the GEMM is compute-bound there and oneDNN's beats the engine's tile kernel; the
# copy costs a weight's bf16 size in memory traffic, small against 128+ rows of work). Not for
# panels: their int8 products beat the copy + float32 GEMM at any size (1.4-1.9x at 64-512 rows,
# one thread, int8 SmolLM2 shapes; int4 1.5-2.6x).
LARGE_BATCH = 128
# Panels on AMX-BF16 CPUs: rows from which a bf16 step dequantizes each panel into bf16 (once for
# all its rows) for AMX tiles instead of the int8 products. Batch-invariant, LARGE_BATCH (the two
# paths round differently, and below it the engine promises the same bits at any batch size);
# otherwise from where the tiles win (SmolLM2 int4's fused decode step, 2 cores, Sapphire Rapids:
# 0.98x the int8 products at 12 rows, 0.99x at 16, 1.05x at 24, 1.18x at 32; its gate/up and down
# alone 1.3x / 1.6x at 32 rows, 1.5x / 2.7x at 128: benchmarks/quant_kernel.py).
AMX_ROWS = {True: LARGE_BATCH, False: 24}
# w8a8: layers/w8a8.py, model/smoothquant.py; awq / gptq: checkpoints quantized already (model/quantized_checkpoint.py);
# fp8 / compressed-tensors: model/compressed_tensors.py
QUANTIZATION_METHODS = ("int4", "int8", "gguf", "w8a8", "awq", "gptq", "fp8", "compressed-tensors")
BITS = {"int4": 4, "int8": 8}


def quantize(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (qweight, float16 scales) in the kernel's format."""
    N, K = w.shape
    wg = w.detach().float().reshape(N, K // GROUP, GROUP)
    if bits == 8:
        d = (wg.abs().amax(-1) / 127).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), 0)
        q = (wg * inv.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
        return q.reshape(N, K).contiguous(), d.contiguous()
    lo, hi = wg.amin(-1), wg.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), 0)
    q = ((wg - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(N, K // 2).contiguous(), torch.stack([d, m], -1).contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 [N, K] weight a (qweight, scales) pair stands for (pure torch)."""
    N = qweight.shape[0]
    if bits == 8:
        K = qweight.shape[1]
        return (qweight.view(N, K // GROUP, GROUP).float() * scales.float().unsqueeze(-1)).reshape(N, K)
    K = qweight.shape[1] * 2
    b = qweight.view(N, K // GROUP, GROUP // 2)
    q = torch.cat([b & 0xF, b >> 4], -1).float()
    s = scales.float()
    return (q * s[..., :1] + s[..., 1:]).reshape(N, K)


def quantize_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float rows -> (int8-valued codes [M, K/32, 32], scales [M, K/32]) per group of 32:
    codes round(x * 127 / max|x|), scale max|x| / 127, in float32 as the panel kernel computes them."""
    xg = x.float().reshape(x.shape[0], -1, GROUP)
    amax = xg.abs().amax(-1)
    # The quotients correctly rounded, as the kernel's divisions are (torch's `127 / t` and `t / 127`
    # multiply by a rounded reciprocal: one ulp off, one code off at ties).
    inv = torch.where(amax > 0, (127 / amax.double()).float(), 0)
    return (xg * inv.unsqueeze(-1)).round(), (amax.double() / 127).float()


def a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """What the AVX2 panel kernel computes (weights in rows format), in float64: activations
    quantized per group (quantize_activation_groups), y = sum_g [(d s) (xq . q) + m sum(x)] (int8: m = 0)."""
    N = qweight.shape[0]
    xq, xs = quantize_activation_groups(x)
    if bits == 8:
        q, d = qweight.view(N, xq.shape[1], GROUP).double(), scales.double()
    else:
        b = qweight.view(N, xq.shape[1], GROUP // 2)
        q = torch.cat([b & 0xF, b >> 4], -1).double()
        d, m = scales.double().unbind(-1)
    dots = torch.einsum("mgk,ngk->mng", xq.double(), q)
    y = torch.einsum("mng,ng,mg->mn", dots, d, xs.double())
    if bits == 4:
        y += x.double().reshape(x.shape[0], -1, GROUP).sum(-1) @ m.T
    return y


PANEL = 32  # output rows per panel


def to_panels(qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales) in rows -> the same codes and scales in output panels of 32 rows (rows
    past N zero), the layout of csrc/quant_panels.cpp: codes [P, K/32, 32, 16] (int4) or
    [P, K/32, 32, 32] (int8), per group 32-byte runs for 8 outputs 8v + i: int4's byte 4i + j of
    run 4s + v holds input 8s + j (low nibble) and 8s + 4 + j (high), int8's input 4s + j; scales
    float16 [P, K/32, 2, 32] (d row, m row) or [P, K/32, 32]."""
    N = qweight.shape[0]
    P = -(-N // PANEL)
    pad = P * PANEL - N
    if bits == 8:
        K = qweight.shape[1]
        # output 8v + i, input 4s + j -> [P, G, s, v, i, j]
        q = F.pad(qweight, (0, 0, 0, pad)).view(P, 4, 8, K // GROUP, 8, 4).permute(0, 3, 4, 1, 2, 5)
        s = F.pad(scales, (0, 0, 0, pad)).view(P, PANEL, K // GROUP).permute(0, 2, 1)
        return q.reshape(P, K // GROUP, GROUP, PANEL).contiguous(), s.contiguous()
    K = qweight.shape[1] * 2
    b = qweight.view(N, K // GROUP, GROUP // 2)
    codes = F.pad(torch.cat([b & 0xF, b >> 4], -1), (0, 0, 0, 0, 0, pad))  # [P * 32, G, 32 inputs]
    # output 8v + i, input 8s + 4h + j -> [P, G, s, v, i, h, j]
    codes = codes.view(P, 4, 8, K // GROUP, 4, 2, 4).permute(0, 3, 4, 1, 2, 5, 6)
    q = codes[..., 0, :] | (codes[..., 1, :] << 4)
    s = F.pad(scales, (0, 0, 0, 0, 0, pad)).view(P, PANEL, K // GROUP, 2).permute(0, 2, 3, 1)
    return q.reshape(P, K // GROUP, GROUP, 16).contiguous(), s.contiguous()


def from_panels(qpanels: torch.Tensor, spanels: torch.Tensor, bits: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """to_panels' inverse: (qweight, scales) in rows for the first N outputs."""
    P, G = qpanels.shape[:2]
    if bits == 8:
        q = qpanels.view(P, G, 8, 4, 8, 4).permute(0, 3, 4, 1, 2, 5).reshape(P * PANEL, G * GROUP)[:N]
        return q.contiguous(), spanels.permute(0, 2, 1).reshape(P * PANEL, G)[:N].contiguous()
    b = qpanels.view(P, G, 4, 4, 8, 1, 4)
    codes = torch.cat([b & 0xF, b >> 4], 5)  # [P, G, s, v, i, h, j]: output 8v + i, input 8s + 4h + j
    codes = codes.permute(0, 3, 4, 1, 2, 5, 6).reshape(P * PANEL, G, GROUP)[:N]
    q = codes[..., :16] | (codes[..., 16:] << 4)
    s = spanels.permute(0, 3, 1, 2).reshape(P * PANEL, G, 2)[:N]
    return q.reshape(N, G * GROUP // 2).contiguous(), s.contiguous()


def _dequantized(qweight: torch.Tensor, scales: torch.Tensor, bits: int, rows: int, panels: bool) -> torch.Tensor:
    """A layer's float32 [rows, in] weight, its codes in rows or in output panels."""
    if panels:
        qweight, scales = from_panels(qweight, scales, bits, rows)
    return dequantize(qweight, scales, bits)


class QuantLinear(nn.Module):
    """A linear layer with int4 / int8 weights; bias (if any) stays a float parameter. `ops`: the
    kernels (those for its weights' device when made, then bound at load: layers/bind.py; None:
    the torch path)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.bits = bits
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * (2 if bits == 4 else 1)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.panels = False  # qweight / scales in output panels (to_panels), see pack_quantized
        self.bind_kernels(kernels_for(qweight.device))

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        self.ops = ops
        # bf16 prompt steps without oneDNN's bf16 GEMM (AVX2): its float32 GEMM, not torch's slow bf16
        self.f32_gemm = not onednn_bf16_fast()

    def to_panels(self) -> None:
        self.qweight, self.scales = to_panels(self.qweight, self.scales, self.bits)
        self.panels = True

    def dequantized(self) -> torch.Tensor:
        """The float32 [out, in] weight this layer stands for (pure torch)."""
        return _dequantized(self.qweight, self.scales, self.bits, self.out_features, self.panels)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int) -> QuantLinear:
        qw, s = quantize(linear.weight, bits)
        return cls(qw, s, bits, linear.bias.detach() if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        ops = self.ops
        # panels (int8 activations) are faster than the GEMM at any size
        if ops is not None and x2.shape[0] >= LARGE_BATCH and not self.panels:  # prompts: oneDNN, dequantized copy
            if x2.dtype == torch.bfloat16 and self.f32_gemm:  # AVX2: its float32 GEMM, not its slow bf16
                y = F.linear(x2.float(), self._dequantize(ops, torch.float32)).to(x2.dtype)
            else:
                y = F.linear(x2, self._dequantize(ops, x2.dtype))
        elif ops is not None and self.panels:
            y = ops.quant_panel_linear(x2, self.qweight, self.scales, self.bits, self.out_features)
        elif ops is not None:
            y = ops.quant_linear(x2, self.qweight, self.scales, self.bits)
        elif self.panels:  # kernels turned off after packing: the panels' numbers
            y = a8_linear(x2, *from_panels(self.qweight, self.scales, self.bits, self.out_features), self.bits).to(
                x2.dtype
            )
        else:  # no C++ kernels: dequantize on the fly (slow, but the same numbers)
            y = F.linear(x2, self.dequantized().to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _dequantize(self, ops, dtype: torch.dtype) -> torch.Tensor:
        return ops.dequantize_weight(self.qweight, self.scales, self.bits, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}" + (
            ", panels" if self.panels else ""
        )


class QuantEmbedding(nn.Module):
    """Token embeddings read from an int4 / int8 table (shared with a tied lm_head). `ops`: as QuantLinear's."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype):
        super().__init__()
        self.bits, self.dtype = bits, dtype
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.rows = qweight.shape[0]
        self.panels = False  # the tied lm_head's panels (pack_quantized): rows read across them
        self.bind_kernels(kernels_for(qweight.device))

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        self.ops = ops

    def share_panels(self, head: QuantLinear) -> None:
        self.qweight, self.scales, self.panels = head.qweight, head.scales, True

    def dequantized(self) -> torch.Tensor:
        return _dequantized(self.qweight, self.scales, self.bits, self.rows, self.panels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.quant_embedding(
                ids.reshape(-1), self.qweight, self.scales, self.bits, self.dtype, self.rows if self.panels else -1
            ).reshape(*ids.shape, -1)
        if self.panels:  # (kernels turned off after packing: slow, but the same numbers)
            return self.dequantized()[ids].to(self.dtype)
        rows = dequantize(self.qweight[ids.reshape(-1)], self.scales[ids.reshape(-1)], self.bits)
        return rows.to(self.dtype).reshape(*ids.shape, -1)


def quantizable(linear: nn.Module) -> bool:
    return type(linear) is nn.Linear and linear.in_features % GROUP == 0 and linear.weight.device.type == "cpu"


def quantize_model(model: nn.Module, bits: int) -> int:
    """Replace every quantizable nn.Linear by a QuantLinear of `bits`, except the lm_head, which
    gets int8 (as llama.cpp keeps the output layer above 4 bits: it decides every token). A tied
    embedding table becomes a QuantEmbedding sharing the lm_head's quantized buffers."""
    count = 0
    head = getattr(model, "lm_head", None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if quantizable(child):
                setattr(parent, name, QuantLinear.from_linear(child, 8 if child is head else bits))
                count += 1
    split = getattr(getattr(model, "tp", None), "size", 1) > 1  # the lm_head is a vocab slice, not the table
    if getattr(model, "tie_word_embeddings", False) and isinstance(model.lm_head, QuantLinear) and not split:
        head = model.lm_head
        model.embed_tokens = QuantEmbedding(head.qweight, head.scales, head.bits, model.embed_tokens.weight.dtype)
    return count


def pack_quantized(model: nn.Module) -> int:
    """Repack every QuantLinear's codes into output panels where the kernels run them that way
    (builds with AVX2 + FMA + F16C: csrc/quant_panels.cpp); a tied embedding table then reads the
    LM head's panels (one copy). TOKENMILL_QUANT_PANELS=0 keeps the rows. Returns the layers packed."""
    kernels = cpu_kernels.load() if cpu_kernels.enabled() else None
    if kernels is None or not hasattr(kernels, "quant_panel_linear") or not envs.TOKENMILL_QUANT_PANELS:
        return 0
    packed: dict[int, tuple[torch.Tensor, QuantLinear]] = {}  # the old codes' address -> (them, the layer)
    for m in model.modules():
        if isinstance(m, QuantLinear) and not m.panels and m.qweight.device.type == "cpu":
            old = m.qweight
            m.to_panels()
            packed[old.data_ptr()] = old, m
    for m in model.modules():
        if isinstance(m, QuantEmbedding) and not m.panels and m.qweight.data_ptr() in packed:
            m.share_panels(packed[m.qweight.data_ptr()][1])
    if packed:
        amx = ""
        if hasattr(kernels, "set_quant_amx_rows"):
            rows = AMX_ROWS[cpu_kernels.batch_invariant()]
            kernels.set_quant_amx_rows(rows)
            if kernels.quant_panels_amx(rows):
                amx = f"; steps of {rows}+ rows on AMX tiles, the panels dequantized to bf16"
        logger.info("int4 / int8 linears: %d in output panels (int8 activations%s)", len(packed), amx)
    return len(packed)


def check_w8a8_args(method: str | None, calibration: str | None, enable_lora: bool) -> None:
    """What --quantization w8a8 cannot be combined with, refused before the model loads."""
    if calibration and method != "w8a8":
        raise ValueError("--quantization-calibration is for --quantization w8a8")
    if method == "w8a8" and enable_lora:  # the smoothing rescales the inputs the adapters' A matrices read
        raise ValueError("--enable-lora is not supported with --quantization w8a8")


def check_quantization(method: str | None) -> str | None:
    if method in (None, "", "none"):
        return None
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    return method
