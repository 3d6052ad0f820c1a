// Paged decode attention's work items, shared by the paged_decode op (ATen's thread pool) and
// the fused decode step (each thread of one parallel region taking its share).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace tm_cpu {

// One decode attention call: q [B, H, D] -> out [B, H, D], keys read through block tables from
// caches [slots, Hkv, D] (T, or int8 with float32 scales [slots, Hkv]).
template <typename T, typename C>
struct DecodeArgs {
  const T* q;
  const C* k_cache;
  const C* v_cache;
  const float* k_scale;  // int8 caches only, else null
  const float* v_scale;
  const int64_t* tables;    // [B, max_blocks]
  const int64_t* seq_lens;  // [B], the new token included
  T* out;
  int64_t B, H, Hkv, D, block_size, max_blocks;
  float scale;
  int64_t splits = 1;         // per sequence: decode_splits(...)
  float* part_ml = nullptr;   // splits > 1: [B * splits, 2, H] softmax max and sum
  float* part_acc = nullptr;  //             [B * splits, H, D] unnormalised outputs
};

// Whether the kernel is compiled for this head_dim.
bool decode_head_dim_supported(int64_t D);

// How many pieces each sequence's keys are split into so that `threads` threads all get work.
int64_t decode_splits(const int64_t* seq_lens, int64_t B, int64_t block_size, int64_t threads);

// Run work items [begin, end) of B * splits; then, when splits > 1 (after every item is done),
// merge items [begin, end) of B * H.
template <typename T, typename C>
void decode_items(const DecodeArgs<T, C>& a, int64_t begin, int64_t end);
template <typename T, typename C>
void decode_merge(const DecodeArgs<T, C>& a, int64_t begin, int64_t end);

}  // namespace tm_cpu
