// Fused element-wise ops around the linears: memory-bound, and each one replaces several
// small torch ops (torch's bfloat16 element-wise path is slow on CPU, and every op costs a
// few microseconds of dispatch: a decode step runs ~40 of them per layer without these).
// The row kernels are in elementwise.h (shared with the fused decode step).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "elementwise.h"

namespace {

using namespace tm_cpu;

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * dim, w, out + r * dim, dim, eps);
  });
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps) {
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
