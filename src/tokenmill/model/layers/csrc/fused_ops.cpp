// Fused element-wise ops around the linears: memory-bound, and each one replaces several
// small torch ops (torch's bfloat16 element-wise path is slow on CPU, and every op costs a
// few microseconds of dispatch: a decode step runs ~40 of them per layer without these).
// Rounding follows the torch ops they replace (each bfloat16 product or sum rounded), so
// results match the unfused path bit for bit in bfloat16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace tm_cpu;

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

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * dim, w, out + r * dim, dim, eps);
  });
}

// residual += x (rounded to T, as `residual + x` is); x = rms_norm(residual). Both in place.
template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* res = residual + r * dim;
      for (int64_t i = 0; i < dim; ++i) from_f(to_f(res[i]) + to_f(xr[i]), res + i);
      rms_norm_row(res, w, xr, dim, eps);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = to_f(g[i]);
        from_f(rnd<T>(gv / (1.f + std::exp(-gv))) * to_f(u[i]), o + i);
      }
    }
  });
}

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
#endif

// Rotary embedding, neox layout (rotate_half), as `x * cos + rotate_half(x) * sin` in T:
// out[i] = x[i] cos[i] - x[i+h] sin[i], out[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h].
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const T* tag = nullptr;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = half - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (half - i)) - 1);
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

template <typename T>
void rope_and_cache_rows(const T* qkv, const int64_t* positions, const T* cos, const T* sin, T* k_cache,
                         T* v_cache, const int64_t* slots, T* q_out, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim, kv_width = kv_heads * dim, half = dim / 2;
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = qkv + r * width;
      const T* c = cos + positions[r] * dim;
      const T* s = sin + positions[r] * dim;
      for (int64_t h = 0; h < heads; ++h) rope_head(row + h * dim, c, s, q_out + (r * heads + h) * dim, half);
      T* kc = k_cache + slots[r] * kv_width;
      const T* k = row + heads * dim;
      for (int64_t h = 0; h < kv_heads; ++h) rope_head(k + h * dim, c, s, kc + h * dim, half);
      std::memcpy(v_cache + slots[r] * kv_width, k + kv_width, kv_width * sizeof(T));
    }
  });
}

template <typename F>
void dispatch_float(const torch::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
    f(c10::BFloat16{});
  }
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(), "rms_norm inputs");
  auto out = torch::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x, "rms_norm", [&](auto t) {
    using T = decltype(t);
    rms_norm_rows<T>(x.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), rows, dim, eps);
  });
  return out;
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && w.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type() && x.scalar_type() == w.scalar_type(),
              "fused_add_rms_norm inputs");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x, "fused_add_rms_norm", [&](auto t) {
    using T = decltype(t);
    add_rms_norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<T>(), rows, dim, eps);
  });
}

// gate_up: [T, 2 * I] (gate first) -> silu(gate) * up: [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "silu_and_mul input");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  dispatch_float(gate_up, "silu_and_mul", [&](auto t) {
    using T = decltype(t);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
  });
  return out;
}

// qkv: [T, (H + 2 Hkv) * D], the fused projection's output. Rotates q and k at `positions`
// (cos / sin: [max_position, D] in qkv's dtype), writes k and v into the caches
// ([num_slots, Hkv, D]) at `slot_mapping`, and returns the rotated q: [T, H, D].
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                             int64_t num_heads, int64_t num_kv_heads) {
  const int64_t dim = k_cache.size(-1), rows = qkv.size(0);
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "rope_and_cache: qkv must be [T, (H + 2 Hkv) * D], contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(-2) == num_kv_heads &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rope_and_cache: caches must be contiguous [slots, Hkv, D] of qkv's dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == dim && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(), "rope_and_cache: cos / sin must be [max_position, D] of qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong && positions.numel() == rows &&
                  slot_mapping.numel() == rows && dim % 2 == 0, "rope_and_cache: positions / slot_mapping");
  auto q = torch::empty({rows, num_heads, dim}, qkv.options());
  const auto pos = positions.contiguous(), slots = slot_mapping.contiguous();
  dispatch_float(qkv, "rope_and_cache", [&](auto t) {
    using T = decltype(t);
    rope_and_cache_rows<T>(qkv.data_ptr<T>(), pos.data_ptr<int64_t>(), cos.data_ptr<T>(), sin.data_ptr<T>(),
                           k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), slots.data_ptr<int64_t>(), q.data_ptr<T>(),
                           rows, num_heads, num_kv_heads, dim);
  });
  return q;
}
