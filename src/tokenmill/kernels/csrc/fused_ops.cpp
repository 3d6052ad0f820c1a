// Fused element-wise ops around the linears: memory-bound, and each one replaces several
// small torch ops (torch's bfloat16 element-wise path is slow on CPU, and every op costs a
// few microseconds of dispatch: a decode step runs ~40 of them per layer without these).
// The row kernels are in elementwise.h (shared with the fused decode step).
#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "elementwise.h"

namespace {

using namespace tm_cpu;

template <typename T, typename W>
void rms_norm_rows(const T* x, const W* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<W, T>) rms_norm_row(x + r * dim, w, out + r * dim, dim, eps);
      else rms_norm_row_w32(x + r * dim, w, out + r * dim, dim, eps);
    }
  });
}

template <typename T, typename W>
void add_rms_norm_rows(T* x, T* residual, const W* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) add_rms_norm_row(x + r * dim, residual + r * dim, w, x + r * dim, dim, eps);
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      silu_mul_row(g, g + inter, out + r * inter, inter);
    }
  });
}

template <typename T>
void rope_and_cache_rows(const T* qkv, const int64_t* positions, const T* cos, const T* sin, T* k_cache,
                         T* v_cache, const int64_t* slots, T* q_out, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rope_and_cache_row(qkv + r * width, positions[r], cos, sin, k_cache, v_cache, slots[r],
                         q_out + r * heads * dim, heads, kv_heads, dim);
  });
}

template <typename T>
void gelu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      gelu_tanh_mul_row(g, g + inter, out + r * inter, inter);
    }
  });
}

template <typename F>
void dispatch_float(const at::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
    f(c10::BFloat16{});
  }
}

}  // namespace

// w: x's dtype (Llama: w * T(normalized x)), or float32 (Gemma's 1 + w: T(normalized x * w)).
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(-1) &&
                  (x.scalar_type() == w.scalar_type() || w.scalar_type() == at::kFloat), "rms_norm inputs");
  auto out = tm_cpu::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x, "rms_norm", [&](auto t) {
    using T = decltype(t);
    if (w.scalar_type() == at::kFloat)
      rms_norm_rows<T, float>(x.data_ptr<T>(), w.data_ptr<float>(), out.data_ptr<T>(), rows, dim, eps);
    else
      rms_norm_rows<T, T>(x.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), rows, dim, eps);
  });
  return out;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && w.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type() && w.numel() == x.size(-1) &&
                  (x.scalar_type() == w.scalar_type() || w.scalar_type() == at::kFloat),
              "fused_add_rms_norm inputs");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x, "fused_add_rms_norm", [&](auto t) {
    using T = decltype(t);
    if (w.scalar_type() == at::kFloat)
      add_rms_norm_rows<T, float>(x.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<float>(), rows, dim, eps);
    else
      add_rms_norm_rows<T, T>(x.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<T>(), rows, dim, eps);
  });
}

// gate_up: [T, 2 * I] (gate first) -> silu(gate) * up: [T, I]
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "silu_and_mul input");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = tm_cpu::empty({rows, inter}, gate_up.options());
  dispatch_float(gate_up, "silu_and_mul", [&](auto t) {
    using T = decltype(t);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
  });
  return out;
}

// gate_up: [T, 2 * I] (gate first) -> gelu_tanh(gate) * up: [T, I]
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "gelu_tanh_and_mul input");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = tm_cpu::empty({rows, inter}, gate_up.options());
  dispatch_float(gate_up, "gelu_tanh_and_mul", [&](auto t) {
    using T = decltype(t);
    gelu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
  });
  return out;
}

// qkv: [T, (H + 2 Hkv) * D], the fused projection's output. Rotates q and k at `positions`
// (cos / sin: [max_position, D] in qkv's dtype), writes k and v into the caches
// ([num_slots, Hkv, D]) at `slot_mapping`, and returns the rotated q: [T, H, D].
at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                             at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
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
  auto q = tm_cpu::empty({rows, num_heads, dim}, qkv.options());
  const auto pos = positions.contiguous(), slots = slot_mapping.contiguous();
  dispatch_float(qkv, "rope_and_cache", [&](auto t) {
    using T = decltype(t);
    rope_and_cache_rows<T>(qkv.data_ptr<T>(), pos.data_ptr<int64_t>(), cos.data_ptr<T>(), sin.data_ptr<T>(),
                           k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), slots.data_ptr<int64_t>(), q.data_ptr<T>(),
                           rows, num_heads, num_kv_heads, dim);
  });
  return q;
}

// x: [T, Hkv, D] float32 / bf16, the step's new K or V. Each (token, kv head) row is quantized
// symmetrically and written into cache ([slots, Hkv, D] int8 or float8 e4m3) at slot_mapping[t],
// its float32 scale (absmax / 127 or / 448) into scales ([slots, Hkv]): the same values as
// attention.quantize_kv (x times the scale's reciprocal; int8 rounded half to even, e4m3 to the
// nearest, ties to even, by c10's conversion).
void write_scaled_cache(at::Tensor x, at::Tensor cache, at::Tensor scales, at::Tensor slot_mapping) {
  TORCH_CHECK(x.dim() == 3 && cache.dim() == 3 && cache.is_contiguous() && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && x.size(1) == cache.size(1) && x.size(2) == cache.size(2) &&
                  scales.size(0) == cache.size(0) && scales.size(1) == cache.size(1),
              "write_scaled_cache: x [T, Hkv, D], cache [slots, Hkv, D], float32 scales [slots, Hkv]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == x.size(0),
              "write_scaled_cache: one int64 slot per row");
  const bool fp8 = cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || cache.scalar_type() == at::kChar, "write_scaled_cache: an int8 or float8_e4m3fn cache");
  const auto xc = x.contiguous();
  const auto slots = slot_mapping.contiguous();
  const int64_t T = xc.size(0), Hkv = xc.size(1), D = xc.size(2), num_slots = cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_scaled_cache: slot out of range");
  float* sc = scales.data_ptr<float>();
  auto* base = static_cast<uint8_t*>(cache.data_ptr());  // one byte per value, int8 or e4m3
  dispatch_float(xc, "write_scaled_cache", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = xc.data_ptr<T_>();
    at::parallel_for(0, T * Hkv, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t dst = sp[i / Hkv] * Hkv + i % Hkv;
        quantize_kv_row(xp + i * D, D, fp8, base + dst * D, sc + dst);
      }
    });
  });
}

// logits: [B, V] float32 -> the index of each row's largest value (the first one on ties), as
// logits.max(dim=-1).indices gives it (torch's reduction takes ~1.3 ms for 32 x 49152 on 2
// cores: a few percent of a decode step; this is one pass at memory speed).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0, "argmax_rows: float32 [B, V]");
  const auto x = logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  auto out = tm_cpu::empty({B}, tm_cpu::dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = p + b * V;
      int64_t best = 0;
#if defined(__AVX512F__)
      // Per lane: the largest value and its first index (lanes see increasing indices, and only
      // a strictly larger value replaces one); then the smallest index among lanes holding the max.
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      __m512i vidx = _mm512_setzero_si512();
      const __m512i step = _mm512_set1_epi32(16);
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t i = 0; i < V; i += 16, idx = _mm512_add_epi32(idx, step)) {
        const __mmask16 valid = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, row + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
        vmax = _mm512_mask_mov_ps(vmax, gt, v);
        vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
      }
      const float m = _mm512_reduce_max_ps(vmax);
      const __mmask16 at_max = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
      best = _mm512_mask_reduce_min_epi32(at_max, vidx);
#elif defined(__AVX2__)
      // The same in 8 lanes (the scalar loop took ~40 us a row of 49152, a branch per element),
      // then the tail after the last full vector, whose indices come after every lane's.
      __m256 vmax = _mm256_set1_ps(-INFINITY);
      __m256i vidx = _mm256_setzero_si256();
      const __m256i step = _mm256_set1_epi32(8);
      __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      int64_t i = 0;
      for (; i + 8 <= V; i += 8, idx = _mm256_add_epi32(idx, step)) {
        const __m256 v = _mm256_loadu_ps(row + i);
        const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
        vmax = _mm256_blendv_ps(vmax, v, gt);
        vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(idx), gt));
      }
      alignas(32) float lane_max[8];
      alignas(32) int32_t lane_idx[8];
      _mm256_store_ps(lane_max, vmax);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lane_idx), vidx);
      float m = lane_max[0];
      for (int l = 1; l < 8; ++l) m = std::max(m, lane_max[l]);
      best = INT64_MAX;
      for (int l = 0; l < 8; ++l)
        if (lane_max[l] == m) best = std::min<int64_t>(best, lane_idx[l]);
      for (; i < V; ++i)
        if (row[i] > m) m = row[i], best = i;
#else
      for (int64_t i = 1; i < V; ++i)
        if (row[i] > row[best]) best = i;
#endif
      o[b] = best;
    }
  });
  return out;
}
