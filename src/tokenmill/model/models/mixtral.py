"""Mixtral (MixtralForCausalLM): Llama's decoder with a sparse mixture of experts as every
layer's feed-forward block (layers/moe.py): top-k experts per token, softmax over their logits.

Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up)
and w2 (down); they load into the stacked expert tensors.
"""

from __future__ import annotations

from torch import nn

from tokenmill.distributed.comm import TPGroup
from tokenmill.model.layers.moe import SparseMoeBlock, expert_target
from tokenmill.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def check_silu(cfg) -> None:
    """The experts' kernel computes SwiGLU (silu(gate) * up), what these families use."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{type(cfg).__name__}: hidden_act {act!r} in a mixture of experts is not supported (silu is)")


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg, layer_idx: int, tp: TPGroup) -> nn.Module:
        check_silu(cfg)
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            renormalize=True,
            tp=tp,
        )


class MixtralForCausalLM(LlamaForCausalLM):
    ARCHITECTURES = {"MixtralForCausalLM": False}
    decoder_layer_cls = MixtralDecoderLayer

    def fused_target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_target(name, self) or super().fused_target(name)
