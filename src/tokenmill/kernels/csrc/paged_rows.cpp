// The rows kernel (paged_decode.h): every query row of a flat batch (prompt chunks, speculative
// verification rows, decode rows) attended through the block tables exactly as the decode kernel
// (paged_attention.cpp) attends a lone decode row at that row's length: batch-invariant. Tiles
// shared with the decode kernel: paged_tiles.h; bf16 on AMX tiles: paged_rows_amx.h; 16 (row, head)s
// a vector with AVX-512 BF16: paged_rows_lanes.h; AVX2: paged_rows_avx2.h.
#include "paged_tiles.h"

#include <atomic>
#include <tuple>

#include "paged_rows_amx.h"
#include "paged_rows_avx2.h"
#include "paged_rows_lanes.h"

namespace {

using namespace tm_cpu;

#if defined(__AVX512F__)
// The rows kernel (paged_decode.h; bf16 where AMX runs: paged_rows_amx.h): for each row of the
// item, exactly decode_items_d's computation with splits = 1 at that row's length. Key tiles are
// the decode kernel's (up to 16 keys of one block); a tile is attended by every (row, head) of the
// item that sees all of it in groups of up to kMaxGB sharing its K and V rows, and by the rows that
// see part of it (the causal diagonal) one at a time with only the keys they see. A (row, head)'s
// softmax state and accumulators never mix with another's, and attend_tile computes each head of
// a group as it computes a lone head, so the grouping leaves every result as the row alone gives it.
// With AVX-512 BF16 (bf16 queries and cache) a whole group of 16 (row, head)s that sees all of a
// tile takes it in one vector, each lane computing what attend_tile computes (paged_rows_lanes.h):
// a prompt's attention at 1.44-1.65x (SmolLM2's and Llama's heads, benchmarks/paged_decode_kernel.py
// --rows 512; 2 cores, AMD EPYC).
template <typename T, typename C, int D>
void rows_item_d(const RowsArgs<T, C>& a, const RowsItem& it) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if constexpr (amx_rows::kTakes<T, C, D>)  // bf16 on the tile unit (paged_rows_amx.h): every row count
    if (amx_rows::usable(a.block_size)) return amx_rows::rows_item<D>(a, it);
#endif
  constexpr bool quantized = kScaledCache<C>;
  constexpr int NV = D / 16;
  constexpr int kMaxGB = NV <= 4 ? 4 : NV <= 5 ? 3 : NV <= 8 ? 2 : 1;
  using Layout = RowLayout<T, C, D>;
  const int64_t H = a.H, Hkv = a.Hkv, G = H / Hkv, bs = a.block_size;
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t q0 = a.q_start[it.b], n = a.q_start[it.b + 1] - q0;
  const int64_t R = it.r1 - it.r0, NH = it.h1 - it.h0, RG = R * G;
  const int64_t first = a.seq_lens[it.b] - n + it.r0;  // position of the item's first row
  const int64_t L = first + R;                         // keys its last row sees
  const int64_t* table = a.tables + it.b * a.max_blocks;
  // (row, head) x = (hh * R + i) * G + g: kv head it.h0 + hh, row it.r0 + i, query head g of the group
  thread_local std::vector<float> qf, acc, m, l, ksv, vsv;
  thread_local std::vector<T> qb;
  qf.resize(NH * RG * D);
  acc.assign(NH * RG * D, 0.f);
  m.assign(NH * RG, kNoScore);
  l.assign(NH * RG, 0.f);
  qb.resize(NH * RG * D);
  if constexpr (quantized) {
    ksv.resize(NH * kTile);
    vsv.resize(NH * kTile);
  }
  for (int64_t hh = 0; hh < NH; ++hh)
    for (int64_t i = 0; i < R; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t x = (hh * R + i) * G + g;
        const T* src = a.q + ((q0 + it.r0 + i) * H + (it.h0 + hh) * G + g) * D;
        if constexpr (!Layout::kBf16Dot)  // (the bf16 dots read qb)
          for (int64_t d = 0; d < D; ++d) qf[x * D + Layout::slot(d)] = to_f(src[d]);
        std::copy(src, src + D, qb.data() + x * D);
      }
  // With a sliding window W row i sees keys lo(i) = first + i + 1 - W .. first + i only: the blocks
  // before row 0's window are never read (they may be freed).
  const int64_t W = a.window;
  const int64_t lo0 = W > 0 ? std::max<int64_t>(0, first + 1 - W) : 0;
  const int64_t nblocks = (L + bs - 1) / bs, blo = lo0 / bs;
  // The next block's K and V are prefetched while this one is computed: with every kv head in the
  // item (its slots' rows whole, contiguous) a share at each (tile, head) as decode_items_d does,
  // else (one head's slice of each row) all at once.
  const bool all_heads = NH == Hkv;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(C));
#if defined(__AVX512BF16__)
  // The lanes path: the item's queries transposed, 16 (row, head)s of a kv head a group.
  constexpr int64_t kLanesFrom = 16;  // (row, head)s of a group seeing a whole tile
  const int64_t groups = (RG + 15) / 16;
  struct alignas(64) Words16 {
    __m512i v;
  };
  thread_local std::vector<Words16> qt_store;
  alignas(64) __m512i vw[Layout::kBf16Dot ? 8 * D / 16 : 1];
  if constexpr (Layout::kBf16Dot) {
    qt_store.resize(NH * groups * (D / 2));
    for (int64_t hh = 0; hh < NH; ++hh)
      for (int64_t gi = 0; gi < groups; ++gi)
        lanes::transpose_pairs<D>(reinterpret_cast<const lanes::BF16*>(qb.data() + (hh * RG + gi * 16) * D), D,
                                  static_cast<int>(std::min<int64_t>(16, RG - gi * 16)), &qt_store[(hh * groups + gi) * (D / 2)].v);
  }
  const __m512i* qt = qt_store.empty() ? nullptr : &qt_store[0].v;
#endif
  if (all_heads) {
    const int64_t first_bytes = std::min(bs, L - blo * bs) * row_bytes;
    prefetch_rows(reinterpret_cast<const char*>(a.k_cache + table[blo] * bs * row), 0, 1, first_bytes);
    prefetch_rows(reinterpret_cast<const char*>(a.v_cache + table[blo] * bs * row), 0, 1, first_bytes);
  }
  for (int64_t bi = blo; bi < nblocks; ++bi) {
    const int64_t nb = std::min(bs, L - bi * bs);
    const int64_t base = table[bi] * bs;
    const char* nk = nullptr;
    const char* nv = nullptr;
    int64_t next_bytes = 0, pf_done = 0;
    if (bi + 1 < nblocks) {
      const int64_t nbase = table[bi + 1] * bs, nn = std::min(bs, L - (bi + 1) * bs);
      if (all_heads) {
        next_bytes = nn * row_bytes;
        nk = reinterpret_cast<const char*>(a.k_cache + nbase * row);
        nv = reinterpret_cast<const char*>(a.v_cache + nbase * row);
      } else {
        const int64_t head_bytes = NH * D * static_cast<int64_t>(sizeof(C));
        prefetch_rows(a.k_cache + nbase * row + it.h0 * D, row, nn, head_bytes);
        prefetch_rows(a.v_cache + nbase * row + it.h0 * D, row, nn, head_bytes);
      }
      if constexpr (quantized) {
        prefetch_rows(a.k_scale + nbase * Hkv, 0, 1, bs * Hkv * 4);
        prefetch_rows(a.v_scale + nbase * Hkv, 0, 1, bs * Hkv * 4);
      }
    }
    for (int64_t j0 = bi == blo ? lo0 % bs / kTile * kTile : 0; j0 < nb; j0 += kTile) {
      const int nt = static_cast<int>(std::min<int64_t>(kTile, nb - j0));
      const int64_t k0 = bi * bs + j0, k1 = k0 + nt - 1;  // the tile's first and last key
      // Causally row i sees none of this tile below i_vis, all of it from i_full; its window
      // starts at or before k0 below i_wfull, at or before k1 below i_wvis. Rows [i_full, i_wfull)
      // see the whole tile; the others in [i_vis, i_wvis) see part of it (the causal diagonal, the
      // window's edge): a row alone, only its keys, as the decode kernel clips the tile for it.
      const int64_t i_vis = std::max<int64_t>(0, k0 - first);
      const int64_t i_full = std::min<int64_t>(R, std::max<int64_t>(i_vis, k1 - first));
      const int64_t i_wfull = W > 0 ? std::clamp<int64_t>(k0 + W - first, 0, R) : R;
      const int64_t i_wvis = W > 0 ? std::clamp<int64_t>(k1 + W - first, 0, R) : R;
      auto visible = [&](int64_t i, int64_t& off, int& keys) {  // row i's keys in the tile: [k0 + off, + keys)
        const int64_t a0 = W > 0 ? std::max(k0, first + i + 1 - W) : k0, a1 = std::min(k1, first + i);
        off = a0 - k0;
        keys = static_cast<int>(a1 - a0 + 1);
        return a1 >= a0 && !(i >= i_full && i < i_wfull);
      };
      if constexpr (quantized) {
        for (int j = 0; j < nt; ++j)
          for (int64_t hh = 0; hh < NH; ++hh) {
            ksv[hh * kTile + j] = a.k_scale[(base + j0 + j) * Hkv + it.h0 + hh];
            vsv[hh * kTile + j] = a.v_scale[(base + j0 + j) * Hkv + it.h0 + hh];
          }
      }
      // The keys of the first call at each (tile, head), which sizes its share of the prefetch.
      int first_keys = nt;
      for (int64_t i = i_vis, off; i < i_wvis; ++i) {
        int keys;
        if (visible(i, off, keys)) {
          first_keys = keys;
          break;
        }
      }
      const int64_t calls = ((nb - j0 + kTile - 1) / kTile) * NH;  // (tile, head) pairs left in the block
      for (int64_t hh = 0; hh < NH; ++hh) {
        const int64_t h = it.h0 + hh;
        const C* kp = a.k_cache + (base + j0) * row + h * D;
        const C* vp = a.v_cache + (base + j0) * row + h * D;
        const float* ks = quantized ? ksv.data() + hh * kTile : nullptr;
        const float* vs = quantized ? vsv.data() + hh * kTile : nullptr;
        // This (tile, head)'s share of the next block, in 64-byte lines per key row of its first call.
        const int64_t left = next_bytes - pf_done;
        int pstep = left > 0 ? static_cast<int>((left / (calls - hh) + first_keys * 64 - 1) / (first_keys * 64) * 64) : 0;
        const char* pfk = nk + pf_done;
        const char* pfv = nv + pf_done;
        pf_done += static_cast<int64_t>(pstep) * first_keys;
        auto attend = [&](int64_t x, int64_t gb, int64_t off, int keys) {
          float* qg = qf.data() + x * D;
          const T* qbg = qb.data() + x * D;
          float* mg = m.data() + x;
          float* lg = l.data() + x;
          float* ag = acc.data() + x * D;
          const C* kq = kp + off * row;
          const C* vq = vp + off * row;
          const float* ksq = quantized ? ks + off : nullptr;
          const float* vsq = quantized ? vs + off : nullptr;
          const int ps = pstep;
          pstep = 0;  // the first call of the (tile, head) prefetches
          switch (gb) {
            case 1: attend_tile<T, C, D, 1>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps); break;
            case 2:
              if constexpr (kMaxGB >= 2) attend_tile<T, C, D, 2>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps);
              break;
            case 3:
              if constexpr (kMaxGB >= 3) attend_tile<T, C, D, 3>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps);
              break;
            default:
              if constexpr (kMaxGB >= 4) attend_tile<T, C, D, 4>(qg, qbg, kq, vq, row, keys, ksq, vsq, a.scale, a.softcap, mg, lg, ag, pfk, pfv, ps);
              break;
          }
        };
        for (int64_t i = i_vis, off; i < i_wvis; ++i) {  // rows seeing part of the tile
          int keys;
          if (visible(i, off, keys))
            for (int64_t g0 = 0; g0 < G; g0 += kMaxGB) attend((hh * R + i) * G + g0, std::min<int64_t>(kMaxGB, G - g0), off, keys);
        }
        // Rows seeing all of it, by groups of 16 (row, head)s: a group with enough of them in one
        // vector (paged_rows_lanes.h; its cost is the same for 1 or 16), the rest kMaxGB at a time.
        bool v_ready = false;
        for (int64_t x = i_full * G; x < i_wfull * G;) {
          const int64_t gi = x / 16, end = std::min<int64_t>(i_wfull * G, gi * 16 + 16);
#if defined(__AVX512BF16__)
          if constexpr (Layout::kBf16Dot)
            if (end - x >= kLanesFrom) {
              if (pstep > 0)  // this (tile, head)'s share of the next block's prefetch
                for (int j = 0; j < first_keys; ++j)
                  for (int o = 0; o < pstep; o += 64) {
                    _mm_prefetch(pfk + j * pstep + o, _MM_HINT_T1);
                    _mm_prefetch(pfv + j * pstep + o, _MM_HINT_T1);
                  }
              pstep = 0;
              if (!v_ready) lanes::interleave_v<D>(reinterpret_cast<const lanes::BF16*>(vp), row, nt, vw);
              v_ready = true;
              const int64_t x0 = hh * RG + gi * 16;
              lanes::attend<D>(qt + (hh * groups + gi) * (D / 2), reinterpret_cast<const lanes::BF16*>(kp), vw, row,
                               nt, static_cast<int>(x - gi * 16), static_cast<int>(end - gi * 16), a.scale, a.softcap,
                               m.data() + x0, l.data() + x0, acc.data() + x0 * D, kNoScore);
              x = end;
              continue;
            }
#endif
          for (; x < end; x += kMaxGB) attend(hh * RG + x, std::min<int64_t>(kMaxGB, end - x), 0, nt);
          x = end;
        }
      }
    }
  }
  for (int64_t hh = 0; hh < NH; ++hh)
    for (int64_t i = 0; i < R; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t x = (hh * R + i) * G + g;
        write_out<T, C, D>(acc.data() + x * D, 1.f / l[x], a.out + ((q0 + it.r0 + i) * H + (it.h0 + hh) * G + g) * D);
      }
}

#else  // portable path
// Each row as a lone decode row at its length (with AVX2: paged_rows_avx2.h, rows sharing tiles).
template <typename T, typename C, int D>
void rows_item_d(const RowsArgs<T, C>& a, const RowsItem& it) {
#if defined(__AVX2__) && defined(__FMA__)
  avx2::rows_item<T, C, D>(a, it);
#else
  const int64_t q0 = a.q_start[it.b], n = a.q_start[it.b + 1] - q0;
  for (int64_t i = it.r0; i < it.r1; ++i) {
    const int64_t L = a.seq_lens[it.b] - n + i + 1, lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0;
    for (int64_t h = it.h0; h < it.h1; ++h)
      portable_heads<T, C, D>(a.q + (q0 + i) * a.H * D, a.out + (q0 + i) * a.H * D, lo, L,
                              a.tables + it.b * a.max_blocks, h, a.k_cache, a.v_cache, a.k_scale, a.v_scale, a.H,
                              a.Hkv, a.block_size, a.scale, a.softcap);
  }
#endif
}

#endif  // __AVX512F__

}  // namespace

namespace tm_cpu {

std::vector<RowsItem> rows_items(const int64_t* q_start, const int64_t* seq_lens, int64_t B, int64_t Hkv,
                                 int64_t threads) {
  constexpr int64_t kRowBlock = 16;
  std::vector<RowsItem> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r0 = 0, n = q_start[b + 1] - q_start[b]; r0 < n; r0 += kRowBlock)
      items.push_back({b, r0, std::min(n, r0 + kRowBlock), 0, Hkv});
  if (Hkv > 1 && static_cast<int64_t>(items.size()) < 2 * threads) {
    std::vector<RowsItem> per_head;
    for (const auto& it : items)
      for (int64_t h = 0; h < Hkv; ++h) per_head.push_back({it.b, it.r0, it.r1, h, h + 1});
    items.swap(per_head);
  }
  // Still too few (a lone request's verification chunk: 3 kv heads on 2 threads leave one idle
  // half the time): rows split too, in parts of at least kMinRows (each part reads the K/V again).
  constexpr int64_t kMinRows = 4;
  const int64_t have = static_cast<int64_t>(items.size());
  if (have < 2 * threads) {
    const int64_t want = (2 * threads + have - 1) / have;
    std::vector<RowsItem> split;
    for (const auto& it : items) {
      const int64_t parts = std::max<int64_t>(1, std::min(want, (it.r1 - it.r0) / kMinRows));
      for (int64_t p = 0; p < parts; ++p)
        split.push_back({it.b, it.r0 + (it.r1 - it.r0) * p / parts, it.r0 + (it.r1 - it.r0) * (p + 1) / parts, it.h0,
                         it.h1});
    }
    items.swap(split);
  }
  // Most work first: (keys of the last row) x rows x heads.
  auto work = [&](const RowsItem& it) {
    const int64_t ctx = seq_lens[it.b] - (q_start[it.b + 1] - q_start[it.b]);
    return (ctx + it.r1) * (it.r1 - it.r0) * (it.h1 - it.h0);
  };
  std::stable_sort(items.begin(), items.end(), [&](const RowsItem& x, const RowsItem& y) { return work(x) > work(y); });
  return items;
}

template <typename T, typename C>
void rows_item(const RowsArgs<T, C>& a, const RowsItem& it) {
#define TM_CASE(DIM) \
  case DIM: return rows_item_d<T, C, DIM>(a, it);
  switch (a.D) {
    TM_HEAD_DIMS(TM_CASE)
    default: TORCH_CHECK(false, "paged_rows: unsupported head_dim ", a.D);
  }
#undef TM_CASE
}

#define TM_INSTANTIATE(T, C) template void rows_item<T, C>(const RowsArgs<T, C>&, const RowsItem&);
TM_QUERY_CACHE_TYPES(TM_INSTANTIATE)
#undef TM_INSTANTIATE

}  // namespace tm_cpu

// Every query row of a flat batch attended decode-style (paged_decode.h: the rows kernel).
// q: [T, H, D]; block_tables: [B, max_blocks] int64; seq_lens: [B] int64, keys of each
// sequence's last row; query_start_loc: [B + 1] int64, sequence b's rows are
// query_start_loc[b] .. query_start_loc[b + 1] - 1 at positions seq_lens[b] - n_b ..
// seq_lens[b] - 1, their K/V already in the cache. Returns [T, H, D].
at::Tensor paged_rows(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                         at::Tensor seq_lens, at::Tensor query_start_loc, int64_t block_size, double scale,
                         c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, int64_t window,
                         double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_rows: q [T, H, D], contiguous caches [slots, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong && block_tables.dim() == 2,
              "paged_rows: int64 block tables, lengths and query starts");
  TORCH_CHECK(scaled_cache(k_cache) || q.scalar_type() == k_cache.scalar_type(), "paged_rows: q and cache dtype differ");
  const float *ks, *vs;
  std::tie(ks, vs) = cache_scales(k_cache, v_cache, k_scale, v_scale);
  q = q.contiguous();
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto qs = query_start_loc.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), B = sl.numel();
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "paged_rows: head shapes");
  TORCH_CHECK(qs.numel() == B + 1 && bt.size(0) == B, "paged_rows: one block table and length per sequence");
  const int64_t* qsp = qs.data_ptr<int64_t>();
  const int64_t* lp = sl.data_ptr<int64_t>();
  TORCH_CHECK(qsp[0] == 0 && qsp[B] == T, "paged_rows: query_start_loc must run from 0 to the number of rows");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_rows: window and softcap must be >= 0 (0: none)");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(qsp[b + 1] >= qsp[b] && lp[b] >= qsp[b + 1] - qsp[b] && lp[b] <= bt.size(1) * block_size,
                "paged_rows: sequence lengths / query starts / block tables");
  auto out = tm_cpu::empty_like(q);
  const auto items = rows_items(qsp, lp, B, Hkv, at::get_num_threads());
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using TT = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    using CC = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const RowsArgs<TT, CC> a{qp, kp, vp, ks, vs, bt.data_ptr<int64_t>(), lp, qsp, op, B, H, Hkv, D, block_size,
                             bt.size(1), static_cast<float>(scale), window, static_cast<float>(softcap)};
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < n;) rows_item(a, items[i]);
    });
  };
  if (T == 0) return out;
  with_query_and_cache(q, out, k_cache, v_cache, "paged_rows", run);
  return out;
}
