// The engine's small-batch linear kernel, shared by the quant_linear op (one call, ATen's thread
// pool) and the fused decode step (each thread of one parallel region computing its own tiles).
// Both split the output rows into the same tiles and compute each output alike, so the two
// paths give the same numbers bit for bit.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace tm_cpu {

constexpr int kGroup = 32;     // quantization group: inputs sharing one scale
constexpr int kTileRows = 4;   // output rows per tile; threads take whole tiles

// A linear layer's weight: plain bf16 [N, K] (bits 16), or int8 [N, K] / int4 [N, K / 2] in
// groups of 32 with float16 scales (see quant_linear.cpp).
struct LinearWeights {
  int bits = 16;
  const void* data = nullptr;
  const at::Half* scales = nullptr;  // null for bits 16
  int64_t N = 0, K = 0;
  int64_t tiles() const { return (N + kTileRows - 1) / kTileRows; }
};

// out[m * ldo + n] = x[m] . w[n] (+ bias[n], rounded as `y + bias` is) for the M input rows
// (K apart) and the output rows n of tiles [t0, t1). XT / OT: float or c10::BFloat16 (bits 16
// needs bf16 inputs and AVX512-BF16).
template <typename XT, typename OT>
void linear_tiles(const XT* x, int64_t M, const LinearWeights& w, int64_t t0, int64_t t1, OT* out, int64_t ldo,
                  const OT* bias = nullptr);

// Row `id` of an embedding table in the same form (bits 16: a bf16 copy; 4 / 8: dequantized
// in float32, then rounded to T, as quant_embedding(...).to(dtype) is).
template <typename T>
void embedding_row(const LinearWeights& table, int64_t id, T* out);

}  // namespace tm_cpu
