// Paged decode attention for CPU: one query token per sequence, K/V read in place through
// block tables (no gathered copy of the cache). Parallel over work items (paged_decode.h), by
// ATen's thread pool here or by the fused decode step's threads; scores and accumulation in float32; float32, bfloat16, int8 or float8 e4m3 cache
// (int8 / float8 with one float32 scale per slot and kv head).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "elementwise.h"
#include "paged_decode.h"
#include "paged_rows_amx.h"
#include "paged_rows_avx2.h"
#include "paged_rows_lanes.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace tm_cpu;

constexpr float kNoScore = -1e30f;  // finite "minus infinity" (the build uses -ffast-math)

#if defined(__AVX512F__)
// ---- AVX-512 decode path ----
constexpr int kPfBlocks = 2;  // decode_items_d's prefetch distance, in blocks

// Keys are taken in tiles of up to 16 consecutive slots of one block. For a tile, the dot
// products of up to GB query heads (sharing one kv head) with every key row are accumulated
// while the row is in registers, reduced to one vector of 16 scores per head, and the online
// softmax runs on those vectors; then each V row is loaded once and FMA'd into the GB heads'
// float32 accumulators, which stay in registers for the tile.

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  return e4m3x16_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

constexpr int kTile = 16;        // keys per score vector

// How a cache row is read. bf16 rows with D % 32 == 0 are loaded 32 elements at a time and
// split into even and odd elements (shift / mask: no widening loads), so a row's float32
// vectors hold its elements permuted; the queries and the accumulators use the same order
// (RowLayout::kEvenOdd), undone when the result is written.
template <typename T, typename C, int D>
struct RowLayout {
  static constexpr bool kEvenOdd = std::is_same_v<C, c10::BFloat16> && D % 32 == 0;
  // Dots with bf16 K rows via vdpbf16ps when the queries are bf16 too: the bf16 x bf16
  // products are exact in float32 and summed in float32.
#if defined(__AVX512BF16__)
  static constexpr bool kBf16Dot = kEvenOdd && std::is_same_v<T, c10::BFloat16>;
#else
  static constexpr bool kBf16Dot = false;
#endif
  // Position of element d in the permuted order.
  static constexpr int64_t slot(int64_t d) {
    if constexpr (!kEvenOdd) return d;
    const int64_t c2 = d / 32, e = d % 32;
    return c2 * 32 + (e % 2) * 16 + e / 2;
  }
  // Position of element d in the output accumulators: slot(d), except with kBf16Dot, where P.V
  // runs on pairs of V rows interleaved by 16-bit unpacks (attend_tile): bf16_pair_slot(d).
  static constexpr int64_t acc_slot(int64_t d) {
    if constexpr (!kBf16Dot) return slot(d);
    return bf16_pair_slot(d);
  }
};

template <typename T, typename C, int D>
inline void load_row(const C* r, __m512* v) {
  if constexpr (RowLayout<T, C, D>::kEvenOdd) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
#pragma GCC unroll 8
    for (int c2 = 0; c2 < D / 32; ++c2) {
      const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(r + c2 * 32));
      v[2 * c2] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * c2 + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
    }
  } else {
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; ++c) v[c] = load16(r + c * 16);
  }
}

// One tile of n (1..16) keys at kp / vp (rows `row` elements apart) for GB query heads.
// qf: the GB heads' queries (float32, D each); qb: the same as raw bf16 (vdpbf16ps path).
// ksv / vsv: per-key scales (int8 / float8 cache) or null; m, l, acc: the heads' softmax state;
// softcap > 0: scores soft-capped (softcap16).
template <typename T, typename C, int D, int GB>
inline void attend_tile(const float* qf, const T* qb, const C* kp, const C* vp, int64_t row, int n,
                        const float* ksv, const float* vsv, float scale, float softcap, float* m, float* l,
                        float* acc, const char* pfk, const char* pfv, int pf_step) {
  constexpr int NV = D / 16;
  const __mmask16 valid = n >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  __m512 s[GB];
  __m512 dot[GB];
  {
    __m512 u[GB][4];
#pragma GCC unroll 4
    for (int j4 = 0; j4 < 4; ++j4) {
      __m512 part[GB][4];
#pragma GCC unroll 4
      for (int jj = 0; jj < 4; ++jj) {
        const int j = j4 * 4 + jj;
        if (j < n) {
          const C* kr = kp + j * row;
          for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pfk + j * pf_step + o, _MM_HINT_T1);
          if constexpr (RowLayout<T, C, D>::kBf16Dot) {
#if defined(__AVX512BF16__)
            __m512i kv[D / 32];
#pragma GCC unroll 8
            for (int c = 0; c < D / 32; ++c) kv[c] = _mm512_loadu_si512(reinterpret_cast<const void*>(kr + c * 32));
#pragma GCC unroll 4
            for (int g = 0; g < GB; ++g) {
              __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
              for (int c = 0; c < D / 32; ++c)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(qb + g * D + c * 32)),
                                     (__m512bh)kv[c]);
              part[g][jj] = a;
            }
#endif
          } else {
            __m512 kv[NV];
            load_row<T, C, D>(kr, kv);
#pragma GCC unroll 4
            for (int g = 0; g < GB; ++g) {
              __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qf + g * D), kv[0]);
#pragma GCC unroll 16
              for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + c * 16), kv[c], a);
              part[g][jj] = a;
            }
          }
        } else {
#pragma GCC unroll 4
          for (int g = 0; g < GB; ++g) part[g][jj] = _mm512_setzero_ps();
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) u[g][j4] = hsum4(part[g][0], part[g][1], part[g][2], part[g][3]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) dot[g] = hsum_lanes(u[g][0], u[g][1], u[g][2], u[g][3]);
  }
  {
    __m512 sc = _mm512_set1_ps(scale);
    if (ksv != nullptr) sc = _mm512_mul_ps(sc, _mm512_maskz_loadu_ps(valid, ksv));
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      __m512 raw = _mm512_mul_ps(dot[g], sc);
      if (softcap > 0.f) raw = softcap16(raw, softcap);
      s[g] = _mm512_mask_mov_ps(_mm512_set1_ps(kNoScore), valid, raw);
    }
  }
  alignas(64) float p[GB][kTile];
  alignas(64) uint32_t pw[GB][kTile / 2];  // kBf16Dot: the weights in bf16, pairs of keys per word
  alignas(64) float corr[16], bms[16] = {}, old_m[16] = {};
  const __m512 vs = vsv != nullptr ? _mm512_maskz_loadu_ps(valid, vsv) : _mm512_set1_ps(1.f);
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    old_m[g] = m[g];
    bms[g] = std::max(m[g], _mm512_reduce_max_ps(s[g]));
  }
  // The rescale factors of the GB heads in one vector exp (a libm call per head costs more
  // than the rest of the head's softmax); lanes past GB unused.
  _mm512_store_ps(corr, exp16(_mm512_sub_ps(_mm512_load_ps(old_m), _mm512_load_ps(bms))));
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    const float bm = bms[g];
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s[g], _mm512_set1_ps(bm))));
    l[g] = std::fma(l[g], corr[g], reduce_add_fixed(e));  // explicit: the same rounding in every caller
    m[g] = bm;
    if constexpr (RowLayout<T, C, D>::kBf16Dot) {
#if defined(__AVX512BF16__)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw[g]), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
#endif
    } else {
      _mm512_store_ps(p[g], _mm512_mul_ps(e, vs));  // int8 / float8 V: fold the row scale into the weight
    }
  }
  __m512 a[GB][NV];
  load_rescaled<GB, NV>(a, acc, D, corr);
  if constexpr (RowLayout<T, C, D>::kBf16Dot) {
#if defined(__AVX512BF16__)
    // P.V with vdpbf16ps on pairs of keys (P rounded to bf16, as flash attention does): V rows j
    // and j + 1 interleaved 16 bits at a time (a missing j + 1 is zeros), each pair's two weights
    // one broadcast word; half the instructions of float32 FMAs per key.
    for (int j = 0; j < n; j += 2) {
      const C* vr = vp + j * row;
      for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pfv + j * pf_step + o, _MM_HINT_T1);
      if (j + 1 < n)
        for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pfv + (j + 1) * pf_step + o, _MM_HINT_T1);
      __m512i w[NV];
#pragma GCC unroll 8
      for (int c2 = 0; c2 < D / 32; ++c2) {
        const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(vr + c2 * 32));
        const __m512i y = j + 1 < n ? _mm512_loadu_si512(reinterpret_cast<const void*>(vr + row + c2 * 32))
                                    : _mm512_setzero_si512();
        w[2 * c2] = _mm512_unpacklo_epi16(x, y);
        w[2 * c2 + 1] = _mm512_unpackhi_epi16(x, y);
      }
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) {
        const __m512bh pj = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pw[g][j / 2])));
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], pj, reinterpret_cast<__m512bh>(w[c]));
      }
    }
#endif
  } else {
  for (int j = 0; j < n; ++j) {
    const C* vr = vp + j * row;
    for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pfv + j * pf_step + o, _MM_HINT_T1);
    __m512 vv[NV];
    load_row<T, C, D>(vr, vv);
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g][j]);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(pj, vv[c], a[g][c]);
    }
  }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * D + c * 16, a[g][c]);
}

// A (row, head)'s output: its accumulators (in RowLayout's acc_slot order) times inv, rounded to
// T (as from_f rounds), in vectors: each 32 elements' order undone by one two-vector permute.
template <typename T, typename C, int D>
inline void write_out(const float* ag, float inv, T* out) {
  using Layout = RowLayout<T, C, D>;
  struct Perm {  // lane r of output vector h of a 32-element chunk: lane idx[h][r] of the chunk's two
    alignas(64) int32_t idx[2][16] = {};
    constexpr Perm() {
      for (int e = 0; e < 32; ++e) idx[e / 16][e % 16] = static_cast<int32_t>(Layout::acc_slot(e));
    }
  };
  static constexpr Perm perm{};
  const __m512 vi = _mm512_set1_ps(inv);
#pragma GCC unroll 8
  for (int o = 0; o < D / 16; ++o) {
    __m512 v;
    if constexpr (Layout::kEvenOdd)
      v = _mm512_permutex2var_ps(_mm512_loadu_ps(ag + o / 2 * 32), _mm512_load_si512(perm.idx[o % 2]),
                                 _mm512_loadu_ps(ag + o / 2 * 32 + 16));
    else
      v = _mm512_loadu_ps(ag + o * 16);  // element order
    v = _mm512_mul_ps(v, vi);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(out + o * 16, v);
    } else {
#if defined(__AVX512BW__)
      store_lanes(out + o * 16, v, static_cast<__mmask16>(0xFFFF));
#else
      alignas(64) float f[16];
      _mm512_store_ps(f, v);
      for (int r = 0; r < 16; ++r) from_f(f[r], out + o * 16 + r);
#endif
    }
  }
}

template <typename C>
inline void prefetch_rows(const C* p, int64_t row, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* r = reinterpret_cast<const char*>(p + j * row);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
  }
}

// Work items are (sequence, split): a split is a run of the sequence's blocks, all kv heads,
// so each block's K and V (contiguous: [block_size, Hkv, D]) are streamed once, front to back.
// Sequences are split (partial softmax states merged afterwards) only when there are too few
// of them to keep every thread busy (decode_splits).
template <typename T, typename C, int D>
void decode_items_d(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  constexpr bool quantized = kScaledCache<C>;
  constexpr int NV = D / 16;
  // Query heads per register tile: GB * NV float32 accumulators held in zmm registers.
  constexpr int kMaxGB = NV <= 4 ? 4 : NV <= 5 ? 3 : NV <= 8 ? 2 : 1;
  using Layout = RowLayout<T, C, D>;
  const int64_t H = a.H, Hkv = a.Hkv, S = a.splits, block_size = a.block_size;
  const C* k_cache = a.k_cache;
  const C* v_cache = a.v_cache;
  const float* k_scale = a.k_scale;
  const float* v_scale = a.v_scale;
  const float scale = a.scale, softcap = a.softcap;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements per cache slot
  std::vector<float> qf(H * D), acc(H * D), m(H), l(H), ksv(Hkv * kTile), vsv(Hkv * kTile);
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(C));
  // Item i's keys L, its window's first key lo and its blocks [bi0, bi1).
  struct Span {
    int64_t L, lo, bi0, bi1;
  };
  auto span = [&](int64_t i) {
    const int64_t b = i / S, s = i % S;
    const int64_t L = a.seq_lens[b];
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;
    const int64_t nblocks = (L + block_size - 1) / block_size, blo = lo / block_size;
    const int64_t per_split = (nblocks - blo + S - 1) / S;
    const int64_t bi0 = std::min(nblocks, blo + s * per_split);
    return Span{L, lo, bi0, std::min(nblocks, bi0 + per_split)};
  };
  // K and V are prefetched kPfBlocks blocks ahead of the block computed, across the items (a
  // sequence's first blocks during the previous one's last, not a demand miss): against one block
  // ahead within an item, 1.0-1.4x on bf16 caches, int8 within the noise
  // (benchmarks/paged_decode_kernel.py --compare, 1-32 sequences of 320-1000 keys, random and
  // consecutive blocks; 2 cores, AMD EPYC).
  int64_t ci = begin;  // the cursor: item ci's block cb
  Span cs = ci < end ? span(ci) : Span{};
  int64_t cb = cs.bi0;
  auto ahead = [&](const char*& k, const char*& v, int64_t& bytes) {
    while (ci < end && cb >= cs.bi1)
      if (++ci < end) cb = (cs = span(ci)).bi0;
    if (ci >= end) return;
    const int64_t nbase = a.tables[ci / S * a.max_blocks + cb] * block_size;
    bytes = std::min(block_size, cs.L - cb * block_size) * row_bytes;
    k = reinterpret_cast<const char*>(k_cache + nbase * row);
    v = reinterpret_cast<const char*>(v_cache + nbase * row);
    if constexpr (quantized) {
      prefetch_rows(k_scale + nbase * Hkv, 0, 1, block_size * Hkv * 4);
      prefetch_rows(v_scale + nbase * Hkv, 0, 1, block_size * Hkv * 4);
    }
    ++cb;
  };
  for (int p = 0; p < kPfBlocks; ++p) {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t bytes = 0;
    ahead(k, v, bytes);
    if (bytes > 0) {
      prefetch_rows(k, 0, 1, bytes);
      prefetch_rows(v, 0, 1, bytes);
    }
  }
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / S;
    const auto [L, lo, bi0, bi1] = span(i);
    const int64_t* table = a.tables + b * a.max_blocks;
    const int64_t blo = lo / block_size;
    const T* qb = a.q + b * H * D;
    for (int64_t g = 0; g < H; ++g)
      for (int64_t d = 0; d < D; ++d) qf[g * D + Layout::slot(d)] = to_f(qb[g * D + d]);
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), kNoScore);
    std::fill(l.begin(), l.end(), 0.f);
    for (int64_t bi = bi0; bi < bi1; ++bi) {
      // The block kPfBlocks ahead, a few lines per key row processed.
      const char* nk = nullptr;
      const char* nv = nullptr;
      int64_t next_bytes = 0;
      ahead(nk, nv, next_bytes);
      int64_t pf_done = 0;
      const int64_t nb = std::min(block_size, L - bi * block_size);
      const int64_t base = table[bi] * block_size;
      const int64_t jlo = bi == blo ? lo % block_size : 0;  // keys before the window are never read
      for (int64_t t0 = jlo / kTile * kTile; t0 < nb; t0 += kTile) {
        // The block's kTile-aligned tiles clipped to the window (the rows kernel cuts them the same way).
        const int64_t j0 = std::max(t0, jlo);
        const int n = static_cast<int>(std::min<int64_t>(t0 + kTile, nb) - j0);
        if constexpr (quantized) {
          for (int j = 0; j < n; ++j)
            for (int64_t h = 0; h < Hkv; ++h) {
              ksv[h * kTile + j] = k_scale[(base + j0 + j) * Hkv + h];
              vsv[h * kTile + j] = v_scale[(base + j0 + j) * Hkv + h];
            }
        }
        const int64_t calls = ((nb - t0 + kTile - 1) / kTile) * Hkv;  // tile x head calls left
        for (int64_t h = 0; h < Hkv; ++h) {
          // This call's share of the next block, in 64-byte lines per key row.
          const int64_t left = next_bytes - pf_done;
          const int step = left > 0 ? static_cast<int>((left / (calls - h) + n * 64 - 1) / (n * 64) * 64) : 0;
          const char* pfk = nk + pf_done;
          const char* pfv = nv + pf_done;
          pf_done += static_cast<int64_t>(step) * n;
          const C* kp = k_cache + (base + j0) * row + h * D;
          const C* vp = v_cache + (base + j0) * row + h * D;
          const float* ks = quantized ? ksv.data() + h * kTile : nullptr;
          const float* vs = quantized ? vsv.data() + h * kTile : nullptr;
          for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += kMaxGB) {
            const int64_t gb = std::min<int64_t>(kMaxGB, (h + 1) * G - g0);
            const float* qg = qf.data() + g0 * D;
            const T* qbg = qb + g0 * D;
            float* mg = m.data() + g0;
            float* lg = l.data() + g0;
            float* ag = acc.data() + g0 * D;
            const int pstep = g0 == h * G ? step : 0;
            switch (gb) {
              case 1: attend_tile<T, C, D, 1>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep); break;
              case 2:
                if constexpr (kMaxGB >= 2) attend_tile<T, C, D, 2>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep);
                break;
              case 3:
                if constexpr (kMaxGB >= 3) attend_tile<T, C, D, 3>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep);
                break;
              default:
                if constexpr (kMaxGB >= 4) attend_tile<T, C, D, 4>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep);
                break;
            }
          }
        }
      }
    }
    if (S == 1) {
      T* ob = a.out + b * H * D;
      for (int64_t g = 0; g < H; ++g) write_out<T, C, D>(acc.data() + g * D, 1.f / l[g], ob + g * D);
    } else {
      if constexpr (Layout::kEvenOdd) {  // accumulators back to element order
        float tmp[D];
        for (int64_t g = 0; g < H; ++g) {
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) tmp[d] = ag[Layout::acc_slot(d)];
          std::copy(tmp, tmp + D, ag);
        }
      }
      float* ml = a.part_ml + i * H * 2;
      std::copy(m.begin(), m.end(), ml);
      std::copy(l.begin(), l.end(), ml + H);
      std::copy(acc.begin(), acc.end(), a.part_acc + i * H * D);
    }
  }
}

// The rows kernel (paged_decode.h; bf16 where AMX runs: paged_rows_amx.h): for each row of the
// item, exactly decode_items_d's computation with splits = 1 at that row's length. Key tiles are
// the decode kernel's (up to 16 keys of one block); a tile is attended by every (row, head) of the
// item that sees all of it in groups of up to kMaxGB sharing its K and V rows, and by the rows that
// see part of it (the causal diagonal) one at a time with only the keys they see. A (row, head)'s
// softmax state and accumulators never mix with another's, and attend_tile computes each head of
// a group as it computes a lone head, so the grouping leaves every result as the row alone gives it.
// With AVX-512 BF16 (bf16 queries and cache) a whole group of 16 (row, head)s that sees all of a
// tile takes it in one vector, each lane computing what attend_tile computes (paged_rows_lanes.h):
// a prompt's attention at 1.44-1.65x (SmolLM2's and Llama's heads, benchmarks/paged_decode_kernel.py
// --rows 512; 2 cores, AMD EPYC).
template <typename T, typename C, int D>
void rows_item_d(const RowsArgs<T, C>& a, const RowsItem& it) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if constexpr (amx_rows::kTakes<T, C, D>)  // bf16 on the tile unit (paged_rows_amx.h): every row count
    if (amx_rows::usable(a.block_size)) return amx_rows::rows_item<D>(a, it);
#endif
  constexpr bool quantized = kScaledCache<C>;
  constexpr int NV = D / 16;
  constexpr int kMaxGB = NV <= 4 ? 4 : NV <= 5 ? 3 : NV <= 8 ? 2 : 1;
  using Layout = RowLayout<T, C, D>;
  const int64_t H = a.H, Hkv = a.Hkv, G = H / Hkv, bs = a.block_size;
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t q0 = a.q_start[it.b], n = a.q_start[it.b + 1] - q0;
  const int64_t R = it.r1 - it.r0, NH = it.h1 - it.h0, RG = R * G;
  const int64_t first = a.seq_lens[it.b] - n + it.r0;  // position of the item's first row
  const int64_t L = first + R;                         // keys its last row sees
  const int64_t* table = a.tables + it.b * a.max_blocks;
  // (row, head) x = (hh * R + i) * G + g: kv head it.h0 + hh, row it.r0 + i, query head g of the group
  thread_local std::vector<float> qf, acc, m, l, ksv, vsv;
  thread_local std::vector<T> qb;
  qf.resize(NH * RG * D);
  acc.assign(NH * RG * D, 0.f);
  m.assign(NH * RG, kNoScore);
  l.assign(NH * RG, 0.f);
  qb.resize(NH * RG * D);
  if constexpr (quantized) {
    ksv.resize(NH * kTile);
    vsv.resize(NH * kTile);
  }
  for (int64_t hh = 0; hh < NH; ++hh)
    for (int64_t i = 0; i < R; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t x = (hh * R + i) * G + g;
        const T* src = a.q + ((q0 + it.r0 + i) * H + (it.h0 + hh) * G + g) * D;
        if constexpr (!Layout::kBf16Dot)  // (the bf16 dots read qb)
          for (int64_t d = 0; d < D; ++d) qf[x * D + Layout::slot(d)] = to_f(src[d]);
        std::copy(src, src + D, qb.data() + x * D);
      }
  // With a sliding window W row i sees keys lo(i) = first + i + 1 - W .. first + i only: the blocks
  // before row 0's window are never read (they may be freed).
  const int64_t W = a.window;
  const int64_t lo0 = W > 0 ? std::max<int64_t>(0, first + 1 - W) : 0;
  const int64_t nblocks = (L + bs - 1) / bs, blo = lo0 / bs;
  // The next block's K and V are prefetched while this one is computed: with every kv head in the
  // item (its slots' rows whole, contiguous) a share at each (tile, head) as decode_items_d does,
  // else (one head's slice of each row) all at once.
  const bool all_heads = NH == Hkv;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(C));
#if defined(__AVX512BF16__)
  // The lanes path: the item's queries transposed, 16 (row, head)s of a kv head a group.
  constexpr int64_t kLanesFrom = 16;  // (row, head)s of a group seeing a whole tile
  const int64_t groups = (RG + 15) / 16;
  struct alignas(64) Words16 {
    __m512i v;
  };
  thread_local std::vector<Words16> qt_store;
  alignas(64) __m512i vw[Layout::kBf16Dot ? 8 * D / 16 : 1];
  if constexpr (Layout::kBf16Dot) {
    qt_store.resize(NH * groups * (D / 2));
    for (int64_t hh = 0; hh < NH; ++hh)
      for (int64_t gi = 0; gi < groups; ++gi)
        lanes::transpose_pairs<D>(reinterpret_cast<const lanes::BF16*>(qb.data() + (hh * RG + gi * 16) * D), D,
                                  static_cast<int>(std::min<int64_t>(16, RG - gi * 16)), &qt_store[(hh * groups + gi) * (D / 2)].v);
  }
  const __m512i* qt = qt_store.empty() ? nullptr : &qt_store[0].v;
#endif
  if (all_heads) {
    const int64_t first_bytes = std::min(bs, L - blo * bs) * row_bytes;
    prefetch_rows(reinterpret_cast<const char*>(a.k_cache + table[blo] * bs * row), 0, 1, first_bytes);
    prefetch_rows(reinterpret_cast<const char*>(a.v_cache + table[blo] * bs * row), 0, 1, first_bytes);
  }
  for (int64_t bi = blo; bi < nblocks; ++bi) {
    const int64_t nb = std::min(bs, L - bi * bs);
    const int64_t base = table[bi] * bs;
    const char* nk = nullptr;
    const char* nv = nullptr;
    int64_t next_bytes = 0, pf_done = 0;
    if (bi + 1 < nblocks) {
      const int64_t nbase = table[bi + 1] * bs, nn = std::min(bs, L - (bi + 1) * bs);
      if (all_heads) {
        next_bytes = nn * row_bytes;
        nk = reinterpret_cast<const char*>(a.k_cache + nbase * row);
        nv = reinterpret_cast<const char*>(a.v_cache + nbase * row);
      } else {
        const int64_t head_bytes = NH * D * static_cast<int64_t>(sizeof(C));
        prefetch_rows(a.k_cache + nbase * row + it.h0 * D, row, nn, head_bytes);
        prefetch_rows(a.v_cache + nbase * row + it.h0 * D, row, nn, head_bytes);
      }
      if constexpr (quantized) {
        prefetch_rows(a.k_scale + nbase * Hkv, 0, 1, bs * Hkv * 4);
        prefetch_rows(a.v_scale + nbase * Hkv, 0, 1, bs * Hkv * 4);
      }
    }
    for (int64_t j0 = bi == blo ? lo0 % bs / kTile * kTile : 0; j0 < nb; j0 += kTile) {
      const int nt = static_cast<int>(std::min<int64_t>(kTile, nb - j0));
      const int64_t k0 = bi * bs + j0, k1 = k0 + nt - 1;  // the tile's first and last key
      // Causally row i sees none of this tile below i_vis, all of it from i_full; its window
      // starts at or before k0 below i_wfull, at or before k1 below i_wvis. Rows [i_full, i_wfull)
      // see the whole tile; the others in [i_vis, i_wvis) see part of it (the causal diagonal, the
      // window's edge): a row alone, only its keys, as the decode kernel clips the tile for it.
      const int64_t i_vis = std::max<int64_t>(0, k0 - first);
      const int64_t i_full = std::min<int64_t>(R, std::max<int64_t>(i_vis, k1 - first));
      const int64_t i_wfull = W > 0 ? std::clamp<int64_t>(k0 + W - first, 0, R) : R;
      const int64_t i_wvis = W > 0 ? std::clamp<int64_t>(k1 + W - first, 0, R) : R;
      auto visible = [&](int64_t i, int64_t& off, int& keys) {  // row i's keys in the tile: [k0 + off, + keys)
        const int64_t a0 = W > 0 ? std::max(k0, first + i + 1 - W) : k0, a1 = std::min(k1, first + i);
        off = a0 - k0;
        keys = static_cast<int>(a1 - a0 + 1);
        return a1 >= a0 && !(i >= i_full && i < i_wfull);
      };
      if constexpr (quantized) {
        for (int j = 0; j < nt; ++j)
          for (int64_t hh = 0; hh < NH; ++hh) {
            ksv[hh * kTile + j] = a.k_scale[(base + j0 + j) * Hkv + it.h0 + hh];
            vsv[hh * kTile + j] = a.v_scale[(base + j0 + j) * Hkv + it.h0 + hh];
          }
      }
      // The keys of the first call at each (tile, head), which sizes its share of the prefetch.
      int first_keys = nt;
      for (int64_t i = i_vis, off; i < i_wvis; ++i) {
        int keys;
        if (visible(i, off, keys)) {
          first_keys = keys;
          break;
        }
      }
      const int64_t calls = ((nb - j0 + kTile - 1) / kTile) * NH;  // (tile, head) pairs left in the block
      for (int64_t hh = 0; hh < NH; ++hh) {
        const int64_t h = it.h0 + hh;
        const C* kp = a.k_cache + (base + j0) * row + h * D;
        const C* vp = a.v_cache + (base + j0) * row + h * D;
        const float* ks = quantized ? ksv.data() + hh * kTile : nullptr;
        const float* vs = quantized ? vsv.data() + hh * kTile : nullptr;
        // This (tile, head)'s share of the next block, in 64-byte lines per key row of its first call.
        const int64_t left = next_bytes - pf_done;
        int pstep = left > 0 ? static_cast<int>((left / (calls - hh) + first_keys * 64 - 1) / (first_keys * 64) * 64) : 0;
        const char* pfk = nk + pf_done;
        const char* pfv = nv + pf_done;
        pf_done += static_cast<int64_t>(pstep) * first_keys;
        auto attend = [&](int64_t x, int64_t gb, int64_t off, int keys) {
          float* qg = qf.data() + x * D;
          const T* qbg = qb.data() + x * D;
          float* mg = m.data() + x;
          float* lg = l.data() + x;
          float* ag = acc.data() + x * D;
          const C* kq = kp + off * row;
          const C* vq = vp + off * row;
          const float* ksq = quantized ? ks + off : nullptr;
          const float* vsq = quantized ? vs + off : nullptr;
          const int ps = pstep;
          pstep = 0;  // the first call of the (tile, head) prefetches
          switch (gb) {
            case 1: attend_tile<T, C, D, 1>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps); break;
            case 2:
              if constexpr (kMaxGB >= 2) attend_tile<T, C, D, 2>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps);
              break;
            case 3:
              if constexpr (kMaxGB >= 3) attend_tile<T, C, D, 3>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps);
              break;
            default:
              if constexpr (kMaxGB >= 4) attend_tile<T, C, D, 4>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps);
              break;
          }
        };
        for (int64_t i = i_vis, off; i < i_wvis; ++i) {  // rows seeing part of the tile
          int keys;
          if (visible(i, off, keys))
            for (int64_t g0 = 0; g0 < G; g0 += kMaxGB) attend((hh * R + i) * G + g0, std::min<int64_t>(kMaxGB, G - g0), off, keys);
        }
        // Rows seeing all of it, by groups of 16 (row, head)s: a group with enough of them in one
        // vector (paged_rows_lanes.h; its cost is the same for 1 or 16), the rest kMaxGB at a time.
        bool v_ready = false;
        for (int64_t x = i_full * G; x < i_wfull * G;) {
          const int64_t gi = x / 16, end = std::min<int64_t>(i_wfull * G, gi * 16 + 16);
#if defined(__AVX512BF16__)
          if constexpr (Layout::kBf16Dot)
            if (end - x >= kLanesFrom) {
              if (pstep > 0)  // this (tile, head)'s share of the next block's prefetch
                for (int j = 0; j < first_keys; ++j)
                  for (int o = 0; o < pstep; o += 64) {
                    _mm_prefetch(pfk + j * pstep + o, _MM_HINT_T1);
                    _mm_prefetch(pfv + j * pstep + o, _MM_HINT_T1);
                  }
              pstep = 0;
              if (!v_ready) lanes::interleave_v<D>(reinterpret_cast<const lanes::BF16*>(vp), row, nt, vw);
              v_ready = true;
              const int64_t x0 = hh * RG + gi * 16;
              lanes::attend<D>(qt + (hh * groups + gi) * (D / 2), reinterpret_cast<const lanes::BF16*>(kp), vw, row,
                               nt, static_cast<int>(x - gi * 16), static_cast<int>(end - gi * 16), a.scale, a.softcap,
                               m.data() + x0, l.data() + x0, acc.data() + x0 * D, kNoScore);
              x = end;
              continue;
            }
#endif
          for (; x < end; x += kMaxGB) attend(hh * RG + x, std::min<int64_t>(kMaxGB, end - x), 0, nt);
          x = end;
        }
      }
    }
  }
  for (int64_t hh = 0; hh < NH; ++hh)
    for (int64_t i = 0; i < R; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t x = (hh * R + i) * G + g;
        write_out<T, C, D>(acc.data() + x * D, 1.f / l[x], a.out + ((q0 + it.r0 + i) * H + (it.h0 + hh) * G + g) * D);
      }
}

#else  // portable path

// One query row's G heads of kv head h (q_row, out_row: [H, D]) over keys lo .. L - 1: one pass
// over each block (online softmax, rescaled once per block), K and V rows read straight from the cache.
template <typename T, typename C, int D>
void portable_heads(const T* q_row, T* out_row, int64_t lo, int64_t L, const int64_t* table, int64_t h,
                    const C* k_cache, const C* v_cache, const float* k_scale, const float* v_scale, int64_t H,
                    int64_t Hkv, int64_t block_size, float scale, float softcap) {
  constexpr bool quantized = kScaledCache<C>;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements per cache slot
  std::vector<float> qf(G * D), acc(G * D, 0.f), s(G * block_size), m(G, -INFINITY), l(G, 0.f);
  alignas(64) float kv[D];
  for (int64_t g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qf[g * D + d] = to_f(q_row[(h * G + g) * D + d]) * scale;
  for (int64_t b0 = lo / block_size * block_size; b0 < L; b0 += block_size) {
    const int64_t t0 = std::max(b0, lo);  // this block's first key in the window
    const int64_t n = std::min(b0 + block_size, L) - t0;
    const int64_t base = table[b0 / block_size] * block_size + (t0 - b0);
    const C* kb = k_cache + base * row + h * D;
    const C* vb = v_cache + base * row + h * D;
    for (int64_t j = 0; j < n; ++j) {
      const C* kp = kb + j * row;
      for (int d = 0; d < D; ++d) kv[d] = to_f(kp[d]);
      const float ks = quantized ? k_scale[(base + j) * Hkv + h] : 1.f;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf.data() + g * D;
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qg[d] * kv[d];
        s[g * block_size + j] = softcap1(dot * ks, softcap);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.data() + g * block_size;
      float bm = m[g];
      for (int64_t j = 0; j < n; ++j) bm = sg[j] > bm ? sg[j] : bm;
      const float correction = std::exp(m[g] - bm);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        sg[j] = std::exp(sg[j] - bm);
        sum += sg[j];
      }
      l[g] = l[g] * correction + sum;
      m[g] = bm;
      float* ag = acc.data() + g * D;
      if (correction != 1.f)
        for (int d = 0; d < D; ++d) ag[d] *= correction;
    }
    for (int64_t j = 0; j < n; ++j) {
      const C* vp = vb + j * row;
      const float vs = quantized ? v_scale[(base + j) * Hkv + h] : 1.f;
      for (int d = 0; d < D; ++d) kv[d] = to_f(vp[d]) * vs;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * block_size + j];
        float* ag = acc.data() + g * D;
        for (int d = 0; d < D; ++d) ag[d] += p * kv[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    for (int d = 0; d < D; ++d) from_f(acc[g * D + d] * inv, out_row + (h * G + g) * D + d);
  }
}

// Work items are sequences (never split).
template <typename T, typename C, int D>
void decode_items_d(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const int64_t L = a.seq_lens[b], lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;
    for (int64_t h = 0; h < a.Hkv; ++h)
      portable_heads<T, C, D>(a.q + b * a.H * D, a.out + b * a.H * D, lo, L, a.tables + b * a.max_blocks, h,
                              a.k_cache, a.v_cache, a.k_scale, a.v_scale, a.H, a.Hkv, a.block_size, a.scale,
                              a.softcap);
  }
}

// Each row as a lone decode row at its length (with AVX2: paged_rows_avx2.h, rows sharing tiles).
template <typename T, typename C, int D>
void rows_item_d(const RowsArgs<T, C>& a, const RowsItem& it) {
#if defined(__AVX2__) && defined(__FMA__)
  avx2::rows_item<T, C, D>(a, it);
#else
  const int64_t q0 = a.q_start[it.b], n = a.q_start[it.b + 1] - q0;
  for (int64_t i = it.r0; i < it.r1; ++i) {
    const int64_t L = a.seq_lens[it.b] - n + i + 1, lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;
    for (int64_t h = it.h0; h < it.h1; ++h)
      portable_heads<T, C, D>(a.q + (q0 + i) * a.H * D, a.out + (q0 + i) * a.H * D, lo, L,
                              a.tables + it.b * a.max_blocks, h, a.k_cache, a.v_cache, a.k_scale, a.v_scale, a.H,
                              a.Hkv, a.block_size, a.scale, a.softcap);
  }
#endif
}

#endif  // __AVX512F__

}  // namespace

namespace tm_cpu {

int64_t decode_splits(const int64_t* seq_lens, int64_t B, int64_t block_size, int64_t threads, int64_t window) {
#if defined(__AVX512F__)
  if (B >= 4 * threads) return 1;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, window > 0 ? std::min(seq_lens[b], window + block_size) : seq_lens[b]);
  const int64_t most_blocks = (longest + block_size - 1) / block_size;
  return std::max<int64_t>(1, std::min<int64_t>((4 * threads + B - 1) / B, most_blocks / 2));
#else
  return 1;
#endif
}

#define TM_HEAD_DIMS(X) X(16) X(32) X(64) X(80) X(96) X(128) X(256)

bool decode_head_dim_supported(int64_t D) {
#define TM_CASE(DIM) case DIM:
  switch (D) {
    TM_HEAD_DIMS(TM_CASE) return true;
    default: return false;
  }
#undef TM_CASE
}

template <typename T, typename C>
void decode_items(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
#define TM_CASE(DIM) \
  case DIM: return decode_items_d<T, C, DIM>(a, begin, end);
  switch (a.D) {
    TM_HEAD_DIMS(TM_CASE)
    default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", a.D);
  }
#undef TM_CASE
}

// out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), over the splits of
// items [begin, end) of (sequence, head).
template <typename T, typename C>
void decode_merge(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  const int64_t H = a.H, D = a.D, S = a.splits;
  std::vector<float> o(D);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / H, g = i % H;
    float mx = kNoScore;
    for (int64_t s = 0; s < S; ++s) mx = std::max(mx, a.part_ml[((b * S + s) * H) * 2 + g]);
    float lsum = 0.f;
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t s = 0; s < S; ++s) {
      const float* ml = a.part_ml + (b * S + s) * H * 2;
      const float w = std::exp(ml[g] - mx);
      lsum += w * ml[H + g];
      const float* acc = a.part_acc + ((b * S + s) * H + g) * D;
      for (int d = 0; d < D; ++d) o[d] += w * acc[d];
    }
    const float inv = 1.f / lsum;
    for (int d = 0; d < D; ++d) from_f(o[d] * inv, a.out + i * D + d);
  }
}

std::vector<RowsItem> rows_items(const int64_t* q_start, const int64_t* seq_lens, int64_t B, int64_t Hkv,
                                 int64_t threads) {
  constexpr int64_t kRowBlock = 16;
  std::vector<RowsItem> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r0 = 0, n = q_start[b + 1] - q_start[b]; r0 < n; r0 += kRowBlock)
      items.push_back({b, r0, std::min(n, r0 + kRowBlock), 0, Hkv});
  if (Hkv > 1 && static_cast<int64_t>(items.size()) < 2 * threads) {
    std::vector<RowsItem> per_head;
    for (const auto& it : items)
      for (int64_t h = 0; h < Hkv; ++h) per_head.push_back({it.b, it.r0, it.r1, h, h + 1});
    items.swap(per_head);
  }
  // Still too few (a lone request's verification chunk: 3 kv heads on 2 threads leave one idle
  // half the time): rows split too, in parts of at least kMinRows (each part reads the K/V again).
  constexpr int64_t kMinRows = 4;
  const int64_t have = static_cast<int64_t>(items.size());
  if (have < 2 * threads) {
    const int64_t want = (2 * threads + have - 1) / have;
    std::vector<RowsItem> split;
    for (const auto& it : items) {
      const int64_t parts = std::max<int64_t>(1, std::min(want, (it.r1 - it.r0) / kMinRows));
      for (int64_t p = 0; p < parts; ++p)
        split.push_back({it.b, it.r0 + (it.r1 - it.r0) * p / parts, it.r0 + (it.r1 - it.r0) * (p + 1) / parts, it.h0,
                         it.h1});
    }
    items.swap(split);
  }
  // Most work first: (keys of the last row) x rows x heads.
  auto work = [&](const RowsItem& it) {
    const int64_t ctx = seq_lens[it.b] - (q_start[it.b + 1] - q_start[it.b]);
    return (ctx + it.r1) * (it.r1 - it.r0) * (it.h1 - it.h0);
  };
  std::stable_sort(items.begin(), items.end(), [&](const RowsItem& x, const RowsItem& y) { return work(x) > work(y); });
  return items;
}

template <typename T, typename C>
void rows_item(const RowsArgs<T, C>& a, const RowsItem& it) {
#define TM_CASE(DIM) \
  case DIM: return rows_item_d<T, C, DIM>(a, it);
  switch (a.D) {
    TM_HEAD_DIMS(TM_CASE)
    default: TORCH_CHECK(false, "paged_rows: unsupported head_dim ", a.D);
  }
#undef TM_CASE
}

#define TM_INSTANTIATE(T, C)                                                      \
  template void decode_items<T, C>(const DecodeArgs<T, C>&, int64_t, int64_t); \
  template void decode_merge<T, C>(const DecodeArgs<T, C>&, int64_t, int64_t); \
  template void rows_item<T, C>(const RowsArgs<T, C>&, const RowsItem&);
TM_INSTANTIATE(float, float)
TM_INSTANTIATE(c10::BFloat16, c10::BFloat16)
TM_INSTANTIATE(float, int8_t)
TM_INSTANTIATE(c10::BFloat16, int8_t)
TM_INSTANTIATE(float, c10::Float8_e4m3fn)
TM_INSTANTIATE(c10::BFloat16, c10::Float8_e4m3fn)
#undef TM_INSTANTIATE

}  // namespace tm_cpu

// q: [B, H, D]; k_cache, v_cache: [slots, Hkv, D] (q's dtype, or int8 / float8 e4m3 with k_scale / v_scale:
// [slots, Hkv] float32); block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (keys per
// sequence, the new token included); window > 0: each query sees its last `window` keys only;
// softcap > 0: scores soft-capped. Returns [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                           double scale, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale, int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(scaled_cache(k_cache) || q.scalar_type() == k_cache.scalar_type(), "q and cache dtype differ");
  const float *ks, *vs;
  std::tie(ks, vs) = cache_scales(k_cache, v_cache, k_scale, v_scale);
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0, "heads not a multiple of kv heads");
  auto out = torch::empty_like(q);
  const int64_t* lp = sl.data_ptr<int64_t>();
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode: window and softcap must be >= 0 (0: none)");
  const int64_t S = decode_splits(lp, B, block_size, at::get_num_threads(), window);
  std::vector<float> part_ml(S > 1 ? B * S * H * 2 : 0), part_acc(S > 1 ? B * S * H * D : 0);
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    using C = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const DecodeArgs<T, C> a{qp, kp, vp, ks, vs, bt.data_ptr<int64_t>(), lp, op, B, H, Hkv, D, block_size,
                             bt.size(1), static_cast<float>(scale), S, part_ml.data(), part_acc.data(), window,
                             static_cast<float>(softcap)};
    at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) { decode_items(a, begin, end); });
    if (S > 1) at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) { decode_merge(a, begin, end); });
  };
  auto with_q = [&](auto* qp, auto* op) {
    using T = std::remove_pointer_t<decltype(qp)>;
    with_cache<T>(k_cache, v_cache, [&](auto* kp, auto* vp) { run(qp, kp, vp, op); });
  };
  if (q.scalar_type() == at::kFloat) {
    with_q(q.data_ptr<float>(), out.data_ptr<float>());
  } else if (q.scalar_type() == at::kBFloat16) {
    using BF = c10::BFloat16;
    with_q(q.data_ptr<BF>(), out.data_ptr<BF>());
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 queries only");
  }
  return out;
}

// Every query row of a flat batch attended decode-style (paged_decode.h: the rows kernel).
// q: [T, H, D]; block_tables: [B, max_blocks] int64; seq_lens: [B] int64, keys of each
// sequence's last row; query_start_loc: [B + 1] int64, sequence b's rows are
// query_start_loc[b] .. query_start_loc[b + 1] - 1 at positions seq_lens[b] - n_b ..
// seq_lens[b] - 1, their K/V already in the cache. Returns [T, H, D].
torch::Tensor paged_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                         torch::Tensor seq_lens, torch::Tensor query_start_loc, int64_t block_size, double scale,
                         c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, int64_t window,
                         double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_rows: q [T, H, D], contiguous caches [slots, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong && block_tables.dim() == 2,
              "paged_rows: int64 block tables, lengths and query starts");
  TORCH_CHECK(scaled_cache(k_cache) || q.scalar_type() == k_cache.scalar_type(), "paged_rows: q and cache dtype differ");
  const float *ks, *vs;
  std::tie(ks, vs) = cache_scales(k_cache, v_cache, k_scale, v_scale);
  q = q.contiguous();
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto qs = query_start_loc.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), B = sl.numel();
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "paged_rows: head shapes");
  TORCH_CHECK(qs.numel() == B + 1 && bt.size(0) == B, "paged_rows: one block table and length per sequence");
  const int64_t* qsp = qs.data_ptr<int64_t>();
  const int64_t* lp = sl.data_ptr<int64_t>();
  TORCH_CHECK(qsp[0] == 0 && qsp[B] == T, "paged_rows: query_start_loc must run from 0 to the number of rows");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_rows: window and softcap must be >= 0 (0: none)");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(qsp[b + 1] >= qsp[b] && lp[b] >= qsp[b + 1] - qsp[b] && lp[b] <= bt.size(1) * block_size,
                "paged_rows: sequence lengths / query starts / block tables");
  auto out = torch::empty_like(q);
  const auto items = rows_items(qsp, lp, B, Hkv, at::get_num_threads());
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using TT = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    using CC = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const RowsArgs<TT, CC> a{qp, kp, vp, ks, vs, bt.data_ptr<int64_t>(), lp, qsp, op, B, H, Hkv, D, block_size,
                             bt.size(1), static_cast<float>(scale), window, static_cast<float>(softcap)};
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < n;) rows_item(a, items[i]);
    });
  };
  auto with_q = [&](auto* qp, auto* op) {
    using TT = std::remove_pointer_t<decltype(qp)>;
    with_cache<TT>(k_cache, v_cache, [&](auto* kp, auto* vp) { run(qp, kp, vp, op); });
  };
  if (T == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    with_q(q.data_ptr<float>(), out.data_ptr<float>());
  } else if (q.scalar_type() == at::kBFloat16) {
    using BF = c10::BFloat16;
    with_q(q.data_ptr<BF>(), out.data_ptr<BF>());
  } else {
    TORCH_CHECK(false, "paged_rows: float32 or bfloat16 queries only");
  }
  return out;
}
