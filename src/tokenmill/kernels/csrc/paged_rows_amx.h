// The rows kernel (paged_decode.h) on AMX-BF16, for bf16 queries and a bf16 cache: a work item's
// query rows (row, query head) of one kv head, up to 16 at a time, attend each tile of 32 keys
// with tile matrix products: scores S^T = K Q^T (per 16 keys; the queries packed once per item)
// and P V (P rounded to bf16 as flash attention does, V rows interleaved in pairs once per tile
// and kv head); the online softmax between them on AVX-512. A prompt's rows share every tile op,
// so prompt attention runs on the tile unit instead of one row at a time.
//
// Batch invariance: tiles are cut at the same places for every row (keys 32 t .. 32 t + 31, each
// half within one block; lanes outside a row's keys masked), each (row, head) takes one
// attend_group step per tile it sees, and a tile product's output element depends only on its
// own row and column (the same instructions whether the group holds 1 query or 16): a row's bits
// depend only on its query, its position and its sequence's K/V. A decode token is a one-row item.
//
// Sliding window W: row p sees keys p - W + 1 .. p; halves of tiles before the item's first row's
// window are never read (their blocks may be freed). Soft-cap: cap * tanh(s / cap) on the scaled scores.
#pragma once

#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "cpu_common.h"
#include "paged_decode.h"

namespace tm_cpu::amx_rows {

using BF16 = c10::BFloat16;
constexpr int kHalf = 16;   // keys per score tile (within one block)
constexpr int kTile = 32;   // keys per tile: one softmax step, one P V product
constexpr int kGroup = 16;  // (row, head) queries per group
constexpr float kNoScore = -1e30f;

// The shapes this path takes; the rest keep the vector paths.
template <typename T, typename C, int D>
inline constexpr bool kTakes = std::is_same_v<T, BF16> && std::is_same_v<C, BF16> && D % 32 == 0;

inline bool usable(int64_t block_size) { return block_size % kHalf == 0 && amx_permitted(); }

// Tiles: 0, 6 S^T of a tile's two halves [16 keys x 16 queries] f32; 1, 7 the halves' keys, 32 dims
// [16 x 32 bf16]; 2 the queries' same 32 dims in pairs [16 x 16 x 2]; 3 P [qrows queries x 32 keys
// bf16]; 4 V pairs [16 x 16 dims x 2]; 5 O [qrows queries x 16 dims] f32. qrows: the most queries
// of a group in this item (fewer rows to load and store).
inline void configure(int qrows) {
  TileConfig cfg;
  const int rows[8] = {16, 16, 16, qrows, 16, qrows, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// The next tile's K and V lines (a share of its rows in each half), prefetched a few at a time
// between the computations: a burst of prefetches stalls the core once the line fill buffers are full.
struct LineFeed {
  struct Run {
    const char* k;
    const char* v;
    int rows;
  } runs[2] = {};
  int64_t stride = 0, bytes = 0, o = 0;  // bytes between rows, bytes per row, offset in the row
  int n_runs = 0, run = 0, r = 0;
  void reset(int64_t stride_elems, int64_t row_bytes) {
    stride = stride_elems * 2;
    bytes = row_bytes;
    n_runs = run = r = 0;
    o = 0;
  }
  void add(const BF16* k_rows, const BF16* v_rows, int n_rows) {
    if (n_rows > 0) runs[n_runs++] = {reinterpret_cast<const char*>(k_rows), reinterpret_cast<const char*>(v_rows), n_rows};
  }
  void issue(int n) {  // n lines of K and n of V
    for (; n > 0 && run < n_runs; --n) {
      const Run& x = runs[run];
      _mm_prefetch(x.k + r * stride + o, _MM_HINT_T0);
      _mm_prefetch(x.v + r * stride + o, _MM_HINT_T0);
      if ((o += 64) >= bytes) {
        o = 0;
        if (++r == x.rows) {
          r = 0;
          ++run;
        }
      }
    }
  }
  void rest() { issue(1 << 30); }
};

// One group of nq queries (rows of one kv head) and one tile, its scores S^T in `st` [32 keys][16
// queries]: query q sees lanes lo[q] .. hi[q] of the tile's 32 (none when lo > hi: its state is
// left as it is). Updates the queries' softmax state m, l and accumulators acc (D floats each, in
// the order of bf16_pair_slot), through P (pbuf [16][32]) and P V (tiles 3-5, V pairs at vbuf). Not
// inlined: every caller, a decode token or a prompt's rows, runs the same instructions.
template <int D>
__attribute__((noinline)) void attend_group(const float* st, int nq, const int* lo, const int* hi, float scale,
                                            float softcap, float* m, float* l, float* acc, BF16* pbuf,
                                            const BF16* vbuf, float* obuf, LineFeed& feed) {
  __m512 s0[16], s1[16];  // query q's scores of keys 0-15, 16-31
  if (nq > 4) {
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      s0[k] = _mm512_load_ps(st + k * 16);
      s1[k] = _mm512_load_ps(st + 256 + k * 16);
    }
    transpose16(s0);
    transpose16(s1);
  } else {
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int q = 0; q < nq; ++q) {
      s0[q] = _mm512_i32gather_ps(col, st + q, 4);
      s1[q] = _mm512_i32gather_ps(col, st + 256 + q, 4);
    }
  }
  alignas(64) float old_m[16] = {}, new_m[16] = {}, corr[16];
  uint32_t seen = 0;
  __mmask16 v0[16], v1[16];
  const __m512 sc = _mm512_set1_ps(scale), none = _mm512_set1_ps(kNoScore);
  for (int q = 0; q < nq; ++q) {
    if (lo[q] > hi[q]) continue;
    seen |= 1u << q;
    const uint32_t lanes = static_cast<uint32_t>((uint64_t{2} << hi[q]) - 1) & ~((1u << lo[q]) - 1);
    v0[q] = static_cast<__mmask16>(lanes);
    v1[q] = static_cast<__mmask16>(lanes >> 16);
    __m512 r0 = _mm512_mul_ps(s0[q], sc), r1 = _mm512_mul_ps(s1[q], sc);
    if (softcap > 0.f) {
      r0 = softcap16(r0, softcap);
      r1 = softcap16(r1, softcap);
    }
    s0[q] = _mm512_mask_mov_ps(none, v0[q], r0);
    s1[q] = _mm512_mask_mov_ps(none, v1[q], r1);
    old_m[q] = m[q];
    new_m[q] = std::max(m[q], _mm512_reduce_max_ps(_mm512_max_ps(s0[q], s1[q])));
  }
  _mm512_store_ps(corr, exp16(_mm512_sub_ps(_mm512_load_ps(old_m), _mm512_load_ps(new_m))));
  for (int q = 0; q < nq; ++q) {
    __m512i p = _mm512_setzero_si512();
    if (seen >> q & 1) {
      const __m512 nm = _mm512_set1_ps(new_m[q]);
      const __m512 e0 = _mm512_maskz_mov_ps(v0[q], exp16(_mm512_sub_ps(s0[q], nm)));
      const __m512 e1 = _mm512_maskz_mov_ps(v1[q], exp16(_mm512_sub_ps(s1[q], nm)));
      l[q] = std::fma(l[q], corr[q], hsum1(_mm512_add_ps(e0, e1)));
      m[q] = new_m[q];
      p = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0));  // keys 0-15, then 16-31
    }
    _mm512_store_si512(pbuf + q * kTile, p);
  }
  // O = P V per 16 dims (into a zeroed tile, then acc = acc * corr + O: each query's own terms).
  feed.issue(2);
  _tile_loadd(3, pbuf, 64);
#pragma GCC unroll 16
  for (int c = 0; c < D / 16; ++c) {
    feed.issue(1);
    _tile_loadd(4, vbuf + c * 16 * 32, 64);
    _tile_zero(5);
    _tile_dpbf16ps(5, 3, 4);
    _tile_stored(5, obuf + c * 16, D * 4);
  }
  for (int q = 0; q < nq; ++q) {
    if (!(seen >> q & 1)) continue;
    const __m512 cq = _mm512_set1_ps(corr[q]);
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; ++c) {
      float* a = acc + q * D + c * 16;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), cq, _mm512_load_ps(obuf + q * D + c * 16)));
    }
  }
}

// A tile: its first key, its keys (1-32), and each half's first cache slot (-1: not read).
struct Tile {
  int64_t k0;
  int nt;
  int64_t slot[2];
};

// A tile's 32 key rows (kv head at offset h, `row` elements apart) copied to kbuf [32][D] by vector
// loads (many misses in flight, where a tile load waits on its rows in turn); a half not read: zeros.
template <int D>
inline void copy_keys(const BF16* k_cache, const Tile& t, int64_t h, int64_t row, BF16* kbuf, LineFeed& feed) {
  for (int hf = 0; hf < 2; ++hf) {
    const BF16* kp = t.slot[hf] >= 0 ? k_cache + t.slot[hf] * row + h : nullptr;
    for (int k = 0; k < kHalf; ++k) {
      feed.issue(1);
      BF16* dst = kbuf + (hf * kHalf + k) * D;
#pragma GCC unroll 8
      for (int c = 0; c < D / 32; ++c)
        _mm512_store_si512(dst + c * 32, kp ? _mm512_loadu_si512(kp + k * row + c * 32) : _mm512_setzero_si512());
    }
  }
}

// A tile's V rows (keys outside [k_lo, nt) as zeros) in pairs for tile 4: vbuf[(chunk * 16 + pair)
// * 32 ..] = V rows 2 pair and 2 pair + 1 interleaved 16 bits at a time (within 128-bit lanes).
template <int D>
inline void build_vpairs(const BF16* v_cache, const Tile& t, int64_t h, int64_t row, int k_lo, BF16* vbuf,
                         LineFeed& feed) {
  for (int k = 0; k < kTile / 2; ++k) {
    feed.issue(1);
    const int j = 2 * k, hf = j / kHalf;
    const BF16* v0 = t.slot[hf] >= 0 ? v_cache + (t.slot[hf] + j % kHalf) * row + h : nullptr;
    const bool has0 = v0 && j >= k_lo && j < t.nt, has1 = v0 && j + 1 >= k_lo && j + 1 < t.nt;
#pragma GCC unroll 8
    for (int c2 = 0; c2 < D / 32; ++c2) {
      const __m512i x = has0 ? _mm512_loadu_si512(v0 + c2 * 32) : _mm512_setzero_si512();
      const __m512i y = has1 ? _mm512_loadu_si512(v0 + row + c2 * 32) : _mm512_setzero_si512();
      _mm512_store_si512(vbuf + ((2 * c2) * 16 + k) * 32, _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(vbuf + ((2 * c2 + 1) * 16 + k) * 32, _mm512_unpackhi_epi16(x, y));
    }
  }
}

template <int D>
void rows_item(const RowsArgs<BF16, BF16>& a, const RowsItem& it) {
  const int64_t H = a.H, Hkv = a.Hkv, G = H / Hkv, bs = a.block_size, W = a.window;
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t q0 = a.q_start[it.b], n = a.q_start[it.b + 1] - q0;
  const int64_t R = it.r1 - it.r0, NH = it.h1 - it.h0, RG = R * G, NG = (RG + kGroup - 1) / kGroup;
  const int64_t first = a.seq_lens[it.b] - n + it.r0;  // position of the item's first row
  const int64_t L = first + R;                         // keys its last row sees
  const int64_t* table = a.tables + it.b * a.max_blocks;
  // Query x = i * G + g of kv head it.h0 + hh: row it.r0 + i, query head g of the group; its state
  // at hh * RG + x. Queries packed per group of 16 for tile 2: qt[((hh * NG + j) * D / 32 + c) * 256
  // + 16 k + q] = dims 32 c + 2 k, + 1 of query 16 j + q (zeros past RG).
  thread_local std::vector<float> acc, m, l;
  thread_local std::vector<uint32_t> qt;
  thread_local std::vector<int> xrow;
  thread_local std::vector<Tile> tiles;
  alignas(64) float st[kTile * 16];
  alignas(64) float obuf[16 * D];
  alignas(64) BF16 pbuf[16 * kTile];
  alignas(64) BF16 vbuf[D / 16 * 16 * 32];
  alignas(64) BF16 kbuf[kTile * D];
  acc.assign(NH * RG * D, 0.f);
  m.assign(NH * RG, kNoScore);
  l.assign(NH * RG, 0.f);
  qt.resize(NH * NG * D / 32 * 256);
  xrow.resize(NG * kGroup);
  for (int64_t x = 0; x < NG * kGroup; ++x) xrow[x] = static_cast<int>(x / G);
  for (int64_t hh = 0; hh < NH; ++hh)
    for (int64_t j = 0; j < NG; ++j) {
      // The group's queries as rows of 16 dwords (pairs of dims), transposed per 32 dims.
      const int64_t nq = std::min<int64_t>(kGroup, RG - j * kGroup);
      for (int64_t c = 0; c < D / 32; ++c) {
        __m512 r[16];
        for (int64_t q = 0; q < 16; ++q) {
          const int64_t x = j * kGroup + q, i = x / G, g = x % G;
          r[q] = q < nq ? _mm512_loadu_ps(reinterpret_cast<const float*>(
                              a.q + ((q0 + it.r0 + i) * H + (it.h0 + hh) * G + g) * D + c * 32))
                        : _mm512_setzero_ps();
        }
        transpose16(r);
        float* dst = reinterpret_cast<float*>(qt.data() + ((hh * NG + j) * (D / 32) + c) * 256);
        for (int k = 0; k < 16; ++k) _mm512_storeu_ps(dst + 16 * k, r[k]);
      }
    }
  // The item's tiles, from the one holding row 0's first key (lo0) to its last row's; a half with
  // no key in [lo0, L) is not read.
  const int64_t lo0 = W > 0 ? std::max<int64_t>(0, first + 1 - W) : 0;
  tiles.clear();
  for (int64_t k0 = lo0 / kTile * kTile; k0 < L; k0 += kTile) {
    Tile t{k0, static_cast<int>(std::min<int64_t>(kTile, L - k0)), {-1, -1}};
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t kh = k0 + hf * kHalf;
      if (kh < L && kh + kHalf > lo0) t.slot[hf] = table[kh / bs] * bs + kh % bs;
    }
    tiles.push_back(t);
  }
  // K / V rows of this item's heads are prefetched a tile ahead, a share of each half's rows before
  // each head's products (the first tile's at once).
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  LineFeed feed;
  auto feed_share = [&](int64_t ti, int64_t part, int64_t parts) {
    const Tile& t = tiles[ti];
    feed.reset(row, NH * D * 2);
    for (int hf = 0; hf < 2; ++hf) {
      if (t.slot[hf] < 0) continue;
      const int rows = static_cast<int>(std::min<int64_t>(kHalf, L - t.k0 - hf * kHalf));
      const int r0 = static_cast<int>(rows * part / parts), r1 = static_cast<int>(rows * (part + 1) / parts);
      const int64_t off = (t.slot[hf] + r0) * row + it.h0 * D;
      feed.add(a.k_cache + off, a.v_cache + off, r1 - r0);
    }
  };
  if (n_tiles > 0) {
    feed_share(0, 0, 1);
    feed.rest();
  }
  configure(static_cast<int>(std::min<int64_t>(kGroup, RG)));
  int lo[16], hi[16];
  for (int64_t ti = 0; ti < n_tiles; ++ti) {
    const Tile& t = tiles[ti];
    const int64_t k0 = t.k0, k1 = k0 + t.nt - 1;  // the tile's first and last key
    auto feed_next = [&](int64_t hh) {
      feed.rest();
      if (ti + 1 < n_tiles) feed_share(ti + 1, hh, NH);
    };
    // Rows [i_vis, i_end) see some of the tile (never none: the rows' windows cover [lo0, L)):
    // causally row i sees up to first + i; with a window from first + i + 1 - W.
    const int64_t i_vis = std::max<int64_t>(0, k0 - first);
    const int64_t i_end = W > 0 ? std::clamp<int64_t>(k1 + W - first, 0, R) : R;
    auto lanes = [&](int64_t i, int& l0, int& l1) {
      const int64_t p = first + i, from = W > 0 ? std::max<int64_t>(0, p + 1 - W) : 0;
      l0 = static_cast<int>(std::max(k0, from) - k0);
      l1 = static_cast<int>(std::min(k1, p) - k0);
    };
    int k_lo, unused;
    lanes(i_vis, k_lo, unused);  // no row sees the tile's keys before k_lo
    for (int64_t hh = 0; hh < NH; ++hh) {
      const int64_t h = (it.h0 + hh) * D;
      feed_next(hh);
      build_vpairs<D>(a.v_cache, t, h, row, k_lo, vbuf, feed);
      copy_keys<D>(a.k_cache, t, h, row, kbuf, feed);
      for (int64_t j = i_vis * G / kGroup; j * kGroup < i_end * G; ++j) {
        const int nq = static_cast<int>(std::min<int64_t>(kGroup, RG - j * kGroup));
        for (int q = 0; q < nq; ++q) {
          const int64_t i = xrow[j * kGroup + q];
          if (i >= i_vis && i < i_end) {
            lanes(i, lo[q], hi[q]);
          } else {
            lo[q] = 1;
            hi[q] = 0;
          }
        }
        _tile_zero(0);
        _tile_zero(6);
#pragma GCC unroll 8
        for (int c = 0; c < D / 32; ++c) {
          _tile_loadd(2, qt.data() + ((hh * NG + j) * (D / 32) + c) * 256, 64);
          _tile_loadd(1, kbuf + c * 32, D * 2);
          _tile_loadd(7, kbuf + kHalf * D + c * 32, D * 2);
          _tile_dpbf16ps(0, 1, 2);
          _tile_dpbf16ps(6, 7, 2);
        }
        _tile_stored(0, st, 64);
        _tile_stored(6, st + 256, 64);
        const int64_t x0 = hh * RG + j * kGroup;
        attend_group<D>(st, nq, lo, hi, a.scale, a.softcap, m.data() + x0, l.data() + x0, acc.data() + x0 * D,
                        pbuf, vbuf, obuf, feed);
      }
    }
  }
  feed.rest();
  _tile_release();
  static const std::vector<int> slot = [] {
    std::vector<int> v(D);
    for (int d = 0; d < D; ++d) v[d] = static_cast<int>(bf16_pair_slot(d));
    return v;
  }();
  alignas(64) float tmp[D];
  for (int64_t hh = 0; hh < NH; ++hh)
    for (int64_t x = 0; x < RG; ++x) {
      const float* ag = acc.data() + (hh * RG + x) * D;
      const __m512 inv = _mm512_set1_ps(1.f / l[hh * RG + x]);
      for (int d = 0; d < D; ++d) tmp[d] = ag[slot[d]];
      BF16* ob = a.out + ((q0 + it.r0 + x / G) * H + (it.h0 + hh) * G + x % G) * D;
      for (int d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + d),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(tmp + d), inv))));
    }
}

}  // namespace tm_cpu::amx_rows
#endif
