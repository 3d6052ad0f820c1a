"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's decoder as the checkpoint already fuses it.

The checkpoint stores qkv_proj and gate_up_proj fused, in the row order our Llama layers use
(q, k, v; gate, up). load_weights splits them into Llama's q/k/v and gate/up, so that under
tensor parallelism each rank keeps its own heads and rows of each. What differs is the rotary
embedding, which layers/rotary.py handles from the config: partial rotary (partial_rotary_factor: Phi-4-mini turns
the first 3/4 of each head) and LongRoPE scaling (short / long factors, attention factor). A
config's sliding_window is every layer's, as Mistral's (models/llama.py sliding_windows).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tokenmill.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    ARCHITECTURES = {"Phi3ForCausalLM": False}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj, each cut to this rank's share (whole
        heads; the loader reads these tensors whole, as it cannot slice a fused one)."""
        attn, rank, size = self.layers[0].self_attn, self.tp.rank, self.tp.size
        q, kv = attn.q_size * size, attn.kv_size * size  # the whole model's
        for name, w in weights:
            if ".qkv_proj." in name:
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv])):
                    yield name.replace("qkv_proj", proj), part.chunk(size)[rank]
            elif ".gate_up_proj." in name:
                for proj, part in zip(("gate_proj", "up_proj"), w.chunk(2)):
                    yield name.replace("gate_up_proj", proj), part.chunk(size)[rank]
            else:
                yield name, w
