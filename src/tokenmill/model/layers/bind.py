"""Kernels bound once, at load: the transform that gives each module the C++ kernels it runs.

A module whose forward has a kernel path keeps the kernel module it runs in an attribute (`ops`,
None: its torch forward) and has a `bind_kernels(ops, epilogues=True)` method that sets it, and
any decision that follows from it alone (whether a fused gate/up projection computes the
activation in its epilogue, which paths a quantized layer takes). bind_kernels(model, device,
dtype) walks the model's modules, children before their parents (a block's choice may depend on
its children's), and calls each one's method with the kernels for that device and dtype: the
decision cpu_kernels.ops_for(x) made on every call (a CPU tensor in float32 / bfloat16, the
kernels on and loaded), made once. Forward code never asks which kernels exist; a branch that
depends on the input itself (rows above a threshold, a tensor that is not contiguous) stays.

The loader binds a model after its other transforms (quantize_model, pack_linears,
pack_quantized); a transform that swaps modules after it (LoRA's slots) binds again. Modules
built on their own start unbound (the torch forward), except the kernel-backed linears a
transform builds (PackedLinear, QuantLinear, QuantEmbedding, W8A8Linear), which take the kernels
for their weights' device when made; a test binds a module itself (`module.bind_kernels(ops)`,
None for the torch path).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tokenmill.kernels import cpu_kernels

FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # what the float kernels take (cpu_kernels.ops_for)


def kernels_for(device: torch.device | str, dtype: torch.dtype | None = None):
    """The C++ kernel module for tensors on `device` in `dtype` (None: any dtype), or None: off the
    CPU, for other dtypes, with TOKENMILL_NO_CPP_KERNELS=1 or when the kernels are unavailable."""
    if torch.device(device).type != "cpu" or (dtype is not None and dtype not in FLOAT_DTYPES):
        return None
    return cpu_kernels.load() if cpu_kernels.enabled() else None


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


def bind_kernels(model: nn.Module, device: torch.device | str, dtype: torch.dtype, epilogues: bool = True) -> int:
    """Bind every module of `model` that has a kernel path to the kernels for `device` and `dtype`
    (the model's activations). epilogues=False: no fused gate/up projection computes its activation
    in its epilogue (the projection's own forward runs, where forward hooks see it: a reference
    model that watches each linear). Returns the modules bound."""
    ops = kernels_for(device, dtype)
    count = 0
    for module in _children_first(model):
        bind = getattr(module, "bind_kernels", None)
        if bind is not None:
            bind(ops, epilogues)
            count += 1
    return count
