"""Paged attention behind one small interface.

The model calls `backend.forward(layer_idx, q, k, v, meta)` with flat [T, heads, dim]
tensors; the backend writes the new K/V into the paged cache at `meta.slot_mapping` and
attends each request's queries to its keys read through its block table. The model never
sees the cache layout, so a GPU backend (flash-attn, FlashInfer) can replace this one.

CPU backend, batch-invariant (the default, bf16 with the C++ kernels): every query row of the
step, decode tokens, speculative verification chunks and prompt chunks alike, goes through one
call of the rows kernel (`paged_rows`, csrc/paged_decode.h), which computes each row exactly as
it computes a lone decode token at that position, reading K/V in place through the block tables:
a row's bits do not depend on the rest of the batch, on how its prompt was chunked, or on whether
its tokens came in one chunk or one per step. Where the CPU has AMX-BF16 the rows of a work item
share tile matrix products (csrc/paged_rows_amx.h: up to 16 (row, head) queries x 32 keys per
product, so a prompt's attention runs on the tile unit). Not batch-invariant (TOKENMILL_BATCH_INVARIANT=0,
float32, an int8 / fp8 cache): decode requests (one query token each) go through one C++ kernel call
that reads K/V in place through their block tables, split over the threads at small batches (a
pure-torch gather + SDPA when the kernels are unavailable); prompt chunks run one C++ kernel call
each (csrc/paged_prefill.cpp: causal, keys read in place through the block table, faster for long
prompts), or one SDPA call each without the kernels.

With an int8 or fp8 cache (`--kv-cache-dtype int8 | fp8`) each token's K and V are stored per kv
head as int8 (absmax / 127) or float8 e4m3 (absmax / 448) with one float32 scale, and dequantized
where they are read (in the kernels, a row at a time).

Each layer may attend its own way (`LayerAttention`, from the model): a sliding window (a query
sees only its last `sliding_window` keys, and no kernel reads a key before that, so the KV manager
may free those blocks: kv_cache.py), tanh soft-capping of the scores and its own scale
(Gemma). Every path, C++, Triton and torch, takes them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_kernels

KERNEL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # compiled in csrc/paged_attention.cpp


def index_tensor(values: list[int], *shape: int) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long), viewed as `shape` when given (rows, columns), at a
    third of its cost: the tensor takes an array's buffer as its memory, with no per-element type
    inference. A step builds several of these right after a forward that has evicted the caches,
    where torch.tensor's ~15 us each add up to a few percent of a batch-1 decode step."""
    if not values:
        return torch.empty(shape or (0,), dtype=torch.long)
    t = torch.frombuffer(array("q", values), dtype=torch.long)
    return t.view(shape) if shape else t


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends beyond causal softmax(q k^T * scale) v: each query sees its last
    `sliding_window` keys, itself included (transformers' sliding_window_overlay; None: all keys),
    scores become softcap * tanh(score / softcap) (Gemma 2; None: not capped), and `scale` (None:
    head_dim ** -0.5)."""

    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None


def layer_params(layers: list[LayerAttention] | None, num_layers: int, head_dim: int) -> list[tuple[int, float, float]]:
    """Per layer (window, softcap, scale) as the kernels take them: 0 for no window / no cap."""
    layers = layers or [LayerAttention()] * num_layers
    assert len(layers) == num_layers, f"{len(layers)} attention specs for {num_layers} layers"
    return [(spec.sliding_window or 0, float(spec.softcap or 0.0), spec.scale or head_dim**-0.5) for spec in layers]


def kv_window(layers: list[LayerAttention] | None) -> int | None:
    """The window beyond which no layer reads a key (the largest), or None when some layer reads
    every key: what the KV manager may free blocks by."""
    if not layers or any(spec.sliding_window is None for spec in layers):
        return None
    return max(spec.sliding_window for spec in layers)


@dataclass
class PrefillChunk:
    q_start: int  # rows of the flat batch
    q_end: int
    context_len: int  # tokens already in the cache before this chunk
    kv_slots: torch.Tensor | None  # [context_len + q_len] slots, only when context_len > 0
    block_table: torch.Tensor | None = None  # [ceil((context_len + q_len) / block_size)] int64 (C++ kernel)


@dataclass
class SeqChunk:
    """One request's part of a flat batch, as the runner lays it out (each backend builds its
    metadata from these)."""

    row0: int  # first row in the flat batch
    n: int  # query tokens this step
    start: int  # tokens already in the cache (the first query's position)
    table: list[int]  # the request's block table


@dataclass
class AttentionMetadata:
    """Everything attention needs about one flat batch; built once per step, used by all layers."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    # Decode group: rows with a single query token, attended together.
    decode_rows: torch.Tensor | None = None  # [Bd] row of each decode token in the flat batch (None: all_decode)
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] (padding -> null block 0)
    decode_seq_lens: torch.Tensor | None = None  # [Bd] keys per decode request, new token included
    block_size: int = 16
    prefills: list[PrefillChunk] | None = None
    all_decode: bool = False  # every row is a decode row, in order: skip the scatter
    # Varlen view (the GPU backend): request i is rows query_start_loc[i]:query_start_loc[i+1].
    query_start_loc: torch.Tensor | None = None  # [B + 1]
    seq_lens: torch.Tensor | None = None  # [B] keys per request, this step's included
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (padding -> null block 0)
    max_query_len: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The index tensors a device copy moves (decode group and varlen view)."""
        names = (
            "slot_mapping",
            "decode_rows",
            "decode_block_tables",
            "decode_seq_lens",
            "query_start_loc",
            "seq_lens",
            "block_tables",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


KV_QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the absmax maps to the type's largest value


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hkv, D] -> int8 / float8 e4m3 [T, Hkv, D] and float32 scales [T, Hkv] (symmetric, per
    token and head; int8 rounds to the nearest integer, e4m3 to the nearest of its values)."""
    top = KV_QUANT_MAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min_(1e-8).div_(top)
    y = (xf * scale.reciprocal().unsqueeze(-1)).clamp_(-top, top)  # x itself stays intact
    return (y.round_() if dtype == torch.int8 else y).to(dtype), scale


def write_quantized(cache: torch.Tensor, scale_cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """x [T, Hkv, D] quantized into an int8 / fp8 cache [slots, Hkv, D] and its scales at `slots` (torch ops)."""
    xq, xs = quantize_kv(x, cache.dtype)
    # index_copy_ has no float8 kernel on the CPU: the bytes are copied
    cache.view(torch.uint8).index_copy_(0, slots, xq.view(torch.uint8))
    scale_cache.index_copy_(0, slots, xs)


class AttentionBackend:
    name = "cpu"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        use_cpp_kernels: bool = True,
        kv_scales: torch.Tensor | None = None,
        batch_invariant: bool | None = None,
        layers: list[LayerAttention] | None = None,
    ):
        # kv_cache: [num_layers, 2, num_slots, num_kv_heads, head_dim]; kv_scales (int8 / fp8 cache
        # only): [num_layers, 2, num_slots, num_kv_heads] float32. layers: how each layer attends
        # (None: all plain causal).
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        # Each layer's K and V views, made once (indexing the cache costs a few us per call).
        self.layer_caches = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.params = layer_params(layers, kv_cache.shape[0], head_dim)  # per layer (window, softcap, scale)
        self.plain = all(p == (0, 0.0, self.scale) for p in self.params)  # what the fused step computes
        self.gqa = num_heads != num_kv_heads
        self.kernels = None
        if (
            use_cpp_kernels
            and kv_cache.device.type == "cpu"
            and kv_cache.dtype in (torch.float32, torch.bfloat16, *KV_QUANT_MAX)
            and head_dim in KERNEL_HEAD_DIMS
        ):
            self.kernels = cpu_kernels.load()
        if batch_invariant is None:
            batch_invariant = cpu_kernels.batch_invariant()
        # Every row through the rows kernel (csrc/paged_decode.h): a bf16 cache, the C++ kernels.
        self.batch_invariant = bool(
            batch_invariant
            and self.kernels is not None
            and hasattr(self.kernels, "paged_rows")
            and kv_cache.dtype == torch.bfloat16
            and kv_scales is None
        )
        # An int8 / fp8 cache's decode steps through the rows kernel where the decode kernel is the
        # portable loop (CPUs without AVX-512): the rows kernel has AVX2 code for every cache dtype
        # (1.4x a 2-thread decode step on SmolLM2 with a 256-token context).
        self.decode_by_rows = bool(
            kv_scales is not None
            and self.kernels is not None
            and hasattr(self.kernels, "paged_rows")
            and torch.backends.cpu.get_cpu_capability() != "AVX512"
        )

    @staticmethod
    def build_metadata(seqs: list[SeqChunk], slots: list[int], block_size: int) -> AttentionMetadata:
        """Decode rows grouped (one kernel call for all), each prompt chunk on its own; and the
        varlen view of every request (query_start_loc, seq_lens, block_tables, max_query_len),
        which the batch-invariant rows kernel and the fused step read. `seqs` in row order."""
        bs = block_size
        meta = AttentionMetadata(slot_mapping=index_tensor(slots), block_size=bs)
        decodes = [c for c in seqs if c.n == 1]
        meta.prefills = []
        for c in seqs:
            if c.n > 1:
                end = c.start + c.n
                kv_slots = _slots_for(c.table, end, bs) if c.start > 0 else None
                chunk_table = torch.tensor(c.table[: -(-end // bs)], dtype=torch.long)
                meta.prefills.append(PrefillChunk(c.row0, c.row0 + c.n, c.start, kv_slots, chunk_table))
        meta.all_decode = not meta.prefills
        if decodes:
            meta.decode_block_tables = _block_tables(decodes, -(-max(c.start + 1 for c in decodes) // bs))
            meta.decode_seq_lens = index_tensor([c.start + 1 for c in decodes])
            if not meta.all_decode:  # all decode: row i is decode row i, no scatter to index
                meta.decode_rows = index_tensor([c.row0 for c in decodes])
        meta.max_query_len = max((c.n for c in seqs), default=0)
        if meta.all_decode and decodes:  # the decode group is the varlen view already
            meta.query_start_loc = index_tensor(list(range(len(decodes) + 1)))
            meta.seq_lens, meta.block_tables = meta.decode_seq_lens, meta.decode_block_tables
        elif seqs:
            meta.block_tables = _block_tables(seqs, max(-(-(c.start + c.n) // bs) for c in seqs))
            meta.seq_lens = index_tensor([c.start + c.n for c in seqs])
            meta.query_start_loc = index_tensor([c.row0 for c in seqs] + [seqs[-1].row0 + seqs[-1].n])
        return meta

    def fuses_rope(self, qkv: torch.Tensor) -> bool:
        """Whether rope_and_cache can take this projection: the C++ kernels, and a cache in
        its dtype (an int8 / fp8 cache quantizes on write: the unfused path)."""
        return (
            self.kernels is not None
            and self.kv_scales is None
            and qkv.dtype == self.kv_cache.dtype
            and qkv.dtype in (torch.float32, torch.bfloat16)
        )

    def rope_and_cache(
        self,
        layer: int,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One kernel for what `rope` and forward's cache write do: rotates q and k, writes k
        and v at meta.slot_mapping; returns q [T, H, D]. Then call forward(layer, q, None, None, meta)."""
        return self.kernels.rope_and_cache(
            qkv, positions, cos, sin, *self.layer_caches[layer], meta.slot_mapping, self.num_heads, self.num_kv_heads
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D], or None when rope_and_cache has written them. Returns [T, H * D]."""
        k_cache, v_cache = self.layer_caches[layer]
        window, softcap, scale = self.params[layer]
        scales = None if self.kv_scales is None else (self.kv_scales[layer, 0], self.kv_scales[layer, 1])
        if k is not None:  # else rope_and_cache wrote them (never with an int8 / fp8 cache)
            if scales is not None:
                for cache, scale_cache, x in ((k_cache, scales[0], k), (v_cache, scales[1], v)):
                    if self.kernels is not None:
                        self.kernels.write_scaled_cache(x, cache, scale_cache, meta.slot_mapping)
                    else:
                        write_quantized(cache, scale_cache, x, meta.slot_mapping)
            else:
                k_cache.index_copy_(0, meta.slot_mapping, k)
                v_cache.index_copy_(0, meta.slot_mapping, v)
        T = q.shape[0]
        if self.batch_invariant and q.dtype == torch.bfloat16 and meta.query_start_loc is not None:
            # Each row decode-style, the same bits whatever the batch and however its prompt is chunked.
            return self.kernels.paged_rows(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.block_size,
                scale,
                window=window,
                softcap=softcap,
            ).reshape(T, -1)
        if meta.all_decode and self.decode_by_rows and q.dtype == torch.bfloat16 and meta.query_start_loc is not None:
            return self.kernels.paged_rows(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.block_size,
                scale,
                *scales,
                window=window,
                softcap=softcap,
            ).reshape(T, -1)
        if meta.all_decode:
            return self._decode(q, k_cache, v_cache, meta, scales, layer).reshape(T, -1)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta, scales, layer)
        for c in meta.prefills or ():
            # The kernel reads all keys (prefix and this chunk's, just written) in place through the
            # block table. Not for a fresh prompt with an int8 / fp8 cache: the torch path attends its
            # unquantized K/V there, and that is kept.
            if (
                self.kernels is not None
                and c.block_table is not None
                and q.dtype in (torch.float32, torch.bfloat16)
                and (k_cache.dtype == q.dtype or (scales is not None and c.context_len > 0))
            ):
                out[c.q_start : c.q_end] = self.kernels.paged_prefill(
                    q[c.q_start : c.q_end],
                    k_cache,
                    v_cache,
                    c.block_table,
                    c.context_len,
                    meta.block_size,
                    scale,
                    *(scales or ()),
                    window=window,
                    softcap=softcap,
                )
                continue
            qc = q[c.q_start : c.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            n = c.q_end - c.q_start
            if c.context_len == 0:  # whole prompt in this chunk: attend to the fresh K/V
                assert k is not None, "a prompt chunk without a block table needs its fresh K/V"
                kc = k[c.q_start : c.q_end].transpose(0, 1).unsqueeze(0)
                vc = v[c.q_start : c.q_end].transpose(0, 1).unsqueeze(0)
                if not window and not softcap:
                    o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=self.gqa)
                    out[c.q_start : c.q_end] = o.squeeze(0).transpose(0, 1)
                    continue
            else:  # keys before the window may sit in freed blocks (the null block): masked out
                kc = self._read(k_cache, c.kv_slots, scales, 0, q.dtype).transpose(0, 1).unsqueeze(0)
                vc = self._read(v_cache, c.kv_slots, scales, 1, q.dtype).transpose(0, 1).unsqueeze(0)
            # Query i sits at position context_len + i and sees keys 0..context_len + i (the last `window`).
            mask = _causal_mask(c.context_len + torch.arange(n), kc.shape[2], window)
            o = _attend(qc, kc, vc, mask, scale, softcap, self.gqa)
            out[c.q_start : c.q_end] = o.squeeze(0).transpose(0, 1)
        return out.reshape(T, -1)

    @staticmethod
    def _read(cache: torch.Tensor, slots: torch.Tensor, scales, kv: int, dtype: torch.dtype) -> torch.Tensor:
        """Gather slots of a K or V cache in the compute dtype (dequantized when int8 / fp8)."""
        x = cache[slots]
        if scales is None:
            return x
        return (x.float() * scales[kv][slots].unsqueeze(-1)).to(dtype)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scales=None,
        layer: int = 0,
    ) -> torch.Tensor:
        """q: [Bd, H, D] -> [Bd, H, D], keys read through the block tables."""
        window, softcap, scale = self.params[layer]
        if self.kernels is not None:  # in place, no gathered copy of the cache
            return self.kernels.paged_decode(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                meta.block_size,
                scale,
                *(scales or ()),
                window=window,
                softcap=softcap,
            )
        # Pure-torch fallback: gather each request's keys [Bd, Hkv, Lmax, D] and mask the padding.
        bs = meta.block_size
        L = meta.decode_block_tables.shape[1] * bs
        pos = torch.arange(L)
        lens = meta.decode_seq_lens.unsqueeze(1)
        valid = (pos.unsqueeze(0) < lens) & (pos.unsqueeze(0) >= lens - window if window else True)
        # Slots past a request's length may hold stale (even NaN) data: read the null block instead.
        slots = torch.where(valid, meta.decode_block_tables[:, pos // bs] * bs + pos % bs, 0)
        mask = valid.view(-1, 1, 1, L)
        kc = self._read(k_cache, slots, scales, 0, q.dtype).transpose(1, 2)
        vc = self._read(v_cache, slots, scales, 1, q.dtype).transpose(1, 2)
        return _attend(q.unsqueeze(2), kc, vc, mask, scale, softcap, self.gqa).squeeze(2)


def _causal_mask(q_pos: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """[n, num_keys]: query at q_pos[i] sees keys q_pos[i] - window + 1 .. q_pos[i] (window 0: from 0)."""
    k_pos = torch.arange(num_keys).unsqueeze(0)
    mask = k_pos <= q_pos.unsqueeze(1)
    return mask & (k_pos > q_pos.unsqueeze(1) - window) if window else mask


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float, gqa: bool
) -> torch.Tensor:
    """SDPA over [.., H, n, D] queries and [.., Hkv, L, D] keys; with soft-capping (which SDPA has
    not) the same written out, scores and softmax in float32 as transformers' eager attention."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = torch.tanh(q.float() @ k.float().transpose(-1, -2) * scale / softcap) * softcap
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p @ v.float()).to(q.dtype)


def _block_tables(seqs: list[SeqChunk], width: int) -> torch.Tensor:
    """[len(seqs), width] int64: each chunk's block table cut or padded (null block 0) to width."""
    return index_tensor(
        [b for c in seqs for b in c.table[:width] + [0] * (width - len(c.table[:width]))], len(seqs), width
    )


def _slots_for(table: list[int], length: int, bs: int) -> torch.Tensor:
    pos = torch.arange(length)
    return torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
