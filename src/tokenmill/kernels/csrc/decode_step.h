// The fused decode step (decode_step.cpp) as bindings.cpp sees it. decode_step.cpp is compiled
// once per ISA level and bindings.cpp once for all of them (kernels/build.py), so the bindings
// reach the step through this abstract class: no member whose layout depends on the ISA macros.
#pragma once

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "torch_lite.h"

namespace tm_cpu {

// A linear layer as Python hands it over: (weight, scales or None, bits, bias or None).
// bits kBitsW8A8: a W8A8Linear's (packed, w_scale, kBitsW8A8, float32 bias or None).
using LinearSpec = std::tuple<at::Tensor, c10::optional<at::Tensor>, int64_t, c10::optional<at::Tensor>>;
// One adapted linear's LoRA buffers: (A, Bt, ranks, slice_bounds), as lora.h describes them.
using LoraSpec = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

class FusedDecoderApi {
 public:
  virtual ~FusedDecoderApi() = default;
  virtual at::Tensor forward(at::Tensor ids, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor logits_rows, c10::optional<at::Tensor> query_start_loc,
                             c10::optional<at::Tensor> row_slots) = 0;
  virtual void set_tensor_parallel(at::Tensor slots, at::Tensor words, int64_t rank, int64_t world,
                                   int64_t spin_ns) = 0;
  virtual std::tuple<int64_t, int64_t, int64_t, int64_t> take_wait_stats() = 0;
  virtual void set_lora(std::vector<c10::optional<LoraSpec>> specs) = 0;
  virtual void clear_lora() = 0;
  virtual int64_t spin_ns() const = 0;
  virtual void set_spin_ns(int64_t ns) = 0;

  int64_t tp_seq_ = 0;         // the next all-reduce's sequence number, less one
  bool adaptive_spin_ = true;  // StepBarrier's adaptive budget (off: always spin_ns)
  bool count_waits_ = false;   // keep the barrier's wait statistics (benchmarks)
};

// Whether this build has the fused step (AVX512-BF16, or AVX2 + FMA); make_fused_decoder and
// barrier_next_spin_budget throw where it has not.
bool fused_decoder_built();
std::unique_ptr<FusedDecoderApi> make_fused_decoder(
    at::Tensor embed, c10::optional<at::Tensor> embed_scales, int64_t embed_bits, std::vector<at::Tensor> norms,
    std::vector<LinearSpec> linears, std::vector<at::Tensor> kv_caches, at::Tensor cos, at::Tensor sin, int64_t heads,
    int64_t kv_heads, int64_t head_dim, int64_t intermediate, int64_t vocab_size, double eps, int64_t block_size,
    double scale, std::vector<at::Tensor> kv_scales);
int64_t barrier_next_spin_budget(int64_t budget, int64_t max_spin_ns, int64_t waited_ns);

}  // namespace tm_cpu
