"""The GPU attention backend: the Triton paged-attention kernels (triton_attention.py) behind the
same interface as the CPU backend (attention.py), so the model code does not know which runs.

Its metadata is the varlen view of a flat batch (vLLM's): every request, decode row or prompt
chunk alike, is `query_start_loc[i]:query_start_loc[i+1]` of the batch with `seq_lens[i]` keys
read through `block_tables[i]`. An all-decode batch takes the split-K decode kernel (and is what
CUDA graphs capture: cuda_graphs.py); any other batch one varlen prefill launch per layer.

Also runs on CPU tensors under TRITON_INTERPRET=1 (`TOKENMILL_ATTENTION_BACKEND=triton`), which is
how CI tests this path without a GPU.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import triton_attention as kernels
from tokenmill.model.layers.attention import AttentionMetadata, LayerAttention, SeqChunk, layer_params, write_quantized


class TritonAttentionBackend:
    name = "triton"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_scales: torch.Tensor | None = None,
        layers: list[LayerAttention] | None = None,
    ):
        # kv_cache: [num_layers, 2, num_slots, num_kv_heads, head_dim]; kv_scales (int8 / fp8 cache
        # only): [num_layers, 2, num_slots, num_kv_heads] float32. layers: how each layer attends.
        self.kv_cache, self.kv_scales = kv_cache, kv_scales
        self.layer_caches = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.params = layer_params(layers, kv_cache.shape[0], head_dim)  # per layer (window, softcap, scale)
        self.plain = all(p == (0, 0.0, self.scale) for p in self.params)
        self.kernels = None  # no C++ kernels: the model and the fused CPU step see a torch-only backend

    @staticmethod
    def build_metadata(seqs: list[SeqChunk], slots: list[int], block_size: int) -> AttentionMetadata:
        """Host tensors (the runner moves them to the device in one copy)."""
        lens = [c.start + c.n for c in seqs]
        width = max(-(-n // block_size) for n in lens)
        tables = [c.table[:width] + [0] * (width - len(c.table[:width])) for c in seqs]
        loc = [0]
        for c in seqs:
            loc.append(loc[-1] + c.n)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=block_size)
        meta.query_start_loc = torch.tensor(loc, dtype=torch.long)
        meta.seq_lens = torch.tensor(lens, dtype=torch.long)
        meta.block_tables = torch.tensor(tables, dtype=torch.long)
        meta.max_query_len = max(c.n for c in seqs)
        meta.all_decode = meta.max_query_len == 1
        return meta

    def fuses_rope(self, qkv: torch.Tensor) -> bool:
        return False

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] written at meta.slot_mapping first. Returns [T, H * D]."""
        k_cache, v_cache = self.layer_caches[layer]
        scales = ()
        if self.kv_scales is not None:
            scales = (self.kv_scales[layer, 0], self.kv_scales[layer, 1])
            for cache, scale_cache, x in ((k_cache, scales[0], k), (v_cache, scales[1], v)):
                write_quantized(cache, scale_cache, x, meta.slot_mapping)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        T = q.shape[0]
        window, softcap, scale = self.params[layer]
        if meta.all_decode:
            out = kernels.paged_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.block_size,
                scale,
                *scales,
                window=window,
                softcap=softcap,
            )
        else:
            out = kernels.paged_prefill_varlen(
                q,
                k_cache,
                v_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                meta.max_query_len,
                meta.block_size,
                scale,
                *scales,
                window=window,
                softcap=softcap,
            )
        return out.reshape(T, -1)
