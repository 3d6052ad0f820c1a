"""Qwen3: Llama's decoder with an RMSNorm over each head of q and of k before rope.

QKNormAttention is the reusable part (Qwen3-MoE's attention is the same). The norms run on the
fused projection's output, so the C++ rope + K/V cache write kernel still applies after them.
"""

from __future__ import annotations

import torch

from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class QKNormAttention(LlamaAttention):
    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, tp: TPGroup = NO_TP):
        super().__init__(cfg, layer_idx, qkv_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def prepare_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        T, qs, kvs = qkv.shape[0], self.q_size, self.kv_size
        q = self.q_norm(qkv[:, :qs].reshape(-1, self.head_dim)).view(T, qs)
        k = self.k_norm(qkv[:, qs : qs + kvs].reshape(-1, self.head_dim)).view(T, kvs)
        return torch.cat((q, k, qkv[:, qs + kvs :]), dim=-1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention


class Qwen3ForCausalLM(LlamaForCausalLM):
    ARCHITECTURES = {"Qwen3ForCausalLM": False}  # q/k/v (and o) biases only with attention_bias
    decoder_layer_cls = Qwen3DecoderLayer
