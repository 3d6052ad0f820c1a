// Paged decode attention for CPU: one query token per sequence, K/V read in place through
// block tables (no gathered copy of the cache). Parallel over (sequence, kv head) with ATen's
// thread pool; scores and accumulation in float32; float32 or bfloat16 cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void from_f(float v, float* dst) { *dst = v; }
inline void from_f(float v, c10::BFloat16* dst) { *dst = c10::BFloat16(v); }

template <typename T, int D>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                   const int64_t* seq_lens, T* out, int64_t B, int64_t H, int64_t Hkv,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements per cache slot
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(G * D), acc(G * D), krow(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t L = seq_lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) qf[g * D + d] = to_f(q[(b * H + h * G + g) * D + d]) * scale;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* kp = k_cache + slot * row + h * D;
        for (int d = 0; d < D; ++d) krow[d] = to_f(kp[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          const float* qg = qf.data() + g * D;
          for (int d = 0; d < D; ++d) s += qg[d] * krow[d];
          scores[g * L + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* vp = v_cache + slot * row + h * D;
        for (int d = 0; d < D; ++d) krow[d] = to_f(vp[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
          for (int d = 0; d < D; ++d) ag[d] += p * krow[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) from_f(acc[g * D + d], out + (b * H + h * G + g) * D + d);
    }
  });
}

template <typename T>
void dispatch_head_dim(int64_t D, const T* q, const T* k, const T* v, const int64_t* tables,
                       const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t bs,
                       int64_t mb, float scale) {
  switch (D) {
    case 16: return decode_kernel<T, 16>(q, k, v, tables, lens, out, B, H, Hkv, bs, mb, scale);
    case 32: return decode_kernel<T, 32>(q, k, v, tables, lens, out, B, H, Hkv, bs, mb, scale);
    case 64: return decode_kernel<T, 64>(q, k, v, tables, lens, out, B, H, Hkv, bs, mb, scale);
    case 80: return decode_kernel<T, 80>(q, k, v, tables, lens, out, B, H, Hkv, bs, mb, scale);
    case 96: return decode_kernel<T, 96>(q, k, v, tables, lens, out, B, H, Hkv, bs, mb, scale);
    case 128: return decode_kernel<T, 128>(q, k, v, tables, lens, out, B, H, Hkv, bs, mb, scale);
    case 256: return decode_kernel<T, 256>(q, k, v, tables, lens, out, B, H, Hkv, bs, mb, scale);
    default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", D);
  }
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [slots, Hkv, D]; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64 (keys per sequence, the new token included). Returns [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                           double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtype differ");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0, "heads not a multiple of kv heads");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(D, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                             bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv,
                             block_size, bt.size(1), static_cast<float>(scale));
  } else if (q.scalar_type() == at::kBFloat16) {
    using BF = c10::BFloat16;
    dispatch_head_dim<BF>(D, q.data_ptr<BF>(), k_cache.data_ptr<BF>(), v_cache.data_ptr<BF>(),
                          bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), out.data_ptr<BF>(), B, H, Hkv,
                          block_size, bt.size(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
}
