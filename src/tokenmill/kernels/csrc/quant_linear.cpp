// Weight-only quantized linear layers for CPU: y = x @ dequant(W)^T with W stored as int4 or int8
// in groups of 32 along the input dimension, each group with float16 scale d (and, int4, an
// offset m): w = q * d + m (int4, q in 0..15) or w = q * d (int8, q in -128..127).
// These are GGUF's Q4_1 / Q4_0 (m = -8d) / Q8_0 blocks with the scales split out, so llama.cpp
// files load without dequantizing. int4 byte j of a group holds element j (low nibble) and
// element j + 16 (high nibble), as in GGUF.
//
// Each thread takes a range of 4-row tiles of the output (linear.h); it dequantizes a tile's rows
// into a small buffer (L1-resident) and multiplies every input row by them, so a weight is read
// from memory once per call whatever the batch size. The dot products run on AVX-512 (bf16 pairs
// with vdpbf16ps where the CPU has it) or AVX2 + FMA (float32; bf16 inputs widened first), with a
// portable scalar path elsewhere. (bf16 weights: panel_linear.cpp.)
#include "torch_lite.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "linear.h"

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace tm_cpu;

#if defined(__AVX512F__) || !defined(__AVX2__)
#define TM_QUANT_AVX2 0
#else
#define TM_QUANT_AVX2 1
#endif
// AVX2 + FMA + F16C (every AVX2 CPU in practice): weights dequantized in registers (below).
#if TM_QUANT_AVX2 && defined(__FMA__) && defined(__F16C__)
#define TM_QUANT_AVX2_FMA 1
#else
#define TM_QUANT_AVX2_FMA 0
#endif

constexpr int kRows = kTileRows;  // weight rows dequantized and multiplied together
constexpr int kBatch = TM_QUANT_AVX2 ? 2 : 4;  // input rows per micro-tile (AVX2: 2 x 4 accumulators + 4 weights of 16 ymm)

inline float half_to_f(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);  // one instruction; c10's portable conversion is a dozen
#else
  return static_cast<float>(h);
#endif
}

#if TM_QUANT_AVX2_FMA
// n float16 scales as float32, 8 at a time (F16C).
inline void halves_to_f32(const at::Half* s, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(s[i].x);
}

// Group g of a row, dequantized in registers: w[v] = its elements 8v .. 8v + 7. int4: w = q * d + m
// in one FMA (q: a byte's low nibble for elements 0..15, its high nibble for 16..31); int8:
// w = q * d, an FMA with 0 (exact, and opaque to -ffast-math's reassociation like every FMA here).
// dm: the row's scales as float32 ((d, m) pairs for int4).
template <int BITS>
inline void dequant_group(const uint8_t* q, const float* dm, int64_t g, __m256 (&w)[4]) {
  if constexpr (BITS == 4) {
    const uint8_t* qg = q + g * kGroup / 2;
    const __m256 d = _mm256_broadcast_ss(dm + 2 * g), m = _mm256_broadcast_ss(dm + 2 * g + 1);
    const __m256i low4 = _mm256_set1_epi32(0xF);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 8)));
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), d, m);
  } else {
    const int8_t* qg = reinterpret_cast<const int8_t*>(q) + g * kGroup;
    const __m256 d = _mm256_broadcast_ss(dm + g), zero = _mm256_setzero_ps();
    for (int v = 0; v < 4; ++v) {
      const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 8 * v)));
      w[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), d, zero);
    }
  }
}

// One row of K weights dequantized to float32, its scales already float32.
template <int BITS>
inline void dequant_row_dm(const uint8_t* q, const float* dm, float* w, int64_t K) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m256 v[4];
    dequant_group<BITS>(q, dm, g, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(w + g * kGroup + 8 * i, v[i]);
  }
}
#endif

// Dequantize one row of K weights to float32.
template <int BITS>
void dequant_row_f32(const uint8_t* q, const at::Half* s, float* w, int64_t K) {
#if TM_QUANT_AVX2_FMA
  thread_local std::vector<float> dm;
  dm.resize(K / kGroup * (BITS == 4 ? 2 : 1));
  halves_to_f32(s, dm.size(), dm.data());
  dequant_row_dm<BITS>(q, dm.data(), w, K);
#else
  const int64_t groups = K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    float* wg = w + g * kGroup;
    if constexpr (BITS == 4) {
      const float d = half_to_f(s[2 * g]), m = half_to_f(s[2 * g + 1]);
      const uint8_t* qg = q + g * kGroup / 2;
#if defined(__AVX512F__)
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
      const __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF));
      const __m512i hi = _mm512_srli_epi32(bytes, 4);
      const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
      _mm512_storeu_ps(wg, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), vd, vm));
      _mm512_storeu_ps(wg + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), vd, vm));
#else
      for (int j = 0; j < 16; ++j) {
        wg[j] = (qg[j] & 0xF) * d + m;
        wg[j + 16] = (qg[j] >> 4) * d + m;
      }
#endif
    } else {
      const float d = half_to_f(s[g]);
      const int8_t* qg = reinterpret_cast<const int8_t*>(q) + g * kGroup;
#if defined(__AVX512F__)
      const __m512 vd = _mm512_set1_ps(d);
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16 * h)));
        _mm512_storeu_ps(wg + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(v), vd));
      }
#else
      for (int j = 0; j < kGroup; ++j) wg[j] = qg[j] * d;
#endif
    }
  }
#endif
}

#if defined(__AVX512F__)
// out[i * ldo + j] = sum of acc[i][j]'s lanes. A full tile sums through hsum16, a tail of rows or
// outputs one vector at a time through hsum1, which adds in the same order: an output's bits do
// not depend on how many input rows share its tile (batch-invariant).
template <int MB, int NB>
inline void store_sums(__m512 (&acc)[MB][NB], float* out, int64_t ldo) {
  if constexpr (MB * NB == 16 && NB == 4) {
    if (ldo == 4) {
      _mm512_storeu_ps(out, hsum16(&acc[0][0]));
      return;
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * ldo + j] = hsum1(acc[i][j]);
}
#endif

#if defined(__AVX512BF16__)
// Dequantize one row straight to bf16 (round to nearest even), the operand of vdpbf16ps.
// int4: the group's 16 possible values form a bf16 table that vpermw indexes by nibble.
// pq / ps (or null): the same row of the next tile, prefetched into L2 meanwhile, a line at a time.
template <int BITS>
void dequant_row_bf16(const uint8_t* q, const at::Half* s, c10::BFloat16* w, int64_t K,
                      const uint8_t* pq = nullptr, const at::Half* ps = nullptr) {
  const int64_t groups = K / kGroup;
  constexpr int64_t group_bytes = BITS == 4 ? kGroup / 2 : kGroup, group_scales = BITS == 4 ? 2 : 1;
  auto prefetch = [&](int64_t g) {  // a trickle, one line when the group starts one: bursts do not help
    if (pq == nullptr) return;
    if ((g * group_bytes) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(pq + g * group_bytes), _MM_HINT_T1);
    if ((g * group_scales * 2) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(ps + g * group_scales), _MM_HINT_T1);
  };
  if constexpr (BITS == 4) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i low4 = _mm256_set1_epi16(0xF);
    for (int64_t g = 0; g < groups; ++g) {
      prefetch(g);
      const __m512 vals = _mm512_fmadd_ps(iota, _mm512_set1_ps(half_to_f(s[2 * g])), _mm512_set1_ps(half_to_f(s[2 * g + 1])));
      const __m512i table = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(vals)));
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16)));
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low4)),
                                             _mm256_srli_epi16(bytes, 4), 1);
      _mm512_storeu_si512(reinterpret_cast<void*>(w + g * kGroup), _mm512_permutexvar_epi16(idx, table));
    }
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      prefetch(g);
      const __m512 d = _mm512_set1_ps(half_to_f(s[g]));
      const int8_t* qg = reinterpret_cast<const int8_t*>(q) + g * kGroup;
      const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)))), d);
      const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)))), d);
      _mm512_storeu_si512(reinterpret_cast<void*>(w + g * kGroup), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
  }
}

// out[m][n] = sum_k x[m][k] * w[n][k] for MB input rows and NB weight rows, bf16 pairs.
template <int MB, int NB>
inline void tile_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw, int64_t K,
                      float* out, int64_t ldo) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * ldw + k));
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + i * ldx + k));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  store_sums<MB, NB>(acc, out, ldo);
}
#endif

#if TM_QUANT_AVX2 && defined(__FMA__)
// The sum of x's 8 lanes in one fixed order (every output of every tile alike: batch-invariant).
inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

template <int MB, int NB>
inline void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
#if TM_QUANT_AVX2 && defined(__FMA__)
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm256_loadu_ps(w + j * ldw + k);
      asm("" : "+x"(wv[j]));  // kept in a register: GCC would fold the load into each row's FMA, a load per FMA
    }
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * ldo + j] = hsum8(acc[i][j]);
#elif defined(__AVX512F__)
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + k);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  store_sums<MB, NB>(acc, out, ldo);
#else
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[i * ldx + k] * w[j * ldw + k];
      out[i * ldo + j] = s;
    }
#endif
}

#if TM_QUANT_AVX2_FMA
// Input rows up to which a tile's weights are dequantized in registers (tile_packed) rather than
// into the L1 buffer that tile_f32 reads: each weight is then dequantized once per row.
constexpr int kPackedRows = 4;

// tile_f32's products and sums, bit for bit, on weights dequantized in registers straight from the
// packed rows (no store and reload through L1; what batch-1 decode runs): group by group, each
// weight row's 32 values are dequantized once and FMA'd with every input row, the lanes
// accumulating in k order as tile_f32's do. q / dm: NB rows ldq bytes / lds scales apart.
template <int BITS, int MB, int NB>
inline void tile_packed(const float* x, int64_t ldx, const uint8_t* q, int64_t ldq, const float* dm, int64_t lds,
                        int64_t K, float* out, int64_t ldo) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      __m256 w[4];
      dequant_group<BITS>(q + j * ldq, dm + j * lds, g, w);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + i * ldx + 8 * v), w[v], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * ldo + j] = hsum8(acc[i][j]);
}
#endif

// Runs tile<MB, NB> with MB, NB in 1..4 chosen at run time (tails of M and N).
template <typename Fn>
inline void dispatch_tile(int mb, int nb, Fn&& fn) {
#define TM_NB(MB_)                                                 \
  switch (nb) {                                                    \
    case 1: fn(std::integral_constant<int, MB_>{}, std::integral_constant<int, 1>{}); break; \
    case 2: fn(std::integral_constant<int, MB_>{}, std::integral_constant<int, 2>{}); break; \
    case 3: fn(std::integral_constant<int, MB_>{}, std::integral_constant<int, 3>{}); break; \
    default: fn(std::integral_constant<int, MB_>{}, std::integral_constant<int, 4>{}); break; \
  }
  switch (mb) {
    case 1: TM_NB(1) break;
    case 2: TM_NB(2) break;
    case 3: TM_NB(3) break;
    default: TM_NB(4) break;
  }
#undef TM_NB
}

template <typename T>
inline void store(float v, T* dst, const T* bias) {
  if (bias == nullptr) {
    *dst = static_cast<T>(v);
  } else {  // rounded to T first, then the bias added and rounded again, as `y + bias` does
    *dst = static_cast<T>(static_cast<float>(static_cast<T>(v)) + static_cast<float>(*bias));
  }
}

// Tiles [t0, t1): each tile's rows dequantized into an L1-resident buffer (WT: bf16 with
// vdpbf16ps, else float), then multiplied by every input row in 4 x 4 register tiles.
template <int BITS, typename WT, typename XT, typename OT>
void tiles_4x4(const XT* x, int64_t M, const LinearWeights& lw, int64_t t0, int64_t t1, OT* out, int64_t ldo,
               const OT* bias) {
  const int64_t N = lw.N, K = lw.K;
  const uint8_t* qw = static_cast<const uint8_t*>(lw.data);
  const at::Half* sc = lw.scales;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  const int64_t row_scales = BITS == 4 ? 2 * K / kGroup : K / kGroup;
  thread_local std::vector<WT> buf;
  buf.resize(kRows * K);
  alignas(64) float acc[kBatch * kRows];
#if TM_QUANT_AVX2_FMA
  thread_local std::vector<float> dm;  // the tile's scales as float32
  dm.resize(kRows * row_scales);
#endif
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kRows;
    const int nb = static_cast<int>(std::min<int64_t>(kRows, N - n0));
    const WT* w = buf.data();  // this tile's weight rows, dequantized
#if TM_QUANT_AVX2_FMA  // (WT is float here)
    halves_to_f32(sc + n0 * row_scales, nb * row_scales, dm.data());
    const uint8_t* qt = qw + n0 * row_bytes;
    if (M <= kPackedRows) {  // few rows: dequantized in registers, no L1 buffer
      // MB x NB <= 8 accumulators: up to 2 rows x 4 weight rows, or 3-4 rows x 2 weight rows twice
      const int step = M <= 2 ? nb : 2;
      for (int j0 = 0; j0 < nb; j0 += step) {
        dispatch_tile(static_cast<int>(M), std::min(step, nb - j0), [&](auto MB, auto NB) {
          constexpr int mb_ = decltype(MB)::value, nb_ = decltype(NB)::value;
          if constexpr (mb_ <= kPackedRows && mb_ * nb_ <= 8)
            tile_packed<BITS, mb_, nb_>(reinterpret_cast<const float*>(x), K, qt + j0 * row_bytes, row_bytes,
                                        dm.data() + j0 * row_scales, row_scales, K, acc + j0, kRows);
        });
      }
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < nb; ++j)
          store(acc[i * kRows + j], out + i * ldo + n0 + j, bias == nullptr ? nullptr : bias + n0 + j);
      continue;
    }
    for (int j = 0; j < nb; ++j)
      dequant_row_dm<BITS>(qt + j * row_bytes, dm.data() + j * row_scales, reinterpret_cast<float*>(buf.data()) + j * K, K);
#else
    for (int j = 0; j < nb; ++j) {
      const uint8_t* q = qw + (n0 + j) * row_bytes;
      const at::Half* s = sc + (n0 + j) * row_scales;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<WT, c10::BFloat16>) {
        const bool more = t + 1 < t1;
        dequant_row_bf16<BITS>(q, s, buf.data() + j * K, K, more ? q + kRows * row_bytes : nullptr,
                               more ? s + kRows * row_scales : nullptr);
        continue;
      }
#endif
      if constexpr (std::is_same_v<WT, float>) dequant_row_f32<BITS>(q, s, buf.data() + j * K, K);
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += kBatch) {
      const int mb = static_cast<int>(std::min<int64_t>(kBatch, M - m0));
      dispatch_tile(mb, nb, [&](auto MB, auto NB) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<WT, c10::BFloat16>) {
          tile_bf16<decltype(MB)::value, decltype(NB)::value>(x + m0 * K, K, w, K, K, acc, kRows);
          return;
        }
#endif
        if constexpr (std::is_same_v<WT, float>)
          tile_f32<decltype(MB)::value, decltype(NB)::value>(reinterpret_cast<const float*>(x) + m0 * K, K, w, K, K,
                                                             acc, kRows);
      });
      for (int i = 0; i < mb; ++i)
        for (int j = 0; j < nb; ++j)
          store(acc[i * kRows + j], out + (m0 + i) * ldo + n0 + j, bias == nullptr ? nullptr : bias + n0 + j);
    }
  }
}

}  // namespace

namespace tm_cpu {

template <typename XT, typename OT>
void linear_tiles(const XT* x, int64_t M, const LinearWeights& w, int64_t t0, int64_t t1, OT* out, int64_t ldo,
                  const OT* bias) {
  if (M == 0 || t0 >= t1) return;
  auto run = [&](auto bits_c) {
    constexpr int B = decltype(bits_c)::value;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<XT, c10::BFloat16>) {
      tiles_4x4<B, c10::BFloat16>(x, M, w, t0, t1, out, ldo, bias);
      return;
    }
#endif
    if constexpr (std::is_same_v<XT, float>) {
      tiles_4x4<B, float>(x, M, w, t0, t1, out, ldo, bias);
    } else {  // without vdpbf16ps: the inputs widened to float32 (exact), as the op does
      thread_local std::vector<float> xf;
      xf.resize(M * w.K);
      for (int64_t i = 0; i < M * w.K; ++i) xf[i] = static_cast<float>(x[i]);
      tiles_4x4<B, float>(xf.data(), M, w, t0, t1, out, ldo, bias);
    }
  };
  if (w.bits == 4) run(std::integral_constant<int, 4>{});
  else run(std::integral_constant<int, 8>{});
}

template <typename T>
void embedding_row(const LinearWeights& table, int64_t id, T* out) {
  const int64_t K = table.K;
#if TM_QUANT_PANELS
  if (table.panels) {
    quant_panel_row(table, id, out);
    return;
  }
#endif
  if (table.bits == 16) {
    const c10::BFloat16* row = static_cast<const c10::BFloat16*>(table.data) + id * K;
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<T>(static_cast<float>(row[k]));
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(table.data);
  auto dequant = [&](float* f) {
    if (table.bits == 4) dequant_row_f32<4>(q + id * K / 2, table.scales + id * 2 * K / kGroup, f, K);
    else dequant_row_f32<8>(q + id * K, table.scales + id * K / kGroup, f, K);
  };
  if constexpr (std::is_same_v<T, float>) {
    dequant(out);  // in place
  } else {  // through a float32 row
    thread_local std::vector<float> tmp;
    tmp.resize(K);
    dequant(tmp.data());
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<T>(tmp[k]);
  }
}

template void embedding_row<float>(const LinearWeights&, int64_t, float*);
template void embedding_row<c10::BFloat16>(const LinearWeights&, int64_t, c10::BFloat16*);

template void linear_tiles<float, float>(const float*, int64_t, const LinearWeights&, int64_t, int64_t, float*,
                                         int64_t, const float*);
template void linear_tiles<float, c10::BFloat16>(const float*, int64_t, const LinearWeights&, int64_t, int64_t,
                                                 c10::BFloat16*, int64_t, const c10::BFloat16*);
template void linear_tiles<c10::BFloat16, c10::BFloat16>(const c10::BFloat16*, int64_t, const LinearWeights&,
                                                         int64_t, int64_t, c10::BFloat16*, int64_t,
                                                         const c10::BFloat16*);

}  // namespace tm_cpu

namespace {

// The op: tiles shared out over ATen's thread pool, at least 8 tiles (32 rows) per task so
// small layers are not over-split.
template <typename XT, typename OT>
void linear_op(const XT* x, int64_t M, const LinearWeights& w, OT* out) {
  at::parallel_for(0, w.units(), 8, [&](int64_t begin, int64_t end) { linear_tiles(x, M, w, begin, end, out, w.N); });
}

}  // namespace

// x: [M, K] float32 or bfloat16; qweight: uint8 [N, K/2] (bits 4) or int8 [N, K] (bits 8);
// scales: float16 [N, K/32, 2] (d, m) for bits 4, [N, K/32] (d) for bits 8. Returns [M, N] in x's dtype.
at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && qweight.is_contiguous() && scales.is_contiguous(),
              "quant_linear: x [M, K], contiguous weights");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "quant_linear: float16 scales");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % kGroup == 0, "quant_linear: in_features must be a multiple of 32");
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? K / 2 : K), "quant_linear: weight shape does not match x");
  TORCH_CHECK(scales.numel() == N * (K / kGroup) * (bits == 4 ? 2 : 1), "quant_linear: scales shape");
  auto out = tm_cpu::empty({M, N}, x.options());
  if (M == 0) return out;
  const LinearWeights w{static_cast<int>(bits), false, qweight.data_ptr(), scales.data_ptr<at::Half>(), N, K};
  if (x.scalar_type() == at::kBFloat16) {
    auto xc = x.contiguous();
#if defined(__AVX512BF16__)
    linear_op(xc.data_ptr<c10::BFloat16>(), M, w, out.data_ptr<c10::BFloat16>());
#else
    auto xf = xc.to(at::kFloat);
    linear_op(xf.data_ptr<float>(), M, w, out.data_ptr<c10::BFloat16>());
#endif
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_linear: float32 or bfloat16 inputs");
    auto xc = x.contiguous();
    linear_op(xc.data_ptr<float>(), M, w, out.data_ptr<float>());
  }
  return out;
}

// The whole weight dequantized: [N, K] in `dtype` (bfloat16 or float32). For large batches
// (prompt steps) a dequantized copy through oneDNN's GEMM beats dequantizing per tile.
at::Tensor dequantize_weight(at::Tensor qweight, at::Tensor scales, int64_t bits, at::ScalarType dtype) {
  TORCH_CHECK((bits == 4 || bits == 8) && qweight.is_contiguous() && scales.is_contiguous() &&
              scales.scalar_type() == at::kHalf, "dequantize_weight inputs");
  const int64_t N = qweight.size(0), K = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  const int64_t row_bytes = qweight.size(1), row_scales = scales.numel() / N;
  const uint8_t* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sc = scales.data_ptr<at::Half>();
  auto out = tm_cpu::empty({N, K}, tm_cpu::dtype(dtype));
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(bf16 || dtype == at::kFloat, "dequantize_weight: bfloat16 or float32");
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(bf16 ? K : 0);
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* q = qw + n * row_bytes;
      const at::Half* s = sc + n * row_scales;
      if (bf16) {
#if defined(__AVX512BF16__)
        if (bits == 4) dequant_row_bf16<4>(q, s, out.data_ptr<c10::BFloat16>() + n * K, K);
        else dequant_row_bf16<8>(q, s, out.data_ptr<c10::BFloat16>() + n * K, K);
        continue;
#endif
        if (bits == 4) dequant_row_f32<4>(q, s, tmp.data(), K);
        else dequant_row_f32<8>(q, s, tmp.data(), K);
        c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + n * K;
        for (int64_t k = 0; k < K; ++k) o[k] = c10::BFloat16(tmp[k]);
      } else if (bits == 4) {
        dequant_row_f32<4>(q, s, out.data_ptr<float>() + n * K, K);
      } else {
        dequant_row_f32<8>(q, s, out.data_ptr<float>() + n * K, K);
      }
    }
  });
  return out;
}

// Rows of a quantized table (an embedding), dequantized: ids [T] -> [T, K] in `dtype`.
// Panels (a table tied to a quantized LM head, quant_panels.cpp): qweight [ceil(rows / 32), K / 32, 32, 16 or 32].
at::Tensor quant_embedding(at::Tensor ids, at::Tensor qweight, at::Tensor scales, int64_t bits,
                              at::ScalarType dtype, int64_t rows) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && qweight.is_contiguous() && scales.is_contiguous(), "quant_embedding");
  auto idc = ids.contiguous();
  const bool panels = qweight.dim() == 4;
  TORCH_CHECK(!panels || TM_QUANT_PANELS, "quant_embedding: quantized panels need a build with AVX2 + FMA + F16C");
  const int64_t T = idc.numel(), N = panels ? rows : qweight.size(0);
  const int64_t K = panels ? qweight.size(1) * kGroup : bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  const int64_t slots = panels ? qweight.size(0) * kPanelRows : N;
  TORCH_CHECK((bits == 4 || bits == 8) && scales.scalar_type() == at::kHalf && N <= slots &&
                  scales.numel() == slots * (K / kGroup) * (bits == 4 ? 2 : 1), "quant_embedding: bits 4 or 8, scales shape");
  auto out = tm_cpu::empty({T, K}, tm_cpu::dtype(at::kFloat));
  const int64_t* ip = idc.data_ptr<int64_t>();
  const LinearWeights table{static_cast<int>(bits), panels, qweight.data_ptr(), scales.data_ptr<at::Half>(), N, K};
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "quant_embedding: token id out of range");
    embedding_row(table, ip[t], out.data_ptr<float>() + t * K);
  }
  return out.to(dtype);
}
