// W8A8 linear layers for CPU (--quantization w8a8, layers/w8a8.py): int8 weights with one float32
// scale per output row (symmetric, q in -127..127), activations quantized per token on the fly
// (asymmetric, 8 bits: u in 0..255 with a zero point z, x ~ (u - z) * scale), products summed in
// int32 and rescaled in float32:
//   y[m][n] = float(sum_k u[m][k] * q[n][k] - z[m] * rowsum(q[n])) * (sx[m] * sw[n]) + bias[n]
//
// Weights are packed once (pack in layers/w8a8.py) in panels of 16 output rows, each panel's K
// inputs in groups of 4: [N/16][K/4][16][4] int8, so one 64-byte row of a panel holds 4 inputs of
// 16 outputs: the operand of AVX-512 VNNI's vpdpbusd (and the B tile of AMX), two 32-byte halves of
// AVX2's. An input row's 4 bytes are broadcast against it: no horizontal sums.
//
// Instruction paths (chosen at compile time by -march=native):
// - AMX-INT8 (tdpbusd), where the CPU and the OS allow it and K is a multiple of 64: blocks of
//   32 input rows x 32 outputs (the last rows in tiles of fewer rows). Otherwise:
// - AVX-512 VNNI (vpdpbusd: u8 x s8, 4 products summed into each int32 lane, no intermediate
//   rounding or saturation), tiles of 8 input rows x 16 outputs.
// - AVX2 (+ AVX-VNNI's 256-bit vpdpbusd where the CPU has it): vpmaddubsw multiplies u8 by s8 and
//   adds pairs into int16 *with saturation*: 255 * 127 * 2 overflows it. So activations are stored
//   signed (u - 128 in -128..127) and multiplied with the sign trick of llama.cpp's AVX2 dot
//   products: |a| (as u8, at most 128) times sign(a) * q (at most 127 in magnitude), pairs at most
//   2 * 128 * 127 = 32512: exact. The 128 * rowsum(q) this shifts is put back with the zero point.
//   Tiles of 4 input rows x 16 outputs.
// - Anything else: plain loops.
// Every path computes the same integers, exactly, so a row's outputs do not depend on the other
// rows in the call, on the tiling, or on the instruction set (the float epilogue is one
// function applied to each row alike): batch-invariant by construction.
#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "cpu_common.h"
#include "elementwise.h"
#include "linear.h"
#include "w8a8.h"

namespace {

using tm_cpu::to_f;

constexpr int kPanel = tm_cpu::kW8A8Panel;  // output rows per packed panel
constexpr int kQuad = 4;    // inputs per packed group
constexpr int64_t kRowBlock = 128;  // input rows whose activations stay in L2 while a thread walks its panels

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_W8A8_VNNI512 1
constexpr bool kSignedActs = false;  // vpdpbusd takes u8 activations
constexpr int kTileRows = 8;
#elif defined(__AVX2__) && defined(__AVXVNNI__)
constexpr bool kSignedActs = false;  // 256-bit vpdpbusd takes u8 activations
constexpr int kTileRows = 4;
#elif defined(__AVX2__)
constexpr bool kSignedActs = true;  // u - 128, for the sign trick
constexpr int kTileRows = 4;
#else
constexpr bool kSignedActs = false;
constexpr int kTileRows = 4;
#endif

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- per-token activation quantization ---------------------------------------------------------
// a / b rounded once, out of -ffast-math's reach: it compiles `1.f / ((hi - lo) * c)` as
// (1 / c) / (hi - lo) for some -march targets and as written for others (another inv, so other
// codes, from machine to machine).
inline float ieee_div(float a, float b) {
#if defined(__SSE__)
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));
#else
  volatile float q = a / b;
  return q;
#endif
}

// One row: lo = min(x, 0), hi = max(x, 0), scale = (hi - lo) * (1 / 255), z = round(-lo / scale),
// u = clamp(round(x / scale) + z, 0, 255) with x / scale computed as x * (1 / scale) and round to
// nearest even: exactly what layers/w8a8.py's quantize_activations does in torch. The row's tail
// up to Kp is zero-filled (its weights are zero). Stored as u (or u - 128 when `flip`).
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, uint8_t* out, float* scale, int32_t* zero, bool flip) {
  float lo = 0.f, hi = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = to_f(x[k]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  float s = (hi - lo) * (1.f / 255.f);
  if (!(s > 0.f) || !std::isfinite(s)) s = 1.f;  // an all-zero row (or a non-finite one: garbage in, no crash)
  const float inv = ieee_div(1.f, s);
  const float zf = std::nearbyint(-lo * inv);
  const uint8_t fx = flip ? 0x80 : 0;
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv), vz = _mm256_set1_ps(zf), v0 = _mm256_setzero_ps(),
               v255 = _mm256_set1_ps(255.f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; k + 32 <= K; k += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      __m256 v;
      if constexpr (std::is_same_v<T, float>) {
        v = _mm256_loadu_ps(x + k + 8 * j);
      } else {  // bf16: the upper half of a float
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k + 8 * j));
        v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      // round(x * inv) then + z (both exact integers in float): the same as the scalar tail
      v = _mm256_add_ps(_mm256_round_ps(_mm256_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
      q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, v0), v255));
    }
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23), perm);
    b = _mm256_xor_si256(b, _mm256_set1_epi8(static_cast<char>(fx)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), b);
  }
#endif
  for (; k < K; ++k) {
    const float v = std::nearbyint(to_f(x[k]) * inv) + zf;
    out[k] = static_cast<uint8_t>(static_cast<int>(std::min(std::max(v, 0.f), 255.f))) ^ fx;
  }
  for (; k < Kp; ++k) out[k] = 0;  // zero weights there: any value; 0 keeps the sign trick's |a| small
  *scale = s;
  *zero = static_cast<int32_t>(zf);
}

// ---- int32 tiles: acc[i][0..15] = sum_k a[i][k] * panel[k][0..15] ------------------------------
// `next` (or null): lines of the next panel to prefetch meanwhile, one every 2^shift k steps (see
// run_panels; each k step reads one 64-byte line of the panel). The AVX-512 tiles only: AVX2's
// take and ignore it.
#if defined(TM_W8A8_VNNI512)
template <int MB>
inline void tile(const uint8_t* a, int64_t lda, const int8_t* panel, int64_t Kp, int32_t* acc,
                 const char* next = nullptr, int shift = 0) {
  __m512i c[MB];
  for (int i = 0; i < MB; ++i) c[i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += kQuad) {
    const __m512i w = _mm512_loadu_si512(panel + k * kPanel);
    if (next != nullptr) _mm_prefetch(next + ((k / kQuad) >> shift) * 64, _MM_HINT_T0);
    for (int i = 0; i < MB; ++i) {
      int32_t q4;
      std::memcpy(&q4, a + i * lda + k, 4);
      c[i] = _mm512_dpbusd_epi32(c[i], _mm512_set1_epi32(q4), w);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_si512(acc + i * kPanel, c[i]);
}
#elif defined(__AVX2__)
// AVX-VNNI: a = u, acc = sum u * q. Plain AVX2: a = u - 128 (signed), acc = sum (u - 128) * q.
// The panel's first 32 bytes hold outputs 0-7, the next 32 outputs 8-15: lane j of c0 is output j.
template <int MB>
inline void tile(const uint8_t* a, int64_t lda, const int8_t* panel, int64_t Kp, int32_t* acc, const char* = nullptr,
                 int = 0) {
  __m256i c0[MB], c1[MB];
  for (int i = 0; i < MB; ++i) c0[i] = c1[i] = _mm256_setzero_si256();
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t k = 0; k < Kp; k += kQuad) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel + 32));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      int32_t q4;
      std::memcpy(&q4, a + i * lda + k, 4);
      const __m256i s = _mm256_set1_epi32(q4);
#if defined(__AVXVNNI__)
      c0[i] = _mm256_dpbusd_avx_epi32(c0[i], s, w0);  // u8 x s8, no saturation
      c1[i] = _mm256_dpbusd_avx_epi32(c1[i], s, w1);
#else
      const __m256i as = _mm256_sign_epi8(s, s);  // |a| as u8 (-128 -> 128)
      c0[i] = _mm256_add_epi32(c0[i], _mm256_madd_epi16(_mm256_maddubs_epi16(as, _mm256_sign_epi8(w0, s)), ones));
      c1[i] = _mm256_add_epi32(c1[i], _mm256_madd_epi16(_mm256_maddubs_epi16(as, _mm256_sign_epi8(w1, s)), ones));
#endif
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + i * kPanel), c0[i]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + i * kPanel + 8), c1[i]);
  }
}
#else
template <int MB>
inline void tile(const uint8_t* a, int64_t lda, const int8_t* panel, int64_t Kp, int32_t* acc, const char* = nullptr,
                 int = 0) {
  for (int i = 0; i < MB; ++i) {
    int32_t c[kPanel] = {};
    for (int64_t k = 0; k < Kp; k += kQuad) {
      const int8_t* w = panel + k * kPanel;
      for (int n = 0; n < kPanel; ++n)
        for (int j = 0; j < kQuad; ++j) c[n] += static_cast<int32_t>(a[i * lda + k + j]) * w[n * kQuad + j];
    }
    std::memcpy(acc + i * kPanel, c, sizeof(c));
  }
}
#endif

// The float epilogue of `rows` rows of a panel (nb <= 16 outputs; row i's int32 sums at
// acc + i * ld, its outputs at out + i * ldo), the same code for every row:
//   y = float(acc - shift * rowsum) * (sx * sw) (+ bias), rounded once to OT,
// where acc = sum a * q with a = u (- 128 when signed), so shift = z (- 128). (noinline: however
// the tiles around it are compiled, fast-math cannot make a row's rounding depend on its tile.)
#if defined(TM_W8A8_VNNI512)
// AVX-512: one vector a row, the panel's scales and row sums loaded once for all the rows (the
// plain loop, called row by row, took ~28% of the AMX path's time at K = 576 in a profile).
inline void store_row(__m512 v, __mmask16 m, float* out) { _mm512_mask_storeu_ps(out, m, v); }
inline void store_row(__m512 v, __mmask16 m, c10::BFloat16* out) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(out, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else  // round to nearest even, as c10::BFloat16(float) does, NaN to its quiet NaN
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(out, m, _mm512_cvtepi32_epi16(r));
#endif
}

template <typename OT>
__attribute__((noinline)) void finish_rows(const int32_t* acc, int64_t ld, int rows, int nb, const int32_t* zx,
                                           const float* sx, const float* sw, const int32_t* rowsum,
                                           const float* bias, OT* out, int64_t ldo) {
  const __mmask16 m = static_cast<__mmask16>(nb >= 16 ? 0xffff : (1u << nb) - 1);
  const __m512i rs = _mm512_maskz_loadu_epi32(m, rowsum);
  const __m512 ws = _mm512_maskz_loadu_ps(m, sw);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i) {
    const int32_t shift = zx[i] - (kSignedActs ? 128 : 0);
    const __m512i sums = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(m, acc + i * ld),
                                          _mm512_mullo_epi32(_mm512_set1_epi32(shift), rs));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sx[i]), ws);
    const __m512 v = bias != nullptr ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, b)
                                     : _mm512_mul_ps(_mm512_cvtepi32_ps(sums), scale);
    store_row(v, m, out + i * ldo);
  }
}
#else
template <typename OT>
__attribute__((noinline)) void finish_rows(const int32_t* acc, int64_t ld, int rows, int nb, const int32_t* zx,
                                           const float* sx, const float* sw, const int32_t* rowsum,
                                           const float* bias, OT* out, int64_t ldo) {
  for (int i = 0; i < rows; ++i) {
    const int32_t shift = zx[i] - (kSignedActs ? 128 : 0);
    for (int n = 0; n < nb; ++n) {
      const float v = static_cast<float>(acc[i * ld + n] - shift * rowsum[n]) * (sx[i] * sw[n]);
      tm_cpu::from_f(bias != nullptr ? v + bias[n] : v, out + i * ldo + n);
    }
  }
}
#endif

template <int MB>
void tile_dispatch(int mb, const uint8_t* a, int64_t lda, const int8_t* panel, int64_t Kp, int32_t* acc,
                   const char* next = nullptr, int shift = 0) {
  if constexpr (MB > 1) {
    if (mb < MB) return tile_dispatch<MB - 1>(mb, a, lda, panel, Kp, acc, next, shift);
  }
  tile<MB>(a, lda, panel, Kp, acc, next, shift);
}

struct Problem {
  const uint8_t* a;  // [M][Kp] quantized activations (u, or u - 128 with kSignedActs)
  const float* sx;
  const int32_t* zx;
  const int8_t* packed;  // [Np/16][Kp/4][16][4]
  const float* sw;       // [N]
  const int32_t* rowsum; // [N]
  const float* bias;     // [N] or null
  int64_t M, N, Kp;
  // > 0: gate/up with SiLU in the epilogue (w8a8_linear_silu_mul): panels [0, glu) are the gate's,
  // panel p's up is panel p + glu, and out holds silu(gate) * up, N / 2 columns.
  int64_t glu = 0;
};

#if defined(TM_W8A8_VNNI512) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define TM_W8A8_AMX 1
// AMX-INT8: tdpbusd multiplies a tile of up to 16 rows x 64 bytes of u8 activations by a 16 x 64
// tile of a panel (16 groups of 4 inputs for 16 outputs: the packed layout as it is) into int32
// sums. Blocks of two row tiles x two panels (32 rows x 32 outputs: four sums tiles, so that each
// tile loaded feeds two products), the last row tile of M % 16 rows (another configuration); where
// K is a multiple of 64 (the other shapes take the VNNI tiles: the same integers). Linux gives a
// process the tile state only when asked (arch_prctl); the path is checked once against the VNNI
// tiles on random data and not used if it differs.

// Tiles 0, 1: the sums of row tile 0 with panels 0, 1; 2, 3: row tile 1's; 4, 5: the activations
// of row tiles 0 and 1 (rows0 and rows1 rows); 6, 7: the two panels' weights.
inline void amx_configure(int rows0, int rows1) {  // every call: other libraries load their own
  tm_cpu::TileConfig cfg;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t] > 0 ? rows[t] : 16);
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// acc[r][0..32) (32 int32 a row) = sum over Kp of a's rows (row tile 0, and with R2 row tile 1 at
// a + 16 * lda) times panel w0's 16 outputs (and with P2 w1's at acc[r][16..32)).
template <bool R2, bool P2>
inline void amx_block(const uint8_t* a, int64_t lda, const int8_t* w0, const int8_t* w1, int64_t Kp, int32_t* acc,
                      bool prefetch) {
  constexpr int kLd = 2 * kPanel * sizeof(int32_t);
  _tile_zero(0);
  if constexpr (P2) _tile_zero(1);
  if constexpr (R2) _tile_zero(2);
  if constexpr (R2 && P2) _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += 64) {
    if (prefetch)  // the weights come from memory (the first rows to read these panels)
      for (int l = 0; l < 64 * kPanel; l += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + k * kPanel) + tm_cpu::kPrefetchAhead + l, _MM_HINT_T0);
        if constexpr (P2)
          _mm_prefetch(reinterpret_cast<const char*>(w1 + k * kPanel) + tm_cpu::kPrefetchAhead + l, _MM_HINT_T0);
      }
    _tile_loadd(6, w0 + k * kPanel, kQuad * kPanel);
    if constexpr (P2) _tile_loadd(7, w1 + k * kPanel, kQuad * kPanel);
    _tile_loadd(4, a + k, lda);
    _tile_dpbusd(0, 4, 6);
    if constexpr (P2) _tile_dpbusd(1, 4, 7);
    if constexpr (R2) {
      _tile_loadd(5, a + 16 * lda + k, lda);
      _tile_dpbusd(2, 5, 6);
      if constexpr (P2) _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, acc, kLd);
  if constexpr (P2) _tile_stored(1, acc + kPanel, kLd);
  if constexpr (R2) _tile_stored(2, acc + 16 * 2 * kPanel, kLd);
  if constexpr (R2 && P2) _tile_stored(3, acc + 16 * 2 * kPanel + kPanel, kLd);
}

inline void amx_block(bool r2, bool p2, const uint8_t* a, int64_t lda, const int8_t* w0, const int8_t* w1,
                      int64_t Kp, int32_t* acc, bool prefetch) {
  if (r2 && p2) return amx_block<true, true>(a, lda, w0, w1, Kp, acc, prefetch);
  if (r2) return amx_block<true, false>(a, lda, w0, w1, Kp, acc, prefetch);
  if (p2) return amx_block<false, true>(a, lda, w0, w1, Kp, acc, prefetch);
  amx_block<false, false>(a, lda, w0, w1, Kp, acc, prefetch);
}

bool amx_usable() {
  static const bool ok = [] {
    if (!tm_cpu::amx_permitted()) return false;
    constexpr int64_t Kp = 128;
    std::vector<uint8_t> a(32 * Kp);
    std::vector<int8_t> w(2 * Kp * kPanel);
    uint32_t r = 12345;
    for (auto& v : a) v = static_cast<uint8_t>((r = r * 1103515245 + 12345) >> 16);
    for (auto& v : w) v = static_cast<int8_t>(static_cast<int>((r = r * 1103515245 + 12345) >> 16) % 255 - 127);
    alignas(64) int32_t got[32 * 2 * kPanel], want[32 * 2 * kPanel], one[kTileRows * kPanel];
    amx_configure(16, 16);
    amx_block<true, true>(a.data(), Kp, w.data(), w.data() + Kp * kPanel, Kp, got, false);
    _tile_release();
    for (int m = 0; m < 32; m += kTileRows)
      for (int j = 0; j < 2; ++j) {
        tile<kTileRows>(a.data() + m * Kp, Kp, w.data() + j * Kp * kPanel, Kp, one);
        for (int i = 0; i < kTileRows; ++i)
          std::memcpy(want + (m + i) * 2 * kPanel + j * kPanel, one + i * kPanel, sizeof(int32_t) * kPanel);
      }
    return std::memcmp(got, want, sizeof(got)) == 0;
  }();
  return ok;
}
#endif

// Panels [p0, p1) for all M rows, in blocks of kRowBlock rows (with P.glu: gate panels, each with
// its up panel).
template <typename OT>
void run_panels(const Problem& P, int64_t p0, int64_t p1, OT* out) {
  alignas(64) int32_t acc[32 * 2 * kPanel];  // 32 rows x 2 panels
  // The float epilogue of rows [m, m + rows) of panel p, row i's sums at sums + i * ld, into
  // `to` (row stride ldo; by default the output's own place).
  auto finish = [&](int64_t p, const int32_t* sums, int64_t ld, int64_t m, int rows, OT* to = nullptr,
                    int64_t ldo = 0) {
    const int64_t n0 = p * kPanel;
    finish_rows(sums, ld, rows, static_cast<int>(std::min<int64_t>(kPanel, P.N - n0)), P.zx + m, P.sx + m,
                P.sw + n0, P.rowsum + n0, P.bias == nullptr ? nullptr : P.bias + n0,
                to != nullptr ? to : out + m * P.N + n0, to != nullptr ? ldo : P.N);
  };
  // gate panel p's and its up panel's sums (at sums and up_sums) -> silu(gate) * up, rounded as the
  // unfused ops round: both outputs to OT first, then silu_and_mul's own row function.
  OT pair[32 * 2 * kPanel];
  auto finish_glu = [&](int64_t p, const int32_t* sums, const int32_t* up_sums, int64_t ld, int64_t m, int rows) {
    finish(p, sums, ld, m, rows, pair, 2 * kPanel);
    finish(p + P.glu, up_sums, ld, m, rows, pair + kPanel, 2 * kPanel);
    for (int i = 0; i < rows; ++i)
      tm_cpu::silu_mul_row(pair + i * 2 * kPanel, pair + i * 2 * kPanel + kPanel, out + (m + i) * (P.N / 2) + p * kPanel,
                           kPanel);
  };
#if defined(TM_W8A8_AMX)
  if (P.Kp % 64 == 0 && amx_usable()) {
    // Pairs of whole row tiles, then the rest (1-31 rows: one or two tiles), each its own pass.
    const int64_t pairs_end = P.M / 32 * 32, rest = P.M - pairs_end;
    const int64_t bounds[3] = {0, pairs_end, P.M};
    for (int pass = 0; pass < 2; ++pass) {
      const int64_t m_begin = bounds[pass], m_end = bounds[pass + 1];
      if (m_begin == m_end) continue;
      const int rows0 = pass == 0 ? 16 : static_cast<int>(std::min<int64_t>(16, rest));
      const int rows1 = pass == 0 ? 16 : static_cast<int>(rest - rows0);
      amx_configure(rows0, rows1);
      for (int64_t r0 = m_begin; r0 < m_end; r0 += kRowBlock) {
        const int64_t r1 = std::min(m_end, r0 + kRowBlock);
        if (P.glu > 0) {  // the two panels of a block: a gate panel and its up panel
          for (int64_t p = p0; p < p1; ++p) {
            const int8_t* w0 = P.packed + p * P.Kp * kPanel;
            for (int64_t m = r0; m < r1; m += 32) {
              amx_block(rows1 > 0, true, P.a + m * P.Kp, P.Kp, w0, w0 + P.glu * P.Kp * kPanel, P.Kp, acc, m == r0);
              finish_glu(p, acc, acc + kPanel, 2 * kPanel, m, rows0 + rows1);
            }
          }
          continue;
        }
        for (int64_t p = p0; p < p1; p += 2) {
          const bool two = p + 1 < p1;
          const int8_t* w0 = P.packed + p * P.Kp * kPanel;
          for (int64_t m = r0; m < r1; m += 32) {
            amx_block(rows1 > 0, two, P.a + m * P.Kp, P.Kp, w0, w0 + P.Kp * kPanel, P.Kp, acc, m == r0);
            for (int j = 0; j < (two ? 2 : 1); ++j) finish(p + j, acc + j * kPanel, 2 * kPanel, m, rows0 + rows1);
          }
        }
      }
    }
    _tile_release();
    return;
  }
#endif
  // Several row tiles a panel: the first brings the panel from memory and the others find it in
  // the caches. Each of the first 2^shift tiles prefetches its part of the next panel (one line
  // every 2^shift k steps), so that the next panel's first tile does not wait for memory either:
  // at 32 rows (a 32-concurrent decode step) the first tile streamed its panel at 8 products a
  // line, faster than one core's share of the bandwidth. (2 cores, AMD EPYC, SmolLM2's linears:
  // 1.1-1.3x at 32 rows, `python benchmarks/panel_linear.py --w8a8`; one row streams its panel
  // alone, and software prefetch there measured no gain.)
  const int64_t tiles = (std::min(P.M, kRowBlock) + kTileRows - 1) / kTileRows;
  int shift = 0;
  while (shift < 4 && (int64_t{2} << shift) <= tiles) ++shift;
  const int64_t panel_bytes = P.Kp * kPanel;
  for (int64_t r0 = 0; r0 < P.M; r0 += kRowBlock) {
    const int64_t r1 = std::min(P.M, r0 + kRowBlock);
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* panel = P.packed + p * P.Kp * kPanel;
      for (int64_t m = r0; m < r1; m += kTileRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kTileRows, r1 - m));
        const int64_t part = (m - r0) / kTileRows;  // this tile's part of the next panel (none: shift 0)
        const bool pf = shift > 0 && p + 1 < p1 && part < (int64_t{1} << shift);
        const char* next = reinterpret_cast<const char*>(panel) + panel_bytes + part * (panel_bytes >> shift);
        tile_dispatch<kTileRows>(mb, P.a + m * P.Kp, P.Kp, panel, P.Kp, acc, pf ? next : nullptr, shift);
        if (P.glu > 0) {  // the up panel's sums beside the gate's
          tile_dispatch<kTileRows>(mb, P.a + m * P.Kp, P.Kp, panel + P.glu * P.Kp * kPanel, P.Kp, acc + kTileRows * kPanel,
                                   pf ? next + P.glu * panel_bytes : nullptr, shift);
          finish_glu(p, acc, acc + kTileRows * kPanel, kPanel, m, mb);
        } else {
          finish(p, acc, kPanel, m, mb);
        }
      }
    }
  }
}

void check_weights(const at::Tensor& packed, const at::Tensor& sw, const at::Tensor& rowsum, int64_t N,
                   int64_t K) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == round_up(N, kPanel) / kPanel && packed.size(1) == round_up(K, kQuad) / kQuad &&
                  packed.size(2) == kPanel && packed.size(3) == kQuad,
              "w8a8: packed weight must be int8 [ceil(N/16), ceil(K/4), 16, 4]");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.numel() == N, "w8a8: float32 scales [N]");
  TORCH_CHECK(rowsum.scalar_type() == at::kInt && rowsum.is_contiguous() && rowsum.numel() == N,
              "w8a8: int32 row sums [N]");
  // |sum u * q - z * rowsum| <= 2 * 255 * 127 * K must fit int32
  TORCH_CHECK(K <= 32768, "w8a8: at most 32768 inputs");
}

// x [M, K] float32 / bfloat16 -> quantized rows [M, Kp] (u or u - 128), scales [M], zero points [M].
void quantize_all(const at::Tensor& x, int64_t Kp, bool flip, uint8_t* q, float* sx, int32_t* zx) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  AT_DISPATCH_SWITCH(x.scalar_type(), "w8a8_quantize",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* xp = x.data_ptr<float>();
      at::parallel_for(0, M, grain, [&](int64_t b, int64_t e) {
        for (int64_t m = b; m < e; ++m) quantize_row(xp + m * K, K, Kp, q + m * Kp, sx + m, zx + m, flip);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
      at::parallel_for(0, M, grain, [&](int64_t b, int64_t e) {
        for (int64_t m = b; m < e; ++m) quantize_row(xp + m * K, K, Kp, q + m * Kp, sx + m, zx + m, flip);
      });
    }));
}

}  // namespace

namespace tm_cpu {

// The fused decode step's entry points (w8a8.h): the same quantize_row and run_panels as the op,
// so its outputs equal w8a8_linear's bit for bit.
int64_t w8a8_padded_k(int64_t K) { return round_up(K, kQuad); }

void w8a8_quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, uint8_t* q, float* sx, int32_t* zx) {
  const int64_t Kp = w8a8_padded_k(K);
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, Kp, q + m * Kp, sx + m, zx + m, kSignedActs);
}

void w8a8_units(const W8A8Weights& w, const uint8_t* q, const float* sx, const int32_t* zx, int64_t M, int64_t p0,
                int64_t p1, c10::BFloat16* out) {
  const Problem P{q, sx, zx, w.packed, w.sw, w.rowsum, w.bias, M, w.N, w8a8_padded_k(w.K)};
  run_panels(P, p0, p1, out);
}

}  // namespace tm_cpu

// y = x @ dequant(W)^T (+ bias), activations quantized per token inside. x: [M, K] float32 or
// bfloat16 (contiguous); packed: int8 [ceil(N/16), ceil(K/4), 16, 4]; w_scale float32 [N]; rowsum
// int32 [N] (sum of each row's q); bias float32 [N] or None. Returns [M, N] in x's dtype.
namespace {
at::Tensor w8a8_run(at::Tensor x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& rowsum, const c10::optional<at::Tensor>& bias, int64_t N, int64_t glu) {
  TORCH_CHECK(x.dim() == 2, "w8a8_linear: x [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w8a8_linear: float32 or bfloat16 x");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), Kp = round_up(K, kQuad);
  check_weights(packed, w_scale, rowsum, N, K);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "w8a8_linear: float32 bias [N]");
    bp = bias->data_ptr<float>();
  }
  auto out = tm_cpu::empty({M, glu > 0 ? N / 2 : N}, x.options());
  if (M == 0 || N == 0) return out;
  auto q = tm_cpu::empty({M, Kp}, tm_cpu::dtype(at::kByte));
  auto sx = tm_cpu::empty({M}, tm_cpu::dtype(at::kFloat));
  auto zx = tm_cpu::empty({M}, tm_cpu::dtype(at::kInt));
  quantize_all(x, Kp, kSignedActs, q.data_ptr<uint8_t>(), sx.data_ptr<float>(), zx.data_ptr<int32_t>());
  const Problem P{q.data_ptr<uint8_t>(), sx.data_ptr<float>(), zx.data_ptr<int32_t>(), packed.data_ptr<int8_t>(),
                  w_scale.data_ptr<float>(), rowsum.data_ptr<int32_t>(), bp, M, N, Kp, glu};
  const int64_t panels = glu > 0 ? glu : packed.size(0);  // with glu: the gate's panels (each with its up's)
  // Enough panels per task that a thread streams a long run of weights (2 per task at least).
  const int64_t grain = std::max<int64_t>(2, panels / (4 * at::get_num_threads()));
  if (x.scalar_type() == at::kFloat) {
    float* op = out.data_ptr<float>();
    at::parallel_for(0, panels, grain, [&](int64_t b, int64_t e) { run_panels(P, b, e, op); });
  } else {
    c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
    at::parallel_for(0, panels, grain, [&](int64_t b, int64_t e) { run_panels(P, b, e, op); });
  }
  return out;
}
}  // namespace

at::Tensor w8a8_linear(at::Tensor x, at::Tensor packed, at::Tensor w_scale, at::Tensor rowsum,
                          c10::optional<at::Tensor> bias, int64_t N) {
  return w8a8_run(std::move(x), packed, w_scale, rowsum, bias, N, 0);
}

// silu(gate) * up of a fused gate/up W8A8 linear (N = 2 I outputs, gate first, I a multiple of 16)
// in its epilogue: [M, I], the bits w8a8_linear then silu_and_mul give, without writing [M, N].
at::Tensor w8a8_linear_silu_mul(at::Tensor x, at::Tensor packed, at::Tensor w_scale, at::Tensor rowsum,
                                   c10::optional<at::Tensor> bias, int64_t N) {
  TORCH_CHECK(N % (2 * kPanel) == 0, "w8a8_linear_silu_mul: N = 2 I with I a multiple of ", kPanel);
  return w8a8_run(std::move(x), packed, w_scale, rowsum, bias, N, N / (2 * kPanel));
}

// The activation quantization alone (tests): (u uint8 [M, K], scale float32 [M], zero point int32 [M]).
std::vector<at::Tensor> w8a8_quantize_activations(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_quantize_activations: float32 or bfloat16 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = tm_cpu::empty({M, K}, tm_cpu::dtype(at::kByte));
  auto sx = tm_cpu::empty({M}, tm_cpu::dtype(at::kFloat));
  auto zx = tm_cpu::empty({M}, tm_cpu::dtype(at::kInt));
  quantize_all(x, K, false, q.data_ptr<uint8_t>(), sx.data_ptr<float>(), zx.data_ptr<int32_t>());
  return {q, sx, zx};
}

// Which instruction path this build runs (logged, and named in tests).
std::string w8a8_isa() {
#if defined(TM_W8A8_AMX)
  return amx_usable() ? "amx-int8" : "avx512-vnni";
#elif defined(TM_W8A8_VNNI512)
  return "avx512-vnni";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}
