"""Sparse mixture-of-experts FFN block (Mixtral, Qwen2-MoE, Qwen3-MoE), over a flat token batch.

The router scores every expert per token; each token goes to its top-k experts and their
outputs are summed with the routing weights: softmax over all experts, then the top k, then
(Mixtral always, Qwen with norm_topk_prob) renormalised to sum to one. Qwen2-MoE adds a shared
expert, a plain MLP every token goes through, scaled by sigmoid(shared_expert_gate(x)).

The experts live in two stacked tensors, w13 [E, 2I, H] (each expert's gate rows, then its up
rows: transformers' gate_up_proj) and w2 [E, H, I]. On the CPU they run in one C++ call
(csrc/moe.cpp): tokens grouped by expert, each expert's weights read once per step over all the
rows routed to it, the results scatter-added back in a fixed order (batch-invariant). Elsewhere
(no kernels, a GPU) the torch path loops over the experts that have rows, never over tokens.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.model.sharding import sharding_rule


class Router(nn.Module):
    """The router's [E, H] weight. Not an nn.Linear, so that --quantization and the packed-linear
    pass leave it as loaded: a few bits off in its logits can send a token to another expert."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], int32 expert ids [T, k]): softmax in float32, top k, optionally
    renormalised (which for Mixtral equals a softmax over the top-k logits)."""
    weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


class Experts(nn.Module):
    """E SwiGLU experts stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; `ops`:
    the kernels bound at load (layers/bind.py; None: the torch loop)."""

    ops = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        self.ops = ops

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights float32 [T, k]; ids int32 [T, k] -> [T, H] in x's dtype."""
        ops = self.ops
        if ops is not None:
            return ops.moe_experts(x, self.w13, self.w2, ids, weights)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return experts_dense(x, self.w13, self.w2, ids, weights)
        return experts_reference(x, self.w13, self.w2, ids, weights)


def experts_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Every expert over every row, then each row's top-k gathered: no host sync and fixed shapes,
    so a CUDA graph can hold it (decode steps, a few rows: every expert's weights are read anyway)."""
    T, k = ids.shape
    gate, up = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
    y = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))  # [E, T, H]
    picked = y[ids.long(), torch.arange(T, device=x.device).unsqueeze(1)]  # [T, k, H]
    return _weighted_slot_sum(picked, weights, x.dtype)


def _weighted_slot_sum(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T, k, H] (each row's k experts' outputs) times their routing weights, summed in float32
    in slot order, as the kernel sums."""
    out = (y.float() * weights.unsqueeze(-1)).unbind(1)
    total = out[0]
    for part in out[1:]:
        total = total + part
    return total.to(dtype)


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The experts in torch, one expert at a time over the rows routed to it (a loop over the
    experts, never the tokens); the products sum in float32 in slot order, as the kernel's do."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    y = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        gate, up = F.linear(x[rows // k], w13[e]).chunk(2, dim=-1)
        y[rows] = F.linear(F.silu(gate) * up, w2[e])
        start += n
    return _weighted_slot_sum(y.view(T, k, -1), weights, x.dtype)


@sharding_rule(
    "every expert's intermediate rows split (gate/up rows, down columns), the router replicated; "
    "the experts' partial sums all-reduced",
    covers=("gate", "experts", "shared_expert_gate"),
)
class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert). round_weights: the routing weights
    rounded to the model's dtype before use (what Qwen's transformers code does). Under tensor
    parallelism (`tp`) each rank holds a slice of every expert's intermediate dimension: its down
    projection's output is a partial sum, all-reduced; the router runs whole on every rank (the
    same input, the same experts), the shared expert (an MLP) splits and reduces as every MLP."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        round_weights: bool = False,
        shared_expert: nn.Module | None = None,
        tp: TPGroup = NO_TP,
    ):
        super().__init__()
        self.top_k, self.renormalize, self.round_weights = top_k, renormalize, round_weights
        self.tp = tp
        self.gate = Router(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, intermediate_size // tp.size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# Per-expert checkpoint names: Mixtral's w1 / w3 / w2, Qwen's gate_proj / up_proj / down_proj.
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


def expert_target(name: str, model: nn.Module) -> tuple[str, tuple[int, int] | None] | None:
    """An expert tensor's (parameter, (first row, rows) of the parameter with its leading dims
    flattened), or None for other names. Takes per-expert tensors (the Hub's checkpoints) and the
    stacked gate_up_proj / down_proj that transformers >= 5 holds in memory."""
    m = _EXPERT.match(name)
    if m is not None:
        experts: Experts = model.get_submodule(m.group(1))
        e, part = int(m.group(2)), _PART[m.group(3)]
        inter, hidden = experts.intermediate, experts.hidden_size
        if part == 2:
            return f"{m.group(1)}.w2", (e * hidden, hidden)
        return f"{m.group(1)}.w13", (e * 2 * inter + part * inter, inter)
    for stacked, ours in ((".experts.gate_up_proj", ".experts.w13"), (".experts.down_proj", ".experts.w2")):
        if name.endswith((stacked, stacked + ".weight")):
            return name[: name.rindex(stacked)] + ours, None
    return None
