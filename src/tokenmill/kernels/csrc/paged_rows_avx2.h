// The rows kernel (paged_decode.h) on CPUs with AVX2 and FMA but not AVX-512: the rows of a work
// item share each tile of up to 16 keys of one block, converted to float32 once per kv head,
// instead of every row reading its sequence's whole K/V alone (a verification chunk of 13 rows,
// or a prompt chunk, used to stream it 13 times or more).
//
// Batch invariance: every (row, query head) takes one step of tile_steps per tile it sees (tiles
// cut at the same places for every row: kTile-aligned within each block), the same instructions
// whatever else is in the item (not inlined, so no caller can compile it another way): its bits
// depend only on its query, its position and its sequence's K/V.
//
// Sliding window W (RowsArgs::window): row p sees keys p - W + 1 .. p, its tile's lanes before
// that masked; tiles before the item's first row's window are never read (their blocks may be
// freed, the null block in the table). Soft-cap: the scaled scores become cap * tanh(s / cap)
// before the softmax (softcap8), as the portable and AVX-512 paths do.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "paged_decode.h"

namespace tm_cpu::avx2 {

constexpr int kTile = 16;  // keys per tile
constexpr float kNoScore = -1e30f;

// exp(x) for x <= 0 (arguments below ~-87 give ~1e-38): exp16's polynomial on 8 lanes.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // times 2^n, n in [-126, 0]: a normal float built from its exponent bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// cap * tanh(x / cap) on 8 lanes (as softcap16 in cpu_common.h): tanh(|t|) = (1 - e) / (1 + e)
// with e = exp(-2|t|) <= 1 (exp8's domain), the sign put back after.
inline __m256 softcap8(__m256 x, float cap) {
  const __m256 t = _mm256_div_ps(x, _mm256_set1_ps(cap));
  const __m256 sign = _mm256_and_ps(t, _mm256_set1_ps(-0.f));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, t), _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_or_ps(th, sign), _mm256_set1_ps(cap));
}

// Lane j of the result: the sum of v[j]'s 8 lanes (one fixed hadd tree).
inline __m256 hsum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 x) {
  __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  y = _mm_max_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
}

inline float hsum1(__m256 x) {
  __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  y = _mm_add_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

// 8 cache elements as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {  // as to_f (cpu_common.h) widens one
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
  const __m256 f = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
}

// NH (row, query head) pairs' online-softmax steps over a tile, pair p's query qx + p * D, its
// state m[p], l[p], acc + p * D (the query heads of one row that share the tile's kv head). qx:
// float32, scale folded in; kf, vf: the tile's K and V rows (float32, zero past the sequence);
// ks: per-key K scales (int8 / float8 cache) or null; the row sees the tile's keys from .. vis - 1
// (0 <= from < vis; the others masked, never summed); cap > 0: scores soft-capped. Each pair's
// operations are the same whatever NH (the pairs side by side give the scheduler independent
// chains to interleave, where one pair's horizontal sums and exponentials wait on each other).
template <int D, int NH>
__attribute__((noinline)) void tile_steps(const float* qx, const float (*kf)[D], const float (*vf)[D], const float* ks,
                                          int from, int vis, float cap, float* m, float* l, float* acc) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  constexpr int NV = D / 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 valid[2];
  for (int half = 0; half < 2; ++half) {
    const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * half));  // from <= j < vis
    valid[half] = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(from), j),
                                                          _mm256_cmpgt_epi32(_mm256_set1_epi32(vis), j)));
  }
  // Scores, 8 keys at a time: one accumulator per key (its lanes summing d = lane mod 8 in order),
  // QW query vectors in registers against each key's slice, then the hsum8 tree.
  constexpr int QW = NV % 4 == 0 ? 4 : 2;
  __m256 s[NH][2];
  for (int p = 0; p < NH; ++p)
    for (int half = 0; half < 2; ++half) {
      __m256 dots[8];
      for (int jj = 0; jj < 8; ++jj) dots[jj] = _mm256_setzero_ps();
      for (int c0 = 0; c0 < NV; c0 += QW) {
        __m256 q[QW];
        for (int u = 0; u < QW; ++u) q[u] = _mm256_loadu_ps(qx + p * D + 8 * (c0 + u));
        for (int jj = 0; jj < 8; ++jj) {
          const float* kr = kf[half * 8 + jj] + 8 * c0;
          for (int u = 0; u < QW; ++u) dots[jj] = _mm256_fmadd_ps(q[u], _mm256_loadu_ps(kr + 8 * u), dots[jj]);
        }
      }
      s[p][half] = hsum8(dots);
      if (ks != nullptr) s[p][half] = _mm256_mul_ps(s[p][half], _mm256_loadu_ps(ks + 8 * half));
      if (cap > 0.f) s[p][half] = softcap8(s[p][half], cap);
      s[p][half] = _mm256_blendv_ps(_mm256_set1_ps(kNoScore), s[p][half], valid[half]);
    }
  alignas(32) float e[NH][kTile];
  float corr[NH];
  for (int p = 0; p < NH; ++p) {
    const float bm = std::max(m[p], hmax8(_mm256_max_ps(s[p][0], s[p][1])));
    corr[p] = std::exp(m[p] - bm);
    __m256 esum = _mm256_setzero_ps();
    for (int half = 0; half < 2; ++half) {
      const __m256 ex = _mm256_and_ps(exp8(_mm256_sub_ps(s[p][half], _mm256_set1_ps(bm))), valid[half]);
      _mm256_store_ps(e[p] + 8 * half, ex);
      esum = _mm256_add_ps(esum, ex);
    }
    l[p] = std::fma(l[p], corr[p], hsum1(esum));
    m[p] = bm;
  }
  // P.V, at most 8 vectors of accumulators in registers at a time (W of them, W dividing NV).
  constexpr int W = NV % 8 == 0 ? 8 : NV % 6 == 0 ? 6 : NV % 5 == 0 ? 5 : NV % 4 == 0 ? 4 : 2;
  for (int p = 0; p < NH; ++p) {
    const __m256 c = _mm256_set1_ps(corr[p]);
    float* ap = acc + p * D;
    for (int v0 = 0; v0 < NV; v0 += W) {
      __m256 a[W];
      for (int v = 0; v < W; ++v) a[v] = _mm256_mul_ps(_mm256_loadu_ps(ap + 8 * (v0 + v)), c);
      for (int j = from; j < vis; ++j) {
        const __m256 pj = _mm256_set1_ps(e[p][j]);
        for (int v = 0; v < W; ++v) a[v] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vf[j] + 8 * (v0 + v)), a[v]);
      }
      for (int v = 0; v < W; ++v) _mm256_storeu_ps(ap + 8 * (v0 + v), a[v]);
    }
  }
}

// Up to 4 query heads of a row per call (a row's G heads always cut the same way).
constexpr int kHeadsPerStep = 4;

template <int D>
inline void row_tile_steps(int nh, const float* qx, const float (*kf)[D], const float (*vf)[D], const float* ks,
                           int from, int vis, float cap, float* m, float* l, float* acc) {
  switch (nh) {
    case 1: return tile_steps<D, 1>(qx, kf, vf, ks, from, vis, cap, m, l, acc);
    case 2: return tile_steps<D, 2>(qx, kf, vf, ks, from, vis, cap, m, l, acc);
    case 3: return tile_steps<D, 3>(qx, kf, vf, ks, from, vis, cap, m, l, acc);
    default: return tile_steps<D, 4>(qx, kf, vf, ks, from, vis, cap, m, l, acc);
  }
}

// Keys are fetched this far ahead of the one being converted, one key (a few lines) at a time:
// the tile's compute is shorter than memory's latency for the next blocks (scattered anywhere in
// the cache), and a whole tile's lines asked for at once waited on each other (1.05-1.17x at
// 256-2048 keys, one thread, bf16 cache).
constexpr int64_t kAhead = 2 * kTile;

// Key slot `slot`'s K and V of kv head h into L1.
template <typename T, typename C>
inline void prefetch_key(const RowsArgs<T, C>& a, int64_t slot, int64_t h) {
  constexpr int64_t bytes = static_cast<int64_t>(sizeof(C));
  const int64_t at = (slot * a.Hkv + h) * a.D;
  for (int64_t o = 0; o < a.D * bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(a.k_cache + at) + o, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a.v_cache + at) + o, _MM_HINT_T0);
  }
}

// The item's rows, one kv head at a time: per tile of keys, K and V (and int8 scales) converted
// once, then every (row, query head) that sees part of the tile takes its step.
template <typename T, typename C, int D>
void rows_item(const RowsArgs<T, C>& a, const RowsItem& it) {
  constexpr bool quantized = kScaledCache<C>;
  const int64_t H = a.H, Hkv = a.Hkv, G = H / Hkv, bs = a.block_size;
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t q0 = a.q_start[it.b], n = a.q_start[it.b + 1] - q0;
  const int64_t R = it.r1 - it.r0, RG = R * G;
  const int64_t first = a.seq_lens[it.b] - n + it.r0;  // position of the item's first row
  const int64_t L = first + R;                         // keys its last row sees
  const int64_t W = a.window;
  const int64_t lo0 = W > 0 ? std::max<int64_t>(0, first + 1 - W) : 0;  // the first row's first key
  const int64_t* table = a.tables + it.b * a.max_blocks;
  thread_local std::vector<float> qf, acc, m, l;
  qf.resize(RG * D);
  acc.resize(RG * D);
  m.resize(RG);
  l.resize(RG);
  alignas(32) float kf[kTile][D], vf[kTile][D], ks[kTile];
  for (int64_t h = it.h0; h < it.h1; ++h) {
    // (row, head) x = i * G + g: row it.r0 + i, query head h * G + g
    for (int64_t x = 0; x < RG; ++x) {
      const T* src = a.q + ((q0 + it.r0 + x / G) * H + h * G + x % G) * D;
      for (int d = 0; d < D; ++d) qf[x * D + d] = to_f(src[d]) * a.scale;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), kNoScore);
    std::fill(l.begin(), l.end(), 0.f);
    // From the tile holding lo0 (tiles start at multiples of kTile in their block).
    const int64_t start = lo0 / bs * bs + lo0 % bs / kTile * kTile;
    for (int64_t key = start, end = std::min<int64_t>(L, start + kAhead); key < end; ++key)
      prefetch_key(a, table[key / bs] * bs + key % bs, h);
    for (int64_t k0 = start; k0 < L;) {
      const int64_t base = table[k0 / bs] * bs + k0 % bs;  // the tile's first slot
      const int nt = static_cast<int>(std::min<int64_t>({kTile, bs - k0 % bs, L - k0}));
      const int64_t next = k0 + nt;
      const int j0 = static_cast<int>(std::max<int64_t>(0, lo0 - k0));  // keys before it: not read
      for (int j = 0; j < j0; ++j) {
        ks[j] = 0.f;
        std::fill(kf[j], kf[j] + D, 0.f);
        std::fill(vf[j], vf[j] + D, 0.f);
      }
      for (int j = j0; j < nt; ++j) {
        const C* kr = a.k_cache + (base + j) * row + h * D;
        const C* vr = a.v_cache + (base + j) * row + h * D;
        const __m256 vs = _mm256_set1_ps(quantized ? a.v_scale[(base + j) * Hkv + h] : 1.f);
        ks[j] = quantized ? a.k_scale[(base + j) * Hkv + h] : 1.f;
        if (const int64_t key = k0 + j + kAhead; key < L) prefetch_key(a, table[key / bs] * bs + key % bs, h);
        for (int d = 0; d < D; d += 8) {
          _mm256_store_ps(kf[j] + d, load8(kr + d));
          _mm256_store_ps(vf[j] + d, _mm256_mul_ps(load8(vr + d), vs));
        }
      }
      for (int j = nt; j < kTile; ++j) {  // past the sequence or the block: zeros, masked
        ks[j] = 0.f;
        std::fill(kf[j], kf[j] + D, 0.f);
        std::fill(vf[j], vf[j] + D, 0.f);
      }
      // Row i sees keys lo(i) = first + i + 1 - W .. first + i: none of this tile below i_vis (causal)
      // or from i_end on (its window starts past the tile).
      const int64_t i_end = W > 0 ? std::min<int64_t>(R, k0 + nt - 1 + W - first) : R;
      for (int64_t i = std::max<int64_t>(0, k0 - first); i < i_end; ++i) {
        const int vis = static_cast<int>(std::min<int64_t>(nt, first + i + 1 - k0));
        const int from = W > 0 ? static_cast<int>(std::max<int64_t>(0, first + i + 1 - W - k0)) : 0;
        for (int64_t x = i * G; x < (i + 1) * G; x += kHeadsPerStep)
          row_tile_steps<D>(static_cast<int>(std::min<int64_t>(kHeadsPerStep, (i + 1) * G - x)), qf.data() + x * D, kf,
                            vf, quantized ? ks : nullptr, from, vis, a.softcap, m.data() + x, l.data() + x,
                            acc.data() + x * D);
      }
      k0 = next;
    }
    for (int64_t x = 0; x < RG; ++x) {
      T* ob = a.out + ((q0 + it.r0 + x / G) * H + h * G + x % G) * D;
      const float inv = 1.f / l[x];
      for (int d = 0; d < D; ++d) from_f(acc[x * D + d] * inv, ob + d);
    }
  }
}

}  // namespace tm_cpu::avx2

#endif
