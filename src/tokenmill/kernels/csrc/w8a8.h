// W8A8 linears (w8a8.cpp) as the fused decode step calls them: each thread quantizes the step's
// activation rows itself (per token, as the op does), then computes its own panels of 16 outputs.
#pragma once

#include "torch_lite.h"

#include <cstdint>

namespace tm_cpu {

constexpr int kW8A8Panel = 16;  // output rows per packed panel (a unit of work)

struct W8A8Weights {
  const int8_t* packed = nullptr;   // [ceil(N / 16), ceil(K / 4), 16, 4]
  const float* sw = nullptr;        // [N] per-row weight scales
  const int32_t* rowsum = nullptr;  // [N] sums of each row's q
  const float* bias = nullptr;      // [N] or null
  int64_t N = 0, K = 0;
  int64_t units() const { return (N + kW8A8Panel - 1) / kW8A8Panel; }
};

// Inputs per quantized row: K rounded up to the packing's groups of 4.
int64_t w8a8_padded_k(int64_t K);
// M rows of K bf16 -> q [M, w8a8_padded_k(K)], scales and zero points [M] (this thread only).
void w8a8_quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, uint8_t* q, float* sx, int32_t* zx);
// out[m * N + n] for the outputs n of panels [p0, p1) (bf16, + bias).
void w8a8_units(const W8A8Weights& w, const uint8_t* q, const float* sx, const int32_t* zx, int64_t M, int64_t p0,
                int64_t p1, c10::BFloat16* out);

}  // namespace tm_cpu
