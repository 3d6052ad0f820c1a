// Paged prefill attention for CPU: one prompt chunk's queries (positions context_len ..
// context_len + n - 1) attend causally to every key of their sequence (the cached prefix and
// the chunk's own keys, already written into the paged cache), read through the sequence's
// block table. Flash-style: online softmax in float32, one pass over the keys.
//
// One parallel region (ATen's thread pool) with two kinds of work:
//  - pack: every tile of kNK keys of each kv head is read once from the cache (through the
//    block table) into the layout the matrix micro-kernels want (K transposed, V with pairs
//    of keys interleaved for vdpbf16ps), int8 / float8 e4m3 values widened exactly (their scales are
//    folded into the scores / the softmax weights instead), by the first thread to need it;
//  - attend: work items are (tile of kQT queries, kv head): the kQT x G query rows of one kv
//    head share every packed K/V tile, key tiles above the causal diagonal are skipped, and
//    items are handed out longest first.
// bf16 queries use vdpbf16ps (bf16 x bf16 products, float32 sums; the softmax weights are
// rounded to bf16 for P.V) where the CPU has AVX512-BF16, else float32 FMAs.
#include "torch_lite.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>

#include "cpu_common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace tm_cpu;

constexpr int kNK = 32;             // keys per tile
constexpr int kQT = 32;             // queries per work item
constexpr float kNoScore = -1e30f;  // finite "minus infinity" (the build uses -ffast-math)

// bf16 bits of a cache element (exact for bf16, int8 and float8 e4m3 values).
inline uint16_t bf_bits(c10::BFloat16 x) { return x.x; }
template <typename C, typename = std::enable_if_t<kScaledCache<C>>>
inline uint16_t bf_bits(C x) {
  const float f = to_f(x);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}
inline uint16_t bf_bits(float x) { return c10::BFloat16(x).x; }
inline uint32_t f_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// A "word" is 32 bits: two bf16 (BF compute) or one float32. E = elements per word.
template <bool BF>
struct Cmp {
  static constexpr int E = BF ? 2 : 1;
};

#if defined(__AVX512F__)
template <bool BF>
inline __m512 madd(__m512 acc, __m512i a, __m512i b) {
  if constexpr (BF) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    return acc;  // unreachable: BF compute needs AVX512-BF16
#endif
  } else {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  }
}
#endif

// S[r][0..kNK) = sum_w Q[r][w] (.) Kp[w][0..kNK) for NR rows (Q rows `qs` words apart).
template <bool BF, int NR>
inline void qk_rows(const uint32_t* Q, int64_t qs, const uint32_t* Kp, int W, float* S) {
#if defined(__AVX512F__)
  __m512 acc[NR][2];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int w = 0; w < W; ++w) {
    const __m512i k0 = _mm512_loadu_si512(Kp + w * kNK);
    const __m512i k1 = _mm512_loadu_si512(Kp + w * kNK + 16);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512i b = _mm512_set1_epi32(static_cast<int>(Q[r * qs + w]));
      acc[r][0] = madd<BF>(acc[r][0], b, k0);
      acc[r][1] = madd<BF>(acc[r][1], b, k1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    _mm512_storeu_ps(S + r * kNK, acc[r][0]);
    _mm512_storeu_ps(S + r * kNK + 16, acc[r][1]);
  }
#else
  static_assert(!BF, "bf16 compute needs AVX-512");
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < kNK; ++j) {
      float a = 0.f;
      for (int w = 0; w < W; ++w) {
        float x, y;
        std::memcpy(&x, Q + r * qs + w, 4);
        std::memcpy(&y, Kp + w * kNK + j, 4);
        a += x * y;
      }
      S[r * kNK + j] = a;
    }
#endif
}

// O[r][0..D) = O[r] * corr[r] + sum_j P[r][j] (.) Vp[j][0..D) for NR rows; J words of P.
template <bool BF, int D, int NR>
inline void pv_rows(const uint32_t* P, const uint32_t* Vp, int J, float* O, const float* corr) {
#if defined(__AVX512F__)
  constexpr int NV = D / 16;
  __m512 acc[NR][NV];
  load_rescaled<NR, NV>(acc, O, D, corr);
  for (int j = 0; j < J; ++j) {
    __m512i vv[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_si512(Vp + j * D + v * 16);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512i b = _mm512_set1_epi32(static_cast<int>(P[r * (kNK / Cmp<BF>::E) + j]));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = madd<BF>(acc[r][v], b, vv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(O + r * D + v * 16, acc[r][v]);
#else
  static_assert(!BF, "bf16 compute needs AVX-512");
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < D; ++d) {
      float a = O[r * D + d] * corr[r];
      for (int j = 0; j < J; ++j) {
        float x, y;
        std::memcpy(&x, P + r * kNK + j, 4);
        std::memcpy(&y, Vp + j * D + d, 4);
        a += x * y;
      }
      O[r * D + d] = a;
    }
#endif
}

// Row counts per micro-kernel call: accumulators stay in zmm registers.
template <int D>
struct Blocking {
  static constexpr int NV = D / 16;
  static constexpr int PV = NV <= 2 ? 8 : NV <= 4 ? 6 : NV <= 6 ? 4 : NV <= 8 ? 3 : 1;
  static constexpr int QK = 8;
};

template <typename T, typename C, int D, bool BF>
void prefill_kernel(const T* q, const C* k_cache, const C* v_cache, const float* k_scale, const float* v_scale,
                    const int64_t* table, int64_t n, int64_t ctx, int64_t H, int64_t Hkv, int64_t block_size,
                    float scale, int64_t window, float softcap, T* out) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  constexpr bool quantized = kScaledCache<C>;
  constexpr int E = Cmp<BF>::E;
  constexpr int W = D / E;          // words per query / key row
  constexpr int PW = kNK / E;       // words per row of P (per tile)
  constexpr int64_t KT = W * kNK;   // words per packed K tile
  constexpr int64_t VT = PW * D;    // words per packed V tile
  const int64_t G = H / Hkv;
  const int64_t L = ctx + n;
  const int64_t ntiles = (L + kNK - 1) / kNK;
  const int64_t row = Hkv * D;  // cache elements per slot

  // The first key any query of the chunk sees (its first query's window start).
  const int64_t kmin = window > 0 ? std::max<int64_t>(0, ctx + 1 - window) : 0;
  static const C zero_row[256] = {};  // D <= 256

  // ---- packing of K / V tiles (and per-key score / weight factors) ----
  std::unique_ptr<uint32_t[]> kp(new uint32_t[Hkv * ntiles * KT]);
  std::unique_ptr<uint32_t[]> vp(new uint32_t[Hkv * ntiles * VT]);
  std::unique_ptr<float[]> kf(new float[Hkv * ntiles * kNK]);
  std::unique_ptr<float[]> vf(quantized ? new float[Hkv * ntiles * kNK] : nullptr);
  auto pack_tile = [&](int64_t it) {
    {
      const int64_t h = it / ntiles, t = it % ntiles;
      const int64_t k0 = t * kNK;
      const int nk = static_cast<int>(std::min<int64_t>(kNK, L - k0));
      uint32_t* K = kp.get() + it * KT;
      uint32_t* V = vp.get() + it * VT;
      float* KF = kf.get() + it * kNK;
      const C* krow[kNK];
      const C* vrow[kNK];
      for (int j = 0; j < nk; ++j) {
        const int64_t p = k0 + j;
        if (p < kmin) {  // before every query's window: never read (its block may be freed), packed as zeros
          krow[j] = vrow[j] = zero_row;
          KF[j] = 0.f;
          if constexpr (quantized) vf[it * kNK + j] = 0.f;
          continue;
        }
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        krow[j] = k_cache + slot * row + h * D;
        vrow[j] = v_cache + slot * row + h * D;
        if constexpr (quantized) {
          KF[j] = scale * k_scale[slot * Hkv + h];
          vf[it * kNK + j] = v_scale[slot * Hkv + h];
        } else {
          KF[j] = scale;
        }
      }
      for (int j = nk; j < kNK; ++j) {
        KF[j] = 0.f;
        if constexpr (quantized) vf[it * kNK + j] = 0.f;
      }
      if constexpr (BF) {
        // K: [W][kNK] words, word w of key j = (k[j][2w], k[j][2w+1]).
        for (int j = 0; j < nk; ++j) {
          const C* kr = krow[j];
          if constexpr (std::is_same_v<C, c10::BFloat16>) {
            const uint32_t* kw = reinterpret_cast<const uint32_t*>(kr);
            for (int w = 0; w < W; ++w) K[w * kNK + j] = kw[w];
          } else {
            for (int w = 0; w < W; ++w)
              K[w * kNK + j] = static_cast<uint32_t>(bf_bits(kr[2 * w])) | (static_cast<uint32_t>(bf_bits(kr[2 * w + 1])) << 16);
          }
        }
        for (int j = nk; j < kNK; ++j)
          for (int w = 0; w < W; ++w) K[w * kNK + j] = 0;
        // V: [kNK / 2][D] words, word d of key pair j2 = (v[2 j2][d], v[2 j2 + 1][d]).
        for (int j2 = 0; j2 < PW; ++j2) {
          uint32_t* vw = V + j2 * D;
          const int ja = 2 * j2, jb = 2 * j2 + 1;
          if (jb < nk) {
            const C* a = vrow[ja];
            const C* b = vrow[jb];
            for (int d = 0; d < D; ++d)
              vw[d] = static_cast<uint32_t>(bf_bits(a[d])) | (static_cast<uint32_t>(bf_bits(b[d])) << 16);
          } else if (ja < nk) {
            const C* a = vrow[ja];
            for (int d = 0; d < D; ++d) vw[d] = static_cast<uint32_t>(bf_bits(a[d]));
          } else {
            std::memset(vw, 0, D * sizeof(uint32_t));
          }
        }
      } else {
        // K: [D][kNK] floats; V: [kNK][D] floats.
        for (int j = 0; j < nk; ++j) {
          const C* kr = krow[j];
          const C* vr = vrow[j];
          for (int d = 0; d < D; ++d) {
            K[d * kNK + j] = f_bits(to_f(kr[d]));
            V[j * D + d] = f_bits(to_f(vr[d]));
          }
        }
        for (int j = nk; j < kNK; ++j) {
          for (int d = 0; d < D; ++d) K[d * kNK + j] = 0;
          std::memset(V + j * D, 0, D * sizeof(uint32_t));
        }
      }
    }
  };
  // Tiles are packed on first use, by whichever thread needs one first (0: not packed,
  // 1: being packed, 2: ready): one parallel region, no barrier between packing and attending.
  std::unique_ptr<std::atomic<int>[]> state(new std::atomic<int>[Hkv * ntiles]);
  for (int64_t i = 0; i < Hkv * ntiles; ++i) state[i].store(0, std::memory_order_relaxed);
  auto ensure_packed = [&](int64_t it) {
    std::atomic<int>& st = state[it];
    if (st.load(std::memory_order_acquire) == 2) return;
    int expected = 0;
    if (st.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      pack_tile(it);
      st.store(2, std::memory_order_release);
      return;
    }
    while (st.load(std::memory_order_acquire) != 2) {
#if defined(__AVX512F__)
      _mm_pause();
#endif
    }
  };

  // ---- attention, items = (query tile, kv head), longest first ----
  const int64_t nqt = (n + kQT - 1) / kQT;
  const int64_t items = nqt * Hkv;
  std::atomic<int64_t> next{0};
  const int64_t M_max = kQT * G;
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    std::unique_ptr<uint32_t[]> Q(new uint32_t[M_max * W]);
    std::unique_ptr<float[]> S(new float[M_max * kNK]);
    std::unique_ptr<uint32_t[]> P(new uint32_t[M_max * PW]);
    std::unique_ptr<float[]> O(new float[M_max * D]);
    std::unique_ptr<float[]> m(new float[M_max]), corr(new float[M_max]);
    // Softmax denominators: 16 lane-wise partial sums per row, reduced once at the end.
    std::unique_ptr<float[]> l(new float[M_max * 16]);
    std::unique_ptr<int64_t[]> pos(new int64_t[M_max]), lo(new int64_t[M_max]);
    for (;;) {
      const int64_t it = next.fetch_add(1);
      if (it >= items) break;
      const int64_t qt = nqt - 1 - it / Hkv, h = it % Hkv;  // last query tiles (most keys) first
      const int64_t q0 = qt * kQT;
      const int64_t nq = std::min<int64_t>(kQT, n - q0);
      const int64_t M = nq * G;
      // Rows r = qi * G + g (position order); queries as words.
      for (int64_t qi = 0; qi < nq; ++qi)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = qi * G + g;
          const T* src = q + ((q0 + qi) * H + h * G + g) * D;
          uint32_t* dst = Q.get() + r * W;
          if constexpr (BF) {
            std::memcpy(dst, src, D * sizeof(T));  // T is bf16 here
          } else {
            for (int d = 0; d < D; ++d) dst[d] = f_bits(to_f(src[d]));
          }
          pos[r] = ctx + q0 + qi;
          lo[r] = window > 0 ? std::max<int64_t>(0, pos[r] + 1 - window) : 0;  // its first key
          m[r] = kNoScore;
          std::fill(l.get() + r * 16, l.get() + r * 16 + 16, 0.f);
        }
      std::fill(O.get(), O.get() + M * D, 0.f);
      const int64_t kend = ctx + q0 + nq;  // keys seen by the last row
      const int64_t tiles = (kend + kNK - 1) / kNK;
      // Rows [r0, r1) see some of the current tile: causally from r0, within their window below r1.
      // Tiles before the first row's window are never read (their blocks may be freed).
      int64_t r0 = 0, r1 = 0;
      for (int64_t t = lo[0] / kNK; t < tiles; ++t) {
        const int64_t k0 = t * kNK;
        while (r0 < M && pos[r0] < k0) ++r0;
        while (r1 < M && lo[r1] < k0 + kNK) ++r1;
        ensure_packed(h * ntiles + t);
        const uint32_t* K = kp.get() + (h * ntiles + t) * KT;
        const uint32_t* V = vp.get() + (h * ntiles + t) * VT;
        const float* KF = kf.get() + (h * ntiles + t) * kNK;
        const float* VF = quantized ? vf.get() + (h * ntiles + t) * kNK : nullptr;
        // Scores.
        {
          constexpr int NR = Blocking<D>::QK;
          int64_t r = r0;
          for (; r + NR <= r1; r += NR) qk_rows<BF, NR>(Q.get() + r * W, W, K, W, S.get() + r * kNK);
          for (; r < r1; ++r) qk_rows<BF, 1>(Q.get() + r * W, W, K, W, S.get() + r * kNK);
        }
        // Online softmax per row.
        for (int64_t r = r0; r < r1; ++r) {
          // Visible keys: j0 .. nv - 1 of the tile (the window's start, the causal end).
          const int nv = static_cast<int>(std::min<int64_t>(kNK, pos[r] + 1 - k0));
          const int j0 = static_cast<int>(std::max<int64_t>(0, lo[r] - k0));
          float* s = S.get() + r * kNK;
          uint32_t* pr = P.get() + r * PW;
#if defined(__AVX512F__)
          const uint32_t vis = (nv >= 32 ? 0xFFFFFFFFu : (1u << nv) - 1) & ~((1u << j0) - 1);  // j0 < nv <= 32
          const __mmask16 v0 = static_cast<__mmask16>(vis), v1 = static_cast<__mmask16>(vis >> 16);
          const __m512 none = _mm512_set1_ps(kNoScore);
          __m512 c0 = _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_loadu_ps(KF));
          __m512 c1 = _mm512_mul_ps(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(KF + 16));
          if (softcap > 0.f) {
            c0 = softcap16(c0, softcap);
            c1 = softcap16(c1, softcap);
          }
          const __m512 s0 = _mm512_mask_mov_ps(none, v0, c0);
          const __m512 s1 = _mm512_mask_mov_ps(none, v1, c1);
          const float bm = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
          const __m512 bmv = _mm512_set1_ps(bm);
          __m512 e0 = _mm512_maskz_mov_ps(v0, exp16(_mm512_sub_ps(s0, bmv)));
          __m512 e1 = _mm512_maskz_mov_ps(v1, exp16(_mm512_sub_ps(s1, bmv)));
          corr[r] = std::exp(m[r] - bm);
          _mm512_storeu_ps(l.get() + r * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l.get() + r * 16), _mm512_set1_ps(corr[r]),
                                                            _mm512_add_ps(e0, e1)));
          m[r] = bm;
          if constexpr (quantized) {
            e0 = _mm512_mul_ps(e0, _mm512_loadu_ps(VF));
            e1 = _mm512_mul_ps(e1, _mm512_loadu_ps(VF + 16));
          }
          if constexpr (BF) {
#if defined(__AVX512BF16__)
            _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
#endif
          } else {
            _mm512_storeu_ps(reinterpret_cast<float*>(pr), e0);
            _mm512_storeu_ps(reinterpret_cast<float*>(pr) + 16, e1);
          }
#else
          float bm = m[r];
          for (int j = j0; j < nv; ++j) {
            s[j] = softcap1(s[j] * KF[j], softcap);
            bm = std::max(bm, s[j]);
          }
          float sum = 0.f;
          float* pf = reinterpret_cast<float*>(pr);
          for (int j = 0; j < kNK; ++j) {
            const float e = j >= j0 && j < nv ? std::exp(s[j] - bm) : 0.f;
            sum += e;
            pf[j] = quantized ? e * VF[j] : e;
          }
          corr[r] = std::exp(m[r] - bm);
          l[r * 16] = l[r * 16] * corr[r] + sum;
          m[r] = bm;
#endif
        }
        // O = O * corr + P V.
        {
          constexpr int NR = Blocking<D>::PV;
          const int J = static_cast<int>((std::min<int64_t>(kNK, kend - k0) + E - 1) / E);
          int64_t r = r0;
          for (; r + NR <= r1; r += NR) pv_rows<BF, D, NR>(P.get() + r * PW, V, J, O.get() + r * D, corr.get() + r);
          for (; r < r1; ++r) pv_rows<BF, D, 1>(P.get() + r * PW, V, J, O.get() + r * D, corr.get() + r);
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = qi * G + g;
          float lsum = 0.f;
          for (int i = 0; i < 16; ++i) lsum += l[r * 16 + i];
          const float inv = 1.f / lsum;
          T* dst = out + ((q0 + qi) * H + h * G + g) * D;
          const float* o = O.get() + r * D;
          for (int d = 0; d < D; ++d) from_f(o[d] * inv, dst + d);
        }
    }
  });
}

template <typename T, typename C, bool BF>
void prefill_dispatch(int64_t D, const T* q, const C* k, const C* v, const float* ks, const float* vs,
                      const int64_t* table, int64_t n, int64_t ctx, int64_t H, int64_t Hkv, int64_t bs, float scale,
                      int64_t window, float softcap, T* out) {
#define TM_CASE(DIM) \
  case DIM: return prefill_kernel<T, C, DIM, BF>(q, k, v, ks, vs, table, n, ctx, H, Hkv, bs, scale, window, softcap, out);
  switch (D) {
    TM_CASE(16) TM_CASE(32) TM_CASE(64) TM_CASE(80) TM_CASE(96) TM_CASE(128) TM_CASE(256)
    default: TORCH_CHECK(false, "paged_prefill: unsupported head_dim ", D);
  }
#undef TM_CASE
}

}  // namespace

// q: [n, H, D] (the chunk's queries, query i at position context_len + i); k_cache, v_cache:
// [slots, Hkv, D] (q's dtype, or int8 / float8 e4m3 with k_scale / v_scale: [slots, Hkv] float32), already
// holding the chunk's own K/V; block_table: [>= ceil((context_len + n) / block_size)] int64.
// Returns [n, H, D]: query i attends to keys 0 .. context_len + i (window > 0: the last `window`
// of them; softcap > 0: scores soft-capped).
at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                            int64_t context_len, int64_t block_size, double scale,
                            c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [n, H, D], caches [slots, Hkv, D]");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1, "int64 block table");
  TORCH_CHECK(scaled_cache(k_cache) || q.scalar_type() == k_cache.scalar_type(), "q and cache dtype differ");
  const float *ks, *vs;
  std::tie(ks, vs) = cache_scales(k_cache, v_cache, k_scale, v_scale);
  q = q.contiguous();
  auto bt = block_table.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "head shapes");
  TORCH_CHECK(context_len >= 0 && block_size > 0, "context_len / block_size");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_prefill: window and softcap must be >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);
  TORCH_CHECK(bt.size(0) * block_size >= context_len + n, "block table too short");
  auto out = tm_cpu::empty_like(q);
  if (n == 0) return out;
  const float sc = static_cast<float>(scale);
  const int64_t* tp = bt.data_ptr<int64_t>();
  if (q.scalar_type() == at::kFloat) {
    with_cache<float>(k_cache, v_cache, [&](auto* kp, auto* vp) {
      using C = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
      prefill_dispatch<float, C, false>(D, q.data_ptr<float>(), kp, vp, ks, vs, tp, n, context_len, H, Hkv, block_size,
                                        sc, window, cap, out.data_ptr<float>());
    });
  } else if (q.scalar_type() == at::kBFloat16) {
    using BF = c10::BFloat16;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    constexpr bool kBF = true;
#else
    constexpr bool kBF = false;
#endif
    with_cache<BF>(k_cache, v_cache, [&](auto* kp, auto* vp) {
      using C = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
      prefill_dispatch<BF, C, kBF>(D, q.data_ptr<BF>(), kp, vp, ks, vs, tp, n, context_len, H, Hkv, block_size, sc,
                                   window, cap, out.data_ptr<BF>());
    });
  } else {
    TORCH_CHECK(false, "paged_prefill: float32 or bfloat16 queries only");
  }
  return out;
}
