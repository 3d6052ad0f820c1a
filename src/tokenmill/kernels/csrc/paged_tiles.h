// The tiles both paged attention kernels share (paged_attention.cpp: decode rows; paged_rows.cpp: the
// rows kernel, which computes every row exactly as the decode kernel does): a tile's scores and
// online softmax (attend_tile), the row layouts, the output write; and the portable path's heads.
// Each kernel is its own unit, so the ISA levels compile each only where it changes (the rows
// kernel has an AMX path, the decode kernel none: kernels/build.py).
#pragma once

#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "elementwise.h"
#include "paged_decode.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TM_HEAD_DIMS(X) X(16) X(32) X(64) X(80) X(96) X(128) X(256)
// (query, cache) element types both kernels are instantiated for
#define TM_QUERY_CACHE_TYPES(X)                                                   \
  X(float, float) X(c10::BFloat16, c10::BFloat16) X(float, int8_t) X(c10::BFloat16, int8_t) \
  X(float, c10::Float8_e4m3fn) X(c10::BFloat16, c10::Float8_e4m3fn)

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

#endif  // __AVX512F__

// run(q, k, v, out) with q and out typed by q's dtype (float32 or bfloat16), k and v by the cache's:
// both kernels' entry points.
template <typename F>
void with_query_and_cache(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const char* op, F&& run) {
  auto typed = [&](auto* qp, auto* op_) {
    using T = std::remove_pointer_t<decltype(qp)>;
    with_cache<T>(k_cache, v_cache, [&](auto* kp, auto* vp) { run(qp, kp, vp, op_); });
  };
  if (q.scalar_type() == at::kFloat) {
    typed(q.data_ptr<float>(), out.data_ptr<float>());
  } else if (q.scalar_type() == at::kBFloat16) {
    typed(q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 queries only");
  }
}

}  // namespace
