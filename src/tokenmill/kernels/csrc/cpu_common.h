// Small helpers shared by the engine's CPU kernels: scalar conversions to and from float32,
// and (with AVX-512) a vector exp and horizontal-sum trees.
#pragma once

#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
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
// float8 e4m3fn (bias 7, no infinities; the cache never holds its NaN code): the 7 magnitude bits
// shifted into a float32's exponent and mantissa and rebiased (+120), subnormals (exponent 0) as
// m * 2^-9. Integer ops and a select, no table: plain loops over a row vectorize.
inline float to_f(c10::Float8_e4m3fn x) {
  const uint32_t mag = x.x & 0x7fu;
  const uint32_t normal = (mag << 20) + (120u << 23);
  float f;
  std::memcpy(&f, &normal, 4);
  if (mag < 8) f = static_cast<float>(static_cast<int32_t>(mag)) * (1.f / 512.f);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= static_cast<uint32_t>(x.x & 0x80u) << 24;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Caches stored with one float32 scale per (slot, kv head): int8 and float8 e4m3.
template <typename C>
inline constexpr bool kScaledCache = std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn>;

// The attention ops' cache arguments: whether a cache is int8 / float8 (scaled), its scales'
// pointers (null for a cache in the queries' dtype), and f(k, v) called with typed pointers.
inline bool scaled_cache(const at::Tensor& cache) {
  return cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn;
}
inline std::pair<const float*, const float*> cache_scales(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                          const c10::optional<at::Tensor>& k_scale,
                                                          const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k and v cache dtype differ");
  if (!scaled_cache(k_cache)) return {nullptr, nullptr};
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 / float8 cache needs its scales");
  TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() &&
              v_scale->scalar_type() == at::kFloat && v_scale->is_contiguous(), "float32 contiguous scales");
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}
template <typename T, typename F>
inline void with_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, F&& f) {
  if (k_cache.scalar_type() == at::kChar) {
    f(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  } else if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    using F8 = c10::Float8_e4m3fn;
    f(reinterpret_cast<const F8*>(k_cache.data_ptr()), reinterpret_cast<const F8*>(v_cache.data_ptr()));
  } else {
    f(k_cache.data_ptr<T>(), v_cache.data_ptr<T>());
  }
}
inline void from_f(float v, float* dst) { *dst = v; }
inline void from_f(float v, c10::BFloat16* dst) { *dst = c10::BFloat16(v); }

// One (token, kv head) row of D values into an int8 / float8 e4m3 cache row, symmetric with one
// float32 scale (absmax / 127 or / 448), as attention.quantize_kv does it: x times the scale's
// reciprocal, int8 rounded half to even, e4m3 to the nearest (ties to even) by c10's conversion.
template <typename T>
inline void quantize_kv_row(const T* x, int64_t D, bool fp8, void* out, float* scale) {
  const float top = fp8 ? 448.f : 127.f;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(to_f(x[d])));
  const float s = std::max(amax, 1e-8f) / top, inv = 1.f / s;
  *scale = s;
  if (fp8) {
    auto* o = static_cast<c10::Float8_e4m3fn*>(out);
    for (int64_t d = 0; d < D; ++d) o[d] = c10::Float8_e4m3fn(std::clamp(to_f(x[d]) * inv, -top, top));
  } else {
    auto* o = static_cast<int8_t*>(out);
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<int8_t>(std::clamp(std::nearbyint(to_f(x[d]) * inv), -top, top));
  }
}

// Attention-logit soft-capping (Gemma 2): cap * tanh(s / cap); cap <= 0: none.
// Where dim d of a head sits after P.V on pairs of bf16 V rows interleaved by 16-bit unpacks
// (within 128-bit lanes, 32 dims at a time): vector 2 c2 + hi, lane 4 L + i holds dim
// 32 c2 + 8 L + 4 hi + i (paged_attention.cpp's attend_tile, paged_rows_amx.h's O tiles).
constexpr int64_t bf16_pair_slot(int64_t d) {
  const int64_t c2 = d / 32, e = d % 32, L = e / 8, hi = (e % 8) / 4, i = e % 4;
  return (2 * c2 + hi) * 16 + 4 * L + i;
}

inline float softcap1(float s, float cap) { return cap > 0.f ? cap * std::tanh(s / cap) : s; }

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

// cap * tanh(x / cap) on 16 lanes: tanh(|t|) = (1 - e) / (1 + e) with e = exp(-2|t|) <= 1 (exp16's
// domain), the sign put back after.
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 t = _mm512_div_ps(x, _mm512_set1_ps(cap));
  const __m512 a = _mm512_abs_ps(t);
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 th = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th), sign)), _mm512_set1_ps(cap));
}

// 16 bf16 values (their bits) widened to float32: a bf16 is the upper half of a float.
inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 float8 e4m3fn values (their bytes) widened to float32, as to_f does one.
inline __m512 e4m3x16_to_f32(__m128i b) {
  const __m512i x = _mm512_cvtepu8_epi32(b);
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 f = _mm512_mask_mul_ps(normal, sub, _mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.f / 512.f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
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

// r[i] = row i of a 16 x 16 matrix -> r[j] = its column j.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // u[4 i + j], 128-bit lane L: column 4 L + j of rows 4 i .. 4 i + 3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 b = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 c = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 d = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    r[j] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + j] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + j] = _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// An add the compiler may not reassociate under -ffast-math (a builtin with its rounding given):
// for sums whose order must be the same in two places.
inline __m512 add_fixed(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// The sum of x's lanes in _mm512_reduce_add_ps's order, every add fixed: lanes i and i + 8, then
// i and i + 4, then i and i + 2, then 0 and 1 (paged_rows_lanes.h does the same vertically).
inline float reduce_add_fixed(__m512 x) {
  const __m512 t3 = add_fixed(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 t6 = add_fixed(t3, _mm512_shuffle_f32x4(t3, t3, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m128 t8 = _mm512_castps512_ps128(add_fixed(t6, _mm512_permute_ps(t6, _MM_SHUFFLE(1, 0, 3, 2))));
  return _mm_cvtss_f32(_mm_add_round_ss(t8, _mm_movehdup_ps(t8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace tm_cpu
