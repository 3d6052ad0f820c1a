// Paged decode attention for CPU: one query token per sequence, K/V read in place through
// block tables (no gathered copy of the cache). Parallel over (sequence, kv head) with ATen's
// thread pool; scores and accumulation in float32; float32, bfloat16 or int8 cache (int8 with
// one float32 scale per slot and kv head).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

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

template <typename T, typename C, int D>
void decode_kernel(const T* q, const C* k_cache, const C* v_cache, const float* k_scale,
                   const float* v_scale, const int64_t* tables, const int64_t* seq_lens, T* out,
                   int64_t B, int64_t H, int64_t Hkv, int64_t block_size, int64_t max_blocks,
                   float scale) {
  constexpr bool quantized = std::is_same_v<C, int8_t>;
  // One pass over each block (online softmax, rescaled once per block): K and V rows of a
  // block are read once, straight from the paged cache.
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements per cache slot
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), s(G * block_size), m(G), l(G);
    alignas(64) float kv[D];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t L = seq_lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) qf[g * D + d] = to_f(q[(b * H + h * G + g) * D + d]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const int64_t n = std::min(block_size, L - t0);
        const int64_t base = table[t0 / block_size] * block_size;
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
            s[g * block_size + j] = dot * ks;
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
        for (int d = 0; d < D; ++d) from_f(acc[g * D + d] * inv, out + (b * H + h * G + g) * D + d);
      }
    }
  });
}

template <typename T, typename C>
void dispatch_head_dim(int64_t D, const T* q, const C* k, const C* v, const float* ks, const float* vs,
                       const int64_t* tables, const int64_t* lens, T* out, int64_t B, int64_t H,
                       int64_t Hkv, int64_t bs, int64_t mb, float scale) {
#define TM_CASE(DIM) \
  case DIM: return decode_kernel<T, C, DIM>(q, k, v, ks, vs, tables, lens, out, B, H, Hkv, bs, mb, scale);
  switch (D) {
    TM_CASE(16) TM_CASE(32) TM_CASE(64) TM_CASE(80) TM_CASE(96) TM_CASE(128) TM_CASE(256)
    default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", D);
  }
#undef TM_CASE
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [slots, Hkv, D] (q's dtype, or int8 with k_scale / v_scale:
// [slots, Hkv] float32); block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (keys per
// sequence, the new token included). Returns [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                           double scale, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized || q.scalar_type() == k_cache.scalar_type(), "q and cache dtype differ");
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (quantized) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 cache needs its scales");
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() &&
                v_scale->scalar_type() == at::kFloat && v_scale->is_contiguous(), "float32 contiguous scales");
    ks = k_scale->data_ptr<float>();
    vs = v_scale->data_ptr<float>();
  }
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0, "heads not a multiple of kv heads");
  auto out = torch::empty_like(q);
  const float sc = static_cast<float>(scale);
  const int64_t* tp = bt.data_ptr<int64_t>();
  const int64_t* lp = sl.data_ptr<int64_t>();
  const int64_t mb = bt.size(1);
  auto run = [&](auto* qp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    if (quantized) {
      dispatch_head_dim<T, int8_t>(D, qp, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), ks, vs, tp, lp,
                                   op, B, H, Hkv, block_size, mb, sc);
    } else {
      dispatch_head_dim<T, T>(D, qp, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), ks, vs, tp, lp, op, B, H,
                              Hkv, block_size, mb, sc);
    }
  };
  if (q.scalar_type() == at::kFloat) {
    run(q.data_ptr<float>(), out.data_ptr<float>());
  } else if (q.scalar_type() == at::kBFloat16) {
    using BF = c10::BFloat16;
    run(q.data_ptr<BF>(), out.data_ptr<BF>());
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 queries only");
  }
  return out;
}

// ---- fused element-wise ops (memory-bound; torch's bf16 element-wise path is slow on CPU) ----
namespace {
template <typename T>
inline T round_to(float v) {
  T out;
  from_f(v, &out);
  return out;
}

// out = w * T(x * rsqrt(mean(x^2) + eps)), computed in float32 as Hugging Face does.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* o = out + r * dim;
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = to_f(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const float n = to_f(round_to<T>(to_f(xr[i]) * inv));
        from_f(to_f(w[i]) * n, o + i);
      }
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
        const float s = to_f(round_to<T>(gv / (1.f + std::exp(-gv))));
        from_f(s * to_f(u[i]), o + i);
      }
    }
  });
}
}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(), "rms_norm inputs");
  auto out = torch::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, dim, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
    using BF = c10::BFloat16;
    rms_norm_rows<BF>(x.data_ptr<BF>(), w.data_ptr<BF>(), out.data_ptr<BF>(), rows, dim, eps);
  }
  return out;
}

// gate_up: [T, 2 * I] (gate first) -> silu(gate) * up: [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "silu_and_mul input");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_and_mul: float32 or bfloat16");
    using BF = c10::BFloat16;
    silu_mul_rows<BF>(gate_up.data_ptr<BF>(), out.data_ptr<BF>(), rows, inter);
  }
  return out;
}

// quant_linear.cpp
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t bits);
torch::Tensor quant_embedding(torch::Tensor ids, torch::Tensor qweight, torch::Tensor scales, int64_t bits,
                              at::ScalarType dtype);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm, float32 inside");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("quant_linear", &quant_linear, "weight-only int4/int8 linear (groups of 32)");
  m.def("quant_embedding", &quant_embedding, "rows of an int4/int8 table, dequantized");
}
