"""Qwen2-MoE and Qwen3-MoE (Qwen2MoeForCausalLM, e.g. Qwen1.5-MoE-A2.7B; Qwen3MoeForCausalLM, e.g.
Qwen3-30B-A3B): in the sparse layers a mixture of experts (layers/moe.py) with routing weights
softmax over all experts, top k, renormalised only with norm_topk_prob. Qwen2-MoE: Qwen2's
attention (q/k/v biases) and a shared expert every token goes through, scaled by
sigmoid(shared_expert_gate(x)). Qwen3-MoE: Qwen3's attention (q/k norms), no shared expert.
A layer is sparse when it is not in mlp_only_layers and (layer + 1) is a multiple of
decoder_sparse_step; the others have a dense MLP of intermediate_size.
"""

from __future__ import annotations

from torch import nn

from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.model.layers.moe import SparseMoeBlock, expert_target
from tokenmill.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tokenmill.model.models.mixtral import check_silu
from tokenmill.model.models.qwen3 import QKNormAttention


def is_sparse(cfg, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (transformers' Qwen2-MoE / Qwen3-MoE rule)."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    shared_expert = True

    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, tp: TPGroup = NO_TP):
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"{type(cfg).__name__} with use_sliding_window is not supported yet")
        super().__init__(cfg, layer_idx, bool(getattr(cfg, "qkv_bias", qkv_bias)), tp)

    def make_mlp(self, cfg, layer_idx: int, tp: TPGroup) -> nn.Module:
        if not is_sparse(cfg, layer_idx):
            return LlamaMLP(cfg, tp)
        check_silu(cfg)
        size = getattr(cfg, "shared_expert_intermediate_size", 0) if self.shared_expert else 0
        # round_weights: transformers' Qwen code rounds the routing weights to the model's dtype
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
            round_weights=True,
            shared_expert=LlamaMLP(cfg, tp, intermediate_size=size) if size else None,
            tp=tp,
        )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    ARCHITECTURES = {"Qwen2MoeForCausalLM": True}  # Qwen2MoeConfig.qkv_bias decides (the layer reads it)
    decoder_layer_cls = Qwen2MoeDecoderLayer

    def fused_target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        return expert_target(name, self) or super().fused_target(name)


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = QKNormAttention
    shared_expert = False


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    ARCHITECTURES = {"Qwen3MoeForCausalLM": False}  # q/k/v (and o) biases only with attention_bias
    decoder_layer_cls = Qwen3MoeDecoderLayer
