// bf16 linear layers for small and medium batches (decode steps), on weights packed in panels.
//
// A panel is 32 output rows of the weight, stored as [K/2][32][2]: for each pair of inputs
// (k, k+1), the 32 rows' two weights side by side: one 64-byte zmm of vdpbf16ps operands. The
// kernel keeps MB x 2 accumulators of 16 outputs each and, per input pair, loads the panel's
// two zmm once, broadcasts each input row's pair and issues 2 * MB vdpbf16ps: no horizontal
// sums, every weight byte read once per call, a thread's panels one sequential stream.
// Measured on SmolLM2's shapes (2 cores, AVX512-BF16): at 1 row it streams the weights ~10-30%
// faster than a row-by-row GEMV, and at 8-128 rows it beats oneDNN's packed GEMM (e.g. 32 rows
// 304-371 GFLOP/s vs 214-329).
//
// Without AVX512-BF16 (AVX2 + FMA, e.g. AMD Zen 2/3) the same panels run on float32 FMAs: each
// 32-byte load holds 8 rows' pairs, split into the k and k+1 weights (a shift and a mask widen a
// bf16 to float32 exactly) and FMA'd with the input row's k and k+1 values, in that order.
//
// Where the CPU has AMX-BF16 (and Linux grants the process its tile state) every batch size runs
// on AMX tiles instead: the panels are the tiles' weight operand as they are (below).
//
// Each output sums its products in one float32 accumulator over the input pairs in order, so
// the result does not depend on the batch size or on how panels are shared out among threads.
#include "torch_lite.h"

#include <cstdint>
#include <string>

#include "elementwise.h"
#include "linear.h"

#if TM_PANEL_KERNEL
#include <immintrin.h>
#if defined(TM_PANEL_AMX)
#include "amx.h"
#endif

namespace {

using namespace tm_cpu;
using BF16 = c10::BFloat16;

#if defined(__AVX512BF16__)
constexpr int kMaxRows = 8;  // input rows per register tile (2 x 8 accumulators)

// 16 floats -> 16 bf16 (round to nearest even), as c10::BFloat16(float) rounds.
inline __m256i to_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline __m512 from_bf16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

// Stores a row's 32 float32 sums as bf16 (round to nearest even; + bias, rounded as `y + bias`
// is), its first ncols only.
struct RowStore {
  __mmask16 lo_mask, hi_mask;
  const BF16* bias;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  RowStore(int ncols, const BF16* bias_)
      : lo_mask(ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1)),
        hi_mask(ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1)),
        bias(bias_) {
    if (bias != nullptr) {
      b0 = from_bf16(_mm256_maskz_loadu_epi16(lo_mask, bias));
      b1 = from_bf16(_mm256_maskz_loadu_epi16(hi_mask, bias + 16));
    }
  }
  void operator()(__m512 a0, __m512 a1, BF16* o) const {
    __m256i lo = to_bf16(a0), hi = to_bf16(a1);
    if (bias != nullptr) {
      lo = to_bf16(_mm512_add_ps(from_bf16(lo), b0));
      hi = to_bf16(_mm512_add_ps(from_bf16(hi), b1));
    }
    _mm256_mask_storeu_epi16(o, lo_mask, lo);
    _mm256_mask_storeu_epi16(o + 16, hi_mask, hi);
  }
  // n rows of float32 sums (c, kPanelRows a row) into out, ldo apart.
  void rows(const float* c, int n, BF16* out, int64_t ldo) const {
    for (int r = 0; r < n; ++r)
      (*this)(_mm512_load_ps(c + r * kPanelRows), _mm512_load_ps(c + r * kPanelRows + 16), out + r * ldo);
  }
};

// out[m][0..ncols) = x[m] . panel rows (+ bias, rounded as `y + bias` is) for MB input rows.
template <int MB>
inline void panel_tile(const BF16* x, int64_t ldx, const BF16* panel, int64_t K, BF16* out, int64_t ldo, int ncols,
                       const BF16* bias) {
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // input pairs
  const int64_t ldp = ldx / 2;
  const BF16* w = panel;
  for (int64_t kp = 0; kp < K / 2; ++kp, w += 2 * kPanelRows) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchAhead, _MM_HINT_T0);  // (linear.h)
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchAhead + 64, _MM_HINT_T0);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 32));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[m * ldp + kp]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
    }
  }
  const RowStore store(ncols, bias);
  for (int m = 0; m < MB; ++m) store(acc[m][0], acc[m][1], out + m * ldo);
}

#if defined(TM_PANEL_AMX)
// AMX-BF16: tdpbf16ps multiplies a tile of up to 16 input rows x 16 input pairs by a tile of 16
// input pairs x 16 outputs' pairs into 16 x 16 float32 sums. A panel's 16 pairs x 32 outputs
// are two such weight tiles side by side (rows 128 bytes apart), so the panels are read as they
// are. AMX rounds its sums otherwise than vdpbf16ps does, so where it runs it runs every batch
// size; a row's sums never depend on the other rows of its tile (tile rows are independent), and
// every row goes through the same tiles in the same order of k. The last K % 32 inputs take tail
// tiles of their own width (nothing padded, nothing copied). Linux hands a process the tile state
// only when asked (arch_prctl); where it refuses, the vdpbf16ps tiles above run instead.

// Tiles 0, 1: the sums of outputs 0-15 and 16-31; 2: the inputs; 3, 4: the weights; 5-7: the
// same for the K % 32 tail. `rows` input rows (1-16) per tile.
inline void amx_configure(int rows, int tail) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = t >= 3 ? 16 : rows;
    cfg.colsb[t] = 64;
  }
  if (tail > 0) {
    cfg.rows[5] = rows;
    cfg.colsb[5] = static_cast<uint16_t>(2 * tail);
    cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(tail / 2);
    cfg.colsb[6] = cfg.colsb[7] = 64;
  }
  load_tile_config(cfg);
}

// The sums of the configured rows of x times the panel's 32 outputs over k < K / 32 * 32 in tiles
// C0 and C1, the inputs in tile A, the weights in tiles 3 and 4. (A macro: GCC's tile intrinsics
// name their tiles in the instruction text, so the tile numbers must be literals.)
#define TM_AMX_PANEL_SUMS(C0, C1, A)                                                                    \
  {                                                                                                     \
    constexpr int kStride = 2 * kPanelRows * sizeof(BF16); /* bytes between a weight tile's rows */     \
    _tile_zero(C0);                                                                                     \
    _tile_zero(C1);                                                                                     \
    for (int64_t k = 0; k < K / 32 * 32; k += 32, w += kStep) {                                         \
      if (prefetch) /* streaming from memory (the first rows to read this panel): see kPrefetchAhead */ \
        for (int l = 0; l < static_cast<int>(kStep * sizeof(BF16)); l += 64)                           \
          _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchAhead + l, _MM_HINT_T0);             \
      _tile_loadd(A, x + k, ldx * sizeof(BF16));                                                        \
      _tile_loadd(3, w, kStride);                                                                       \
      _tile_loadd(4, w + 32, kStride);                                                                  \
      _tile_dpbf16ps(C0, A, 3);                                                                         \
      _tile_dpbf16ps(C1, A, 4);                                                                         \
    }                                                                                                   \
  }
constexpr int64_t kStep = 16 * 2 * kPanelRows;  // one k step of a panel: 16 pairs x 32 outputs x 2

// c[r][0..32) = x[r] . the panel's 32 outputs, for the configured rows (float32, 32 a row).
inline void amx_panel(const BF16* x, int64_t ldx, const BF16* panel, int64_t K, float* c, bool prefetch) {
  const BF16* w = panel;
  TM_AMX_PANEL_SUMS(0, 1, 2)
  const int64_t k32 = K / 32 * 32;
  if (k32 < K) {
    constexpr int kStride = 2 * kPanelRows * sizeof(BF16);
    _tile_loadd(5, x + k32, ldx * sizeof(BF16));
    _tile_loadd(6, w, kStride);
    _tile_loadd(7, w + 32, kStride);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
  }
  _tile_stored(0, c, kPanelRows * sizeof(float));
  _tile_stored(1, c + 16, kPanelRows * sizeof(float));
}

// The same for K % 32 == 0 in tiles 5, 6 and 7 (amx_rows_configure's rest rows).
inline void amx_panel_rest(const BF16* x, int64_t ldx, const BF16* panel, int64_t K, float* c) {
  const BF16* w = panel;
  constexpr bool prefetch = false;
  TM_AMX_PANEL_SUMS(5, 6, 7)
  _tile_stored(5, c, kPanelRows * sizeof(float));
  _tile_stored(6, c + 16, kPanelRows * sizeof(float));
}
#undef TM_AMX_PANEL_SUMS

// glu > 0 (panel_linear_silu_mul): [p0, p1) are gate panels, panel p's up is panel p + glu, and
// out (ldo a row) gets silu(gate) * up: both rounded to bf16 first, then silu_and_mul's row function.
void amx_panel_units(const BF16* x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, BF16* out,
                     int64_t ldo, const BF16* bias, int64_t glu = 0) {
  const int64_t K = w.K, full = M / 16 * 16;
  const BF16* packed = static_cast<const BF16*>(w.data);
  alignas(64) float c[16 * kPanelRows];
  BF16 gate[16 * kPanelRows], up[16 * kPanelRows];
  // Whole tiles of 16 rows, then the rest in one tile of fewer rows (another configuration).
  const int64_t bounds[3] = {0, full, M};
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t m_begin = bounds[pass], m_end = bounds[pass + 1];
    if (m_begin == m_end) continue;
    const int rows = static_cast<int>(std::min<int64_t>(16, m_end - m_begin));
    amx_configure(rows, static_cast<int>(K % 32));
    for (int64_t p = p0; p < p1; ++p) {
      const BF16* panel = packed + p * K * kPanelRows;
      const int64_t n0 = p * kPanelRows;
      const RowStore store(static_cast<int>(std::min<int64_t>(kPanelRows, w.N - n0)), bias == nullptr ? nullptr : bias + n0);
      if (glu > 0) {
        const int64_t nu = (p + glu) * kPanelRows;
        const RowStore store_up(kPanelRows, bias == nullptr ? nullptr : bias + nu);
        for (int64_t m0 = m_begin; m0 < m_end; m0 += 16) {
          amx_panel(x + m0 * K, K, panel, K, c, m0 == 0);
          store.rows(c, rows, gate, kPanelRows);
          amx_panel(x + m0 * K, K, panel + glu * K * kPanelRows, K, c, m0 == 0);
          store_up.rows(c, rows, up, kPanelRows);
          for (int r = 0; r < rows; ++r)
            silu_mul_row(gate + r * kPanelRows, up + r * kPanelRows, out + (m0 + r) * ldo + n0, kPanelRows);
        }
        continue;
      }
      for (int64_t m0 = m_begin; m0 < m_end; m0 += 16) {
        amx_panel(x + m0 * K, K, panel, K, c, m0 == 0);
        store.rows(c, rows, out + m0 * ldo + n0, ldo);
      }
    }
  }
  _tile_release();  // the thread's tile state back to init: nothing to save on a context switch
}
#endif  // TM_PANEL_AMX

#else  // AVX2 + FMA
constexpr int kMaxRows = 4;  // input rows per register tile (4 x 4 accumulators; measured best of 2-4)

// out[m][0..ncols) = x[m] . panel rows (+ bias, rounded as `y + bias` is) for MB input rows.
template <int MB>
inline void panel_tile(const BF16* x, int64_t ldx, const BF16* panel, int64_t K, BF16* out, int64_t ldo, int ncols,
                       const BF16* bias) {
  __m256 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // input pairs
  const int64_t ldp = ldx / 2;
  const BF16* w = panel;
  for (int64_t kp = 0; kp < K / 2; ++kp, w += 2 * kPanelRows) {
    __m256 x0[MB], x1[MB];  // input k and k+1 of each row, broadcast
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256i pair = _mm256_set1_epi32(xp[m * ldp + kp]);
      x0[m] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      x1[m] = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {  // rows 8v .. 8v + 7 of the panel
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * v));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][v] = _mm256_fmadd_ps(x1[m], w1, _mm256_fmadd_ps(x0[m], w0, acc[m][v]));
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float y[kPanelRows];
    for (int v = 0; v < 4; ++v) _mm256_store_ps(y + 8 * v, acc[m][v]);
    BF16* o = out + m * ldo;
    for (int c = 0; c < ncols; ++c)
      o[c] = bias == nullptr ? BF16(y[c]) : BF16(static_cast<float>(BF16(y[c])) + static_cast<float>(bias[c]));
  }
}
#endif

}  // namespace

namespace tm_cpu {

void panel_units(const BF16* x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, BF16* out, int64_t ldo,
                 const BF16* bias) {
#if defined(TM_PANEL_AMX)
  if (amx_permitted()) return amx_panel_units(x, M, w, p0, p1, out, ldo, bias);
#endif
  const int64_t K = w.K;
  const BF16* packed = static_cast<const BF16*>(w.data);
  for (int64_t p = p0; p < p1; ++p) {
    const BF16* panel = packed + p * K * kPanelRows;
    const int64_t n0 = p * kPanelRows;
    const int nc = static_cast<int>(std::min<int64_t>(kPanelRows, w.N - n0));
    const BF16* pb = bias == nullptr ? nullptr : bias + n0;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mb = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      const BF16* xm = x + m0 * K;
      BF16* o = out + m0 * ldo + n0;
      switch (mb) {
#define TM_CASE(R) \
  case R: if constexpr (R <= kMaxRows) panel_tile<R>(xm, K, panel, K, o, ldo, nc, pb); break;
        TM_CASE(1) TM_CASE(2) TM_CASE(3) TM_CASE(4) TM_CASE(5) TM_CASE(6) TM_CASE(7) TM_CASE(8)
#undef TM_CASE
      }
    }
  }
}

#if defined(TM_PANEL_AMX)
bool amx_panels() { return amx_permitted(); }

void amx_rows_configure(int r0, int r1) {
  // Tiles 0, 1: the sums of the first tile of r0 rows, 2: its inputs; 3, 4: the weights; 5, 6, 7:
  // the same as 0, 1, 2 for a second tile of r1 rows (K % 32 == 0: no tail tiles).
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t == 3 || t == 4 ? 16 : t < 3 ? r0 : r1);
    cfg.colsb[t] = cfg.rows[t] == 0 ? 0 : 64;
  }
  load_tile_config(cfg);
}

void amx_panel_rows(const BF16* x, int64_t M, const BF16* panel, int64_t K, BF16* out, int64_t ldo, int ncols,
                    const BF16* bias) {
  alignas(64) float c[16 * kPanelRows];
  const RowStore store(ncols, bias);
  const int64_t full = M / 16 * 16;
  for (int64_t m0 = 0; m0 < full; m0 += 16) {
    amx_panel(x + m0 * K, K, panel, K, c, false);
    store.rows(c, 16, out + m0 * ldo, ldo);
  }
  if (full < M) {
    amx_panel_rest(x + full * K, K, panel, K, c);
    store.rows(c, static_cast<int>(M - full), out + full * ldo, ldo);
  }
}

void amx_sums_zero(bool two) {
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(5);
    _tile_zero(6);
  }
}

void amx_sums_step(const BF16* x, int64_t ldx, const BF16* w, bool two) {
  constexpr int kStride = 2 * kPanelRows * sizeof(BF16);
  _tile_loadd(3, w, kStride);
  _tile_loadd(4, w + 32, kStride);
  _tile_loadd(2, x, ldx * sizeof(BF16));
  _tile_dpbf16ps(0, 2, 3);
  _tile_dpbf16ps(1, 2, 4);
  if (two) {
    _tile_loadd(7, x + 16 * ldx, ldx * sizeof(BF16));
    _tile_dpbf16ps(5, 7, 3);
    _tile_dpbf16ps(6, 7, 4);
  }
}

void amx_sums_store(BF16* out, int64_t ldo, int r0, int r1, int ncols, const BF16* bias) {
  alignas(64) float c[16 * kPanelRows];
  const RowStore store(ncols, bias);
  _tile_stored(0, c, kPanelRows * sizeof(float));
  _tile_stored(1, c + 16, kPanelRows * sizeof(float));
  store.rows(c, r0, out, ldo);
  if (r1 == 0) return;
  _tile_stored(5, c, kPanelRows * sizeof(float));
  _tile_stored(6, c + 16, kPanelRows * sizeof(float));
  store.rows(c, r1, out + 16 * ldo, ldo);
}

void amx_release() { _tile_release(); }
#endif

}  // namespace tm_cpu

#endif  // TM_PANEL_KERNEL

// The instructions panel_units runs here.
std::string panel_isa() {
#if defined(TM_PANEL_AMX)
  if (amx_permitted()) return "amx-bf16";
#endif
#if TM_PANEL_KERNEL && defined(__AVX512BF16__)
  return "avx512-bf16";
#elif TM_PANEL_KERNEL
  return "avx2-fma";
#else
  return "none";
#endif
}

// weight [N, K] bf16 -> panels [ceil(N / 32), K / 2, 32, 2] (rows past N zero).
at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0,
              "pack_panels: a bf16 [N, K] weight, K even");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + tm_cpu::kPanelRows - 1) / tm_cpu::kPanelRows;
  auto out = tm_cpu::zeros({P, K / 2, tm_cpu::kPanelRows, 2}, w.options());
  const int32_t* src = reinterpret_cast<const int32_t*>(w.data_ptr());  // (k, k+1) pairs
  int32_t* dst = reinterpret_cast<int32_t*>(out.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < tm_cpu::kPanelRows && p * tm_cpu::kPanelRows + c < N; ++c) {
        const int32_t* row = src + (p * tm_cpu::kPanelRows + c) * (K / 2);
        int32_t* col = dst + p * (K / 2) * tm_cpu::kPanelRows + c;
        for (int64_t kp = 0; kp < K / 2; ++kp) col[kp * tm_cpu::kPanelRows] = row[kp];
      }
  });
  return out;
}

// silu(gate) * up of a fused gate/up linear (N = 2 I outputs, gate first, I a multiple of 32) in
// the AMX path's epilogue: [M, I], the bits of panel_linear then silu_and_mul, without writing
// [M, N]. AMX-BF16 only (panel_isa() == "amx-bf16").
at::Tensor panel_linear_silu_mul(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 &&
                  panels.is_contiguous() && panels.dim() == 4 && panels.size(2) == tm_cpu::kPanelRows &&
                  panels.size(1) * 2 == x.size(1) && panels.size(0) * tm_cpu::kPanelRows == N &&
                  N % (2 * tm_cpu::kPanelRows) == 0,
              "panel_linear_silu_mul: bf16 x [M, K] and panels [N / 32, K / 2, 32, 2], N = 2 I, I a multiple of 32");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N),
              "panel_linear_silu_mul: bias must be bf16 [N]");
#if TM_PANEL_KERNEL && defined(TM_PANEL_AMX)
  TORCH_CHECK(tm_cpu::amx_permitted(), "panel_linear_silu_mul: needs AMX-BF16");
  const auto xc = x.contiguous();
  auto out = tm_cpu::empty({x.size(0), N / 2}, x.options());
  const tm_cpu::LinearWeights w{16, false, panels.data_ptr(), nullptr, N, x.size(1)};
  const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const int64_t glu = N / (2 * tm_cpu::kPanelRows);
  at::parallel_for(0, glu, 1, [&](int64_t p0, int64_t p1) {
    amx_panel_units(xc.data_ptr<c10::BFloat16>(), x.size(0), w, p0, p1, out.data_ptr<c10::BFloat16>(), N / 2, b, glu);
  });
  return out;
#else
  TORCH_CHECK(false, "panel_linear_silu_mul: needs AMX-BF16");
#endif
}

// x [M, K] bf16 @ (panels of an [N, K] weight)^T (+ bias [N]) -> [M, N] bf16.
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 &&
                  panels.is_contiguous() && panels.dim() == 4 && panels.size(2) == tm_cpu::kPanelRows &&
                  panels.size(1) * 2 == x.size(1) && panels.size(0) * tm_cpu::kPanelRows >= N,
              "panel_linear: bf16 x [M, K] and panels [ceil(N / 32), K / 2, 32, 2]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N),
              "panel_linear: bias must be bf16 [N]");
#if TM_PANEL_KERNEL
  const auto xc = x.contiguous();
  auto out = tm_cpu::empty({x.size(0), N}, x.options());
  const tm_cpu::LinearWeights w{16, false, panels.data_ptr(), nullptr, N, x.size(1)};
  const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, w.units(), 1, [&](int64_t p0, int64_t p1) {
    tm_cpu::panel_units(xc.data_ptr<c10::BFloat16>(), x.size(0), w, p0, p1, out.data_ptr<c10::BFloat16>(), N, b);
  });
  return out;
#else
  TORCH_CHECK(false, "panel_linear needs AVX512-BF16 or AVX2 with FMA");
#endif
}
