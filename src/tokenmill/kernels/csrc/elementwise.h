// Row-level element-wise kernels: the bodies of the fused ops (fused_ops.cpp), shared with the
// fused decode step. Rounding follows the torch ops they replace (each bfloat16 product or sum
// rounded), so results match the unfused path bit for bit in bfloat16.
#pragma once

#include "torch_lite.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tm_cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 lanes at a time (masked tails): T loaded as float, products rounded to T exactly as the
// scalar path (round-to-nearest-even on the bits), stored rounded to T.
inline __m512 load_lanes(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_lanes(const c10::BFloat16* p, __mmask16 m) {
  return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512i bf16_bits(__m512 v) {  // RNE to bf16, left in the upper 16 bits (as c10::BFloat16)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  return _mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
inline __m512 round_lanes(__m512 v, const float*) { return v; }
inline __m512 round_lanes(__m512 v, const c10::BFloat16*) { return _mm512_castsi512_ps(bf16_bits(v)); }
inline void store_lanes(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_lanes(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
inline __mmask16 lanes_left(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
// sigmoid(x) on 16 lanes: 1 / (1 + e) for x >= 0, e / (1 + e) otherwise, e = exp(-|x|) <= 1 (exp16's domain).
inline __m512 sigmoid16(__m512 x) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mask_mul_ps(r, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), r, e);
}
#endif

template <typename T>
inline T round_to(float v) {
  T out;
  from_f(v, &out);
  return out;
}
template <typename T>
inline float rnd(float v) {  // v rounded to T and back (a no-op for float)
  return to_f(round_to<T>(v));
}

// One row: out = w * T(x * rsqrt(mean(x^2) + eps)), in float32 as Hugging Face does.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* o, int64_t dim, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / dim + eps);
  for (int64_t i = 0; i < dim; ++i) from_f(to_f(w[i]) * rnd<T>(to_f(x[i]) * inv), o + i);
}

// One row with a float32 weight: out = T(x * rsqrt(mean(x^2) + eps) * w), rounded once (Gemma's
// norm: w holds 1 + its weight, in float32 as Hugging Face computes it).
template <typename T>
inline void rms_norm_row_w32(const T* x, const float* w, T* o, int64_t dim, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / dim + eps);
  for (int64_t i = 0; i < dim; ++i) from_f(to_f(x[i]) * inv * w[i], o + i);
}

// residual += x (rounded to T, as `residual + x` is); out = rms_norm(residual) (out may be x).
template <typename T, typename W>
inline void add_rms_norm_row(const T* x, T* residual, const W* w, T* out, int64_t dim, float eps) {
  for (int64_t i = 0; i < dim; ++i) from_f(to_f(residual[i]) + to_f(x[i]), residual + i);
  if constexpr (std::is_same_v<W, T>) rms_norm_row(residual, w, out, dim, eps);
  else rms_norm_row_w32(residual, w, out, dim, eps);
}

// o = silu(g) * u over n elements (silu rounded to T first, as F.silu(gate) * up is). With AVX-512
// every element takes the same instructions wherever it lies in the row (masked tails, no scalar
// remainder): W8A8's fused gate/up epilogue calls it on 16 outputs at a time and must give the
// bits the whole-row op gives.
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes_left(n - i);
    const __m512 x = load_lanes(g + i, m);
    store_lanes(o + i, _mm512_mul_ps(round_lanes(_mm512_mul_ps(x, sigmoid16(x)), o), load_lanes(u + i, m)), m);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float gv = to_f(g[i]);
    from_f(rnd<T>(gv / (1.f + std::exp(-gv))) * to_f(u[i]), o + i);
  }
#endif
}

// o = gelu_tanh(g) * u over n elements (gelu rounded to T first, as F.gelu(gate, approximate="tanh")
// * up is): GeGLU.
template <typename T>
inline void gelu_tanh_mul_row(const T* g, const T* u, T* o, int64_t n) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_f(g[i]);
    from_f(rnd<T>(0.5f * x * (1.f + std::tanh(kBeta * (x + kKappa * x * x * x)))) * to_f(u[i]), o + i);
  }
}


// Rotary embedding, neox layout (rotate_half), as `x * cos + rotate_half(x) * sin` in T:
// out[i] = x[i] cos[i] - x[i+h] sin[i], out[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h].
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const T* tag = nullptr;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes_left(half - i);
    const __m512 a = load_lanes(x + i, m), b = load_lanes(x + i + half, m);
    const __m512 lo = _mm512_add_ps(round_lanes(_mm512_mul_ps(a, load_lanes(cos + i, m)), tag),
                                    round_lanes(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), load_lanes(sin + i, m)), tag));
    const __m512 hi = _mm512_add_ps(round_lanes(_mm512_mul_ps(b, load_lanes(cos + i + half, m)), tag),
                                    round_lanes(_mm512_mul_ps(a, load_lanes(sin + i + half, m)), tag));
    store_lanes(out + i, lo, m);
    store_lanes(out + i + half, hi, m);
  }
  return;
#endif
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_f(x[i]), b = to_f(x[i + half]);
    from_f(rnd<T>(a * to_f(cos[i])) + rnd<T>(-b * to_f(sin[i])), out + i);
    from_f(rnd<T>(b * to_f(cos[i + half])) + rnd<T>(a * to_f(sin[i + half])), out + i + half);
  }
}

// One token's rotary embedding and cache write: qkv row [(H + 2 Hkv) * D] -> rotated q
// [H, D] at q_out; rotated k and v into the caches ([slots, Hkv, D]) at `slot`. Only kv heads
// [h0, h1) (h1 < 0: all) and the query heads that share them, when a caller splits the heads.
template <typename T>
inline void rope_and_cache_row(const T* row, int64_t position, const T* cos, const T* sin, T* k_cache, T* v_cache,
                               int64_t slot, T* q_out, int64_t heads, int64_t kv_heads, int64_t dim, int64_t h0 = 0,
                               int64_t h1 = -1) {
  if (h1 < 0) h1 = kv_heads;
  const int64_t kv_width = kv_heads * dim, half = dim / 2, group = heads / kv_heads;
  const T* c = cos + position * dim;
  const T* s = sin + position * dim;
  for (int64_t h = h0 * group; h < h1 * group; ++h) rope_head(row + h * dim, c, s, q_out + h * dim, half);
  T* kc = k_cache + slot * kv_width;
  const T* k = row + heads * dim;
  for (int64_t h = h0; h < h1; ++h) rope_head(k + h * dim, c, s, kc + h * dim, half);
  std::memcpy(v_cache + slot * kv_width + h0 * dim, k + kv_width + h0 * dim, (h1 - h0) * dim * sizeof(T));
}

}  // namespace tm_cpu
