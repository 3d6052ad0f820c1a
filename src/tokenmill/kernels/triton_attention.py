"""Paged attention in Triton: the kernels of the GPU attention backend.

Same cache layout and calls as the CPU kernels (`attention.py`): per layer K and V are
`[num_slots, num_kv_heads, head_dim]` with slot = block_id * block_size + offset, read in place
through block tables; an int8 or fp8 (e4m3) cache has one float32 scale per (slot, kv head),
dequantized here.

- `paged_decode`: one query token per request. A program takes one request, one kv head and
  all the query heads that share it (GQA: the kv tile is loaded once for the whole group), over
  one split of the keys; with more than one split each writes an unnormalized partial result
  with its running max and sum, and `_merge_kernel` combines them (flash-decoding), so a long
  context spreads over more programs than B x kv heads.
- `paged_prefill` / `paged_prefill_varlen`: a chunk of query tokens per request attending
  causally to the request's cached tokens and itself (its own K/V already written). A program
  takes a tile of query tokens times the query heads of one kv head, flattened into the rows
  of one matrix, as vLLM's unified attention does.

Softmax runs in base 2 (the scale premultiplied by log2(e)) with float32 statistics and
accumulators. Keys past a request's length are never loaded: slots there (and the null block
that padding points at) may hold stale, even NaN, data. With a sliding window (`window` > 0) a
query at position p sees keys p - window + 1 .. p, and no key before the first query's window is
loaded (the KV manager may have freed those blocks); `softcap` > 0 caps the scores at
softcap * tanh(score / softcap) (Gemma 2).

Tested on CPU under TRITON_INTERPRET=1 (tests/kernels/test_triton_attention.py); whether triton interprets
is fixed when jit functions are defined, its own included, so set it before triton is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # (jit functions spell it out: they read no plain globals)
DEFAULT_PARTITION = 512  # keys per decode split when the wrapper picks the number of splits
MAX_SPLITS = 16
NO_WINDOW = 1 << 30  # keys a query without a sliding window may see: more than any sequence has


@triton.jit
def _softcap(s, softcap):
    """softcap * tanh(s / softcap), tanh(|t|) = (1 - e) / (1 + e) with e = exp(-2|t|) <= 1."""
    t = s / softcap
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(t))  # exp(-2|t|)
    th = (1.0 - e) / (1.0 + e)
    return tl.where(t < 0, -th, th) * softcap


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    row_lo,
    row_limit,
    kv_lo,
    kv_hi,
    bt_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    kv_head,
    stride_kslot,
    stride_khead,
    stride_vslot,
    stride_vhead,
    stride_sslot,
    stride_shead,
    qk_scale,
    softcap,
    head_dim,
    block_size,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INT8: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online softmax of q [M, HEAD_DIM] over keys kv_lo..kv_hi-1; row r sees keys row_lo[r] ..
    row_limit[r]. qk_scale: the scale times log2(e), or (SOFTCAP) the scale alone."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < head_dim
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < kv_hi
        # Any block size: each key's block comes from the table, so a tile may span blocks.
        block_id = tl.load(bt_ptr + pos // block_size, mask=n_mask, other=0)
        slot = block_id * block_size + pos % block_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_kslot + kv_head * stride_khead + offs_d[None, :], mask=kv_mask, other=0.0
        )
        v = tl.load(
            v_ptr + slot[:, None] * stride_vslot + kv_head * stride_vhead + offs_d[None, :], mask=kv_mask, other=0.0
        )
        # The dots run in q's dtype: int8 values are exact in bf16 / fp32 (their per-key scales go on
        # the scores and on P), and the interpreter's q is float32 (see DOT_F32).
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if INT8:
            k_scale = tl.load(ks_ptr + slot * stride_sslot + kv_head * stride_shead, mask=n_mask, other=0.0)
            s = s * k_scale[None, :]
        s = s * qk_scale
        if SOFTCAP:
            s = _softcap(s, softcap) * 1.4426950408889634  # LOG2E
        visible = n_mask[None, :] & (pos[None, :] <= row_limit[:, None]) & (pos[None, :] >= row_lo[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key yet (padding rows) keep m = -inf: subtract 0 instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if INT8:
            v_scale = tl.load(vs_ptr + slot * stride_sslot + kv_head * stride_shead, mask=n_mask, other=0.0)
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    stride_qb,
    stride_qh,
    stride_kslot,
    stride_khead,
    stride_vslot,
    stride_vhead,
    stride_sslot,
    stride_shead,
    stride_bt,
    stride_ob,
    stride_oh,
    qk_scale,
    softcap,
    window,
    head_dim,
    block_size,
    num_heads,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INT8: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    win_lo = tl.maximum(seq_len - window, 0)  # the first key the query sees (window: _window's)
    # Each split takes a whole number of tiles, so only the last split of a request is ragged.
    split_len = ((seq_len - win_lo + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    kv_lo = win_lo + split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    qd_mask = h_mask[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_limit = tl.where(h_mask, seq_len - 1, -1)  # padding rows of the head group see nothing
    row_lo = tl.zeros([BLOCK_H], dtype=tl.int32) + win_lo
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        row_lo,
        row_limit,
        kv_lo,
        kv_hi,
        bt_ptr + b * stride_bt,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        kv_head,
        stride_kslot,
        stride_khead,
        stride_vslot,
        stride_vhead,
        stride_sslot,
        stride_shead,
        qk_scale,
        softcap,
        head_dim,
        block_size,
        BLOCK_N,
        HEAD_DIM,
        INT8,
        PRECISION,
        SOFTCAP,
    )
    if NUM_SPLITS == 1:
        # seq_len 0 (a padded batch row) gives zeros, not 0 / 0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=qd_mask,
        )
    else:
        # part: [B, H, NUM_SPLITS, HEAD_DIM] unnormalized; stats: [B, H, NUM_SPLITS, 2] (max, sum), float32.
        row = (b * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=h_mask[:, None])
        tl.store(stats_ptr + row * 2, m_i, mask=h_mask)
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=h_mask)


@triton.jit
def _merge_kernel(
    part_ptr,
    stats_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    head_dim,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (b * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(stats_ptr + row * 2)
    l = tl.load(stats_ptr + row * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    acc = tl.sum(tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]) * w[:, None], 0)
    total = tl.sum(l * w, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    q_start_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kslot,
    stride_khead,
    stride_vslot,
    stride_vhead,
    stride_sslot,
    stride_shead,
    stride_bt,
    stride_ot,
    stride_oh,
    qk_scale,
    softcap,
    window,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INT8: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(q_start_ptr + req).to(tl.int32)
    q_len = tl.load(q_start_ptr + req + 1).to(tl.int32) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    context_len = seq_len - q_len

    # Row r of the tile is query token q_block * BLOCK_Q + r // GROUP, head kv_head * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_block * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    qd_mask = m_mask[:, None] & (offs_d[None, :] < head_dim)
    q_off = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_limit = tl.where(m_mask, context_len + tok, -1)  # causal: token i sits at context_len + i
    kv_hi = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)  # the tile's last token's keys
    # With a window, token i sees keys from context_len + i - window + 1: none before the tile's first token's.
    row_lo = context_len + tok - window + 1
    kv_lo = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        row_lo,
        row_limit,
        kv_lo,
        kv_hi,
        bt_ptr + req * stride_bt,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        kv_head,
        stride_kslot,
        stride_khead,
        stride_vslot,
        stride_vhead,
        stride_sslot,
        stride_shead,
        qk_scale,
        softcap,
        head_dim,
        block_size,
        BLOCK_N,
        HEAD_DIM,
        INT8,
        PRECISION,
        SOFTCAP,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=qd_mask)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[int, bool, str]:
    """Validate shapes; returns (query heads per kv head, scaled cache, dot precision). INT8 in the
    kernels means a cache with per-(slot, kv head) scales: int8 or float8 e4m3, loaded and converted
    to q's dtype (exact: both fit in bf16)."""
    H, D = q.shape[-2:]
    Hkv = k_cache.shape[1]
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == D, (k_cache.shape, v_cache.shape, q.shape)
    assert H % Hkv == 0, f"{H} query heads do not share {Hkv} kv heads evenly"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    int8 = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    assert int8 == (k_scale is not None) == (v_scale is not None), "an int8 / fp8 cache comes with k_scale and v_scale"
    if int8:
        assert k_scale.stride() == v_scale.stride() and k_scale.dtype == torch.float32
    else:
        assert k_cache.dtype == q.dtype, f"cache {k_cache.dtype} vs query {q.dtype}"
    # float32 inputs stay float32 in tl.dot (GPUs would otherwise round them to tf32).
    return H // Hkv, int8, "ieee" if q.dtype == torch.float32 else "tf32"


def _scale_args(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, q: torch.Tensor) -> tuple:
    if k_scale is None:  # never read: any pointer will do
        return q, q, 0, 0
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)


def _interpreted(q: torch.Tensor) -> bool:
    """CPU tensors run in the interpreter, whose tl.dot multiplies bfloat16 bit patterns as integers
    (triton-lang/triton#11584): there the dots take float32 operands (bf16 -> fp32 is exact)."""
    return q.device.type == "cpu"


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _window(window: int) -> int:
    """The kernels' window: no window is one longer than any sequence, so they need no branch on it
    (a branch on a scalar argument also trips triton 3.6's interpreter)."""
    return window if window > 0 else NO_WINDOW


def _scores(scale: float, softcap: float) -> tuple[float, float, bool]:
    """(qk_scale, softcap, SOFTCAP) as _attend_tiles takes them."""
    return (scale, float(softcap), True) if softcap else (scale * LOG2E, 0.0, False)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int = 32,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [B, H, D], one token per request -> [B, H, D]. seq_lens [B]: keys per request, the new one included.

    num_splits: key-sequence splits per request (None: from the block table's width, so no host
    sync and the same launch for any lengths, as CUDA graphs need). window > 0: each query sees
    its last `window` keys; softcap > 0: scores soft-capped."""
    B, H, D = q.shape
    group, int8, precision = _check(q, k_cache, v_cache, k_scale, v_scale)
    Hkv = k_cache.shape[1]
    if num_splits is None:
        max_keys = block_tables.shape[1] * block_size
        if window:
            max_keys = min(max_keys, window + block_n)
        num_splits = min(MAX_SPLITS, triton.cdiv(max_keys, DEFAULT_PARTITION))
    num_splits = _pow2(num_splits)  # the merge kernel loads all splits as one tile
    out = torch.empty_like(q)
    if B == 0:
        return out
    ks, vs, s0, s1 = _scale_args(k_scale, v_scale, q)
    qk_scale, cap, capped = _scores(scale, softcap)
    head_dim_p = _pow2(D, 16)
    if num_splits > 1:
        part = torch.empty(B, H, num_splits, head_dim_p, dtype=torch.float32, device=q.device)
        stats = torch.empty(B, H, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # not written
    _decode_kernel[(B, Hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        seq_lens,
        out,
        part,
        stats,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        s0,
        s1,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        qk_scale,
        cap,
        _window(window),
        D,
        block_size,
        H,
        GROUP=group,
        BLOCK_H=_pow2(group, 16),
        BLOCK_N=block_n,
        HEAD_DIM=head_dim_p,
        NUM_SPLITS=num_splits,
        INT8=int8,
        PRECISION=precision,
        DOT_F32=_interpreted(q),
        SOFTCAP=capped,
    )
    if num_splits > 1:
        _merge_kernel[(B, H)](
            part, stats, out, out.stride(0), out.stride(1), D, H, NUM_SPLITS=num_splits, HEAD_DIM=head_dim_p
        )
    return out


def paged_prefill_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    block_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    block_m: int = 64,
    block_n: int = 32,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Several requests' chunks at once: q [T, H, D] flat, request i's rows at
    query_start_loc[i]:query_start_loc[i+1]; seq_lens [B] its keys (cached context + chunk);
    block_tables [B, max_blocks]; max_query_len sizes the grid. Causal within each request
    (window > 0: each query sees its last `window` keys; softcap > 0: scores soft-capped)."""
    T, H, D = q.shape
    group, int8, precision = _check(q, k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    B = seq_lens.shape[0]
    if B == 0 or T == 0:
        return out
    ks, vs, s0, s1 = _scale_args(k_scale, v_scale, q)
    qk_scale, cap, capped = _scores(scale, softcap)
    block_m = _pow2(max(block_m, group))  # a tile holds at least one token's whole head group
    block_q = block_m // group
    grid = (B, triton.cdiv(max_query_len, block_q), k_cache.shape[1])
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        s0,
        s1,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        qk_scale,
        cap,
        _window(window),
        D,
        block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=_pow2(D, 16),
        INT8=int8,
        PRECISION=precision,
        DOT_F32=_interpreted(q),
        SOFTCAP=capped,
    )
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    block_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    **tiles,
) -> torch.Tensor:
    """One request's chunk: q [n, H, D] at positions context_len..context_len+n-1, its K/V already
    in the cache; block_table [num_blocks] covers all context_len + n keys. Returns [n, H, D]."""
    n = q.shape[0]
    loc = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    seq_lens = torch.tensor([context_len + n], dtype=torch.int32, device=q.device)
    return paged_prefill_varlen(
        q, k_cache, v_cache, loc, seq_lens, block_table.view(1, -1), n, block_size, scale, k_scale, v_scale, **tiles
    )
