"""W8A8 linear layers (`--quantization w8a8`): int8 weights and int8 activations, int32 sums.

Weights: int8 per output row (symmetric: w ~ q * sw[n], q in -127..127, sw = max|w[n]| / 127),
packed once in panels of 16 rows for the C++ kernel (csrc/w8a8.cpp). Activations: quantized
per token at every call (asymmetric 8 bits: x ~ (u - z) * sx, u in 0..255, the zero point z
placing 0 exactly), inside the kernel in one pass over the row. The matmul sums u * q in int32,
exactly, and rescales in float32:

    y[m, n] = float(sum_k u[m, k] q[n, k] - z[m] * sum_k q[n, k]) * (sx[m] * sw[n]) + bias[n]

Integer sums are exact, so a row's result never depends on the rest of the batch or on the
instruction set that computed it. SmoothQuant's factors (model/smoothquant.py) are folded into
the weights before they are quantized here. Without the C++ kernels a pure-torch path computes
the same integers (in float64, exact) and the same epilogue.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers.bind import kernels_for

PANEL, QUAD = 16, 4  # the packed layout: panels of 16 output rows, inputs in groups of 4


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 q [N, K], float32 scales [N]): symmetric per output row."""
    wf = w.detach().float()
    amax = wf.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = (wf / scale.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, K] -> (uint8 u [M, K], float32 scale [M], int32 zero point [M]), the float32 operations
    of the C++ kernel's quantize_row one for one: lo = min(x, 0), hi = max(x, 0), d = hi - lo,
    s = d * c with c = 1 / 255, inv = 1 / s (all in float32), z = round(-lo * inv),
    u = clamp(round(x * inv) + z, 0, 255), rounding half to even; s = inv = 1 for an all-zero row."""
    xf = x.float()
    lo, hi = xf.amin(1).clamp_max(0), xf.amax(1).clamp_min(0)
    d = hi - lo
    c = torch.tensor(1 / 255, dtype=torch.float32)
    s = d * c
    ok = (s > 0) & torch.isfinite(s)
    s = torch.where(ok, s, torch.ones_like(s))
    inv = torch.where(ok, 1 / s, torch.ones_like(s))
    z = (-lo * inv).round()
    u = ((xf * inv.unsqueeze(1)).round() + z.unsqueeze(1)).clamp_(0, 255)
    return u.to(torch.uint8), s, z.to(torch.int32)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [ceil(N/16), ceil(K/4), 16, 4] (zero-padded): the kernel's panels."""
    N, K = q.shape
    Np, Kp = -(-N // PANEL) * PANEL, -(-K // QUAD) * QUAD
    padded = F.pad(q, (0, Kp - K, 0, Np - N))
    return padded.view(Np // PANEL, PANEL, Kp // QUAD, QUAD).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The int8 [N, K] weight a pack() result holds."""
    P, KQ = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(P * PANEL, KQ * QUAD)[:N, :K]


def reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in torch: the integer sums exactly (float64), the same epilogue."""
    u, sx, zx = quantize_activations(x)
    acc = (u.double() @ q.double().T).to(torch.int64) - zx.long().unsqueeze(1) * q.long().sum(1).unsqueeze(0)
    y = acc.float() * (sx.unsqueeze(1) * w_scale.unsqueeze(0))
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


@functools.cache
def _fused_silu(ops) -> bool:
    # AVX-512 builds only: there silu_and_mul's row function takes the same instructions for every
    # element (masked tails), so 16 outputs at a time give the whole row's bits.
    return hasattr(ops, "w8a8_linear_silu_mul") and ops.w8a8_isa() in ("amx-int8", "avx512-vnni")


class W8A8Linear(nn.Module):
    """A linear layer with int8 weights (per output row) run on per-token int8 activations. `ops`:
    the kernels (those for its weights' device when made, then bound at load: layers/bind.py;
    None: the torch path); `fuses_silu`: whether silu_and_mul runs in the kernel's epilogue."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        """weight: float (quantized here, per row), or int8 with its per-row float32 `scale` (a
        pre-quantized checkpoint's values, kept as they are)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if scale is None:
            q, scale = quantize_weight(weight)
        else:
            q, scale = weight.to(torch.int8), scale.detach().float().reshape(-1)
        self.register_buffer("packed", pack(q), persistent=False)
        self.register_buffer("w_scale", scale.contiguous(), persistent=False)
        self.register_buffer("rowsum", q.sum(1, dtype=torch.int32), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self.bind_kernels(kernels_for(weight.device))

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        self.ops = ops
        self.fuses_silu = ops is not None and not self.out_features % 32 and _fused_silu(ops)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> W8A8Linear:
        return cls(linear.weight, linear.bias)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> W8A8Linear:
        """int8 [N, K] weights and float [N] scales as stored (w ~ q * scale[n]), used as they are."""
        return cls(q, bias, scale)

    def weight_int8(self) -> torch.Tensor:
        return unpack(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.ops is not None:
            y = self.ops.w8a8_linear(x2, self.packed, self.w_scale, self.rowsum, self.bias, self.out_features)
        else:  # no C++ kernels: the same integers and epilogue in torch (slow)
            y = reference(x2, self.weight_int8(), self.w_scale, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate/up projection (gate's rows first): silu(gate) * up computed in the
        kernel's epilogue, the bits of forward() then silu_and_mul, without writing the [T, 2 I]
        product (~8% of a W8A8 prompt step on SmolLM2 went to that pass). None where the kernel
        cannot (no AVX-512 build, I not a multiple of 16: fuses_silu): the caller runs the two ops."""
        if not self.fuses_silu:
            return None
        x2 = x.reshape(-1, self.in_features)
        y = self.ops.w8a8_linear_silu_mul(x2, self.packed, self.w_scale, self.rowsum, self.bias, self.out_features)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features // 2)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"
