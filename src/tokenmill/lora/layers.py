"""The step's adapter slots beside the base linears, and the LoRA delta they add.

Every adaptable linear (each layer's qkv, o, gate_up and down projections) gets `max_loras`
slots of stacked weights: A [slots, slices, max_rank, in], Bt [slots, max_rank, out] and the
rank of each slot's slices [slots, slices] (0: not adapted). An adapter a step needs is copied
into a slot (the least recently used one not in the step when none is free); each row of the
step carries its request's slot (-1: the base model), and the kernel adds, per row,
(x A_slot^T) Bt_slot onto the base output: the batched shrink / expand of Punica's BGMV, in
the engine's C++ kernel on the CPU (csrc/lora.h: every row alike, batch-invariant) and in
plain torch per adapter elsewhere. Weights are never merged into the base model, so one step
mixes any adapters and the base model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.lora.adapter import LINEARS, LoRAAdapter, linear_shapes
from tokenmill.model.layers.bind import bind_kernels

logger = logging.getLogger("tokenmill")


@dataclass
class SlotWeights:
    """One linear's slots: A [S, slices, r, in], Bt [S, r, out], ranks [S, slices] int32, bounds [slices + 1]."""

    A: torch.Tensor
    Bt: torch.Tensor
    ranks: torch.Tensor
    bounds: torch.Tensor
    ranks_host: torch.Tensor  # a CPU copy (the torch path reads ranks without a device sync)
    bounds_host: list[int]
    ops: object = None  # the kernels, bound with the model (LoRALinear.bind_kernels); None: torch

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots) -> None:
        if self.ops is not None:
            self.ops.lora_add(y, x.contiguous(), self.A, self.Bt, self.ranks, self.bounds, slots.row_slots)
        else:
            lora_add_torch(y, x, self, slots.groups())

    def spec(self) -> tuple:
        return self.A, self.Bt, self.ranks, self.bounds


def lora_add_torch(y: torch.Tensor, x: torch.Tensor, w: SlotWeights, groups: list[tuple[int, torch.Tensor]]) -> None:
    """The same delta in torch ops, one matmul pair per (adapter, slice) in the step (GPU, CPUs
    without the kernels): float32 inside, added to y and rounded once, as the kernel does.
    groups: (slot, its rows) of the step, made once per step on the host (no device syncs here)."""
    bounds = w.bounds_host
    for slot, rows in groups:
        xs = x[rows].float()
        for i, r in enumerate(w.ranks_host[slot].tolist()):
            if r:
                c0, c1 = bounds[i], bounds[i + 1]
                h = xs @ w.A[slot, i, :r].float().t()
                y[rows, c0:c1] = (y[rows, c0:c1].float() + h @ w.Bt[slot, :r, c0:c1].float()).to(y.dtype)


class LoRALinear(nn.Module):
    """A base linear plus the step's adapters' deltas (nothing added when no row has an adapter)."""

    def __init__(self, base_layer: nn.Module, slots: LoRASlots, weights: SlotWeights):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = weights.A.shape[-1], weights.Bt.shape[-1]
        self._slots, self._w = slots, weights  # plain attributes: not the model's parameters

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        self._w.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self._slots.row_slots is not None:
            self._w.add_delta(y.view(-1, self.out_features), x.reshape(-1, self.in_features), self._slots)
        return y


def unadaptable_module(model: nn.Module) -> str | None:
    """The first of the linears the slots take (each layer's self_attn.qkv_proj / o_proj, mlp.gate_up_proj /
    down_proj: LINEARS) that is missing or not the shared nn.Linear, named, or None. A family built
    from the shared attention and MLP blocks takes adapters whatever else it changes."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return "the model (no decoder layers)"
    for i, layer in enumerate(layers):
        for name in LINEARS:
            sub = "self_attn" if name in ("qkv_proj", "o_proj") else "mlp"
            parent = getattr(layer, sub, None)
            module = getattr(parent, name, None)
            if not isinstance(module, nn.Linear):
                return (
                    f"layers.{i}.{sub} ({type(parent).__name__}) has no {name} linear"
                    if module is None
                    else f"layers.{i}.{sub}.{name} is a {type(module).__name__}, not a linear"
                )
    return None


def check_adaptable(model: nn.Module) -> None:
    """Refuses --enable-lora for a model whose adaptable linears are not the shared ones, naming the first."""
    what = unadaptable_module(model)
    if what is not None:
        raise ValueError(f"--enable-lora is not supported for {type(model).__name__} yet: {what}")


class LoRASlots:
    """max_loras slots in every adaptable linear of the model, and which adapter each slot holds."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.num_slots, self.max_rank = max_loras, max_rank
        shapes = linear_shapes(model)
        self.weights: dict[tuple[int, str], SlotWeights] = {}
        for l, layer in enumerate(model.layers):
            for name in LINEARS:
                parent = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
                shape = shapes[name]
                n = len(shape.slices)
                w = SlotWeights(
                    torch.zeros(max_loras, n, max_rank, shape.in_features, dtype=dtype, device=device),
                    torch.zeros(max_loras, max_rank, shape.out_features, dtype=dtype, device=device),
                    torch.zeros(max_loras, n, dtype=torch.int32, device=device),
                    torch.tensor(shape.bounds, dtype=torch.int64, device=device),
                    torch.zeros(max_loras, n, dtype=torch.int32),
                    shape.bounds,
                )
                self.weights[(l, name)] = w
                setattr(parent, name, LoRALinear(getattr(parent, name), self, w))
        # Bound again with the slots in: their delta's kernel, and the MLPs' gate/up projections now
        # wrapped (no activation in an epilogue: the delta adds to the projection's output first).
        bind_kernels(model, device, dtype)
        self.holds: list[int | None] = [None] * max_loras  # adapter uid per slot
        self._last_used = [0] * max_loras
        self._clock = 0
        self.row_slots: torch.Tensor | None = None  # the running step's (set by the runner)
        self._groups: tuple[torch.Tensor, list] | None = None  # (row_slots, its groups), made on first use
        nbytes = sum(w.A.nbytes + w.Bt.nbytes for w in self.weights.values())
        logger.info(
            "LoRA: %d slots of rank <= %d in %d linears (%.1f MB)", max_loras, max_rank, len(self.weights), nbytes / 1e6
        )

    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """The step's (slot, row indices on the device) for the torch path, made once per step."""
        rows = self.row_slots
        if self._groups is None or self._groups[0] is not rows:
            host = rows.cpu()
            found = [
                (s, (host == s).nonzero().squeeze(1).to(rows.device)) for s in torch.unique(host).tolist() if s >= 0
            ]
            self._groups = (rows, found)
        return self._groups[1]

    def specs(self) -> list[tuple]:
        """Each layer's qkv, o, gate_up and down slot weights, in order (the fused step's set_lora)."""
        return [w.spec() for w in self.weights.values()]

    def step_rows(self, scheduled) -> torch.Tensor | None:
        """The slot of every row of a step (its requests' rows in order; -1 for the base model), with
        the step's adapters placed in slots; None when no request of the step has an adapter."""
        if not any(s.request.lora is not None for s in scheduled):
            return None
        self._clock += 1
        wanted = {s.request.lora.uid: s.request.lora for s in scheduled if s.request.lora is not None}
        if len(wanted) > self.num_slots:  # the scheduler keeps a step to max_loras adapters
            raise RuntimeError(f"a step with {len(wanted)} LoRA adapters, above --max-loras {self.num_slots}")
        slot_of = {uid: self.holds.index(uid) for uid in wanted if uid in self.holds}
        for uid, adapter in wanted.items():
            if uid not in slot_of:
                free = [i for i, u in enumerate(self.holds) if u is None]
                slot = (
                    free[0]
                    if free
                    else min((i for i, u in enumerate(self.holds) if u not in wanted), key=self._last_used.__getitem__)
                )
                self._load(slot, adapter)
                slot_of[uid] = slot
        rows: list[int] = []
        for s in scheduled:
            slot = slot_of[s.request.lora.uid] if s.request.lora is not None else -1
            if slot >= 0:
                self._last_used[slot] = self._clock
            rows.extend([slot] * s.num_new_tokens)
        return torch.tensor(rows, dtype=torch.int32)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        with torch.no_grad():
            for w in self.weights.values():
                w.ranks[slot] = 0
                w.ranks_host[slot] = 0
            for key, parts in adapter.weights.items():
                w = self.weights[key]
                bounds = w.bounds_host
                for i, a, bt in parts:
                    r = a.shape[0]
                    w.A[slot, i, :r].copy_(a)
                    w.Bt[slot, :r, bounds[i] : bounds[i + 1]].copy_(bt)
                    w.ranks[slot, i] = r
                    w.ranks_host[slot, i] = r
        self.holds[slot] = adapter.uid
