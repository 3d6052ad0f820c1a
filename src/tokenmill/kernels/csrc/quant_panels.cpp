// int4 / int8 weights in output panels times int8 activations, for every CPU with AVX2 + FMA + F16C
// (quantization.py packs the weights at load, pack_quantized): 256-bit vpmaddubsw products (AMD Zen
// 2/3, and other CPUs without AVX-512 VNNI), or AVX-512 VNNI's vpdpbusd on 512 bits (Intel Ice
// Lake and later, AMD Zen 4 and later).
//
// The groups of 32 inputs and their scales are GGUF's (quant_linear.cpp), but the bytes are laid
// out as the bf16 panels are (panel_linear.cpp): a panel is 32 output rows; for each group the
// panel's codes, then the group's float16 scales: int4 d[32] and m[32], int8 d[32].
//
// Both run with int8 activations (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 way): each input row
// is quantized per group of 32 to int8 (xq = round(x * 127 / max|x|), scale s = max|x| / 127),
// and the group's products are exact integer sums from `vpmaddubsw` (unsigned x signed bytes,
// adjacent pairs added in int16), then `vpmaddwd` to int32:
//   y = sum_g [ (d_g * s_g) * (sum_k xq_k * q_k) + m_g * (sum_k x_k) ]   (int8: no m term)
// the offsets' group sums of x exact in float32 (summed once per row in a fixed order).
// int4: per 8 inputs s and 8 outputs v, 32 bytes at (4s + v) * 32 of the (panel, group), byte
// 4i + j holding output 8v + i's code of input 8s + j (low nibble) and of 8s + 4 + j (high
// nibble), so a mask and a shift give two registers of 4-input runs; the nibbles are unsigned
// and the products (at most 16 of 15 * 127 per int16 lane) add up in int16 through the group.
// int8: per 4 inputs s and 8 outputs v, 32 bytes at (4s + v) * 32, byte 4i + j holding output
// 8v + i's code of input 4s + j; |w| times x with w's sign (`vpabsb`, `vpsignb`), each 4-input
// run to int32 at once (a pair of products reaches 2 * 128 * 127).
// Per 32 weights and row that is 2 (int4) or 4 (int8) integer operations, the codes unpacked once
// for the tile's rows: batch-1 steps stream the packed weights at memory speed instead of
// converting every code to float.
// AVX-512 VNNI: one 64-byte load holds two of those 32-byte blocks (16 outputs), and vpdpbusd
// (unsigned x signed bytes, 4 products summed into each int32 lane, no saturation) takes int4's
// nibbles as they are; int8 codes are signed, so the activations go in as x + 128 (unsigned) and
// 128 * (sum of the codes) comes off the integer sum. Either way each group's integer sums are the
// exact ones the AVX2 path computes, and the float operations after them are the same: the two
// builds give the same bits.
//
// AMX-INT8 (where the CPU and the OS allow it): calls of set_quant_amx_int_rows' rows or more (16)
// take each group's integer sums from tile products instead (tdpbsud / tdpbssd: the same exact
// integers), 32 rows x a panel at a time, then the same float operations in the same order: the
// same bits as the vector path (checked once on random numbers before the path is used), 1.2-1.5x
// its speed for int4 and 1.4x for int8 at 16-64 rows (SmolLM2's shapes, 2 cores).
//
// Every output's operations are the same whatever the number of rows in the call, their place in
// the register tile, or how the panels are shared among threads: batch-invariant, bit for bit.
//
// Where the bf16 panels run on AMX-BF16 tiles (panel_linear.cpp), a bf16 call of many rows
// (set_quant_amx_rows: 128 where the engine is batch-invariant) runs there too: each panel is
// dequantized into bf16 once for all the rows (q * d + m rounded to bf16), the rows stay as they
// are. Its cost is per weight (~7 cycles per 32 weights here), not per row, so it loses to the
// integer products at a few rows and wins past ~16 (SmolLM2's gate/up and down, 2 cores: 1.3-1.5x
// at 32 rows, 1.5-2.7x at 128). The two paths round differently: a row's bits depend on which one
// its step's row count picks, and within each path on nothing else.
#include "torch_lite.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "linear.h"

#if TM_QUANT_PANELS
#include <immintrin.h>

namespace {

using namespace tm_cpu;
using BF16 = c10::BFloat16;

template <int BITS>
constexpr int64_t kGroupBytes = BITS == 4 ? 512 : 1024;  // codes of one (panel, group)
template <int BITS>
constexpr int64_t kGroupScales = BITS == 4 ? 64 : 32;  // float16 scales of one (panel, group)

inline __m256 load_halves(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ---- int8 activations ----

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Group g of MB quantized rows for NV vectors of 8 outputs from output 8 * v0, added to acc[m][0..32).
template <int MB, int NV>
inline void int4_group(const A8Rows& xr, const uint8_t* qp, const at::Half* sp, int64_t g, int v0, float* acc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i sum[MB][NV];  // int16 pairs: each output's products in 2 lanes
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) sum[m][v] = _mm256_setzero_si256();
  const uint8_t* qg = qp + g * kGroupBytes<4>;
  const int8_t* xg = xr.q + g * kGroup;
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + (4 * s + v0 + v) * 32));
      const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        // each 4 codes broadcast from memory (vpbroadcastd; a buffer of them broadcast ahead, 8x the
        // bytes, fell out of L1 with 8 rows of 1536 inputs)
        const int8_t* xc = xg + m * xr.K + 8 * s;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xc))),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xc + 4))));
        sum[m][v] = _mm256_add_epi16(sum[m][v], p);
        // Keeps the sum in its register here: GCC would otherwise reassociate the integer adds,
        // compute every product of the unrolled loop first and spill them to the stack.
        asm("" : "+x"(sum[m][v]));
      }
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const at::Half* sg = sp + g * kGroupScales<4>;
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int o = 8 * (v0 + v);
    const __m256 d = load_halves(sg + o), off = load_halves(sg + kPanelRows + o);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m][v], ones));  // exact: |dot| < 2^24
      const __m256 ds = _mm256_mul_ps(d, _mm256_broadcast_ss(xr.scale + m * xr.G + g));
      __m256 a = _mm256_fmadd_ps(ds, dot, _mm256_load_ps(acc + m * kPanelRows + o));
      a = _mm256_fmadd_ps(off, _mm256_broadcast_ss(xr.sum + m * xr.G + g), a);
      _mm256_store_ps(acc + m * kPanelRows + o, a);
    }
  }
}

// Group g of MB quantized rows for NV vectors of 8 outputs from output 8 * v0 of int8 codes, added
// to acc[m][0..32). `vpmaddubsw` multiplies unsigned by signed bytes: |w| by x with w's sign
// (llama.cpp's Q8_0 x Q8_0 way); pairs of products at most 2 * 128 * 127 fit int16, so each
// 4-input run goes to int32 (`vpmaddwd`) at once.
template <int MB, int NV>
inline void int8_group(const A8Rows& xr, const uint8_t* qp, const at::Half* sp, int64_t g, int v0, float* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i dot[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) dot[m][v] = _mm256_setzero_si256();
  const uint8_t* qg = qp + g * kGroupBytes<8>;
  const int8_t* xg = xr.q + g * kGroup;
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + (4 * s + v0 + v) * 32));
      const __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xg + m * xr.K + 4 * s)), w);
        dot[m][v] = _mm256_add_epi32(dot[m][v], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
        asm("" : "+x"(dot[m][v]));  // as in int4_group: no reassociation of the unrolled adds
      }
    }
  }
  const at::Half* sg = sp + g * kGroupScales<8>;
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int o = 8 * (v0 + v);
    const __m256 d = load_halves(sg + o);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 ds = _mm256_mul_ps(d, _mm256_broadcast_ss(xr.scale + m * xr.G + g));
      // exact: |dot| <= 32 * 128 * 127 < 2^24
      _mm256_store_ps(acc + m * kPanelRows + o,
                      _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(dot[m][v]), _mm256_load_ps(acc + m * kPanelRows + o)));
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load_halves16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_PANELS_VNNI512 1

// Group g of MB quantized rows times the whole panel (2 vectors of 16 outputs), added to
// acc[m][0..32): int4_group's integer sums and float operations on 512-bit registers.
template <int MB>
inline void int4_group_vnni(const A8Rows& xr, const uint8_t* qp, const at::Half* sp, int64_t g, float* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i dot[MB][2];
  for (int m = 0; m < MB; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
  const uint8_t* qg = qp + g * kGroupBytes<4>;
  const int8_t* xg = xr.q + g * kGroup;
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {  // outputs 16v .. 16v + 15: blocks 2v and 2v + 1 of int4_group
      _mm_prefetch(reinterpret_cast<const char*>(qg + (4 * s + 2 * v) * 32 + kPrefetchAhead), _MM_HINT_T0);  // (linear.h)
      const __m512i raw = _mm512_loadu_si512(qg + (4 * s + 2 * v) * 32);
      const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const int8_t* xc = xg + m * xr.K + 8 * s;
        dot[m][v] = _mm512_dpbusd_epi32(dot[m][v], lo, _mm512_set1_epi32(load_i32(xc)));
        dot[m][v] = _mm512_dpbusd_epi32(dot[m][v], hi, _mm512_set1_epi32(load_i32(xc + 4)));
      }
    }
  }
  const at::Half* sg = sp + g * kGroupScales<4>;
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    const __m512 d = load_halves16(sg + 16 * v), off = load_halves16(sg + kPanelRows + 16 * v);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      float* a = acc + m * kPanelRows + 16 * v;
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xr.scale[m * xr.G + g]));
      __m512 r = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dot[m][v]), _mm512_load_ps(a));
      _mm512_store_ps(a, _mm512_fmadd_ps(off, _mm512_set1_ps(xr.sum[m * xr.G + g]), r));
    }
  }
}

// The same for int8 codes: the activations as x + 128 (x ^ 0x80, unsigned), minus 128 * the sum
// of each output's codes (vpdpbusd of 128s by the codes, shared by the rows).
template <int MB>
inline void int8_group_vnni(const A8Rows& xr, const uint8_t* qp, const at::Half* sp, int64_t g, float* acc) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i dot[MB][2], bias[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int m = 0; m < MB; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
  const uint8_t* qg = qp + g * kGroupBytes<8>;
  const int8_t* xg = xr.q + g * kGroup;
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(qg + (4 * s + 2 * v) * 32 + kPrefetchAhead), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(qg + (4 * s + 2 * v) * 32);
      bias[v] = _mm512_dpbusd_epi32(bias[v], flip, w);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m512i xu = _mm512_xor_si512(_mm512_set1_epi32(load_i32(xg + m * xr.K + 4 * s)), flip);
        dot[m][v] = _mm512_dpbusd_epi32(dot[m][v], xu, w);
      }
    }
  }
  const at::Half* sg = sp + g * kGroupScales<8>;
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    const __m512 d = load_halves16(sg + 16 * v);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      float* a = acc + m * kPanelRows + 16 * v;
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xr.scale[m * xr.G + g]));
      const __m512 dot_f = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[m][v], bias[v]));  // exact, as int8_group's
      _mm512_store_ps(a, _mm512_fmadd_ps(ds, dot_f, _mm512_load_ps(a)));
    }
  }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define TM_PANELS_AMX_INT8 1
// AMX-INT8: the same integer sums on tiles, for blocks of up to 32 rows x a panel: per group, the
// rows' int8 activations (two tiles of 16 rows x 32 bytes) times the group's codes as two tiles of
// 8 rows of 4 inputs x 16 outputs (int4: its low and high nibbles, which are those rows; int8: the
// packed bytes as they are, 128 bytes a row), signed x unsigned (int4) or signed x signed (int8)
// bytes into int32 (tdpbsud / tdpbssd: exact). The float operations after them are
// int4_group_vnni's / int8_group_vnni's, row by row in the same order: the same bits as the vector
// path for every row, so the path a step's row count picks changes no output.
// Tiles: 0-3 the sums of row tile r and vector v (2 r + v), 4 and 5 the row tiles, 6 and 7 the codes.
inline void amx_int_configure(int rows0, int rows1) {
  TileConfig cfg;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 8, 8};
  const int colsb[8] = {64, 64, 64, 64, 32, 32, 64, 64};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t] > 0 ? rows[t] : 16);
    cfg.colsb[t] = static_cast<uint16_t>(colsb[t]);
  }
  load_tile_config(cfg);
}

// int4 group g's codes as the two B tiles (vectors 0 and 1): [v][quad of inputs][16 outputs x 4],
// the low nibbles of a 64-byte run being quad 2 s, the high ones quad 2 s + 1.
inline void int4_tiles(const uint8_t* qp, int64_t g, uint8_t* codes) {
  const uint8_t* qg = qp + g * kGroupBytes<4>;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(qg + (4 * s + 2 * v) * 32 + kPrefetchAhead), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(qg + (4 * s + 2 * v) * 32);
      _mm512_store_si512(codes + v * 512 + (2 * s) * 64, _mm512_and_si512(raw, low4));
      _mm512_store_si512(codes + v * 512 + (2 * s + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
    }
}

// Group g of rows [0, rows0 + rows1) (rows1 > 0: two row tiles) times the panel, added to
// acc[m][0..32) as int4_group_vnni / int8_group_vnni add them. int4: the group's B tiles at
// codes[g % 2] (int4_tiles), and the next group's written to the other half while the products
// run (a tile load waits for the stores before it to reach the cache).
template <int BITS>
inline void amx_int_group(const A8Rows& xr, int rows0, int rows1, const uint8_t* qp, const at::Half* sp, int64_t g,
                          float* acc, uint8_t (*codes)[1024]) {
  const uint8_t* qg = qp + g * kGroupBytes<BITS>;
  const int8_t* xg = xr.q + g * kGroup;
  alignas(64) int32_t dot[32 * kPanelRows];
  _tile_loadd(4, xg, xr.K);
  if (rows1 > 0) _tile_loadd(5, xg + 16 * xr.K, xr.K);
  if constexpr (BITS == 4) {
    asm volatile("" : : : "memory");  // GCC does not see tile loads read the codes (nor keep their stores)
    _tile_loadd(6, codes[g % 2], 64);
    _tile_loadd(7, codes[g % 2] + 512, 64);
  } else {
    for (int l = 0; l < 1024; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(qg + l + kPrefetchAhead), _MM_HINT_T0);
    _tile_loadd(6, qg, 128);
    _tile_loadd(7, qg + 64, 128);
  }
  _tile_zero(0);
  _tile_zero(1);
  if (rows1 > 0) {
    _tile_zero(2);
    _tile_zero(3);
  }
  if constexpr (BITS == 4) {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    if (rows1 > 0) {
      _tile_dpbsud(2, 5, 6);
      _tile_dpbsud(3, 5, 7);
    }
  } else {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if (rows1 > 0) {
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  if constexpr (BITS == 4) {
    if ((g + 1) * kGroup < xr.K) int4_tiles(qp, g + 1, codes[(g + 1) % 2]);
  }
  constexpr int kLd = kPanelRows * sizeof(int32_t);
  _tile_stored(0, dot, kLd);
  _tile_stored(1, dot + 16, kLd);
  if (rows1 > 0) {
    _tile_stored(2, dot + 16 * kPanelRows, kLd);
    _tile_stored(3, dot + 16 * kPanelRows + 16, kLd);
  }
  asm volatile("" : : : "memory");  // the sums are in `dot` now (tile stores are opaque to GCC)
  const at::Half* sg = sp + g * kGroupScales<BITS>;
  const int rows = rows0 + rows1;
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    const __m512 d = load_halves16(sg + 16 * v);
    const __m512 off = BITS == 4 ? load_halves16(sg + kPanelRows + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < rows; ++m) {
      float* a = acc + m * kPanelRows + 16 * v;
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xr.scale[m * xr.G + g]));
      const __m512 r = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(_mm512_load_si512(dot + m * kPanelRows + 16 * v)),
                                       _mm512_load_ps(a));
      _mm512_store_ps(a, BITS == 4 ? _mm512_fmadd_ps(off, _mm512_set1_ps(xr.sum[m * xr.G + g]), r) : r);
    }
  }
}
#else
#define TM_PANELS_AMX_INT8 0
#endif
#else
#define TM_PANELS_VNNI512 0
#endif

#if defined(TM_PANEL_AMX)
// ---- AMX: the panels dequantized into bf16, then bf16 tiles ----

// Weights of inputs k and k + 1 for 16 outputs, float32 -> the [16][2] bf16 pairs of a panel
// (round to nearest even, as c10::BFloat16(float)).
inline void store_pairs(__m512 f0, __m512 f1, BF16* dst) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i bf = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f1, f0));  // f0's 16 bf16, then f1's
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, bf));
}

// Bits [B, B + W) of each 32-bit lane moved to [P, P + W) and or'ed into the float32 `base` (whose
// mantissa there is zero): base + the field as an exact float32, in two operations (a shift and a
// vpternlog), where shift + mask + int-to-float conversion takes three.
template <int B, int P>
inline __m512 field_plus(__m512i raw, __m512i mask, __m512i base) {
  __m512i v = raw;
  if constexpr (B < P) v = _mm512_slli_epi32(raw, P - B);
  if constexpr (B > P) v = _mm512_srli_epi32(raw, B - P);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(v, mask, base, 0xEA));  // (v & mask) | base
}

// Group g of a panel (32 inputs x 32 outputs) -> its 16 pairs of the bf16 panel [16][32][2] at dst.
// int4: 128 + q exact (q in bits 16-19 of 128.0f), times d plus (m - 128 d); int8: 384 + q (q + 128
// in bits 15-22 of 256.0f), times d minus 384 d. One rounding each: q * d + m (quant_panel_row's
// numbers) wherever m - 128 d is exact in float32, as it is when m and 128 d (both float16 values)
// lie within ~13 binades of each other (min/max-quantized groups: |m| <= 15 |d| or so); otherwise
// within one float32 ulp before the rounding to bf16. int8: exactly q * d.
template <int BITS>
inline void dequantize_group(const uint8_t* qp, const at::Half* sp, int64_t g, BF16* dst) {
  const uint8_t* qg = qp + g * kGroupBytes<BITS>;
  const at::Half* sg = sp + g * kGroupScales<BITS>;
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {  // outputs 16v .. 16v + 15
    const __m512 d = load_halves16(sg + 16 * v);
    if constexpr (BITS == 4) {
      const __m512i mask = _mm512_set1_epi32(0xF << 16), base = _mm512_set1_epi32(0x43000000);  // 128.0f
      const __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, load_halves16(sg + kPanelRows + 16 * v));
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {  // inputs 8s + j (low nibble of byte j) and 8s + 4 + j (high)
        const uint8_t* src = qg + (4 * s + 2 * v) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchAhead, _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(src);
        const __m512 f[8] = {field_plus<0, 16>(raw, mask, base), field_plus<8, 16>(raw, mask, base),
                             field_plus<16, 16>(raw, mask, base), field_plus<24, 16>(raw, mask, base),
                             field_plus<4, 16>(raw, mask, base), field_plus<12, 16>(raw, mask, base),
                             field_plus<20, 16>(raw, mask, base), field_plus<28, 16>(raw, mask, base)};
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p)
          store_pairs(_mm512_fmadd_ps(f[2 * p], d, c), _mm512_fmadd_ps(f[2 * p + 1], d, c),
                      dst + ((4 * s + p) * kPanelRows + 16 * v) * 2);
      }
    } else {
      const __m512i mask = _mm512_set1_epi32(0xFF << 15), base = _mm512_set1_epi32(0x43800000);  // 256.0f
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      const __m512 c = _mm512_mul_ps(_mm512_set1_ps(-384.f), d);  // exact: d is a float16
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {  // inputs 4s + j: byte j, signed (as q + 128: unsigned)
        const uint8_t* src = qg + (4 * s + 2 * v) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchAhead, _MM_HINT_T0);
        const __m512i raw = _mm512_xor_si512(_mm512_loadu_si512(src), flip);
        store_pairs(_mm512_fmadd_ps(field_plus<0, 15>(raw, mask, base), d, c),
                    _mm512_fmadd_ps(field_plus<8, 15>(raw, mask, base), d, c),
                    dst + ((2 * s) * kPanelRows + 16 * v) * 2);
        store_pairs(_mm512_fmadd_ps(field_plus<16, 15>(raw, mask, base), d, c),
                    _mm512_fmadd_ps(field_plus<24, 15>(raw, mask, base), d, c),
                    dst + ((2 * s + 1) * kPanelRows + 16 * v) * 2);
      }
    }
  }
}

// Panels [p0, p1) for M bf16 rows on AMX tiles. Up to 32 rows (two tiles), each panel 32 inputs at
// a time: a group dequantized into 2 KB (L1), then its products for both tiles (against the whole
// panel at once, one thread, SmolLM2's gate/up, down, q/k/v at 17-32 rows: 1.04-1.53x). More rows:
// each panel dequantized whole into this thread's bf16 panel (in cache), then its rows, 16 a tile.
template <int BITS>
void amx_units(const BF16* x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, BF16* out, int64_t ldo,
               const BF16* bias) {
  const int64_t G = w.K / kGroup;
  const uint8_t* qw = static_cast<const uint8_t*>(w.data);
  thread_local std::vector<BF16> panel;
  const bool steps = M <= 32;
  const int r0 = static_cast<int>(std::min<int64_t>(16, M)), r1 = static_cast<int>(steps ? M - r0 : M % 16);
  panel.resize((steps ? kGroup : w.K) * kPanelRows);
  amx_rows_configure(r0, r1);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* qp = qw + p * G * kGroupBytes<BITS>;
    const at::Half* sp = w.scales + p * G * kGroupScales<BITS>;
    const int64_t n0 = p * kPanelRows;
    const int nc = static_cast<int>(std::min<int64_t>(kPanelRows, w.N - n0));
    const BF16* pb = bias == nullptr ? nullptr : bias + n0;
    if (steps) {
      amx_sums_zero(r1 > 0);
      for (int64_t g = 0; g < G; ++g) {
        dequantize_group<BITS>(qp, sp, g, panel.data());
        amx_sums_step(x + g * kGroup, w.K, panel.data(), r1 > 0);
      }
      amx_sums_store(out + n0, ldo, r0, r1, nc, pb);
    } else {
      for (int64_t g = 0; g < G; ++g) dequantize_group<BITS>(qp, sp, g, panel.data() + g * kGroup * kPanelRows);
      amx_panel_rows(x, M, panel.data(), w.K, out + n0, ldo, nc, pb);
    }
  }
  amx_release();
}
#endif

// acc[m][0..32) = x[m] . the panel's 32 rows for MB input rows, NV output vectors at a time (the
// order of every output's operations is the same whatever MB and NV).
template <int BITS, int MB, int NV>
inline void panel_rows(const A8Rows& xr, const uint8_t* qp, const at::Half* sp, int64_t G, float* acc) {
  for (int i = 0; i < MB * kPanelRows; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());
#if TM_PANELS_VNNI512
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (BITS == 4) int4_group_vnni<MB>(xr, qp, sp, g, acc);
    else int8_group_vnni<MB>(xr, qp, sp, g, acc);
  }
#else
  for (int64_t g = 0; g < G; ++g)
    for (int v0 = 0; v0 < 4; v0 += NV) {
      if constexpr (BITS == 4) int4_group<MB, NV>(xr, qp, sp, g, v0, acc);
      else int8_group<MB, NV>(xr, qp, sp, g, v0, acc);
    }
#endif
}

// The integer sums of MB x NV (row, vector) pairs stay in registers (at most 11 beside the codes
// and products), up to 8 rows a tile.
constexpr int kTileRows = 8;

template <int BITS>
inline void panel_tile(int mb, const A8Rows& xr, const uint8_t* qp, const at::Half* sp, int64_t G, float* acc) {
  switch (mb) {
    case 1: panel_rows<BITS, 1, 4>(xr, qp, sp, G, acc); break;
    case 2: panel_rows<BITS, 2, 4>(xr, qp, sp, G, acc); break;
    case 3: panel_rows<BITS, 3, 2>(xr, qp, sp, G, acc); break;
    case 4: panel_rows<BITS, 4, 2>(xr, qp, sp, G, acc); break;
    case 5: panel_rows<BITS, 5, 2>(xr, qp, sp, G, acc); break;
    case 6: panel_rows<BITS, 6, 1>(xr, qp, sp, G, acc); break;
    case 7: panel_rows<BITS, 7, 1>(xr, qp, sp, G, acc); break;
    default: panel_rows<BITS, 8, 1>(xr, qp, sp, G, acc); break;
  }
}

template <typename T>
inline void store(float v, T* dst, const T* bias) {
  if (bias == nullptr) *dst = static_cast<T>(v);
  else *dst = static_cast<T>(static_cast<float>(static_cast<T>(v)) + static_cast<float>(*bias));  // as `y + bias`
}

inline float hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// One group of 32 inputs to int8: codes round(x * 127 / max|x|) (as
// quantization.quantize_activation_groups computes them), scale max|x| / 127 and the inputs'
// exact sum (one fixed order).
inline void quantize_group(const float* x, int8_t* q, float* scale, float* sum) {
  const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
               x3 = _mm256_loadu_ps(x + 24);
  *sum = hsum(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, abs), _mm256_and_ps(x1, abs)),
                           _mm256_max_ps(_mm256_and_ps(x2, abs), _mm256_and_ps(x3, abs)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  // Divisions through the intrinsic: -ffast-math would turn `a / b` into a * (1 / b), one ulp
  // off the quotient and so, at ties, one code off.
  const __m128 a127 = _mm_set_ss(127.f), am = _mm_set_ss(amax);
  *scale = _mm_cvtss_f32(_mm_div_ss(am, a127));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? _mm_cvtss_f32(_mm_div_ss(a127, am)) : 0.f);
  // round half to even (the default MXCSR mode), as torch.round
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, inv));
  // int32 lanes to bytes: the packs interleave the 128-bit lanes, a dword permutation restores the order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

#if defined(TM_PANELS_AMX_INT8) && TM_PANELS_AMX_INT8
// Whether the tiles are allowed and give the vector path's bits (checked once on random numbers:
// for both code widths, 32 rows, against panel_rows).
bool amx_int_usable() {
  static const bool ok = [] {
    if (!amx_permitted()) return false;
    constexpr int64_t K = 64, G = K / kGroup, M = 32;
    uint32_t r = 2024;
    auto next = [&] { return (r = r * 1103515245u + 12345u) >> 8; };
    std::vector<int8_t> xq(M * K);
    std::vector<float> xs(M * G), xsum(M * G);
    for (auto& v : xq) v = static_cast<int8_t>(static_cast<int>(next() % 255) - 127);
    for (auto& v : xs) v = static_cast<float>(next() % 1000 + 1) * 1e-4f;
    for (auto& v : xsum) v = static_cast<float>(static_cast<int>(next() % 2001) - 1000) * 1e-2f;
    const A8Rows xr{xq.data(), xs.data(), xsum.data(), K, G};
    std::vector<uint8_t> codes(G * kGroupBytes<8>);
    std::vector<at::Half> scales(G * kGroupScales<4>);
    for (auto& v : codes) v = static_cast<uint8_t>(next());
    for (auto& v : scales) v = at::Half(static_cast<float>(static_cast<int>(next() % 2001) - 1000) * 1e-4f);
    alignas(64) float want[M * kPanelRows], got[M * kPanelRows];
    bool same = true;
    for (int bits : {4, 8}) {
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const A8Rows tile{xr.q + m0 * K, xr.scale + m0 * G, xr.sum + m0 * G, K, G};
        if (bits == 4) panel_rows<4, kTileRows, 1>(tile, codes.data(), scales.data(), G, want + m0 * kPanelRows);
        else panel_rows<8, kTileRows, 1>(tile, codes.data(), scales.data(), G, want + m0 * kPanelRows);
      }
      std::memset(got, 0, sizeof got);
      amx_int_configure(16, 16);
      alignas(64) uint8_t tiles[2][1024];
      if (bits == 4) int4_tiles(codes.data(), 0, tiles[0]);
      for (int64_t g = 0; g < G; ++g) {
        if (bits == 4) amx_int_group<4>(xr, 16, 16, codes.data(), scales.data(), g, got, tiles);
        else amx_int_group<8>(xr, 16, 16, codes.data(), scales.data(), g, got, tiles);
      }
      _tile_release();
      same = same && std::memcmp(got, want, sizeof got) == 0;
    }
    return same;
  }();
  return ok;
}

std::atomic<int64_t> amx_int_min_rows{kQuantAmxIntRows};

// Panels [p0, p1) for M rows on AMX-INT8, 32 rows a block; acc as units' (32 rows).
template <int BITS, typename OT>
void amx_int_units(const A8Rows& xr, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out,
                   int64_t ldo, const OT* bias) {
  const int64_t G = w.K / kGroup;
  const uint8_t* qw = static_cast<const uint8_t*>(w.data);
  alignas(64) float acc[32 * kPanelRows];
  alignas(64) uint8_t codes[2][1024];
  int configured = -1;
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int rows0 = static_cast<int>(std::min<int64_t>(16, M - m0));
    const int rows1 = static_cast<int>(std::clamp<int64_t>(M - m0 - 16, 0, 16));
    if (configured != rows0 + rows1) {
      amx_int_configure(rows0, rows1);
      configured = rows0 + rows1;
    }
    const A8Rows block{xr.q + m0 * xr.K, xr.scale + m0 * G, xr.sum + m0 * G, xr.K, G};
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* qp = qw + p * G * kGroupBytes<BITS>;
      const at::Half* sp = w.scales + p * G * kGroupScales<BITS>;
      const int64_t n0 = p * kPanelRows;
      const int nc = static_cast<int>(std::min<int64_t>(kPanelRows, w.N - n0));
      std::memset(acc, 0, sizeof(float) * (rows0 + rows1) * kPanelRows);
      if constexpr (BITS == 4) int4_tiles(qp, 0, codes[0]);
      for (int64_t g = 0; g < G; ++g) amx_int_group<BITS>(block, rows0, rows1, qp, sp, g, acc, codes);
      for (int i = 0; i < rows0 + rows1; ++i)
        for (int c = 0; c < nc; ++c)
          store(acc[i * kPanelRows + c], out + (m0 + i) * ldo + n0 + c, bias == nullptr ? nullptr : bias + n0 + c);
    }
  }
  _tile_release();
}
#endif

template <int BITS, typename OT>
void units(const A8Rows& xr, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out, int64_t ldo,
           const OT* bias) {
#if defined(TM_PANELS_AMX_INT8) && TM_PANELS_AMX_INT8
  if (quant_panels_amx_int(M)) return amx_int_units<BITS>(xr, M, w, p0, p1, out, ldo, bias);
#endif
  const int64_t G = w.K / kGroup;
  const uint8_t* qw = static_cast<const uint8_t*>(w.data);
  alignas(64) float acc[kTileRows * kPanelRows];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* qp = qw + p * G * kGroupBytes<BITS>;
    const at::Half* sp = w.scales + p * G * kGroupScales<BITS>;
    const int64_t n0 = p * kPanelRows;
    const int nc = static_cast<int>(std::min<int64_t>(kPanelRows, w.N - n0));
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int mb = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      const A8Rows tile{xr.q + m0 * xr.K, xr.scale + m0 * G, xr.sum + m0 * G, xr.K, G};
      panel_tile<BITS>(mb, tile, qp, sp, G, acc);
      for (int i = 0; i < mb; ++i)
        for (int c = 0; c < nc; ++c)
          store(acc[i * kPanelRows + c], out + (m0 + i) * ldo + n0 + c, bias == nullptr ? nullptr : bias + n0 + c);
    }
  }
}

}  // namespace

namespace tm_cpu {

template <typename XT>
A8Rows quantize_a8_rows(const XT* x, int64_t M, int64_t K) {
  // Group by group straight from x (no float copy of a prompt's rows), into this thread's buffers.
  const int64_t G = K / kGroup;
  thread_local std::vector<float> xscale, xsum;
  thread_local std::vector<int8_t> xq;
  xq.resize(M * K);
  xscale.resize(M * G);
  xsum.resize(M * G);
  for (int64_t i = 0; i < M * G; ++i) {
    const float* xg;
    alignas(32) float buf[kGroup];
    if constexpr (std::is_same_v<XT, float>) {
      xg = x + i * kGroup;
    } else {
      for (int k = 0; k < kGroup; ++k) buf[k] = static_cast<float>(x[i * kGroup + k]);
      xg = buf;
    }
    quantize_group(xg, xq.data() + i * kGroup, &xscale[i], &xsum[i]);
  }
  return A8Rows{xq.data(), xscale.data(), xsum.data(), K, G};
}

template <typename OT>
void quant_panel_units(const A8Rows& x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out,
                       int64_t ldo, const OT* bias) {
  if (M == 0 || p0 >= p1) return;
  if (w.bits == 4) units<4>(x, M, w, p0, p1, out, ldo, bias);
  else units<8>(x, M, w, p0, p1, out, ldo, bias);
}

namespace {
std::atomic<int64_t> amx_min_rows{kQuantAmxRows};
}

void set_quant_amx_rows(int64_t rows) { amx_min_rows = rows; }

void set_quant_amx_int_rows(int64_t rows) {
#if defined(TM_PANELS_AMX_INT8) && TM_PANELS_AMX_INT8
  amx_int_min_rows = rows;
#endif
}

bool quant_panels_amx_int(int64_t M) {
#if defined(TM_PANELS_AMX_INT8) && TM_PANELS_AMX_INT8
  return M >= amx_int_min_rows.load(std::memory_order_relaxed) && amx_int_usable();
#else
  return false;
#endif
}

bool quant_panels_amx(int64_t M) {
#if defined(TM_PANEL_AMX)
  return M >= amx_min_rows.load(std::memory_order_relaxed) && amx_panels();
#else
  return false;
#endif
}

template <typename XT, typename OT>
void quant_panel_units(const XT* x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out, int64_t ldo,
                       const OT* bias) {
  if (M == 0 || p0 >= p1) return;
#if defined(TM_PANEL_AMX)
  if constexpr (std::is_same_v<XT, BF16> && std::is_same_v<OT, BF16>) {
    if (quant_panels_amx(M)) return w.bits == 4 ? amx_units<4>(x, M, w, p0, p1, out, ldo, bias)
                                               : amx_units<8>(x, M, w, p0, p1, out, ldo, bias);
  }
#endif
  quant_panel_units(quantize_a8_rows(x, M, w.K), M, w, p0, p1, out, ldo, bias);
}

template <typename T>
void quant_panel_row(const LinearWeights& w, int64_t id, T* out) {
  const int64_t G = w.K / kGroup, p = id / kPanelRows, o = id % kPanelRows;
  const int64_t group_bytes = w.bits == 4 ? kGroupBytes<4> : kGroupBytes<8>;
  const int64_t group_scales = w.bits == 4 ? kGroupScales<4> : kGroupScales<8>;
  const uint8_t* qp = static_cast<const uint8_t*>(w.data) + p * G * group_bytes;
  const at::Half* sp = w.scales + p * G * group_scales;
  for (int64_t g = 0; g < G; ++g) {
    const float d = _cvtsh_ss(sp[g * group_scales + o].x);
    const float m = w.bits == 4 ? _cvtsh_ss(sp[g * group_scales + kPanelRows + o].x) : 0.f;
    const uint8_t* qg = qp + g * group_bytes;
    for (int k = 0; k < kGroup; ++k) {
      // int4: input k = 8s + 4h + j of output o = 8v + i: byte (4s + v) * 32 + 4i + j, nibble h;
      // int8: input k = 4s + j: byte (4s + v) * 32 + 4i + j
      const float q = w.bits == 4
                          ? static_cast<float>((qg[(4 * (k / 8) + o / 8) * 32 + 4 * (o % 8) + k % 4] >> (k % 8 >= 4 ? 4 : 0)) & 0xF)
                          : static_cast<float>(static_cast<int8_t>(qg[(4 * (k / 4) + o / 8) * 32 + 4 * (o % 8) + k % 4]));
      out[g * kGroup + k] = static_cast<T>(std::fma(q, d, m));  // q * d + m rounded once, as the plain rows are
    }
  }
}

template void quant_panel_row<float>(const LinearWeights&, int64_t, float*);
template void quant_panel_row<c10::BFloat16>(const LinearWeights&, int64_t, c10::BFloat16*);
template void quant_panel_units<float, float>(const float*, int64_t, const LinearWeights&, int64_t, int64_t, float*,
                                              int64_t, const float*);
template void quant_panel_units<float, BF16>(const float*, int64_t, const LinearWeights&, int64_t, int64_t, BF16*,
                                             int64_t, const BF16*);
template void quant_panel_units<BF16, BF16>(const BF16*, int64_t, const LinearWeights&, int64_t, int64_t, BF16*,
                                            int64_t, const BF16*);
template A8Rows quantize_a8_rows<BF16>(const BF16*, int64_t, int64_t);
template void quant_panel_units<BF16>(const A8Rows&, int64_t, const LinearWeights&, int64_t, int64_t, BF16*, int64_t,
                                      const BF16*);

}  // namespace tm_cpu

namespace {

tm_cpu::LinearWeights panel_weights(const at::Tensor& qpanels, const at::Tensor& spanels, int64_t bits,
                                    int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant panels: bits must be 4 or 8");
  TORCH_CHECK(qpanels.dim() == 4 && qpanels.is_contiguous() && spanels.is_contiguous() &&
                  spanels.scalar_type() == at::kHalf && qpanels.size(2) == tm_cpu::kGroup &&
                  qpanels.size(3) == (bits == 4 ? 16 : 32) && qpanels.size(0) * tm_cpu::kPanelRows >= N && N >= 0 &&
                  spanels.numel() == qpanels.size(0) * qpanels.size(1) * (bits == 4 ? 64 : 32),
              "quant panels: codes [ceil(N / 32), K / 32, 32, 16 (int4) or 32 (int8)] and float16 scales");
  tm_cpu::LinearWeights w;
  w.bits = static_cast<int>(bits);
  w.panels = true;
  w.data = qpanels.data_ptr();
  w.scales = spanels.data_ptr<at::Half>();
  w.N = N;
  w.K = qpanels.size(1) * tm_cpu::kGroup;
  return w;
}

}  // namespace

// x [M, K] float32 or bfloat16 @ (the quantized panels of an [N, K] weight)^T -> [M, N] in x's dtype.
at::Tensor quant_panel_linear(at::Tensor x, at::Tensor qpanels, at::Tensor spanels, int64_t bits,
                                 int64_t N) {
  const tm_cpu::LinearWeights w = panel_weights(qpanels, spanels, bits, N);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "quant_panel_linear: x [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "quant_panel_linear: float32 or bfloat16 inputs");
  const auto xc = x.contiguous();
  auto out = tm_cpu::empty({x.size(0), N}, x.options());
  const int64_t M = x.size(0);
  if (M == 0) return out;
  at::parallel_for(0, w.units(), 1, [&](int64_t p0, int64_t p1) {
    if (x.scalar_type() == at::kBFloat16)
      tm_cpu::quant_panel_units(xc.data_ptr<c10::BFloat16>(), M, w, p0, p1, out.data_ptr<c10::BFloat16>(), N,
                                static_cast<const c10::BFloat16*>(nullptr));
    else
      tm_cpu::quant_panel_units(xc.data_ptr<float>(), M, w, p0, p1, out.data_ptr<float>(), N,
                                static_cast<const float*>(nullptr));
  });
  return out;
}

bool quant_panels_built() { return true; }

#else  // no AVX2 + FMA + F16C: the ops exist so that every ISA level's library has the same symbols;
// bindings.cpp binds them only where quant_panels_built()

bool quant_panels_built() { return false; }
at::Tensor quant_panel_linear(at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t) {
  TORCH_CHECK(false, "quant_panel_linear needs AVX2 with FMA and F16C");
}
namespace tm_cpu {
void set_quant_amx_rows(int64_t) {}
void set_quant_amx_int_rows(int64_t) {}
bool quant_panels_amx(int64_t) { return false; }
bool quant_panels_amx_int(int64_t) { return false; }
}  // namespace tm_cpu

#endif  // TM_QUANT_PANELS
