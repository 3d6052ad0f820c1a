// Mixture-of-experts FFN on the CPU: every token's top-k experts, each expert run once per call
// over all the rows routed to it.
//
//   out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
//
// The (token, slot) assignments are grouped by expert with a counting sort (stable: each
// expert's rows stay in token order), the rows gathered once into float32, then two passes on
// ATen's thread pool, each over work units of (expert, 24 output columns):
//   1. gate and up columns of a unit against every row of its expert, silu(gate) * up written to
//      the expert's rows of an activation buffer;
//   2. down's columns against those rows, each result written to its assignment's row of Y.
// A unit converts its weight rows to float32 once (bf16) and multiplies every row of the expert
// by them, so each expert's weights are read from memory once per call whatever its load; the
// units are shared out among the threads by their cost (rows times columns, plus the weights'
// read), so a busy expert does not leave the other threads idle. Last, each token sums its k
// results in slot order (the weighted scatter-add, in float32) and rounds once to the output dtype.
//
// Inner loop: a unit's columns against its expert's rows in register tiles of up to 4 rows x C
// columns (dot_tile): R x C vector accumulators, each step loading R row vectors and C weight
// vectors once for R x C FMAs (a dot product at a time loads two vectors per FMA and is bound by
// the loads). C is what the registers hold: 3 for 4 rows with AVX2's 16 (12 accumulators), up to
// 6 for a single row; 6 for 4 rows with AVX-512's 32. Leftover rows and columns take narrower
// tiles. The first row tile prefetches the next tile's weight rows (read from memory; the later
// row tiles find them in cache).
//
// Batch-invariant: each dot product is summed in one fixed order (vector lanes over the input
// dimension, then a fixed tree over the lanes), whatever the number of rows sharing its expert,
// the size of the tile it falls in or the thread count, so a row's result does not depend on the
// other rows (each accumulator of a tile is one dot product, summed as it would be alone).
// bf16: the gate/up and down outputs and silu(gate) * up are rounded to bf16 as torch's bf16
// ops round them (the reference in tests/test_moe_kernel.py); the products sum in float32.
// Portable C++ with GCC vector types: 8-float vectors with AVX2, 16 with AVX-512.
#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vec __attribute__((vector_size(kW * sizeof(float))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));
// Pins a vector to a register (GCC would rather fold a load into every FMA). Without AVX (the
// generic level) an 8-float vector is no register's size: left to the compiler.
#if defined(__AVX__)
#define TM_IN_REGISTER(v) asm("" : "+v"(v))
#else
#define TM_IN_REGISTER(v) (void)0
#endif

constexpr int kR = 4;                        // input rows per register tile
constexpr int64_t kCols = 24;                // output columns per work unit
constexpr int64_t kReadCost = 4;             // reading a unit's weights costs as much as this many rows
constexpr int64_t kParallelMacs = 1 << 16;   // below this much work a call runs in the calling thread
constexpr int64_t kBufferBytes = 64 << 20;   // the float32 buffers' budget: larger batches run in chunks

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

// The lanes of v summed in one fixed tree.
inline float hsum(vec v) {
#if defined(__AVX512F__)
  const vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vec8 a = v;
#endif
  const vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// out[r * ldo + c] = x_r . w_c over K (a multiple of kW) for R rows of x and C rows of w: R x C
// accumulators in registers, each vector of x and of w loaded once per step and used C or R times.
template <int R, int C>
inline void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out, int64_t ldo,
                     bool prefetch) {
  vec acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = vec{};
  for (int64_t k = 0; k < K; k += kW) {
    vec wv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      wv[c] = loadv(w + c * ldw + k);
      TM_IN_REGISTER(wv[c]);  // held in a register: GCC would rather fold a load into every FMA
    }
    if (prefetch && k % 16 == 0)  // the next tile's weight rows, a cache line each, while this one computes
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) __builtin_prefetch(w + (C + c) * ldw + k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vec xv = loadv(x + r * ldx + k);
      TM_IN_REGISTER(xv);  // likewise: R + C loads a step, not R + R C
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum(acc[r][c]);
}

// Columns per tile for R rows: as many as the vector registers hold (R * C accumulators, C weight
// vectors and one row vector; 16 registers with AVX2, 32 with AVX-512), fewer rows taking more
// columns so that a tile always has enough independent sums to keep the FMA units busy.
template <int R>
constexpr int tile_cols() {
#if defined(__AVX512F__)
  constexpr int table[kR + 1] = {0, 12, 8, 6, 6};  // 25 .. 31 of 32 registers
#else
  constexpr int table[kR + 1] = {0, 6, 4, 3, 3};  // 13 .. 16 of 16 registers
#endif
  return table[R];
}

// out [R, ldo] = R rows of x against w's cols rows: tiles of C columns, the last cols % C in one
// narrower tile.
template <int R, int C>
inline void dot_rows(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t cols, int64_t K, float* out,
                     int64_t ldo, bool prefetch) {
  int64_t c0 = 0;
  for (; c0 + C <= cols; c0 += C) dot_tile<R, C>(x, ldx, w + c0 * ldw, ldw, K, out + c0, ldo, prefetch);
  if constexpr (C > 1)
    if (c0 < cols) dot_rows<R, C - 1>(x, ldx, w + c0 * ldw, ldw, cols - c0, K, out + c0, ldo, prefetch);
}

// out [rows, ldo] = x [rows, K] @ w [cols, K]^T in tiles of kR rows, the last rows % kR in one tile.
// Every dot product is summed the same way in any tile (see the header), so the tiling is free to
// follow the row count.
inline void dots(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int64_t cols, int64_t K,
                 float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += kR) {
    const float* xr = x + r0 * ldx;
    float* o = out + r0 * ldo;
    const bool first = r0 == 0;  // the first row tile reads the weights from memory, the others from cache
    switch (std::min<int64_t>(kR, rows - r0)) {
      case 1: dot_rows<1, tile_cols<1>()>(xr, ldx, w, ldw, cols, K, o, ldo, first); break;
      case 2: dot_rows<2, tile_cols<2>()>(xr, ldx, w, ldw, cols, K, o, ldo, first); break;
      case 3: dot_rows<3, tile_cols<3>()>(xr, ldx, w, ldw, cols, K, o, ldo, first); break;
      default: dot_rows<4, tile_cols<4>()>(xr, ldx, w, ldw, cols, K, o, ldo, first); break;
    }
  }
}
static_assert(kR == 4, "dots' cases");

template <typename T>
inline float rnd(float v) {  // rounded as a torch op with T output rounds
  if constexpr (std::is_same_v<T, float>) return v;
  else return static_cast<float>(static_cast<T>(v));
}

// n values of T -> float32 at dst, zeros up to padded.
template <typename T>
inline void to_float(const T* src, int64_t n, float* dst, int64_t padded) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {  // a bf16 is the upper half of a float
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &bits, 4);
    }
  }
  std::fill(dst + n, dst + padded, 0.f);
}

inline int64_t pad(int64_t n) { return (n + kW - 1) / kW * kW; }

struct Unit {
  int32_t expert;
  int32_t tile;
};

// Runs fn(unit) for every unit, split among the threads into contiguous ranges of about equal
// cost(unit); in the calling thread when the whole is small.
template <typename Cost, typename Fn>
void run_units(const std::vector<Unit>& units, Cost cost, Fn fn) {
  const int64_t n = static_cast<int64_t>(units.size());
  std::vector<int64_t> cum(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) cum[i + 1] = cum[i] + cost(units[i]);
  const int64_t parts = cum[n] < kParallelMacs ? 1 : std::min<int64_t>(n, at::get_num_threads());
  if (parts <= 1) {
    for (const Unit& u : units) fn(u);
    return;
  }
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  for (int64_t p = 1; p < parts; ++p)
    bounds[p] = std::lower_bound(cum.begin(), cum.end(), cum[n] * p / parts) - cum.begin();
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = bounds[p]; i < bounds[p + 1]; ++i) fn(units[i]);
  });
}

template <typename T>
void moe_chunk(const T* x, const T* w13, const T* w2, const int32_t* ids, const float* weights, int64_t T_, int64_t k,
               int64_t E, int64_t H, int64_t I, T* out) {
  const int64_t A = T_ * k, Hp = pad(H), Ip = pad(I);
  // Counting sort of the assignments by expert (token order kept within an expert).
  std::vector<int64_t> start(E + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) ++start[ids[a] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) order[next[ids[a]]++] = a;
  }
  std::vector<float> xs(A * Hp), act(A * Ip), y(A * H);
  at::parallel_for(0, A, 16, [&](int64_t a0, int64_t a1) {
    for (int64_t i = a0; i < a1; ++i) to_float(x + order[i] / k * H, H, xs.data() + i * Hp, Hp);
  });
  // Weights used in place when they already are float32 rows of a padded length; else converted per unit.
  const bool direct = std::is_same_v<T, float> && H % kW == 0 && I % kW == 0;
  auto rows_of = [&](int32_t e) { return start[e + 1] - start[e]; };

  std::vector<Unit> up_units, down_units;
  for (int32_t e = 0; e < E; ++e) {
    if (rows_of(e) == 0) continue;
    for (int32_t t = 0; t < (I + kCols - 1) / kCols; ++t) up_units.push_back({e, t});
    for (int32_t t = 0; t < (H + kCols - 1) / kCols; ++t) down_units.push_back({e, t});
  }

  // 1. act[rows of e][n0, n1) = silu(gate) * up.
  run_units(up_units, [&](Unit u) { return (rows_of(u.expert) + kReadCost) * 2 * kCols * H; }, [&](Unit u) {
    thread_local std::vector<float> wbuf, gu;
    const int64_t e = u.expert, n0 = u.tile * kCols, nc = std::min<int64_t>(kCols, I - n0), rows = rows_of(u.expert);
    const T* gate = w13 + (e * 2 * I + n0) * H;
    const T* up = gate + I * H;
    const float *gw, *uw;
    if (direct) {
      gw = reinterpret_cast<const float*>(gate);
      uw = reinterpret_cast<const float*>(up);
    } else {
      wbuf.resize(2 * kCols * Hp);
      for (int64_t c = 0; c < nc; ++c) {
        to_float(gate + c * H, H, wbuf.data() + c * Hp, Hp);
        to_float(up + c * H, H, wbuf.data() + (kCols + c) * Hp, Hp);
      }
      gw = wbuf.data();
      uw = wbuf.data() + kCols * Hp;
    }
    gu.resize(2 * rows * kCols);
    const float* xe = xs.data() + start[e] * Hp;
    dots(xe, Hp, rows, gw, Hp, nc, Hp, gu.data(), kCols);
    dots(xe, Hp, rows, uw, Hp, nc, Hp, gu.data() + rows * kCols, kCols);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = act.data() + (start[e] + r) * Ip + n0;
      for (int64_t c = 0; c < nc; ++c) {
        const float g = rnd<T>(gu[r * kCols + c]), v = rnd<T>(gu[(rows + r) * kCols + c]);
        dst[c] = rnd<T>(rnd<T>(g / (1.f + std::exp(-g))) * v);
      }
      if (n0 + nc == I) std::fill(dst + nc, dst - n0 + Ip, 0.f);  // the padding the down pass reads
    }
  });

  // 2. y[assignment][n0, n1) = act row . down rows.
  run_units(down_units, [&](Unit u) { return (rows_of(u.expert) + kReadCost) * kCols * I; }, [&](Unit u) {
    thread_local std::vector<float> wbuf, yt;
    const int64_t e = u.expert, n0 = u.tile * kCols, nc = std::min<int64_t>(kCols, H - n0), rows = rows_of(u.expert);
    const T* down = w2 + (e * H + n0) * I;
    const float* dw;
    if (direct) {
      dw = reinterpret_cast<const float*>(down);
    } else {
      wbuf.resize(kCols * Ip);
      for (int64_t c = 0; c < nc; ++c) to_float(down + c * I, I, wbuf.data() + c * Ip, Ip);
      dw = wbuf.data();
    }
    yt.resize(rows * kCols);
    dots(act.data() + start[e] * Ip, Ip, rows, dw, Ip, nc, Ip, yt.data(), kCols);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = y.data() + order[start[e] + r] * H + n0;
      for (int64_t c = 0; c < nc; ++c) dst[c] = rnd<T>(yt[r * kCols + c]);
    }
  });

  // 3. out[t] = sum over slots j, in order, of weights[t, j] * y[t * k + j].
  at::parallel_for(0, T_, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights[t * k + j];
        const float* yr = y.data() + (t * k + j) * H;
        for (int64_t n = 0; n < H; ++n) acc[n] += w * yr[n];
      }
      for (int64_t n = 0; n < H; ++n) out[t * H + n] = static_cast<T>(acc[n]);
    }
  });
}

}  // namespace

// x [T, H] float32 or bf16; w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
// w2 [E, H, I] in x's dtype; topk_ids [T, k] int32 in [0, E); topk_weights [T, k] float32.
// Returns [T, H] in x's dtype.
at::Tensor moe_experts(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_ids,
                          at::Tensor topk_weights) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && topk_ids.dim() == 2 && topk_weights.dim() == 2,
              "moe_experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids and topk_weights [T, k]");
  const int64_t T_ = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) / 2, k = topk_ids.size(1);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "moe_experts: weight shapes do not match x's hidden size");
  TORCH_CHECK(topk_ids.size(0) == T_ && topk_weights.size(0) == T_ && topk_weights.size(1) == k,
              "moe_experts: topk_ids and topk_weights must be [T, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "moe_experts: float32 or bf16 x");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "moe_experts: the weights must be in x's dtype");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_weights.scalar_type() == at::kFloat,
              "moe_experts: int32 topk_ids and float32 topk_weights");
  const auto xc = x.contiguous(), g = w13.contiguous(), d = w2.contiguous();
  const auto ic = topk_ids.contiguous(), wc = topk_weights.contiguous();
  const int32_t* ids = ic.data_ptr<int32_t>();
  for (int64_t i = 0; i < T_ * k; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "moe_experts: expert id ", ids[i], " out of range [0, ", E, ")");
  auto out = tm_cpu::empty({T_, H}, x.options());
  if (T_ == 0) return out;
  // Tokens per chunk: the float32 buffers (rows, activations, results) within kBufferBytes.
  const int64_t per_token = k * (pad(H) + pad(I) + H) * static_cast<int64_t>(sizeof(float));
  const int64_t chunk = std::max<int64_t>(1, kBufferBytes / per_token);
  AT_DISPATCH_SWITCH(x.scalar_type(), "moe_experts",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      for (int64_t t0 = 0; t0 < T_; t0 += chunk)
        moe_chunk<float>(xc.data_ptr<float>() + t0 * H, g.data_ptr<float>(), d.data_ptr<float>(), ids + t0 * k,
                         wc.data_ptr<float>() + t0 * k, std::min(chunk, T_ - t0), k, E, H, I,
                         out.data_ptr<float>() + t0 * H);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B = c10::BFloat16;
      for (int64_t t0 = 0; t0 < T_; t0 += chunk)
        moe_chunk<B>(xc.data_ptr<B>() + t0 * H, g.data_ptr<B>(), d.data_ptr<B>(), ids + t0 * k,
                     wc.data_ptr<float>() + t0 * k, std::min(chunk, T_ - t0), k, E, H, I, out.data_ptr<B>() + t0 * H);
    }));
  return out;
}
