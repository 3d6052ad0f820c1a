// Paged decode attention's work items, shared by the paged_decode op (ATen's thread pool) and
// the fused decode step (each thread of one parallel region taking its share).
#pragma once

#include "torch_lite.h"

#include <cstdint>
#include <vector>

namespace tm_cpu {

// One decode attention call: q [B, H, D] -> out [B, H, D], keys read through block tables from
// caches [slots, Hkv, D] (T, or int8 with float32 scales [slots, Hkv]). With a sliding window W
// the query at position p sees keys p - W + 1 .. p only, and keys before those are never read
// (their blocks may be freed: the null block in the table); softcap > 0: scores become
// softcap * tanh(score / softcap) (Gemma 2).
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
  int64_t window = 0;         // sliding window in keys (0: none)
  float softcap = 0.f;        // attention-logit soft-cap (0: none)
};

// Whether the kernel is compiled for this head_dim.
bool decode_head_dim_supported(int64_t D);

// How many pieces each sequence's keys (the last `window` of them, if > 0) are split into so
// that `threads` threads all get work.
int64_t decode_splits(const int64_t* seq_lens, int64_t B, int64_t block_size, int64_t threads, int64_t window = 0);

// Run work items [begin, end) of B * splits; then, when splits > 1 (after every item is done),
// merge items [begin, end) of B * H.
template <typename T, typename C>
void decode_items(const DecodeArgs<T, C>& a, int64_t begin, int64_t end);
template <typename T, typename C>
void decode_merge(const DecodeArgs<T, C>& a, int64_t begin, int64_t end);

// ---- The rows kernel: every query row of a flat batch, decode-style ----
// Sequence b's query rows are q_start[b] .. q_start[b + 1] - 1 of q / out, at positions
// seq_lens[b] - n_b .. seq_lens[b] - 1 (n_b rows): a decode row (n_b = 1), a speculative
// verification chunk or a prompt chunk, each row attending causally to its sequence's keys
// (the cached prefix and the rows before it, all already in the cache) through block_tables[b].
//
// Each row is computed exactly as it is alone, a decode token at its position (the same tiles of
// keys, the same dot products, the same online softmax, never split over keys), whatever else is
// in the batch, however many rows its sequence has this step and however they are grouped into
// work items: a row's output bits depend only on its query, its position and its sequence's K/V.
// This is what makes the engine batch-invariant (prefill chunked or not, tokens verified in a
// chunk or decoded one by one). Where AMX-BF16 runs, bf16 rows take tile products
// (paged_rows_amx.h: each row's bits as it has them alone there, not the decode kernel's);
// elsewhere the decode kernel's vector code, each row exactly as paged_decode computes it (with
// AVX-512 BF16, a prompt's rows 16 (row, head)s to a vector: paged_rows_lanes.h).
template <typename T, typename C>
struct RowsArgs {
  const T* q;  // [rows, H, D]
  const C* k_cache;
  const C* v_cache;
  const float* k_scale;  // int8 caches only, else null
  const float* v_scale;
  const int64_t* tables;    // [B, max_blocks]
  const int64_t* seq_lens;  // [B] keys of each sequence's last query row
  const int64_t* q_start;   // [B + 1]
  T* out;                   // [rows, H, D]
  int64_t B, H, Hkv, D, block_size, max_blocks;
  float scale;
  int64_t window = 0;  // as DecodeArgs
  float softcap = 0.f;
};

// A work item: query rows [r0, r1) of sequence b (counted from its first row), kv heads [h0, h1).
struct RowsItem {
  int64_t b, r0, r1, h0, h1;
};

// The work items of a batch for `threads` threads: each sequence's rows in blocks of up to 16,
// all kv heads together, or one kv head per item when there are too few blocks to go round, and
// then, if still too few, rows split in parts of at least 4 (each part reads the K/V again);
// those with the most work first. (How items are cut does not change any result.) An item's rows
// share each tile of keys they read (the AVX-512 path, paged_rows_amx.h and paged_rows_avx2.h).
std::vector<RowsItem> rows_items(const int64_t* q_start, const int64_t* seq_lens, int64_t B, int64_t Hkv,
                                 int64_t threads);

template <typename T, typename C>
void rows_item(const RowsArgs<T, C>& a, const RowsItem& it);

}  // namespace tm_cpu
