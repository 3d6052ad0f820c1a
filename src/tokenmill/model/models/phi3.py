"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's decoder as the checkpoint already fuses it.

The checkpoint stores qkv_proj and gate_up_proj fused, in the row order our Llama layers use
(q, k, v; gate, up), so its tensors load as they are. What differs is the rotary embedding, which
layers/rotary.py handles from the config: partial rotary (partial_rotary_factor: Phi-4-mini turns
the first 3/4 of each head) and LongRoPE scaling (short / long factors, attention factor).
"""

from __future__ import annotations

import logging

import torch

from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.model.models.llama import LlamaForCausalLM

logger = logging.getLogger("tokenmill")


class Phi3ForCausalLM(LlamaForCausalLM):
    ARCHITECTURES = {"Phi3ForCausalLM": False}
    # Tested op by op: the fused decode step turns whole heads; tensor parallelism and LoRA would
    # have to split the checkpoint's fused qkv / gate_up tensors.
    SUPPORTS_FUSED_DECODE = False
    SUPPORTS_TENSOR_PARALLEL = False
    SUPPORTS_LORA = False

    def __init__(self, cfg, dtype: torch.dtype, max_position: int, tp: TPGroup = NO_TP):
        window = getattr(cfg, "sliding_window", None)
        if window and max_position > window:
            # transformers masks keys more than `window` back; our attention does not, so a longer
            # context would diverge from the model's own outputs.
            raise ValueError(f"{cfg.architectures[0]} attends a sliding window of {window} tokens, which this engine "
                             f"does not implement for it yet; serve it with --max-model-len {window} or less")
        super().__init__(cfg, dtype, max_position, tp)
