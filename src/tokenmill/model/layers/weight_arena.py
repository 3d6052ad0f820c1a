"""The weights a small-batch decode step streams, laid out in one buffer on huge pages.

A batch-1 decode step reads every weight once, so it runs at the speed memory streams them.
Allocated one tensor at a time on 4 KiB pages, SmolLM2's weights streamed ~1.15-1.25x slower
than the same bytes in one buffer in the order a step reads them, and ~1.2-1.45x slower than
that buffer on transparent huge pages (2 MiB: a TLB entry covers 512x more, so the stream
stops for page walks far less often), measured on the fused decode step, 2 cores.

`place_decode_weights` copies the weights the small-batch kernels read (bf16 panels and int4 /
int8 blocks) into such an arena, in execution order, and points the layers at it. Where
the kernel does not do huge pages (transparent_hugepage "never", not Linux), the arena is still
one buffer in execution order.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.memory import huge_page_buffer
from tokenmill.model.layers.linear import PackedLinear
from tokenmill.model.layers.quantization import QuantEmbedding, QuantLinear

_ALIGN = 64  # each tensor starts on a cache line


def _decode_tensors(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every weight a small-batch step streams, in the order it reads them."""

    def of(m: nn.Module) -> list[tuple[nn.Module, str]]:
        if isinstance(m, PackedLinear) and m.panels is not None:
            return [(m, "panels")]
        if isinstance(m, (QuantLinear, QuantEmbedding)):  # a quantized table is a tied lm_head's
            return [(m, "qweight"), (m, "scales")]
        return []

    order: list[nn.Module] = []
    for layer in getattr(model, "layers", []):  # a layer's linears in the order it defines them (and runs them)
        order += list(layer.modules())
    order += [getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)]
    return [slot for m in order if m is not None for slot in of(m)]


def place_decode_weights(model: nn.Module) -> int:
    """Move the weights small-batch steps stream into one huge-page arena, in the order a step
    reads them (a tied quantized table once, shared as before). Returns the bytes moved."""
    slots = _decode_tensors(model)
    # Keyed by storage, not by tensor object: a tied quantized table is shared by the embedding
    # and the lm_head, and stays one copy.
    unique: dict[tuple, torch.Tensor] = {}
    for m, name in slots:
        t = getattr(m, name)
        if t.device.type == "cpu" and t.is_contiguous():
            unique.setdefault(_key(t), t)
    offsets, total = {}, 0
    for key, t in unique.items():
        offsets[key] = total
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if total == 0:
        return 0
    arena = huge_page_buffer(total)
    moved: dict[tuple, torch.Tensor] = {}
    for key, t in unique.items():
        nbytes = t.numel() * t.element_size()
        moved[key] = arena[offsets[key] : offsets[key] + nbytes].view(t.dtype).view(t.shape)
        moved[key].copy_(t)
    for m, name in slots:
        view = moved.get(_key(getattr(m, name)))
        if view is not None:
            setattr(m, name, view)
    return total


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.numel() * t.element_size(), t.dtype, tuple(t.shape)
