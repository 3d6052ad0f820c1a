// The rows kernel's prompt path on AVX-512 BF16 (paged_attention.cpp's rows_item_d; bf16 queries,
// a bf16 cache): up to 16 (row, query head)s of one kv head that see a whole tile of keys attend it
// together, one (row, head) a vector lane, where attend_tile takes one (row, head) at a time (its
// scores a vector of 16 keys, reduced across lanes). Each lane computes exactly what attend_tile
// computes for it, in the same order:
// - QK: key j's dot with query p is attend_tile's vdpbf16ps chain for lane i (the pair i of each
//   32-element chunk), here with key j's pair broadcast against the queries' pairs (the queries
//   transposed once per work item), and attend_tile's hsum4 / hsum_lanes tree over the 16 lanes,
//   ((x0 + x2) + (x1 + x3)) a four, then (S0 + S1) + (S2 + S3), as vertical adds.
// - softmax: maxima are exact in any order; the weights' sum is reduce_add_fixed's tree as vertical
//   adds; exp16, the bf16 weights and the fused multiply-add of the running sum as attend_tile's.
// - PV: attend_tile's vdpbf16ps on pairs of V rows interleaved by 16-bit unpacks (once per tile and
//   kv head here), the accumulators rescaled first, pairs of keys in order.
// Every add that must keep its place is a builtin with its rounding given (add_fixed): -ffast-math
// cannot reassociate it. So a row's bits stay those it has alone (tests/test_batch_invariance.py).
// The softmax and the sums run on 16 (row, head)s a vector, not one, with no cross-lane reductions.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"

namespace tm_cpu::lanes {

using BF16 = c10::BFloat16;

// 16 rows of bf16 pairs (row j at src + j * ld, D elements, rows n .. 15 zeros) transposed:
// out[c * 16 + i] holds in lane j row j's pair i (elements 2i, 2i + 1) of its 32-element chunk c.
template <int D>
inline void transpose_pairs(const BF16* src, int64_t ld, int n, __m512i* out) {
  for (int c = 0; c < D / 32; ++c) {
    __m512 r[16];  // (pairs of bf16 moved as floats: bits only)
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      r[j] = j < n ? _mm512_loadu_ps(reinterpret_cast<const float*>(src + j * ld + c * 32)) : _mm512_setzero_ps();
    transpose16(r);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm512_store_si512(out + c * 16 + i, _mm512_castps_si512(r[i]));
  }
}

// A tile's V rows (row j at vp + j * row) as attend_tile's P.V reads them: vw[jj * D / 16 + v], rows
// 2 jj and 2 jj + 1 interleaved 16 bits at a time (a missing 2 jj + 1 is zeros).
template <int D>
inline void interleave_v(const BF16* vp, int64_t row, int n, __m512i* vw) {
  for (int j = 0; j < n; j += 2)
#pragma GCC unroll 8
    for (int c2 = 0; c2 < D / 32; ++c2) {
      const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(vp + j * row + c2 * 32));
      const __m512i y = j + 1 < n ? _mm512_loadu_si512(reinterpret_cast<const void*>(vp + (j + 1) * row + c2 * 32))
                                  : _mm512_setzero_si512();
      _mm512_store_si512(vw + j / 2 * (D / 16) + 2 * c2, _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(vw + j / 2 * (D / 16) + 2 * c2 + 1, _mm512_unpackhi_epi16(x, y));
    }
}

// a += the bf16 pairs of q times the pair at k broadcast (vdpbf16ps with {1to16}: GCC 12 does
// not fold a broadcast into it).
inline __m512 dp_bcast(__m512 a, __m512i q, const BF16* k) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(a) : "v"(q), "m"(*reinterpret_cast<const int32_t*>(k)));
  return a;
}

// Keys j0 .. j0 + NJ - 1 (rows at kp + j * row) against the 16 transposed queries qt: s[jj] lane p
// = query p's dot with key j0 + jj, attend_tile's sums in its order (above).
template <int D, int NJ>
inline void dots(const __m512i* qt, const BF16* kp, int64_t row, int j0, __m512* s) {
  __m512 h[NJ][2];  // (S0 + S1), (S2 + S3)
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    __m512 t[NJ][2];  // (x0 + x2), (x1 + x3) of this four
#pragma GCC unroll 2
    for (int odd = 0; odd < 2; ++odd) {
      __m512 x[NJ][2];
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * k + odd + 2 * e;
#pragma GCC unroll 4
        for (int jj = 0; jj < NJ; ++jj) {
          __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
          for (int c = 0; c < D / 32; ++c) a = dp_bcast(a, qt[c * 16 + i], kp + (j0 + jj) * row + c * 32 + 2 * i);
          x[jj][e] = a;
        }
      }
#pragma GCC unroll 4
      for (int jj = 0; jj < NJ; ++jj) t[jj][odd] = add_fixed(x[jj][0], x[jj][1]);
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < NJ; ++jj) {
      const __m512 sk = add_fixed(t[jj][0], t[jj][1]);
      if (k % 2 == 0) h[jj][k / 2] = sk;
      else h[jj][k / 2] = add_fixed(h[jj][k / 2], sk);
    }
  }
#pragma GCC unroll 4
  for (int jj = 0; jj < NJ; ++jj) s[j0 + jj] = add_fixed(h[jj][0], h[jj][1]);
}

// P.V for GP (row, head)s p0 .. p0 + GP - 1 of the 16: their accumulators (acc + p * D, in
// attend_tile's order) rescaled by corr[p], then the tile's npairs key pairs' weights pw[jj * 16 + p].
template <int D, int GP>
inline void pv(const __m512i* vw, const uint32_t* pw, int npairs, const float* corr, int p0, float* acc) {
  constexpr int NV = D / 16;
  __m512 a[GP][NV];
  load_rescaled<GP, NV>(a, acc + p0 * D, D, corr + p0);
  for (int jj = 0; jj < npairs; ++jj) {
    __m512i w[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) w[c] = _mm512_load_si512(vw + jj * NV + c);
#pragma GCC unroll 4
    for (int g = 0; g < GP; ++g) {
      const __m512bh pj = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pw[jj * 16 + p0 + g])));
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], pj, reinterpret_cast<__m512bh>(w[c]));
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GP; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (p0 + g) * D + c * 16, a[g][c]);
}

// (Row, head)s p in [plo, phi) of a group of 16 (queries qt, transposed; softmax state m, l and
// accumulators acc indexed by p) attend a whole tile of n keys (K at kp, V interleaved in vw).
template <int D>
void attend(const __m512i* qt, const BF16* kp, const __m512i* vw, int64_t row, int n, int plo, int phi, float scale,
            float softcap, float* m, float* l, float* acc, float no_score) {
  __m512 s[16];
  int j = 0;
  for (; j + 4 <= n; j += 4) dots<D, 4>(qt, kp, row, j, s);
  for (; j < n; ++j) dots<D, 1>(qt, kp, row, j, s);
  const __mmask16 live = static_cast<__mmask16>(((1u << phi) - 1) & ~((1u << plo) - 1));
  const __m512 old_m = _mm512_mask_loadu_ps(_mm512_set1_ps(no_score), live, m);
  __m512 new_m = old_m;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int k = 0; k < n; ++k) {
    s[k] = _mm512_mul_ps(s[k], sc);
    if (softcap > 0.f) s[k] = softcap16(s[k], softcap);
    new_m = _mm512_max_ps(new_m, s[k]);
  }
  alignas(64) float corr[16];
  _mm512_store_ps(corr, exp16(_mm512_sub_ps(old_m, new_m)));
  __m512 e[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) e[k] = k < n ? exp16(_mm512_sub_ps(s[k], new_m)) : _mm512_setzero_ps();
  // The weights' sum in reduce_add_fixed's order: lanes k and k + 8, then k and k + 4, then k
  // and k + 2, then 0 and 1.
  __m512 t3[8], t6[4];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) t3[k] = add_fixed(e[k], e[k + 8]);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) t6[k] = add_fixed(t3[k], t3[k + 4]);
  const __m512 sum = add_fixed(add_fixed(t6[0], t6[2]), add_fixed(t6[1], t6[3]));
  const __m512 old_l = _mm512_maskz_loadu_ps(live, l);
  _mm512_mask_storeu_ps(l, live, _mm512_fmadd_ps(old_l, _mm512_load_ps(corr), sum));
  _mm512_mask_storeu_ps(m, live, new_m);
  // The weights in bf16, a pair of keys a word (attend_tile's pw), lane p.
  alignas(64) uint32_t pw[8 * 16];
  const int npairs = (n + 1) / 2;
  for (int jj = 0; jj < npairs; ++jj) {
    const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e[2 * jj])));
    const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e[2 * jj + 1])));
    _mm512_store_si512(pw + jj * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
  // (Row, head)s a P.V pass: GP * D / 16 float32 accumulators held in zmm registers.
  constexpr int GP = D / 16 <= 4 ? 4 : D / 16 <= 8 ? 2 : 1;
  int p = plo;
  for (; p + GP <= phi; p += GP) pv<D, GP>(vw, pw, npairs, corr, p, acc);
  switch (phi - p) {
    case 3: if constexpr (GP > 3) pv<D, 3>(vw, pw, npairs, corr, p, acc); break;
    case 2: if constexpr (GP > 2) pv<D, 2>(vw, pw, npairs, corr, p, acc); break;
    case 1: if constexpr (GP > 1) pv<D, 1>(vw, pw, npairs, corr, p, acc); break;
    default: break;
  }
}

}  // namespace tm_cpu::lanes
#endif
