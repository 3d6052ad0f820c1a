"""The C++ paged prefill kernel (csrc/paged_prefill.cpp) against a float32 reference (sliding
windows and soft-caps included), and the backend's prompt-chunk path with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    LayerAttention,
    PrefillChunk,
    quantize_kv,
)


def reference_paged_prefill(
    q, k_cache, v_cache, table, context_len: int, bs: int, scale: float, window: int = 0, softcap: float = 0.0
):
    """Causal chunk attention in float32 through a block table: [n, H, D]. window > 0: query i sees
    keys context_len + i - window + 1 .. context_len + i only (no other key is read); softcap > 0:
    scores soft-capped."""
    n = q.shape[0]
    L = context_len + n
    lo = max(0, context_len + 1 - window) if window else 0
    pos = torch.arange(lo, L)
    slots = table[pos // bs] * bs + pos % bs
    k = k_cache[slots].float().transpose(0, 1)
    v = v_cache[slots].float().transpose(0, 1)
    q_pos = (context_len + torch.arange(n)).unsqueeze(1)
    mask = (pos.unsqueeze(0) <= q_pos) & ((pos.unsqueeze(0) > q_pos - window) if window else True)
    if not softcap:
        o = F.scaled_dot_product_attention(
            q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return o.transpose(0, 1)
    rep = q.shape[1] // k.shape[0]
    s = torch.einsum("nhd,hld->hnl", q.float(), k.repeat_interleave(rep, 0)) * scale
    p = (torch.tanh(s / softcap) * softcap).masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hnl,hld->nhd", p, v.repeat_interleave(rep, 0))


HEADS = [(9, 3, 64), (4, 4, 128), (8, 2, 16), (6, 3, 96), (2, 1, 256), (5, 5, 80), (4, 2, 32)]
CHUNKS = [(0, 1), (0, 2), (0, 37), (0, 256), (5, 2), (100, 33), (31, 70), (768, 256)]


@pytest.mark.parametrize("cache", ["bfloat16", "float32", "int8-bf16", "int8-fp32"])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}kv{h[1]}D{h[2]}")
def test_paged_prefill_matches_reference(kernels, heads, block_size, cache):
    H, Hkv, D = heads
    q_dtype = torch.bfloat16 if cache in ("bfloat16", "int8-bf16") else torch.float32
    gen = torch.Generator().manual_seed(H * 1000 + D + block_size)
    scale = D**-0.5
    for ctx, n in CHUNKS:
        if D >= 128 and n * (ctx + n) > 60000:
            continue  # keep the test quick
        L = ctx + n
        nb = -(-L // block_size)
        pool = nb + 5
        table = torch.randperm(pool, generator=gen)[:nb].long()
        q = torch.randn(n, H, D, generator=gen).to(q_dtype)
        k = torch.randn(pool * block_size, Hkv, D, generator=gen) * 2
        v = torch.randn(pool * block_size, Hkv, D, generator=gen)
        if cache.startswith("int8"):
            kq, ks = quantize_kv(k)
            vq, vs = quantize_kv(v)
            out = kernels.paged_prefill(q, kq, vq, table, ctx, block_size, scale, ks, vs)
            ref = reference_paged_prefill(
                q, kq.float() * ks.unsqueeze(-1), vq.float() * vs.unsqueeze(-1), table, ctx, block_size, scale
            )
        else:
            kc, vc = k.to(q_dtype), v.to(q_dtype)
            out = kernels.paged_prefill(q, kc, vc, table, ctx, block_size, scale)
            ref = reference_paged_prefill(q, kc, vc, table, ctx, block_size, scale)
        assert out.dtype == q_dtype and out.shape == (n, H, D)
        # bf16: the output's own rounding (2^-9 relative) plus bf16 softmax weights in P.V.
        atol = 2e-2 if q_dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0, msg=f"ctx={ctx} n={n}")


@pytest.mark.parametrize("cache", ["bfloat16", "float32", "int8-fp32"])
def test_paged_prefill_window_and_softcap(kernels, cache):
    """A sliding window (not a multiple of the block or key-tile size) and a soft-cap: the
    reference's values, and no key before the chunk's first window read: those blocks point at a
    null block full of NaN, as a freed block's entry does."""
    H, Hkv, D, bs = 8, 2, 64, 16
    q_dtype = torch.float32 if cache != "bfloat16" else torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    for ctx, n, window, softcap in [
        (0, 40, 13, 5.0),
        (70, 33, 21, 0.0),
        (100, 5, 50, 2.0),
        (37, 64, 7, 30.0),
        (5, 3, 100, 0.0),
    ]:
        L = ctx + n
        nb = -(-L // bs)
        table = torch.randperm(nb + 4, generator=gen)[:nb].long() + 1  # block 0: the null block
        table[: max(0, ctx + 1 - window) // bs] = 0  # wholly before every query's window: freed
        k = torch.randn((nb + 5) * bs, Hkv, D, generator=gen) * 2
        v = torch.randn((nb + 5) * bs, Hkv, D, generator=gen)
        k[:bs], v[:bs] = float("nan"), float("nan")
        q = torch.randn(n, H, D, generator=gen).to(q_dtype)
        if cache.startswith("int8"):
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            ks[:bs], vs[:bs] = float("nan"), float("nan")
            out = kernels.paged_prefill(q, kq, vq, table, ctx, bs, 0.2, ks, vs, window=window, softcap=softcap)
            ref = reference_paged_prefill(
                q, kq.float() * ks.unsqueeze(-1), vq.float() * vs.unsqueeze(-1), table, ctx, bs, 0.2, window, softcap
            )
        else:
            kc, vc = k.to(q_dtype), v.to(q_dtype)
            out = kernels.paged_prefill(q, kc, vc, table, ctx, bs, 0.2, window=window, softcap=softcap)
            ref = reference_paged_prefill(q, kc, vc, table, ctx, bs, 0.2, window, softcap)
        atol = 2e-2 if q_dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0, msg=f"ctx={ctx} n={n} window={window}")


def test_paged_prefill_noncontiguous_q_and_long_table(kernels):
    """q may be a strided view; the block table may hold more blocks than the chunk needs."""
    H, Hkv, D, bs, ctx, n = 4, 2, 64, 16, 20, 30
    gen = torch.Generator().manual_seed(1)
    table = torch.randperm(12, generator=gen)[:6].long()
    k = torch.randn(12 * bs, Hkv, D, generator=gen)
    v = torch.randn(12 * bs, Hkv, D, generator=gen)
    q = torch.randn(H, n, D, generator=gen).transpose(0, 1)
    out = kernels.paged_prefill(q, k, v, table, ctx, bs, 0.125)
    torch.testing.assert_close(out, reference_paged_prefill(q, k, v, table, ctx, bs, 0.125), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layer", [None, LayerAttention(11, 5.0, 0.2)], ids=["plain", "window-softcap"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_backend_prompt_chunks_kernel_vs_torch(kernels, cache_dtype, layer):
    """Two prompt chunks (one fresh, one after a cached prefix) and a decode row in one batch:
    the kernel path and the pure-torch path agree (with a layer's window, soft-cap and scale too)."""
    H, Hkv, D, bs, layers = 9, 3, 64, 16, 1
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    slots_n = 64 * bs
    outs = []
    for use_kernels in (True, False):
        gen = torch.Generator().manual_seed(2)
        kv = torch.zeros(layers, 2, slots_n, Hkv, D, dtype=cache_dtype)
        scales = torch.zeros(layers, 2, slots_n, Hkv) if cache_dtype in (torch.int8, torch.float8_e4m3fn) else None
        backend = AttentionBackend(
            kv, H, Hkv, D, use_cpp_kernels=use_kernels, kv_scales=scales, layers=[layer] if layer else None
        )
        assert (backend.kernels is not None) == use_kernels
        # Sequence A: blocks [3, 7, 1], 40 cached tokens then a 5-token chunk; sequence B: fresh
        # 19-token prompt in blocks [10, 11]; sequence C: decode at position 8 in block [20].
        table_a, table_b, table_c = [3, 7, 1], [10, 11], [20]
        prefix = torch.randn(40, Hkv, D, generator=torch.Generator().manual_seed(4)).to(dtype)
        pre_slots = torch.tensor([table_a[p // bs] * bs + p % bs for p in range(40)])
        pre_c = torch.randn(8, Hkv, D, generator=torch.Generator().manual_seed(5)).to(dtype)
        c_slots = torch.tensor([table_c[0] * bs + p for p in range(8)])
        pre_meta = AttentionMetadata(slot_mapping=torch.cat([pre_slots, c_slots]), block_size=bs, prefills=[])
        backend.forward(
            0, torch.zeros(48, H, D, dtype=dtype), torch.cat([prefix, pre_c]), torch.cat([prefix, pre_c]), pre_meta
        )  # fills the cache (no prompt chunks: output unused)
        T = 5 + 19 + 1
        q = torch.randn(T, H, D, generator=gen).to(dtype)
        k = torch.randn(T, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(T, Hkv, D, generator=gen).to(dtype)
        slots = [table_a[p // bs] * bs + p % bs for p in range(40, 45)]
        slots += [table_b[p // bs] * bs + p % bs for p in range(19)]
        slots += [table_c[0] * bs + 8]
        kv_slots_a = torch.tensor([table_a[p // bs] * bs + p % bs for p in range(45)])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_size=bs,
            decode_rows=torch.tensor([24]),
            decode_block_tables=torch.tensor([table_c]),
            decode_seq_lens=torch.tensor([9]),
            prefills=[
                PrefillChunk(0, 5, 40, kv_slots_a, torch.tensor(table_a)),
                PrefillChunk(5, 24, 0, None, torch.tensor(table_b)),
            ],
        )
        outs.append(backend.forward(0, q, k, v, meta).float())
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)
