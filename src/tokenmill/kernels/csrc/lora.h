// Multi-LoRA row kernels (Punica / S-LoRA "BGMV": each row of a batch with its own adapter),
// shared by the op (lora.cpp: lora_add) and the fused decode step (decode_step.cpp), so the two
// give the same bits.
//
// One adapted linear layer (N outputs in n_slices column slices, e.g. q | k | v) holds S adapter
// slots in fixed buffers that Python rewrites in place:
//   A      [S, n_slices, r_max, K]  lora_A of slice i of slot s: A[s, i, :rank]
//   Bt     [S, r_max, N]            lora_B transposed, PEFT scaling folded in
//   ranks  [S, n_slices] int32      0: that slice (or the slot) not adapted
//   bounds [n_slices + 1] int64     the slices' column offsets
// A row x of slot s gets, per slice i of rank r = ranks[s, i]:
//   shrink  h[i, j] = x . A[s, i, j]              (j < r; float32, never rounded to T)
//   expand  y[c] = T(float(y[c]) + sum_j h[i, j] * Bt[s, j, c])   for c in slice i
//
// Batch invariance: every h[i, j] is one dot product summed in a fixed order (32 inputs (bf16)
// or 16 (float) per vector step, lane-wise in order, then hsum1), and every output column one
// float32 fma chain over j = 0, 1, ... in order (a lane of its own). Neither depends on which
// rows share a register tile, on the column range a call covers, nor on how work is split over
// threads: a row's bits depend only on its x, its slot's weights and y.
#pragma once

#include "torch_lite.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "elementwise.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TM_LORA_AVX512 1
#endif

namespace tm_cpu {

constexpr int kLoraRows = 4;  // rows of one slot per register tile (they share loads of A and Bt)
constexpr int kLoraJ = 4;     // A rows per shrink tile

// One adapted linear's buffers (raw pointers into the tensors above; ranks read at every call).
template <typename T>
struct LoraWeights {
  const T* A = nullptr;
  const T* Bt = nullptr;
  const int32_t* ranks = nullptr;
  const int64_t* bounds = nullptr;
  int64_t slots = 0, n_slices = 0, r_max = 0, K = 0, N = 0;
  int64_t h_size() const { return n_slices * r_max; }  // floats of h per row
  int rank(int64_t s, int64_t i) const { return ranks[s * n_slices + i]; }
  const T* a_rows(int64_t s, int64_t i) const { return A + (s * n_slices + i) * r_max * K; }
  const T* b_rows(int64_t s) const { return Bt + s * r_max * N; }
};

// The rows of a batch that have an adapter, grouped by slot (stably), in tiles of <= kLoraRows
// rows of one slot. h of rows[p] lives at h + p * ldh.
struct LoraTile {
  int64_t slot;
  int32_t begin, end;  // into LoraBatch::rows
};
struct LoraBatch {
  std::vector<int64_t> rows;
  std::vector<LoraTile> tiles;
  bool empty() const { return rows.empty(); }
};

// row_slots [M] must already be checked to lie in [-1, slots).
inline LoraBatch lora_batch(const int32_t* row_slots, int64_t M) {
  LoraBatch b;
  for (int64_t m = 0; m < M; ++m)
    if (row_slots[m] >= 0) b.rows.push_back(m);
  std::stable_sort(b.rows.begin(), b.rows.end(), [&](int64_t a, int64_t c) { return row_slots[a] < row_slots[c]; });
  const int32_t n = static_cast<int32_t>(b.rows.size());
  for (int32_t p = 0; p < n;) {
    const int32_t s = row_slots[b.rows[p]];
    int32_t e = p + 1;
    while (e < n && e - p < kLoraRows && row_slots[b.rows[e]] == s) ++e;
    b.tiles.push_back({s, p, e});
    p = e;
  }
  return b;
}

namespace lora_detail {

#if defined(TM_LORA_AVX512)
inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// out[r * kLoraJ + q] = x[r] . a[q] over K inputs, for RB rows and kLoraJ A rows; meanwhile
// prefetches the kLoraJ rows of K inputs at pf (A rows to come), a cache line per step each.
template <int RB>
inline void dots(const float* const* x, const float* const* a, int64_t K, const float* pf, float* out) {
  __m512 acc[RB][kLoraJ];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = mask16(K - k);
    __m512 av[kLoraJ];
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) _mm_prefetch(reinterpret_cast<const char*>(pf + q * K + k), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) av[q] = _mm512_maskz_loadu_ps(m, a[q] + k);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x[r] + k);
#pragma GCC unroll 4
      for (int q = 0; q < kLoraJ; ++q) acc[r][q] = _mm512_fmadd_ps(xv, av[q], acc[r][q]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) out[r * kLoraJ + q] = hsum1(acc[r][q]);
}

template <int RB>
inline void dots(const c10::BFloat16* const* x, const c10::BFloat16* const* a, int64_t K, const c10::BFloat16* pf,
                 float* out) {
  __m512 acc[RB][kLoraJ];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) acc[r][q] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  // 32 inputs per step: vdpbf16ps sums each lane's pair of products into its float32 accumulator.
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? ~static_cast<__mmask32>(0) : static_cast<__mmask32>((1u << (K - k)) - 1);
    __m512bh av[kLoraJ];
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) _mm_prefetch(reinterpret_cast<const char*>(pf + q * K + k), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) av[q] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, a[q] + k));
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, x[r] + k));
#pragma GCC unroll 4
      for (int q = 0; q < kLoraJ; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xv, av[q]);
    }
  }
#else
  for (int64_t k = 0; k < K; k += 16) {  // widened to float32, 16 inputs per step
    const __mmask16 m = mask16(K - k);
    __m512 av[kLoraJ];
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) _mm_prefetch(reinterpret_cast<const char*>(pf + q * K + k), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) av[q] = load_lanes(a[q] + k, m);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = load_lanes(x[r] + k, m);
#pragma GCC unroll 4
      for (int q = 0; q < kLoraJ; ++q) acc[r][q] = _mm512_fmadd_ps(xv, av[q], acc[r][q]);
    }
  }
#endif
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < kLoraJ; ++q) out[r * kLoraJ + q] = hsum1(acc[r][q]);
}

// y[r][c0 + 16 v + lane] += sum_j h[r][j] * b[j * ldb + c0 + ...] for CB vectors of 16 columns
// (the last one masked by `last`): one float32 fma chain per column over j in order.
template <typename T, int RB, int CB>
inline void expand_block(const float* const* h, int rank, const T* b, int64_t ldb, T* const* y, int64_t c,
                         __mmask16 last) {
  __m512 acc[RB][CB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < CB; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int j = 0; j < rank; ++j) {
    const T* bj = b + j * ldb + c;
#pragma GCC unroll 4
    for (int v = 0; v < CB; ++v)  // the next block's columns
      _mm_prefetch(reinterpret_cast<const char*>(bj + 64 + 16 * v), _MM_HINT_T0);
    __m512 bv[CB];
#pragma GCC unroll 4
    for (int v = 0; v < CB; ++v) bv[v] = load_lanes(bj + 16 * v, v == CB - 1 ? last : static_cast<__mmask16>(0xFFFF));
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512 hb = _mm512_set1_ps(h[r][j]);
#pragma GCC unroll 4
      for (int v = 0; v < CB; ++v) acc[r][v] = _mm512_fmadd_ps(hb, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < CB; ++v) {
      const __mmask16 m = v == CB - 1 ? last : static_cast<__mmask16>(0xFFFF);
      T* yp = y[r] + c + 16 * v;
      store_lanes(yp, _mm512_add_ps(load_lanes(yp, m), acc[r][v]), m);
    }
}

// bf16 Bt: 32 columns per 64-byte load, split into two float32 vectors without a shuffle: the
// even columns (each 32-bit pair << 16) and the odd ones (pair & 0xFFFF0000); y likewise, and
// the two rounded halves put back together. Each column is still its own lane's fma chain.
template <int RB, int CP>
inline void expand_block_pairs(const float* const* h, int rank, const c10::BFloat16* b, int64_t ldb,
                               c10::BFloat16* const* y, int64_t c, __mmask32 last) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[RB][2 * CP];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 2 * CP; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int j = 0; j < rank; ++j) {
    const c10::BFloat16* bj = b + j * ldb + c;
#pragma GCC unroll 2
    for (int p = 0; p < CP; ++p)  // the columns two blocks on
      _mm_prefetch(reinterpret_cast<const char*>(bj + 128 + 32 * p), _MM_HINT_T0);
    __m512 bv[2 * CP];
#pragma GCC unroll 2
    for (int p = 0; p < CP; ++p) {
      const __m512i raw = _mm512_maskz_loadu_epi16(p == CP - 1 ? last : ~static_cast<__mmask32>(0), bj + 32 * p);
      bv[2 * p] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      bv[2 * p + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512 hb = _mm512_set1_ps(h[r][j]);
#pragma GCC unroll 4
      for (int v = 0; v < 2 * CP; ++v) acc[r][v] = _mm512_fmadd_ps(hb, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < CP; ++p) {
      const __mmask32 m = p == CP - 1 ? last : ~static_cast<__mmask32>(0);
      c10::BFloat16* yp = y[r] + c + 32 * p;
      const __m512i raw = _mm512_maskz_loadu_epi16(m, yp);
      const __m512 even = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), acc[r][2 * p]);
      const __m512 odd = _mm512_add_ps(_mm512_castsi512_ps(_mm512_and_si512(raw, hi)), acc[r][2 * p + 1]);
      _mm512_mask_storeu_epi16(yp, m, _mm512_or_si512(_mm512_srli_epi32(bf16_bits(even), 16), bf16_bits(odd)));
    }
}

template <typename T, int RB>
inline void expand_range(const float* const* h, int rank, const T* b, int64_t ldb, T* const* y, int64_t c0,
                         int64_t c1) {
  int64_t c = c0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; c + 64 <= c1; c += 64) expand_block_pairs<RB, 2>(h, rank, b, ldb, y, c, ~static_cast<__mmask32>(0));
    const int64_t rest = c1 - c;
    if (rest <= 0) return;
    const int64_t tail = rest - 32 * ((rest - 1) / 32);  // columns in the last 32-column load, 1..32
    const __mmask32 last = tail >= 32 ? ~static_cast<__mmask32>(0) : static_cast<__mmask32>((1u << tail) - 1);
    if (rest > 32) expand_block_pairs<RB, 2>(h, rank, b, ldb, y, c, last);
    else expand_block_pairs<RB, 1>(h, rank, b, ldb, y, c, last);
  } else {
    for (; c + 64 <= c1; c += 64) expand_block<T, RB, 4>(h, rank, b, ldb, y, c, 0xFFFF);
    const int64_t rest = c1 - c;
    if (rest <= 0) return;
    const __mmask16 last = mask16(rest - 16 * ((rest - 1) / 16));
    switch ((rest + 15) / 16) {
      case 1: expand_block<T, RB, 1>(h, rank, b, ldb, y, c, last); break;
      case 2: expand_block<T, RB, 2>(h, rank, b, ldb, y, c, last); break;
      case 3: expand_block<T, RB, 3>(h, rank, b, ldb, y, c, last); break;
      default: expand_block<T, RB, 4>(h, rank, b, ldb, y, c, last); break;
    }
  }
}
#endif  // TM_LORA_AVX512

}  // namespace lora_detail

// h of the tile's rows (each x[rows[p]] at x + rows[p] * ldx, its h at h + p * ldh):
// h[i * r_max + j] = x . A[slot, i, j] for j < ranks[slot, i] (the rest of h left as it is).
template <typename T>
inline void lora_shrink_tile(const LoraWeights<T>& w, const LoraBatch& batch, const LoraTile& tile, const T* x,
                             int64_t ldx, float* h, int64_t ldh) {
  const int nr = tile.end - tile.begin;
  const T* xr[kLoraRows];
  float* hr[kLoraRows];
  for (int r = 0; r < nr; ++r) {
    xr[r] = x + batch.rows[tile.begin + r] * ldx;
    hr[r] = h + (tile.begin + r) * ldh;
  }
#if defined(TM_LORA_AVX512)
  // The A rows read, in order, in groups of kLoraJ: each dots() call prefetches the group two on
  // (the first 64 groups: ranks up to 256 over the slices), the first two here.
  const T* groups[64];
  int n_groups = 0;
  for (int64_t i = 0; i < w.n_slices; ++i)
    for (int j0 = 0; j0 < w.rank(tile.slot, i) && n_groups < 64; j0 += kLoraJ)
      groups[n_groups++] = w.a_rows(tile.slot, i) + j0 * w.K;
  for (int g = 0; g < std::min(n_groups, 2); ++g)
    for (int64_t off = 0; off < kLoraJ * w.K; off += 64 / sizeof(T))
      _mm_prefetch(reinterpret_cast<const char*>(groups[g] + off), _MM_HINT_T0);
  int g = 0;
#endif
  for (int64_t i = 0; i < w.n_slices; ++i) {
    const int rank = w.rank(tile.slot, i);
    const T* a = w.a_rows(tile.slot, i);
    for (int j0 = 0; j0 < rank; j0 += kLoraJ) {
#if defined(TM_LORA_AVX512)
      const T* aq[kLoraJ];
      for (int q = 0; q < kLoraJ; ++q) aq[q] = a + std::min(j0 + q, rank - 1) * w.K;  // past the rank: repeats, unused
      const T* pf = g + 2 < n_groups ? groups[g + 2] : aq[0];
      ++g;
      float out[kLoraRows * kLoraJ];
      switch (nr) {
        case 1: lora_detail::dots<1>(xr, aq, w.K, pf, out); break;
        case 2: lora_detail::dots<2>(xr, aq, w.K, pf, out); break;
        case 3: lora_detail::dots<3>(xr, aq, w.K, pf, out); break;
        default: lora_detail::dots<4>(xr, aq, w.K, pf, out); break;
      }
      for (int r = 0; r < nr; ++r)
        for (int q = 0; q < kLoraJ && j0 + q < rank; ++q) hr[r][i * w.r_max + j0 + q] = out[r * kLoraJ + q];
#else
      for (int q = j0; q < std::min(j0 + kLoraJ, rank); ++q)
        for (int r = 0; r < nr; ++r) {
          float s = 0.f;
          for (int64_t k = 0; k < w.K; ++k) s += to_f(xr[r][k]) * to_f(a[q * w.K + k]);
          hr[r][i * w.r_max + q] = s;
        }
#endif
    }
  }
}

// The tile's rows of y (y + rows[p] * ldy) += their delta, on the columns [c0, c1) only (any
// range: each slice's part of it with that slice's rank; rank-0 slices untouched).
template <typename T>
inline void lora_expand_tile(const LoraWeights<T>& w, const LoraBatch& batch, const LoraTile& tile, const float* h,
                             int64_t ldh, T* y, int64_t ldy, int64_t c0, int64_t c1) {
  const int nr = tile.end - tile.begin;
  T* yr[kLoraRows];
  const float* hr[kLoraRows];
  const T* b = w.b_rows(tile.slot);
  for (int64_t i = 0; i < w.n_slices; ++i) {
    const int rank = w.rank(tile.slot, i);
    const int64_t a = std::max(c0, w.bounds[i]), e = std::min(c1, w.bounds[i + 1]);
    if (rank <= 0 || a >= e) continue;
    for (int r = 0; r < nr; ++r) {
      yr[r] = y + batch.rows[tile.begin + r] * ldy;
      hr[r] = h + (tile.begin + r) * ldh + i * w.r_max;
    }
#if defined(TM_LORA_AVX512)
    switch (nr) {
      case 1: lora_detail::expand_range<T, 1>(hr, rank, b, w.N, yr, a, e); break;
      case 2: lora_detail::expand_range<T, 2>(hr, rank, b, w.N, yr, a, e); break;
      case 3: lora_detail::expand_range<T, 3>(hr, rank, b, w.N, yr, a, e); break;
      default: lora_detail::expand_range<T, 4>(hr, rank, b, w.N, yr, a, e); break;
    }
#else
    for (int r = 0; r < nr; ++r)
      for (int64_t c = a; c < e; ++c) {
        float s = 0.f;
        for (int j = 0; j < rank; ++j) s += hr[r][j] * to_f(b[j * w.N + c]);
        from_f(to_f(yr[r][c]) + s, yr[r] + c);
      }
#endif
  }
}

}  // namespace tm_cpu
