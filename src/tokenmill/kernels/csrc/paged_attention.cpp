// Paged decode attention for CPU: one query token per sequence, K/V read in place through
// block tables (no gathered copy of the cache). Parallel over work items (paged_decode.h), by
// ATen's thread pool here or by the fused decode step's threads; scores and accumulation in float32; float32, bfloat16, int8 or float8 e4m3 cache
// (int8 / float8 with one float32 scale per slot and kv head).
// The rows kernel, which computes every row of a flat batch the same way: paged_rows.cpp.
#include "paged_tiles.h"

#include <atomic>
#include <tuple>

namespace {

using namespace tm_cpu;

#if defined(__AVX512F__)
// Work items are (sequence, split): a split is a run of the sequence's blocks, all kv heads,
// so each block's K and V (contiguous: [block_size, Hkv, D]) are streamed once, front to back.
// Sequences are split (partial softmax states merged afterwards) only when there are too few
// of them to keep every thread busy (decode_splits).
template <typename T, typename C, int D>
void decode_items_d(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  constexpr bool quantized = kScaledCache<C>;
  constexpr int NV = D / 16;
  // Query heads per register tile: GB * NV float32 accumulators held in zmm registers.
  constexpr int kMaxGB = NV <= 4 ? 4 : NV <= 5 ? 3 : NV <= 8 ? 2 : 1;
  using Layout = RowLayout<T, C, D>;
  const int64_t H = a.H, Hkv = a.Hkv, S = a.splits, block_size = a.block_size;
  const C* k_cache = a.k_cache;
  const C* v_cache = a.v_cache;
  const float* k_scale = a.k_scale;
  const float* v_scale = a.v_scale;
  const float scale = a.scale, softcap = a.softcap;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements per cache slot
  std::vector<float> qf(H * D), acc(H * D), m(H), l(H), ksv(Hkv * kTile), vsv(Hkv * kTile);
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(C));
  // Item i's keys L, its window's first key lo and its blocks [bi0, bi1).
  struct Span {
    int64_t L, lo, bi0, bi1;
  };
  auto span = [&](int64_t i) {
    const int64_t b = i / S, s = i % S;
    const int64_t L = a.seq_lens[b];
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;
    const int64_t nblocks = (L + block_size - 1) / block_size, blo = lo / block_size;
    const int64_t per_split = (nblocks - blo + S - 1) / S;
    const int64_t bi0 = std::min(nblocks, blo + s * per_split);
    return Span{L, lo, bi0, std::min(nblocks, bi0 + per_split)};
  };
  // K and V are prefetched kPfBlocks blocks ahead of the block computed, across the items (a
  // sequence's first blocks during the previous one's last, not a demand miss): against one block
  // ahead within an item, 1.0-1.4x on bf16 caches, int8 within the noise
  // (benchmarks/paged_decode_kernel.py --compare, 1-32 sequences of 320-1000 keys, random and
  // consecutive blocks; 2 cores, AMD EPYC).
  int64_t ci = begin;  // the cursor: item ci's block cb
  Span cs = ci < end ? span(ci) : Span{};
  int64_t cb = cs.bi0;
  auto ahead = [&](const char*& k, const char*& v, int64_t& bytes) {
    while (ci < end && cb >= cs.bi1)
      if (++ci < end) cb = (cs = span(ci)).bi0;
    if (ci >= end) return;
    const int64_t nbase = a.tables[ci / S * a.max_blocks + cb] * block_size;
    bytes = std::min(block_size, cs.L - cb * block_size) * row_bytes;
    k = reinterpret_cast<const char*>(k_cache + nbase * row);
    v = reinterpret_cast<const char*>(v_cache + nbase * row);
    if constexpr (quantized) {
      prefetch_rows(k_scale + nbase * Hkv, 0, 1, block_size * Hkv * 4);
      prefetch_rows(v_scale + nbase * Hkv, 0, 1, block_size * Hkv * 4);
    }
    ++cb;
  };
  for (int p = 0; p < kPfBlocks; ++p) {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t bytes = 0;
    ahead(k, v, bytes);
    if (bytes > 0) {
      prefetch_rows(k, 0, 1, bytes);
      prefetch_rows(v, 0, 1, bytes);
    }
  }
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / S;
    const auto [L, lo, bi0, bi1] = span(i);
    const int64_t* table = a.tables + b * a.max_blocks;
    const int64_t blo = lo / block_size;
    const T* qb = a.q + b * H * D;
    for (int64_t g = 0; g < H; ++g)
      for (int64_t d = 0; d < D; ++d) qf[g * D + Layout::slot(d)] = to_f(qb[g * D + d]);
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), kNoScore);
    std::fill(l.begin(), l.end(), 0.f);
    for (int64_t bi = bi0; bi < bi1; ++bi) {
      // The block kPfBlocks ahead, a few lines per key row processed.
      const char* nk = nullptr;
      const char* nv = nullptr;
      int64_t next_bytes = 0;
      ahead(nk, nv, next_bytes);
      int64_t pf_done = 0;
      const int64_t nb = std::min(block_size, L - bi * block_size);
      const int64_t base = table[bi] * block_size;
      const int64_t jlo = bi == blo ? lo % block_size : 0;  // keys before the window are never read
      for (int64_t t0 = jlo / kTile * kTile; t0 < nb; t0 += kTile) {
        // The block's kTile-aligned tiles clipped to the window (the rows kernel cuts them the same way).
        const int64_t j0 = std::max(t0, jlo);
        const int n = static_cast<int>(std::min<int64_t>(t0 + kTile, nb) - j0);
        if constexpr (quantized) {
          for (int j = 0; j < n; ++j)
            for (int64_t h = 0; h < Hkv; ++h) {
              ksv[h * kTile + j] = k_scale[(base + j0 + j) * Hkv + h];
              vsv[h * kTile + j] = v_scale[(base + j0 + j) * Hkv + h];
            }
        }
        const int64_t calls = ((nb - t0 + kTile - 1) / kTile) * Hkv;  // tile x head calls left
        for (int64_t h = 0; h < Hkv; ++h) {
          // This call's share of the next block, in 64-byte lines per key row.
          const int64_t left = next_bytes - pf_done;
          const int step = left > 0 ? static_cast<int>((left / (calls - h) + n * 64 - 1) / (n * 64) * 64) : 0;
          const char* pfk = nk + pf_done;
          const char* pfv = nv + pf_done;
          pf_done += static_cast<int64_t>(step) * n;
          const C* kp = k_cache + (base + j0) * row + h * D;
          const C* vp = v_cache + (base + j0) * row + h * D;
          const float* ks = quantized ? ksv.data() + h * kTile : nullptr;
          const float* vs = quantized ? vsv.data() + h * kTile : nullptr;
          for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += kMaxGB) {
            const int64_t gb = std::min<int64_t>(kMaxGB, (h + 1) * G - g0);
            const float* qg = qf.data() + g0 * D;
            const T* qbg = qb + g0 * D;
            float* mg = m.data() + g0;
            float* lg = l.data() + g0;
            float* ag = acc.data() + g0 * D;
            const int pstep = g0 == h * G ? step : 0;
            switch (gb) {
              case 1: attend_tile<T, C, D, 1>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep); break;
              case 2:
                if constexpr (kMaxGB >= 2) attend_tile<T, C, D, 2>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep);
                break;
              case 3:
                if constexpr (kMaxGB >= 3) attend_tile<T, C, D, 3>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep);
                break;
              default:
                if constexpr (kMaxGB >= 4) attend_tile<T, C, D, 4>(qg, qbg, kp, vp, row, n, ks, vs, scale, softcap, mg, lg, ag, pfk, pfv, pstep);
                break;
            }
          }
        }
      }
    }
    if (S == 1) {
      T* ob = a.out + b * H * D;
      for (int64_t g = 0; g < H; ++g) write_out<T, C, D>(acc.data() + g * D, 1.f / l[g], ob + g * D);
    } else {
      if constexpr (Layout::kEvenOdd) {  // accumulators back to element order
        float tmp[D];
        for (int64_t g = 0; g < H; ++g) {
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) tmp[d] = ag[Layout::acc_slot(d)];
          std::copy(tmp, tmp + D, ag);
        }
      }
      float* ml = a.part_ml + i * H * 2;
      std::copy(m.begin(), m.end(), ml);
      std::copy(l.begin(), l.end(), ml + H);
      std::copy(acc.begin(), acc.end(), a.part_acc + i * H * D);
    }
  }
}

#else  // portable path
// Work items are sequences (never split).
template <typename T, typename C, int D>
void decode_items_d(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const int64_t L = a.seq_lens[b], lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;
    for (int64_t h = 0; h < a.Hkv; ++h)
      portable_heads<T, C, D>(a.q + b * a.H * D, a.out + b * a.H * D, lo, L, a.tables + b * a.max_blocks, h,
                              a.k_cache, a.v_cache, a.k_scale, a.v_scale, a.H, a.Hkv, a.block_size, a.scale,
                              a.softcap);
  }
}

#endif  // __AVX512F__

}  // namespace

namespace tm_cpu {

int64_t decode_splits(const int64_t* seq_lens, int64_t B, int64_t block_size, int64_t threads, int64_t window) {
#if defined(__AVX512F__)
  if (B >= 4 * threads) return 1;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, window > 0 ? std::min(seq_lens[b], window + block_size) : seq_lens[b]);
  const int64_t most_blocks = (longest + block_size - 1) / block_size;
  return std::max<int64_t>(1, std::min<int64_t>((4 * threads + B - 1) / B, most_blocks / 2));
#else
  return 1;
#endif
}

bool decode_head_dim_supported(int64_t D) {
#define TM_CASE(DIM) case DIM:
  switch (D) {
    TM_HEAD_DIMS(TM_CASE) return true;
    default: return false;
  }
#undef TM_CASE
}

template <typename T, typename C>
void decode_items(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
#define TM_CASE(DIM) \
  case DIM: return decode_items_d<T, C, DIM>(a, begin, end);
  switch (a.D) {
    TM_HEAD_DIMS(TM_CASE)
    default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", a.D);
  }
#undef TM_CASE
}

// out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), over the splits of
// items [begin, end) of (sequence, head).
template <typename T, typename C>
void decode_merge(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  const int64_t H = a.H, D = a.D, S = a.splits;
  std::vector<float> o(D);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / H, g = i % H;
    float mx = kNoScore;
    for (int64_t s = 0; s < S; ++s) mx = std::max(mx, a.part_ml[((b * S + s) * H) * 2 + g]);
    float lsum = 0.f;
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t s = 0; s < S; ++s) {
      const float* ml = a.part_ml + (b * S + s) * H * 2;
      const float w = std::exp(ml[g] - mx);
      lsum += w * ml[H + g];
      const float* acc = a.part_acc + ((b * S + s) * H + g) * D;
      for (int d = 0; d < D; ++d) o[d] += w * acc[d];
    }
    const float inv = 1.f / lsum;
    for (int d = 0; d < D; ++d) from_f(o[d] * inv, a.out + i * D + d);
  }
}

#define TM_INSTANTIATE(T, C)                                                      \
  template void decode_items<T, C>(const DecodeArgs<T, C>&, int64_t, int64_t); \
  template void decode_merge<T, C>(const DecodeArgs<T, C>&, int64_t, int64_t);
TM_QUERY_CACHE_TYPES(TM_INSTANTIATE)
#undef TM_INSTANTIATE

}  // namespace tm_cpu

// q: [B, H, D]; k_cache, v_cache: [slots, Hkv, D] (q's dtype, or int8 / float8 e4m3 with k_scale / v_scale:
// [slots, Hkv] float32); block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (keys per
// sequence, the new token included); window > 0: each query sees its last `window` keys only;
// softcap > 0: scores soft-capped. Returns [B, H, D].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor seq_lens, int64_t block_size,
                           double scale, c10::optional<at::Tensor> k_scale,
                           c10::optional<at::Tensor> v_scale, int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(scaled_cache(k_cache) || q.scalar_type() == k_cache.scalar_type(), "q and cache dtype differ");
  const float *ks, *vs;
  std::tie(ks, vs) = cache_scales(k_cache, v_cache, k_scale, v_scale);
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0, "heads not a multiple of kv heads");
  auto out = tm_cpu::empty_like(q);
  const int64_t* lp = sl.data_ptr<int64_t>();
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode: window and softcap must be >= 0 (0: none)");
  const int64_t S = decode_splits(lp, B, block_size, at::get_num_threads(), window);
  std::vector<float> part_ml(S > 1 ? B * S * H * 2 : 0), part_acc(S > 1 ? B * S * H * D : 0);
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    using C = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const DecodeArgs<T, C> a{qp, kp, vp, ks, vs, bt.data_ptr<int64_t>(), lp, op, B, H, Hkv, D, block_size,
                             bt.size(1), static_cast<float>(scale), S, part_ml.data(), part_acc.data(), window,
                             static_cast<float>(softcap)};
    at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) { decode_items(a, begin, end); });
    if (S > 1) at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) { decode_merge(a, begin, end); });
  };
  with_query_and_cache(q, out, k_cache, v_cache, "paged_decode", run);
  return out;
}
