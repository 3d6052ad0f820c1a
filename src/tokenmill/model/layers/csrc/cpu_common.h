// Small helpers shared by the engine's CPU kernels: scalar conversions to and from float32,
// and (with AVX-512) a vector exp and horizontal-sum trees.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tm_cpu {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float to_f(int8_t x) { return static_cast<float>(x); }
inline void from_f(float v, float* dst) { *dst = v; }
inline void from_f(float v, c10::BFloat16* dst) { *dst = c10::BFloat16(v); }

#if defined(__AVX512F__)
// exp(x) for x <= 0 (arguments below ~-87 give ~0), float32 accuracy (a few ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 values (their bits) widened to float32: a bf16 is the upper half of a float.
inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Online softmax: acc[r][v] = O[r * ld + 16 v ..] * corr[r], R rows of NV vectors, before new terms add in.
template <int R, int NV>
inline void load_rescaled(__m512 (&acc)[R][NV], const float* O, int64_t ld, const float* corr) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(O + r * ld + v * 16), c);
  }
}

// Four vectors a, b, c, d -> per 128-bit lane k: [sum_k(a), sum_k(b), sum_k(c), sum_k(d)],
// where sum_k is the sum of that vector's four floats in lane k.
inline __m512 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)), _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
}
// hsum4 of vectors 0-3, 4-7, 8-11, 12-15 -> lane j holds the full sum of vector j.
inline __m512 hsum_lanes(__m512 u0, __m512 u1, __m512 u2, __m512 u3) {
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}
// Lane j of the result: the sum of v[j]'s lanes (16 horizontal sums in one transpose-add tree).
inline __m512 hsum16(const __m512* v) {
  return hsum_lanes(hsum4(v[0], v[1], v[2], v[3]), hsum4(v[4], v[5], v[6], v[7]), hsum4(v[8], v[9], v[10], v[11]),
                    hsum4(v[12], v[13], v[14], v[15]));
}
// The sum of v's lanes in the order hsum16 sums each vector's: per 128-bit lane k,
// S_k = (x[4k] + x[4k+2]) + (x[4k+1] + x[4k+3]), then (S_0 + S_1) + (S_2 + S_3); so one sum and a
// tile's 16 give the same bits (_mm512_reduce_add_ps sums in another order).
inline float hsum1(__m512 x) {
  const __m512 t = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 a = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(_mm_add_ss(_mm512_castps512_ps128(a), _mm512_extractf32x4_ps(a, 2)));
}
#endif

}  // namespace tm_cpu
