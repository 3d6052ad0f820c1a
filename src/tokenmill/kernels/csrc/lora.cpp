// Multi-LoRA as one op: y += each row's adapter delta, in place (the row kernels: lora.h).
//
// Two passes on ATen's thread pool: the rows' h (shrink, tiles of rows of one slot), then the
// deltas (expand, tiles x column chunks). Small calls (a decode step's few rows) run in the
// calling thread: their few microseconds of work cost less than waking the pool twice.
#include "torch_lite.h"

#include <cstdint>
#include <vector>

#include "lora.h"

namespace {

using namespace tm_cpu;

constexpr int64_t kParallelMacs = 1 << 18;  // work a pool thread should get at least (multiply-adds)
constexpr int64_t kByteCost = 2;            // the work of reading a byte of adapter weights from memory
constexpr int64_t kExpandCols = 256;        // columns per expand work item

int64_t grain(int64_t items, int64_t work) {  // items per thread: at least kParallelMacs of work each
  const int64_t per_item = std::max<int64_t>(1, work / std::max<int64_t>(1, items));
  return std::max<int64_t>(1, kParallelMacs / per_item);
}

template <typename T>
void run(const LoraWeights<T>& w, const int32_t* row_slots, int64_t M, const T* x, int64_t ldx, T* y, int64_t ldy) {
  const LoraBatch batch = lora_batch(row_slots, M);
  if (batch.empty()) return;
  const int64_t ldh = std::max<int64_t>(1, w.h_size()), n_tiles = static_cast<int64_t>(batch.tiles.size());
  std::vector<float> h(batch.rows.size() * ldh);
  // The passes' work: multiply-adds, and each slot's weights read once (from memory, likely).
  int64_t shrink_work = 0, expand_work = 0;
  for (int64_t t = 0; t < n_tiles; ++t) {
    const LoraTile& tile = batch.tiles[t];
    const bool first = t == 0 || batch.tiles[t - 1].slot != tile.slot;  // reads the slot's weights
    const int64_t rows = tile.end - tile.begin + (first ? kByteCost * static_cast<int64_t>(sizeof(T)) : 0);
    for (int64_t i = 0; i < w.n_slices; ++i) {
      shrink_work += rows * w.rank(tile.slot, i) * w.K;
      expand_work += rows * w.rank(tile.slot, i) * (w.bounds[i + 1] - w.bounds[i]);
    }
  }
  at::parallel_for(0, n_tiles, grain(n_tiles, shrink_work), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) lora_shrink_tile(w, batch, batch.tiles[t], x, ldx, h.data(), ldh);
  });
  const int64_t chunks = (w.N + kExpandCols - 1) / kExpandCols, items = n_tiles * chunks;
  at::parallel_for(0, items, grain(items, expand_work), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c0 = (i % chunks) * kExpandCols;
      lora_expand_tile(w, batch, batch.tiles[i / chunks], h.data(), ldh, y, ldy, c0, std::min(w.N, c0 + kExpandCols));
    }
  });
}

}  // namespace

// y [M, N] += each row's LoRA delta (rows with slot -1 untouched), in place; see lora.h.
void lora_add(at::Tensor y, at::Tensor x, at::Tensor A, at::Tensor Bt, at::Tensor ranks,
              at::Tensor slice_bounds, at::Tensor row_slots) {
  const auto dt = A.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "lora_add: A must be float32 or bfloat16");
  TORCH_CHECK(Bt.scalar_type() == dt && x.scalar_type() == dt && y.scalar_type() == dt,
              "lora_add: x, y, A and Bt must have the same dtype");
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && A.device().is_cpu() && Bt.device().is_cpu() &&
                  ranks.device().is_cpu() && slice_bounds.device().is_cpu() && row_slots.device().is_cpu(),
              "lora_add: CPU tensors");
  TORCH_CHECK(A.dim() == 4 && A.is_contiguous(), "lora_add: A must be contiguous [slots, n_slices, r_max, K]");
  const int64_t S = A.size(0), ns = A.size(1), r_max = A.size(2), K = A.size(3);
  TORCH_CHECK(Bt.dim() == 3 && Bt.is_contiguous() && Bt.size(0) == S && Bt.size(1) == r_max,
              "lora_add: Bt must be contiguous [slots, r_max, N] (A is [", S, ", ", ns, ", ", r_max, ", ", K, "])");
  const int64_t N = Bt.size(2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "lora_add: x must be [M, K] with K = ", K);
  const int64_t M = x.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.stride(1) == 1 && y.stride(0) >= N,
              "lora_add: y must be [M, N] = [", M, ", ", N, "] with unit column stride");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.dim() == 2 && ranks.size(0) == S &&
                  ranks.size(1) == ns,
              "lora_add: ranks must be contiguous int32 [slots, n_slices] = [", S, ", ", ns, "]");
  TORCH_CHECK(slice_bounds.scalar_type() == at::kLong && slice_bounds.is_contiguous() && slice_bounds.dim() == 1 &&
                  slice_bounds.numel() == ns + 1, "lora_add: slice_bounds must be int64 [n_slices + 1]");
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous() && row_slots.dim() == 1 &&
                  row_slots.numel() == M, "lora_add: row_slots must be contiguous int32 [M]");
  const int64_t* bounds = slice_bounds.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] >= 0 && bounds[ns] <= N, "lora_add: slice_bounds must lie in [0, N]");
  for (int64_t i = 0; i < ns; ++i) TORCH_CHECK(bounds[i] <= bounds[i + 1], "lora_add: slice_bounds must not decrease");
  const int32_t* rk = ranks.data_ptr<int32_t>();
  for (int64_t i = 0; i < S * ns; ++i)
    TORCH_CHECK(rk[i] >= 0 && rk[i] <= r_max, "lora_add: ranks must lie in [0, r_max]");
  const int32_t* rs = row_slots.data_ptr<int32_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(rs[m] >= -1 && rs[m] < S, "lora_add: row_slots[", m, "] = ", rs[m], " is not -1 or a slot in [0, ", S,
                ")");
  const auto xc = x.contiguous();
  if (dt == at::kFloat) {
    const LoraWeights<float> w{A.data_ptr<float>(), Bt.data_ptr<float>(), rk, bounds, S, ns, r_max, K, N};
    run(w, rs, M, xc.data_ptr<float>(), K, y.data_ptr<float>(), y.stride(0));
  } else {
    using BF16 = c10::BFloat16;
    const LoraWeights<BF16> w{A.data_ptr<BF16>(), Bt.data_ptr<BF16>(), rk, bounds, S, ns, r_max, K, N};
    run(w, rs, M, xc.data_ptr<BF16>(), K, y.data_ptr<BF16>(), y.stride(0));
  }
}
