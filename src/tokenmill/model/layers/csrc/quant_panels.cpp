// int4 / int8 weight-only linears in output panels, for AVX2 + FMA + F16C CPUs (AMD Zen 2/3 and
// other CPUs without AVX-512; quantization.py packs the weights at load, pack_quant_panels).
//
// The groups of 32 inputs and their scales are GGUF's (quant_linear.cpp), but the bytes are laid
// out as the bf16 panels are (panel_linear.cpp): a panel is 32 output rows; for each group, for
// each of its 32 inputs k, the 32 outputs' codes side by side (int4: 16 bytes, byte b = 8h + j
// holding output 16h + j in its low nibble and 16h + 8 + j in its high nibble; int8: 32 bytes,
// one per output), then the group's scales: int4 d[32] and m[32], int8 d[32] (float16). So
// `_mm256_cvtepu8_epi32` of 8 bytes and a mask / shift give 8 outputs' codes of input k as int32,
// which one conversion makes float32, shared by every input row of the register tile: the
// unpacking is paid once per weight and call, not once per row, and no horizontal sums remain.
//
// Each output is factorized per group (w = q * d + m):
//   y = sum_g [ d_g * (sum_k x_k * q_k) + m_g * (sum_k x_k) ]
// the inner sum an FMA chain over the group's inputs in order, then acc = fma(d, inner, acc) and
// acc = fma(m, xsum_g, acc), xsum_g summed once per row in a fixed order. Every output's
// operations are the same whatever the number of rows in the call, their place in the register
// tile, or how the panels are shared among threads: batch-invariant, bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "linear.h"

#if TM_QUANT_PANELS
#include <immintrin.h>

namespace {

using namespace tm_cpu;
using BF16 = c10::BFloat16;

constexpr int kMaxRows = 6;  // input rows per register tile (6 x 2 accumulators)

template <int BITS>
constexpr int64_t kRowBytes = BITS == 4 ? 16 : 32;  // one input's codes for the panel's 32 outputs
template <int BITS>
constexpr int64_t kGroupScales = BITS == 4 ? 64 : 32;  // float16 scales of one (panel, group)

// Codes of input k for NV vectors of 8 outputs, starting at output 8 * v0 (v0 = 0 or 2 for NV 2).
// int4: each 8 bytes give 16 outputs (low nibbles 8, high nibbles the next 8).
template <int BITS, int NV>
inline void unpack(const uint8_t* row, int v0, __m256 (&q)[NV]) {
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi32(0xF);
#pragma GCC unroll 2
    for (int p = 0; p < NV / 2; ++p) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 4 * v0 + 8 * p)));
      q[2 * p] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
      q[2 * p + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
  } else {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * (v0 + v))));
      q[v] = _mm256_cvtepi32_ps(b);
    }
  }
}

// Groups g .. g + GB - 1 of MB input rows (float32, ldx apart; xsum: their group sums, G apart)
// for NV vectors of 8 outputs from output 8 * v0, added to acc[m][0..32) group by group.
// Each (group, row, vector) sums in its own register: GB x MB x NV independent FMA chains (at
// least ~10 keep both FMA pipes busy through the FMA latency).
template <int BITS, int MB, int NV, int GB>
inline void groups_pass(const float* x, int64_t ldx, const float* xsum, int64_t G, const uint8_t* qp,
                        const at::Half* sp, int64_t g, int v0, float* acc) {
  __m256 inner[GB][MB][NV];
  for (int b = 0; b < GB; ++b)
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < NV; ++v) inner[b][m][v] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int k = 0; k < kGroup; ++k) {
#pragma GCC unroll 2
    for (int b = 0; b < GB; ++b) {
      __m256 q[NV];
      unpack<BITS, NV>(qp + ((g + b) * kGroup + k) * kRowBytes<BITS>, v0, q);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + (g + b) * kGroup + k);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) inner[b][m][v] = _mm256_fmadd_ps(xb, q[v], inner[b][m][v]);
      }
    }
  }
  for (int b = 0; b < GB; ++b) {  // groups in order: acc = fma(d, inner, acc), then fma(m, xsum, acc)
    const at::Half* sg = sp + (g + b) * kGroupScales<BITS>;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const int o = 8 * (v0 + v);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + o)));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        __m256 a = _mm256_fmadd_ps(d, inner[b][m][v], _mm256_load_ps(acc + m * kPanelRows + o));
        if constexpr (BITS == 4) {
          const __m256 off = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + kPanelRows + o)));
          a = _mm256_fmadd_ps(off, _mm256_broadcast_ss(xsum + m * G + g + b), a);
        }
        _mm256_store_ps(acc + m * kPanelRows + o, a);
      }
    }
  }
}

// acc[m][0..32) = x[m] . the panel's 32 rows for MB input rows, NV output vectors and GB groups
// at a time (the order of every output's operations is the same whatever MB, NV and GB).
template <int BITS, int MB, int NV, int GB>
inline void panel_rows(const float* x, int64_t ldx, const float* xsum, const uint8_t* qp, const at::Half* sp,
                       int64_t G, float* acc) {
  for (int i = 0; i < MB * kPanelRows; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());
  int64_t g = 0;
  for (; g + GB <= G; g += GB)
    for (int v0 = 0; v0 < 4; v0 += NV) groups_pass<BITS, MB, NV, GB>(x, ldx, xsum, G, qp, sp, g, v0, acc);
  for (; g < G; ++g)
    for (int v0 = 0; v0 < 4; v0 += NV) groups_pass<BITS, MB, NV, 1>(x, ldx, xsum, G, qp, sp, g, v0, acc);
}

// Up to 2 rows: the panel's 4 output vectors at once (4 MB chains, 4 codes in registers); more
// rows: the outputs in halves (2 MB chains, 2 codes). Measured on AMD EPYC (Zen, AVX2), one
// thread, cycles per 32 weights per row: 1 row ~4.9 (int4; the 4 vcvtdq2ps per input bound it;
// two groups at a time did not help, int8 was slower), 32 rows 2.4 (int4) / 2.2 (int8) with 6
// rows a tile against 2.6 / 2.3 with 4 (2 FMAs a cycle bound it at 2.0), bf16 panels 2.9.
template <int BITS>
inline void panel_tile(int mb, const float* x, int64_t ldx, const float* xsum, const uint8_t* qp, const at::Half* sp,
                       int64_t G, float* acc) {
  switch (mb) {
    case 1: panel_rows<BITS, 1, 4, 1>(x, ldx, xsum, qp, sp, G, acc); break;
    case 2: panel_rows<BITS, 2, 4, 1>(x, ldx, xsum, qp, sp, G, acc); break;
    case 3: panel_rows<BITS, 3, 2, 1>(x, ldx, xsum, qp, sp, G, acc); break;
    case 4: panel_rows<BITS, 4, 2, 1>(x, ldx, xsum, qp, sp, G, acc); break;
    case 5: panel_rows<BITS, 5, 2, 1>(x, ldx, xsum, qp, sp, G, acc); break;
    default: panel_rows<BITS, 6, 2, 1>(x, ldx, xsum, qp, sp, G, acc); break;
  }
}

template <typename T>
inline void store(float v, T* dst, const T* bias) {
  if (bias == nullptr) *dst = static_cast<T>(v);
  else *dst = static_cast<T>(static_cast<float>(static_cast<T>(v)) + static_cast<float>(*bias));  // as `y + bias`
}

// The sum of a group's 32 inputs, in one fixed order.
inline float group_sum(const float* x) {
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Group g of panel p dequantized: blk[k][o] = q * d + m (int8: q * d), rounded once as the plain
// rows are (quant_linear.cpp).
template <int BITS>
inline void dequant_block(const LinearWeights& w, int64_t p, int64_t g, float (&blk)[kGroup][kPanelRows]) {
  const int64_t G = w.K / kGroup;
  const uint8_t* qg = static_cast<const uint8_t*>(w.data) + (p * G + g) * kGroup * kRowBytes<BITS>;
  const at::Half* sg = w.scales + (p * G + g) * kGroupScales<BITS>;
  __m256 d[4], m[4];
  for (int v = 0; v < 4; ++v) {
    d[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 8 * v)));
    m[v] = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + kPanelRows + 8 * v)))
                     : _mm256_setzero_ps();
  }
  for (int k = 0; k < kGroup; ++k) {
    __m256 q[4];
    unpack<BITS, 4>(qg + k * kRowBytes<BITS>, 0, q);
    for (int v = 0; v < 4; ++v) _mm256_store_ps(blk[k] + 8 * v, _mm256_fmadd_ps(q[v], d[v], m[v]));
  }
}

// dst[o * ld + k] = blk[k][o] for the block's 32 x 32 values, 8 x 8 at a time in registers.
inline void transpose_block(const float (&blk)[kGroup][kPanelRows], float* dst, int64_t ld) {
  for (int k0 = 0; k0 < kGroup; k0 += 8)
    for (int o0 = 0; o0 < kPanelRows; o0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(blk[k0 + i] + o0);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {  // r[0..3]: columns 0, 1, 2, 3 of rows 0-3 | 4-7 (128-bit halves)
        _mm256_storeu_ps(dst + (o0 + i) * ld + k0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (o0 + i + 4) * ld + k0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
}

template <int BITS, typename OT>
void units(const float* x, const float* xsum, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out,
           int64_t ldo, const OT* bias) {
  const int64_t K = w.K, G = K / kGroup;
  const uint8_t* qw = static_cast<const uint8_t*>(w.data);
  alignas(32) float acc[kMaxRows * kPanelRows];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* qp = qw + p * G * kGroup * kRowBytes<BITS>;
    const at::Half* sp = w.scales + p * G * kGroupScales<BITS>;
    const int64_t n0 = p * kPanelRows;
    const int nc = static_cast<int>(std::min<int64_t>(kPanelRows, w.N - n0));
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mb = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      panel_tile<BITS>(mb, x + m0 * K, K, xsum + m0 * G, qp, sp, G, acc);
      for (int i = 0; i < mb; ++i)
        for (int c = 0; c < nc; ++c)
          store(acc[i * kPanelRows + c], out + (m0 + i) * ldo + n0 + c, bias == nullptr ? nullptr : bias + n0 + c);
    }
  }
}

}  // namespace

namespace tm_cpu {

template <typename XT, typename OT>
void quant_panel_units(const XT* x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out, int64_t ldo,
                       const OT* bias) {
  if (M == 0 || p0 >= p1) return;
  const int64_t K = w.K, G = K / kGroup;
  thread_local std::vector<float> xf, xs;  // the rows as float32 (bf16 widened, exact), their group sums
  const float* xp;
  if constexpr (std::is_same_v<XT, float>) {
    xp = x;
  } else {
    xf.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
    xp = xf.data();
  }
  xs.resize(M * G);
  if (w.bits == 4)
    for (int64_t i = 0; i < M * G; ++i) xs[i] = group_sum(xp + i * kGroup);
  if (w.bits == 4) units<4>(xp, xs.data(), M, w, p0, p1, out, ldo, bias);
  else units<8>(xp, xs.data(), M, w, p0, p1, out, ldo, bias);
}

template <typename T>
void quant_panel_row(const LinearWeights& w, int64_t id, T* out) {
  const int64_t G = w.K / kGroup, p = id / kPanelRows, o = id % kPanelRows;
  const int64_t row_bytes = w.bits == 4 ? 16 : 32, group_scales = w.bits == 4 ? 64 : 32;
  const uint8_t* qp = static_cast<const uint8_t*>(w.data) + p * G * kGroup * row_bytes;
  const at::Half* sp = w.scales + p * G * group_scales;
  // int4: output o's nibble: byte 8 * (o / 16) + o % 8, high nibble if o % 16 >= 8
  const int64_t byte = w.bits == 4 ? 8 * (o / 16) + o % 8 : o;
  const int shift = w.bits == 4 && o % 16 >= 8 ? 4 : 0;
  for (int64_t g = 0; g < G; ++g) {
    const float d = _cvtsh_ss(sp[g * group_scales + o].x);
    const float m = w.bits == 4 ? _cvtsh_ss(sp[g * group_scales + kPanelRows + o].x) : 0.f;
    const uint8_t* qg = qp + g * kGroup * row_bytes + byte;
    for (int k = 0; k < kGroup; ++k) {
      const float q = w.bits == 4 ? static_cast<float>((qg[k * row_bytes] >> shift) & 0xF)
                                  : static_cast<float>(static_cast<int8_t>(qg[k * row_bytes]));
      out[g * kGroup + k] = static_cast<T>(std::fma(q, d, m));  // q * d + m rounded once, as the plain rows are
    }
  }
}

template void quant_panel_row<float>(const LinearWeights&, int64_t, float*);
template void quant_panel_row<c10::BFloat16>(const LinearWeights&, int64_t, c10::BFloat16*);
template void quant_panel_units<float, float>(const float*, int64_t, const LinearWeights&, int64_t, int64_t, float*,
                                              int64_t, const float*);
template void quant_panel_units<float, BF16>(const float*, int64_t, const LinearWeights&, int64_t, int64_t, BF16*,
                                             int64_t, const BF16*);
template void quant_panel_units<BF16, BF16>(const BF16*, int64_t, const LinearWeights&, int64_t, int64_t, BF16*,
                                            int64_t, const BF16*);

}  // namespace tm_cpu

namespace {

tm_cpu::LinearWeights panel_weights(const torch::Tensor& qpanels, const torch::Tensor& spanels, int64_t bits,
                                    int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant panels: bits must be 4 or 8");
  TORCH_CHECK(qpanels.dim() == 4 && qpanels.is_contiguous() && spanels.is_contiguous() &&
                  spanels.scalar_type() == at::kHalf && qpanels.size(2) == tm_cpu::kGroup &&
                  qpanels.size(3) == (bits == 4 ? 16 : 32) && qpanels.size(0) * tm_cpu::kPanelRows >= N && N >= 0 &&
                  spanels.numel() == qpanels.size(0) * qpanels.size(1) * (bits == 4 ? 64 : 32),
              "quant panels: codes [ceil(N / 32), K / 32, 32, 16 (int4) or 32 (int8)] and float16 scales");
  tm_cpu::LinearWeights w;
  w.bits = static_cast<int>(bits);
  w.panels = true;
  w.data = qpanels.data_ptr();
  w.scales = spanels.data_ptr<at::Half>();
  w.N = N;
  w.K = qpanels.size(1) * tm_cpu::kGroup;
  return w;
}

}  // namespace

// x [M, K] float32 or bfloat16 @ (the quantized panels of an [N, K] weight)^T -> [M, N] in x's dtype.
torch::Tensor quant_panel_linear(torch::Tensor x, torch::Tensor qpanels, torch::Tensor spanels, int64_t bits,
                                 int64_t N) {
  const tm_cpu::LinearWeights w = panel_weights(qpanels, spanels, bits, N);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "quant_panel_linear: x [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "quant_panel_linear: float32 or bfloat16 inputs");
  const auto xc = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
  const int64_t M = x.size(0);
  if (M == 0) return out;
  at::parallel_for(0, w.units(), 1, [&](int64_t p0, int64_t p1) {
    if (x.scalar_type() == at::kBFloat16)
      tm_cpu::quant_panel_units(xc.data_ptr<c10::BFloat16>(), M, w, p0, p1, out.data_ptr<c10::BFloat16>(), N,
                                static_cast<const c10::BFloat16*>(nullptr));
    else
      tm_cpu::quant_panel_units(xc.data_ptr<float>(), M, w, p0, p1, out.data_ptr<float>(), N,
                                static_cast<const float*>(nullptr));
  });
  return out;
}

// The whole weight dequantized from its panels: [N, K] in `dtype` (prompt steps' GEMM). A
// (panel, group) block at a time: unpacked as the kernel does, into a [k][32] block in L1, then
// written out row by row.
torch::Tensor dequantize_quant_panels(torch::Tensor qpanels, torch::Tensor spanels, int64_t bits, int64_t N,
                                      at::ScalarType dtype) {
  const tm_cpu::LinearWeights w = panel_weights(qpanels, spanels, bits, N);
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "dequantize_quant_panels: bfloat16 or float32");
  const int64_t K = w.K, G = K / tm_cpu::kGroup;
  auto out = torch::empty({N, K}, torch::dtype(dtype));
  at::parallel_for(0, w.units(), 1, [&](int64_t p0, int64_t p1) {
    alignas(32) float blk[tm_cpu::kGroup][tm_cpu::kPanelRows];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * tm_cpu::kPanelRows;
      const int nc = static_cast<int>(std::min<int64_t>(tm_cpu::kPanelRows, N - n0));
      for (int64_t g = 0; g < G; ++g) {
        if (bits == 4) dequant_block<4>(w, p, g, blk);
        else dequant_block<8>(w, p, g, blk);
        if (dtype == at::kFloat && nc == tm_cpu::kPanelRows) {
          transpose_block(blk, out.data_ptr<float>() + n0 * K + g * tm_cpu::kGroup, K);
          continue;
        }
        for (int o = 0; o < nc; ++o) {
          if (dtype == at::kFloat) {
            float* dst = out.data_ptr<float>() + (n0 + o) * K + g * tm_cpu::kGroup;
            for (int k = 0; k < tm_cpu::kGroup; ++k) dst[k] = blk[k][o];
          } else {
            c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + (n0 + o) * K + g * tm_cpu::kGroup;
            for (int k = 0; k < tm_cpu::kGroup; ++k) dst[k] = c10::BFloat16(blk[k][o]);
          }
        }
      }
    }
  });
  return out;
}
#endif  // TM_QUANT_PANELS
