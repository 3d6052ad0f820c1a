"""Weight-only quantization: int4 / int8 weights in groups of 32, run by the C++ CPU kernel.

The format is GGUF's: int4 stores per group of 32 inputs a float16 scale d and offset m with
w = q * d + m, q in 0..15 (Q4_1; Q4_0 is m = -8d), and byte j of a group packs elements j (low
nibble) and j + 16 (high nibble); int8 stores w = q * d (Q8_0). llama.cpp files therefore load
as they are (gguf_loader), and `--quantization int4|int8` quantizes an HF checkpoint at load
time the way llama.cpp's quantizer would (min/max for int4, absmax for int8).

Activations stay in the model's dtype (weight-only quantization): the kernel dequantizes a few
weight rows at a time into L1 and multiplies every input row by them, so each weight byte is
read once per step: a quarter (int4) or half (int8) of the bfloat16 traffic.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers import cpu_kernels
from tokenmill.model.layers.linear import onednn_bf16_fast

logger = logging.getLogger("tokenmill")

GROUP = 32
# Rows from which a step dequantizes each weight once and runs oneDNN's GEMM on it (prompt
# steps: the GEMM is compute-bound there and oneDNN's beats the engine's tile kernel; the
# copy costs a weight's bf16 size in memory traffic, small against 128+ rows of work).
LARGE_BATCH = 128
QUANTIZATION_METHODS = ("int4", "int8", "gguf", "w8a8")  # w8a8: layers/w8a8.py, model/smoothquant.py
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


class QuantLinear(nn.Module):
    """A linear layer with int4 / int8 weights; bias (if any) stays a float parameter."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.bits = bits
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * (2 if bits == 4 else 1)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int) -> "QuantLinear":
        qw, s = quantize(linear.weight, bits)
        return cls(qw, s, bits, linear.bias.detach() if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        ops = cpu_kernels.ops_for(x2)
        if ops is not None and x2.shape[0] >= LARGE_BATCH:  # prompt steps: oneDNN on a dequantized copy
            if x2.dtype == torch.bfloat16 and not onednn_bf16_fast():  # AVX2: its float32 GEMM, not its slow bf16
                y = F.linear(x2.float(), ops.dequantize_weight(self.qweight, self.scales, self.bits, torch.float32))
                y = y.to(x2.dtype)
            else:
                y = F.linear(x2, ops.dequantize_weight(self.qweight, self.scales, self.bits, x2.dtype))
        elif ops is not None:
            y = ops.quant_linear(x2, self.qweight, self.scales, self.bits)
        else:  # no C++ kernels: dequantize on the fly (slow, but the same numbers)
            y = F.linear(x2, dequantize(self.qweight, self.scales, self.bits).to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class QuantEmbedding(nn.Module):
    """Token embeddings read from an int4 / int8 table (shared with a tied lm_head)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype):
        super().__init__()
        self.bits, self.dtype = bits, dtype
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.load() if cpu_kernels.enabled() and ids.device.type == "cpu" else None
        if kernels is not None:
            return kernels.quant_embedding(ids.reshape(-1), self.qweight, self.scales, self.bits, self.dtype).reshape(
                *ids.shape, -1)
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
