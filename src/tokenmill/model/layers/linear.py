"""CPU linear layers with weights pre-packed for oneDNN.

torch's bfloat16 F.linear re-lays out the weight on every call; packing it once at load time
(the layout oneDNN's AMX kernels read) is 1.3-2x faster for decode-sized batches and no slower
for prefill, with bit-identical results.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from tokenmill.model.layers import cpu_kernels

logger = logging.getLogger("tokenmill")

_BATCH_HINT = 64  # oneDNN picks the packed layout for this batch size; any size still works


SMALL_BATCH = 16  # rows up to which the engine's kernel beats oneDNN's packed GEMM on a plain weight


class PackedLinear(nn.Module):
    """oneDNN-packed bf16 linear. `plain_weight`: the unpacked weight, when kept (see
    pack_linears): batches of up to 16 rows then read it in place with the engine's GEMV-style
    kernel, which streams weights at 23-29 GB/s where oneDNN's packed GEMM reaches ~14 at
    batch 1 (measured on 2 cores, 30 layers of SmolLM2 shapes); larger batches keep oneDNN."""

    def __init__(self, linear: nn.Linear, plain_weight: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.plain_weight = plain_weight  # not a buffer: it belongs to the module that owns it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain_weight is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH:
            y = cpu_kernels.load().quant_linear(x, self.plain_weight, _NO_SCALES, 16)
            return y if self.bias is None else y + self.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


_NO_SCALES = torch.empty(0, dtype=torch.float16)


# Keep every linear's plain weight too (for the small-batch kernel) while that costs at most
# this much memory: 1 GiB, models up to ~0.5B parameters. TOKENMILL_PLAIN_WEIGHTS=1 / 0 forces it.
PLAIN_WEIGHTS_MAX_BYTES = 1 << 30


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap the model's bf16 CPU nn.Linear layers for PackedLinear when oneDNN can run them.
    A tied lm_head keeps its plain weight (the embedding table, in memory anyway); the other
    layers keep theirs while all of them together fit PLAIN_WEIGHTS_MAX_BYTES."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return 0
    if not _works():
        return 0
    embedding_tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = [(parent, name, child) for parent in list(model.modules()) for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"]
    small_batch_kernel = _small_batch_kernel_works()
    extra = sum(c.weight.numel() * c.weight.element_size() for _, _, c in linears if id(c.weight) not in embedding_tables)
    forced = os.environ.get("TOKENMILL_PLAIN_WEIGHTS")
    keep_all = small_batch_kernel and (forced == "1" or (forced != "0" and extra <= PLAIN_WEIGHTS_MAX_BYTES))
    for parent, name, child in linears:
        keep = keep_all or (id(child.weight) in embedding_tables and small_batch_kernel)
        setattr(parent, name, PackedLinear(child, child.weight.detach() if keep else None))
    if keep_all:
        logger.info("bf16 linears: oneDNN-packed, and plain weights kept for batches of <= %d rows (+%.0f MB)",
                    SMALL_BATCH, extra / 1e6)
    return len(linears)


def _small_batch_kernel_works() -> bool:
    """The engine's bf16-weight kernel needs the C++ kernels built with AVX512-BF16."""
    kernels = cpu_kernels.load() if cpu_kernels.enabled() else None
    if kernels is None:
        return False
    try:
        w, x = torch.randn(8, 64).bfloat16(), torch.randn(3, 64).bfloat16()
        # The result is rounded to bf16: compare within its relative precision.
        return torch.allclose(kernels.quant_linear(x, w, _NO_SCALES, 16).float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2)
    except RuntimeError:  # built without AVX512-BF16
        return False


def _works() -> bool:
    try:
        lin = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        return torch.allclose(PackedLinear(lin)(x).float(), lin(x).float(), atol=1e-2)
    except Exception as e:  # noqa: BLE001 - no oneDNN bf16 support here: plain nn.Linear it is
        logger.info("oneDNN packed linear unavailable: %s", e)
        return False
