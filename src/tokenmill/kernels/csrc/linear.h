// The engine's small-batch linear kernels, shared by the ops (one call on ATen's thread pool)
// and the fused decode step (each thread of one parallel region computing its own units).
// Both split the output rows into the same units and compute each output alike, so the two
// paths give the same numbers bit for bit.
#pragma once

#include "torch_lite.h"

#include <cstdint>

// The bf16 panel kernel (and so the fused decode step) is built where the CPU has AVX512-BF16
// (vdpbf16ps) or AVX2 with FMA (float32 FMAs on the widened weights).
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#define TM_PANEL_KERNEL 1
#else
#define TM_PANEL_KERNEL 0
#endif
// Where the CPU has AMX-BF16, the bf16 panels (and the int4 / int8 ones, dequantized) run on AMX tiles.
#if TM_PANEL_KERNEL && defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define TM_PANEL_AMX 1
#endif
// int4 / int8 weights in output panels times int8 activations (quant_panels.cpp): every CPU with
// AVX2 + FMA + F16C (AVX-512 VNNI ones run them on 512 bits); elsewhere the row layout and the
// tiles of quant_linear.cpp.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_QUANT_PANELS 1
#else
#define TM_QUANT_PANELS 0
#endif

namespace tm_cpu {

constexpr int kGroup = 32;      // quantization group: inputs sharing one scale
constexpr int kTileRows = 4;    // int4 / int8: output rows per tile (a unit of work)
constexpr int kPanelRows = 32;  // bf16: output rows per panel (a unit of work)
// The 512-bit panel kernels (bf16 with AVX512-BF16, int4 / int8 with AVX-512 VNNI) prefetch, with
// each 64-byte weight load, the line this far ahead in the same stream (a panel, then the next
// one): one thread streaming a single row's weights at memory speed needs more lines in flight
// than the hardware prefetchers keep. Sapphire Rapids, SmolLM2 batch-1 decode (`bench roofline`):
// int4 67% -> 89% of the bandwidth, bf16 68% -> 87%. (The scales' stream, a quarter as long,
// needs none; on AMD Zen 3's AVX2 kernels software prefetch measured no gain.)
constexpr int64_t kPrefetchAhead = 4096;

// A linear layer's weight: bf16 packed in panels (bits 16, panel_linear.cpp), or int8 [N, K] /
// int4 [N, K / 2] in groups of 32 with float16 scales (bits 8 / 4, quant_linear.cpp), or those
// codes and scales in output panels of 32 rows (bits 8 / 4 with `panels`, quant_panels.cpp).
struct LinearWeights {
  int bits = 16;
  bool panels = false;  // bits 4 / 8: in output panels
  const void* data = nullptr;
  const at::Half* scales = nullptr;  // null for bits 16
  int64_t N = 0, K = 0;
  int64_t unit_rows() const { return bits == 16 || panels ? kPanelRows : kTileRows; }
  int64_t units() const { return (N + unit_rows() - 1) / unit_rows(); }
};

// Quantized weights: out[m * ldo + n] = x[m] . w[n] (+ bias[n], rounded as `y + bias` is) for
// the M input rows (K apart) and the output rows n of tiles [t0, t1). XT / OT: float or
// c10::BFloat16 (bf16 inputs widened to float32 first where the CPU lacks AVX512-BF16).
template <typename XT, typename OT>
void linear_tiles(const XT* x, int64_t M, const LinearWeights& w, int64_t t0, int64_t t1, OT* out, int64_t ldo,
                  const OT* bias = nullptr);

// Input rows quantized per group of 32 to int8 (quant_panels.cpp): each row's K codes, and its
// groups' scales and exact float sums (G = K / 32 per row).
struct A8Rows {
  const int8_t* q = nullptr;
  const float* scale = nullptr;
  const float* sum = nullptr;
  int64_t K = 0, G = 0;
};

// Declared for every ISA level (bindings.cpp binds them only where quant_panels_built(); stubs elsewhere).
// Whether quant_panel_units runs a call of M bf16 rows on AMX tiles, each panel dequantized to
// bf16 once for all of them (the rows as they are, no int8 activations): where the bf16 panels
// run on AMX, from set_quant_amx_rows' rows (default kQuantAmxRows). Dequantizing costs more than
// the integer products at a few rows (per 32 weights ~7 cycles against memory's ~4 at one row),
// much less past them; the two paths round differently, so the rows a row is batched with decide
// which one it takes (quantization.py sets 128 rows where the engine is batch-invariant).
constexpr int64_t kQuantAmxRows = 128;
void set_quant_amx_rows(int64_t rows);
bool quant_panels_amx(int64_t M);
// Whether the int8-activation path runs a call of M rows' integer products on AMX-INT8 tiles
// (the vector path's bits exactly, so only speed sets the rows: set_quant_amx_int_rows, default
// kQuantAmxIntRows; fewer rows leave most of a tile idle).
constexpr int64_t kQuantAmxIntRows = 16;
void set_quant_amx_int_rows(int64_t rows);
bool quant_panels_amx_int(int64_t M);

#if TM_QUANT_PANELS
// Quantized panels: the same for the output rows of panels [p0, p1) (XT / OT as linear_tiles'),
// the rows quantized to int8 on the way in.
template <typename XT, typename OT>
void quant_panel_units(const XT* x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out, int64_t ldo,
                       const OT* bias = nullptr);

// The same in two steps, for a caller that runs several unit ranges on one input: M rows
// quantized into this thread's buffers (valid until its next call), then the units.
template <typename XT>
A8Rows quantize_a8_rows(const XT* x, int64_t M, int64_t K);
template <typename OT>
void quant_panel_units(const A8Rows& x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1, OT* out,
                       int64_t ldo, const OT* bias = nullptr);

// Row `id` of a quantized panel weight (an embedding table tied to a quantized LM head), dequantized.
template <typename T>
void quant_panel_row(const LinearWeights& w, int64_t id, T* out);
#endif

#if TM_PANEL_KERNEL
// bf16 panels: the same for the output rows of panels [p0, p1).
void panel_units(const c10::BFloat16* x, int64_t M, const LinearWeights& w, int64_t p0, int64_t p1,
                 c10::BFloat16* out, int64_t ldo, const c10::BFloat16* bias);

#if defined(TM_PANEL_AMX)
// Whether the bf16 panels run on AMX tiles here (Linux granted the tile state).
bool amx_panels();
// AMX tiles for panels produced on the fly (quant_panels.cpp dequantizes int4 / int8 panels; K %
// 32 == 0, panels [K / 2][32][2] in bf16, the output's first ncols columns, each row's sums in the
// same order as panel_units'). The tiles configured for a tile of r0 (<= 16) rows and one of r1;
// then either each whole panel for M rows (r0 16, r1 M % 16), or, for up to two tiles (32 rows),
// sums kept in the tiles while the panel comes 32 inputs (one step, 2 KB) at a time: zeroed, a
// step's inputs (x: the rows at its first input, ldx apart) times its weights, stored; then released.
void amx_rows_configure(int r0, int r1);
void amx_panel_rows(const c10::BFloat16* x, int64_t M, const c10::BFloat16* panel, int64_t K, c10::BFloat16* out,
                    int64_t ldo, int ncols, const c10::BFloat16* bias);
void amx_sums_zero(bool two);
void amx_sums_step(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, bool two);
void amx_sums_store(c10::BFloat16* out, int64_t ldo, int r0, int r1, int ncols, const c10::BFloat16* bias);
void amx_release();
#endif

// Either kind, bf16 activations: units [u0, u1) of w.units().
inline void linear_units(const c10::BFloat16* x, int64_t M, const LinearWeights& w, int64_t u0, int64_t u1,
                         c10::BFloat16* out, int64_t ldo, const c10::BFloat16* bias) {
  if (w.bits == 16) panel_units(x, M, w, u0, u1, out, ldo, bias);
#if TM_QUANT_PANELS
  else if (w.panels) quant_panel_units(x, M, w, u0, u1, out, ldo, bias);
#endif
  else linear_tiles(x, M, w, u0, u1, out, ldo, bias);
}
#endif

// Row `id` of an embedding table: bits 16 a plain bf16 [rows, K] table (copied), 4 / 8
// quantized, in rows or panels (dequantized in float32, then rounded to T, as quant_embedding(...).to(dtype) is).
template <typename T>
void embedding_row(const LinearWeights& table, int64_t id, T* out);

}  // namespace tm_cpu
