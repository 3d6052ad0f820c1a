// The fused decode step: a whole forward pass of a Llama-family model (embedding, every layer,
// final norm, LM head) for a small batch of decode tokens, or of a few query rows per sequence
// (speculative verification chunks, short prompt chunks: the rows kernel's varlen view), in ONE
// OpenMP parallel region.
//
// Batch-1 decode reads every weight once per token, so it is bound by memory bandwidth. Run as
// ~300 separate ops per step (each a fork/join of the thread pool, with Python between them),
// the weight stream stalls at every op boundary: 30 layers of SmolLM2's linears as 120 kernel
// calls stream ~25-30 GB/s where the same kernel in one region streams ~37 (2 cores).
// Here each thread runs its share of every stage and the threads meet at a barrier where a
// stage needs the whole of the previous one's output (StepBarrier: spins, then sleeps,
// so that the step slows in proportion, not collapses, when other processes take cores):
//
//   per layer: [norm] qkv | rope + cache write (| when sequences are split or have several
//              rows) attention (| merge of split sequences) | o_proj | [add + norm] gate_up + silu | down |
//   then:      [add + norm] lm_head rows
//
// Stages in [brackets] are tiny per-row element-wise work that every thread does redundantly
// on its own copy of the residual stream (cheaper than a barrier). Every stage calls the same
// row / tile kernels as the separate ops (linear.h, elementwise.h, paged_decode.h) and splits
// its work the same way, so logits equal the unfused model's bit for bit. bfloat16 activations,
// bf16 weights in panels, int4 / int8 weights or W8A8 (int8 weights on per-token int8 activations), a bf16, int8 or float8 e4m3 KV cache (the quantized
// ones written row by row as write_scaled_cache writes them, read by the same attention kernels).
#include "torch_lite.h"
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
#include <cstdint>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#endif
#include <tuple>
#include <vector>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>  // _mm_pause
#endif

#include "decode_step.h"
#include "elementwise.h"
#include "linear.h"
#include "lora.h"
#include "paged_decode.h"
#include "shm_allreduce.h"
#include "w8a8.h"

#if TM_PANEL_KERNEL

namespace {

using namespace tm_cpu;
using BF16 = c10::BFloat16;

constexpr int64_t kBitsW8A8 = 88;  // fused_decode.py's W8A8_BITS

struct Linear {
  LinearWeights w;
  const BF16* bias = nullptr;
  bool w8a8 = false;
  W8A8Weights w8;  // w8a8: int8 panels of 16 outputs on per-token int8 activations (w8a8.h)
  std::vector<at::Tensor> keep;  // the tensors the pointers point into
  int64_t unit_rows() const { return w8a8 ? kW8A8Panel : w.unit_rows(); }
  int64_t units() const { return w8a8 ? w8.units() : w.units(); }
};

// A thread's quantized activation rows for the W8A8 linears, sized once per step (nothing inside
// the parallel region allocates).
struct W8A8Acts {
  std::vector<uint8_t> q;
  std::vector<float> sx;
  std::vector<int32_t> zx;
};

// A linear's M input rows as its kernel reads them: W8A8 and int4 / int8 panels quantize them,
// each thread itself (as the op does), once per linear (gate_up's two halves share them).
struct LinearInput {
  const BF16* x;
  int64_t M;
  A8Rows a8;  // int4 / int8 panels: the rows in int8 per group (this thread's buffers; none on AMX tiles)
};

inline LinearInput prepare_input(const Linear& lin, const BF16* x, int64_t M, W8A8Acts& acts) {
  if (lin.w8a8) w8a8_quantize_rows(x, M, lin.w8.K, acts.q.data(), acts.sx.data(), acts.zx.data());
#if TM_QUANT_PANELS
  else if (lin.w.panels && !quant_panels_amx(M)) return {x, M, quantize_a8_rows(x, M, lin.w.K)};
#endif
  return {x, M, {}};
}

// Units [u0, u1) of a linear. A W8A8 linear's output rows are N apart (every linear of the step
// writes whole rows).
inline void run_units(const Linear& lin, const LinearInput& in, int64_t u0, int64_t u1, BF16* out, int64_t ldo,
                      const W8A8Acts& acts) {
  if (lin.w8a8) return w8a8_units(lin.w8, acts.q.data(), acts.sx.data(), acts.zx.data(), in.M, u0, u1, out);
#if TM_QUANT_PANELS
  if (lin.w.panels && in.a8.q != nullptr) return quant_panel_units(in.a8, in.M, lin.w, u0, u1, out, ldo, lin.bias);
#endif
  linear_units(in.x, in.M, lin.w, u0, u1, out, ldo, lin.bias);
}

Linear make_w8a8_linear(const LinearSpec& spec, int64_t in_features, int64_t out_features, const char* name) {
  const auto& [packed, scales, bits, bias] = spec;
  const int64_t N = out_features, K = in_features, Kp = w8a8_padded_k(K);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == (N + kW8A8Panel - 1) / kW8A8Panel && packed.size(1) * 4 == Kp &&
                  packed.size(2) == kW8A8Panel && packed.size(3) == 4,
              name, ": W8A8 weight packed int8 [ceil(out / 16), ceil(in / 4), 16, 4]");
  TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                  scales->numel() == N, name, ": W8A8 float32 scales [out]");
  Linear lin;
  lin.w8a8 = true;
  lin.w.bits = static_cast<int>(bits);
  lin.w.N = N;
  lin.w.K = K;
  // sum of each row's q (the zero point's correction), from the packed panels
  auto rowsum = packed.view({packed.size(0), packed.size(1), kW8A8Panel, 4}).sum({1, 3}).to(at::kInt)
                    .reshape({-1}).slice(0, 0, N).contiguous();
  lin.w8 = W8A8Weights{packed.data_ptr<int8_t>(), scales->data_ptr<float>(), rowsum.data_ptr<int32_t>(), nullptr, N, K};
  lin.keep = {packed, *scales, rowsum};
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, name,
                ": W8A8 float32 bias");
    lin.w8.bias = bias->data_ptr<float>();
    lin.keep.push_back(*bias);
  }
  return lin;
}

// bf16 weights are panels, except a plain [rows, hidden] embedding table (`plain_ok`).
Linear make_linear(const LinearSpec& spec, int64_t in_features, int64_t out_features, const char* name,
                   bool plain_ok = false) {
  const auto& [weight, scales, bits, bias] = spec;
  if (bits == kBitsW8A8) return make_w8a8_linear(spec, in_features, out_features, name);
  TORCH_CHECK(bits != 16 || weight.dim() == 4 || plain_ok, name, ": bf16 linears must be panels");
  const bool quant_panels = bits != 16 && weight.dim() == 4;  // quant_panels.cpp
  TORCH_CHECK(!quant_panels || TM_QUANT_PANELS, name, ": quantized panels need a build with AVX2 + FMA + F16C");
  if (bits == 16 && weight.dim() == 4) {  // panels
    TORCH_CHECK(weight.is_contiguous() && weight.size(0) * kPanelRows >= out_features && weight.size(1) * 2 == in_features &&
                    weight.size(2) == kPanelRows, name, ": bf16 panels [ceil(out / 32), in / 2, 32, 2]");
  } else if (quant_panels) {
    TORCH_CHECK(weight.is_contiguous() && weight.size(0) * kPanelRows >= out_features &&
                    weight.size(1) * kGroup == in_features && weight.size(2) == kGroup &&
                    weight.size(3) == (bits == 4 ? 16 : 32) && scales.has_value() &&
                    scales->numel() == weight.size(0) * weight.size(1) * (bits == 4 ? 64 : 32),
                name, ": quantized panels [ceil(out / 32), in / 32, 32, 16 or 32] and their scales");
  } else {
    TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2 && weight.size(0) == out_features, name,
                ": a contiguous [out, in] weight");
  }
  TORCH_CHECK(in_features % kGroup == 0, name, ": in_features must be a multiple of 32");
  Linear lin;
  lin.w.bits = static_cast<int>(bits);
  lin.w.panels = quant_panels;
  lin.w.data = weight.data_ptr();
  lin.w.N = out_features;
  lin.w.K = in_features;
  lin.keep.push_back(weight);
  if (bits == 16) {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, name, ": bf16 weight");
  } else {
    TORCH_CHECK(bits == 4 || bits == 8, name, ": bits must be 4, 8 or 16");
    TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kHalf && scales->is_contiguous() &&
                    (quant_panels || (scales->numel() == out_features * (in_features / kGroup) * (bits == 4 ? 2 : 1) &&
                                      weight.size(1) == (bits == 4 ? in_features / 2 : in_features))),
                name, ": quantized weight / scales shapes");
    lin.w.scales = scales->data_ptr<at::Half>();
    lin.keep.push_back(*scales);
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features, name,
                ": bf16 bias");
    lin.bias = bias->data_ptr<BF16>();
    lin.keep.push_back(*bias);
  }
  return lin;
}

// A linear's multi-LoRA buffers as Python hands them over: (A, Bt, ranks, slice_bounds), see lora.h.

struct LoraTarget {
  at::Tensor A, Bt, ranks;  // kept alive; Python rewrites their contents in place
  std::vector<int64_t> bounds;
  LoraWeights<BF16> w;  // pointers into the above
};

std::unique_ptr<LoraTarget> make_lora(const LoraSpec& spec, const LinearWeights& lin, const char* name) {
  const auto& [A, Bt, ranks, bounds] = spec;
  TORCH_CHECK(A.scalar_type() == at::kBFloat16 && Bt.scalar_type() == at::kBFloat16, "set_lora: ", name,
              ": A and Bt must be bfloat16");
  TORCH_CHECK(A.dim() == 4 && A.is_contiguous() && A.size(0) > 0 && A.size(3) == lin.K, "set_lora: ", name,
              ": A must be contiguous [slots, n_slices, r_max, ", lin.K, "]");
  const int64_t S = A.size(0), ns = A.size(1), r_max = A.size(2);
  TORCH_CHECK(Bt.dim() == 3 && Bt.is_contiguous() && Bt.size(0) == S && Bt.size(1) == r_max && Bt.size(2) == lin.N,
              "set_lora: ", name, ": Bt must be contiguous [", S, ", ", r_max, ", ", lin.N, "]");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.dim() == 2 && ranks.size(0) == S &&
                  ranks.size(1) == ns, "set_lora: ", name, ": ranks must be contiguous int32 [", S, ", ", ns, "]");
  TORCH_CHECK(bounds.scalar_type() == at::kLong && bounds.dim() == 1 && bounds.numel() == ns + 1, "set_lora: ", name,
              ": slice_bounds must be int64 [n_slices + 1]");
  const auto b = bounds.contiguous();
  auto lt = std::make_unique<LoraTarget>();
  lt->A = A, lt->Bt = Bt, lt->ranks = ranks;
  lt->bounds.assign(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + ns + 1);
  TORCH_CHECK(lt->bounds[0] >= 0 && lt->bounds[ns] <= lin.N, "set_lora: ", name, ": slice_bounds must lie in [0, ",
              lin.N, "]");
  for (int64_t i = 0; i < ns; ++i)
    TORCH_CHECK(lt->bounds[i] <= lt->bounds[i + 1], "set_lora: ", name, ": slice_bounds must not decrease");
  lt->w = {A.data_ptr<BF16>(), Bt.data_ptr<BF16>(), ranks.data_ptr<int32_t>(), lt->bounds.data(), S, ns, r_max, lin.K,
           lin.N};
  return lt;
}

// A barrier for the threads of one parallel region that degrades gracefully when the machine is
// oversubscribed (other processes busy, a container's CPU quota, more threads than free cores).
//
// `#pragma omp barrier` under libgomp's default wait policy spins up to GOMP_SPINCOUNT = 300,000
// pause instructions (~8 ms on this AMD EPYC) before it sleeps. When every thread has a core of
// its own, a barrier's wait is microseconds and spinning is the fastest way to wait (sleeping
// costs a futex wake and, in a VM, waking a halted vCPU: a step whose barriers all sleep took
// 13.0 ms against 9.3 spinning). When a thread is descheduled, the others spin through their
// time slices for it, and a spinner that shares a CPU with the late thread keeps it off that CPU
// until the scheduler's tick: with one busy process beside it on 2 cores, or other processes
// using one core, the step's ~190 barriers cost a time slice each and TPOT went from ~9 to
// 24-80 ms.
//
// Here a waiting thread
// - sleeps at once (futex) when a thread still to come was last seen on its own CPU: that
//   thread cannot be running, and needs this CPU (the scheduler separates them again when it
//   wakes the sleeper, onto an idle CPU if there is one);
// - else spins up to its budget, then sleeps. The budget (per thread, kept across steps) starts
//   at `max_spin_ns`, is cut to a quarter (not below 2 us) each time a spin runs out and the
//   whole wait then lasts 0.5 ms or more (the late thread was descheduled: spinning for it only
//   delays the scheduler from moving it here), raised to twice the wait (up to `max_spin_ns`)
//   when the whole wait was shorter, and doubles (+1 us) each time the others come in while it
//   spins. So a quiet machine spins as libgomp would (its waits are short), and a busy one stops
//   spinning after a few failed waits. (Cutting the budget on every failed spin trapped steps in
//   sleeping: a sleeper wakes 50-100 us late, so the thread that woke it waits that long at the
//   next barrier, fails its spin and sleeps too; int4 batch-1 steps went from ~5 to ~20 ms, and a
//   whole `bench roofline` run stayed there.)
//
// Measured (benchmarks/contention.py, medians of 5 rounds, 2-core AMD EPYC, SmolLM2 bf16): batch-1
// TPOT 8.6 ms quiet; with one busy process beside the engine, 10.3-10.8 ms when libgomp's own
// threads (the torch ops between fused steps) also sleep at once (OMP_WAIT_POLICY=passive) and
// 16.5-17.2 ms when they spin (GOMP_SPINCOUNT 3,000 or libgomp's 300,000): this barrier no
// longer dominates; libgomp's wait policy does (cpu_threads.openmp_wait_defaults).
class StepBarrier {
 public:
  StepBarrier(int threads, int64_t max_spin_ns, bool adaptive)
      : max_spin_ns_(max_spin_ns), adaptive_(adaptive), cpu_(threads) {
    for (auto& c : cpu_) c.store(-1, std::memory_order_relaxed);
  }
  StepBarrier(const StepBarrier&) = delete;
  StepBarrier& operator=(const StepBarrier&) = delete;

  // How this barrier's waits went (summed over its threads; the last one in does not wait).
  struct Stats {
    std::atomic<int64_t> spun{0}, slept_after_spin{0}, slept_at_once{0}, wait_ns{0};
  };

  // Thread t of the region's n threads; all return once the last has come in.
  void wait(int t, int n, Stats* stats = nullptr) {
    if (n <= 1) return;
    const auto t0 = stats ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    struct Count {  // on every way out of a wait
      Stats* st; std::chrono::steady_clock::time_point t0; std::atomic<int64_t>* what = nullptr;
      ~Count() {
        if (!st || !what) return;
        what->fetch_add(1, std::memory_order_relaxed);
        st->wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - t0).count(), std::memory_order_relaxed);
      }
    } count{stats, t0};
    const int my_cpu = current_cpu();
    cpu_[t].store(my_cpu, std::memory_order_relaxed);
    const uint32_t gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {  // the last one in
      arrived_.store(0, std::memory_order_relaxed);  // nobody re-enters before gen_ moves on
      gen_.fetch_add(1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    thread_local int64_t budget = -1;  // this thread's spin budget (ns), across steps
    if (!adaptive_ || budget < 0 || budget > max_spin_ns_) budget = max_spin_ns_;
    bool shares_cpu = false;
    for (int j = 0; j < n && my_cpu >= 0; ++j)
      shares_cpu |= j != t && cpu_[j].load(std::memory_order_relaxed) == my_cpu;
    if (stats) count.what = &stats->slept_at_once;
    std::chrono::steady_clock::time_point spun_from{};
    if (!shares_cpu && budget > 0) {
      spun_from = std::chrono::steady_clock::now();
      if (spin_until_changed(gen, budget)) {
        if (adaptive_) budget = next_spin_budget(budget, max_spin_ns_, -1);
        if (stats) count.what = &stats->spun;
        return;
      }
      if (stats) count.what = &stats->slept_after_spin;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (gen_.load(std::memory_order_seq_cst) == gen) futex(FUTEX_WAIT_PRIVATE, gen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    if (adaptive_ && spun_from != std::chrono::steady_clock::time_point{})
      budget = next_spin_budget(budget, max_spin_ns_, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                          std::chrono::steady_clock::now() - spun_from).count());
  }

  // A thread's next spin budget after a wait that its spin saw end (waited_ns < 0), or that it
  // spun and then slept through, waited_ns in all.
  static int64_t next_spin_budget(int64_t budget, int64_t max_spin_ns, int64_t waited_ns) {
    if (waited_ns < 0) return std::min(max_spin_ns, 2 * budget + 1000);
    if (waited_ns >= kDescheduledNs) return std::max<int64_t>(budget / 4, std::min<int64_t>(kMinSpinNs, max_spin_ns));
    return std::min(max_spin_ns, std::max(budget, 2 * waited_ns));
  }

 private:
  static int current_cpu() {
#if defined(__linux__)
    return sched_getcpu();  // vDSO / rdpid: tens of ns
#else
    return -1;
#endif
  }

  // Spins while gen_ == gen for up to `ns`; true if it moved on meanwhile.
  bool spin_until_changed(uint32_t gen, int64_t ns) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    for (;;) {
      for (int i = 0; i < 32; ++i) {  // ~0.8 us of pauses between clock reads
        if (gen_.load(std::memory_order_acquire) != gen) return true;
#if defined(__x86_64__)
        _mm_pause();
#endif
      }
      if (std::chrono::steady_clock::now() >= deadline) return gen_.load(std::memory_order_acquire) != gen;
    }
  }

  void futex(int op, uint32_t val) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), op, val, nullptr, nullptr, 0);
#else
    (void)op, (void)val;
    std::this_thread::yield();
#endif
  }

  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
  static constexpr int64_t kMinSpinNs = 2000;  // the adaptive budget's floor: room to see a short wait
  // A wait from this long on had a thread descheduled (a scheduler's time slice is milliseconds);
  // a shorter one was the others' work plus this thread's own wake-up (50-100 us in a VM).
  static constexpr int64_t kDescheduledNs = 500000;
  const int64_t max_spin_ns_;
  const bool adaptive_;
  alignas(64) std::atomic<uint32_t> gen_{0};
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::vector<std::atomic<int>> cpu_;  // each thread's CPU when it last came in
};

// This thread's share [begin, end) of n items split evenly over nt threads.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int nt) { return {n * t / nt, n * (t + 1) / nt}; }

}  // namespace

class FusedDecoder final : public FusedDecoderApi {
 public:
  // norms: input and post-attention norm weights of each layer, then the final norm; linears:
  // qkv, o, gate_up, down of each layer, then the LM head; kv_caches: each layer's K and V
  // ([slots, kv_heads, head_dim] views of the cache); cos / sin: [max_position, head_dim].
  FusedDecoder(at::Tensor embed, c10::optional<at::Tensor> embed_scales, int64_t embed_bits,
               std::vector<at::Tensor> norms, std::vector<LinearSpec> linears, std::vector<at::Tensor> kv_caches,
               at::Tensor cos, at::Tensor sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t intermediate, int64_t vocab_size, double eps, int64_t block_size, double scale,
               std::vector<at::Tensor> kv_scales)
      : norms_(std::move(norms)), kv_caches_(std::move(kv_caches)), kv_scales_(std::move(kv_scales)), cos_(cos),
        sin_(sin), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), inter_(intermediate), eps_(static_cast<float>(eps)),
        block_size_(block_size), scale_(static_cast<float>(scale)) {
    layers_ = static_cast<int64_t>(kv_caches_.size()) / 2;
    TORCH_CHECK(layers_ > 0 && static_cast<int64_t>(norms_.size()) == 2 * layers_ + 1 &&
                    static_cast<int64_t>(linears.size()) == 4 * layers_ + 1,
                "FusedDecoder: 2 norms and 4 linears per layer, then the final norm and the LM head");
    hidden_ = norms_[0].numel();
    vocab_ = vocab_size;
    TORCH_CHECK(heads % kv_heads == 0 && decode_head_dim_supported(head_dim), "FusedDecoder: unsupported heads / head_dim");
    TORCH_CHECK(intermediate % kPanelRows == 0, "FusedDecoder: intermediate size must be a multiple of 32");
    for (const auto& n : norms_)
      TORCH_CHECK(n.scalar_type() == at::kBFloat16 && n.is_contiguous() && n.numel() == hidden_, "FusedDecoder: norms");
    scaled_ = scaled_cache(kv_caches_[0]);
    fp8_ = kv_caches_[0].scalar_type() == at::kFloat8_e4m3fn;
    for (const auto& c : kv_caches_)
      TORCH_CHECK(c.scalar_type() == kv_caches_[0].scalar_type() && (scaled_ || c.scalar_type() == at::kBFloat16) &&
                      c.is_contiguous() && c.dim() == 3 && c.size(1) == kv_heads && c.size(2) == head_dim,
                  "FusedDecoder: bf16, int8 or float8_e4m3fn caches [slots, kv_heads, head_dim], all alike");
    TORCH_CHECK(kv_scales_.size() == (scaled_ ? kv_caches_.size() : 0),
                "FusedDecoder: an int8 / float8 cache needs one scale tensor per cache (none for bf16)");
    for (const auto& sc : kv_scales_)
      TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 2 &&
                      sc.size(0) == kv_caches_[0].size(0) && sc.size(1) == kv_heads,
                  "FusedDecoder: float32 cache scales [slots, kv_heads]");
    TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.size(-1) == head_dim, "FusedDecoder: bf16 cos / sin tables");
    const int64_t q_size = heads * head_dim, qkv_size = q_size + 2 * kv_heads * head_dim;
    for (int64_t l = 0; l < layers_; ++l) {
      qkv_.push_back(make_linear(linears[4 * l], hidden_, qkv_size, "qkv_proj"));
      o_.push_back(make_linear(linears[4 * l + 1], q_size, hidden_, "o_proj"));
      gate_up_.push_back(make_linear(linears[4 * l + 2], hidden_, 2 * intermediate, "gate_up_proj"));
      down_.push_back(make_linear(linears[4 * l + 3], intermediate, hidden_, "down_proj"));
    }
    lm_head_ = make_linear(linears.back(), hidden_, vocab_, "lm_head");
    for (const auto* group : {&qkv_, &o_, &gate_up_, &down_})
      for (const auto& lin : *group)
        if (lin.w8a8) w8a8_max_k_ = std::max(w8a8_max_k_, w8a8_padded_k(lin.w8.K));
    TORCH_CHECK(embed.is_contiguous() && (embed.dim() == 2 || (embed.dim() == 4 && embed_bits != 16)),
                "FusedDecoder: a [rows, hidden] (or quantized) embedding table");
    embed_rows_ = embed.dim() == 4 ? vocab_ : embed.size(0);  // quantized panels: the tied LM head's table
    const LinearSpec table{embed, embed_scales, embed_bits, c10::nullopt};
    embed_ = make_linear(table, hidden_, embed_rows_, "embed_tokens", /*plain_ok=*/true);
  }

  // One step of M rows: token ids, positions, KV slots [M] (int64) and the rows that need logits.
  // Without query_start_loc every row is a decode token of its own sequence: block tables
  // [M, max_blocks] and sequence lengths [M] (the new token included), attended by the decode
  // kernel (its keys split over the threads when there are few rows). With query_start_loc
  // [B + 1] the rows are B sequences' chunks (sequence b: rows query_start_loc[b] ..
  // query_start_loc[b + 1] - 1, e.g. the k + 1 rows of a speculative verification), block tables
  // [B, max_blocks] and seq_lens [B] (keys of each sequence's last row), attended causally by the
  // rows kernel (paged_decode.h), each row exactly as a lone decode token at its position.
  // Returns the logits [len(logits_rows), vocab]: float32 values of the bf16 LM head output, as
  // the model's compute_logits gives them.
  at::Tensor forward(at::Tensor ids, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                        at::Tensor seq_lens, at::Tensor logits_rows, c10::optional<at::Tensor> query_start_loc,
                        c10::optional<at::Tensor> row_slots) override {
    const int64_t M = ids.numel(), R = logits_rows.numel();
    const bool by_rows = query_start_loc.has_value();
    for (const auto* t : {&ids, &positions, &slots, &seq_lens, &logits_rows})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "FusedDecoder: int64 vectors");
    const int64_t B = by_rows ? seq_lens.numel() : M;
    TORCH_CHECK(positions.numel() == M && slots.numel() == M && seq_lens.numel() == B && M > 0,
                "FusedDecoder: one position and slot per row, one length per sequence");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                    block_tables.size(0) == B, "FusedDecoder: int64 block tables [sequences, max_blocks]");
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* lrows = logits_rows.data_ptr<int64_t>();
    const int64_t slots_total = kv_caches_[0].size(0), max_pos = cos_.size(0);
    const int64_t* qsl = nullptr;
    if (by_rows) {
      TORCH_CHECK(query_start_loc->scalar_type() == at::kLong && query_start_loc->is_contiguous() &&
                      query_start_loc->numel() == B + 1, "FusedDecoder: int64 query_start_loc [sequences + 1]");
      qsl = query_start_loc->data_ptr<int64_t>();
      TORCH_CHECK(qsl[0] == 0 && qsl[B] == M, "FusedDecoder: query_start_loc must run from 0 to the number of rows");
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(qsl[b + 1] > qsl[b] && lens[b] >= qsl[b + 1] - qsl[b] && lens[b] <= block_tables.size(1) * block_size_,
                    "FusedDecoder: position / slot / length");
    }
    for (int64_t m = 0; m < M; ++m) {  // nothing inside the parallel region may throw
      TORCH_CHECK(id[m] >= 0 && id[m] < embed_rows_, "FusedDecoder: token id out of range");
      TORCH_CHECK(pos[m] >= 0 && pos[m] < max_pos && slot[m] >= 0 && slot[m] < slots_total, "FusedDecoder: position / slot / length");
      TORCH_CHECK(by_rows || (lens[m] >= 1 && lens[m] <= block_tables.size(1) * block_size_),
                  "FusedDecoder: position / slot / length");
    }
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(lrows[r] >= 0 && lrows[r] < M, "FusedDecoder: logits row");
    const LoraBatch lora = row_slots.has_value() ? lora_batch_of(*row_slots, M) : LoraBatch{};

    const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, I = inter_, hid = hidden_;
    const int64_t qkv_w = (H + 2 * Hkv) * D;
    const int nt = at::get_num_threads();
    TORCH_CHECK(!tp_ || M * hid <= tp_args_.capacity, "FusedDecoder: the all-reduce buffer is too small");
    std::atomic<bool> aborted{false};  // a tensor-parallel all-reduce gave up (another rank died)
    int64_t seq = tp_seq_;             // the all-reduces' sequence numbers (thread 0's)
    const int64_t S = by_rows ? 1 : decode_splits(lens, M, block_size_, nt);
    // The rows kernel's work items, each layer's handed out in turn (a counter per layer).
    const std::vector<RowsItem> items = by_rows ? rows_items(qsl, lens, B, kv_heads_, nt) : std::vector<RowsItem>{};
    const int64_t n_items = static_cast<int64_t>(items.size());
    // When each item holds all of its sequence's rows (decode rows, short chunks), the item
    // rotates and caches its own kv heads' rows before attending them: no thread waits for
    // another's cache writes (one barrier less per layer, and those writes spread over threads).
    const bool items_cache = by_rows && std::all_of(items.begin(), items.end(), [&](const RowsItem& it) {
                               return it.r0 == 0 && it.r1 == qsl[it.b + 1] - qsl[it.b];
                             });
    std::unique_ptr<std::atomic<int64_t>[]> next_item(new std::atomic<int64_t>[by_rows ? layers_ : 0]);
    for (int64_t l = 0; by_rows && l < layers_; ++l) next_item[l].store(0, std::memory_order_relaxed);
    auto bf = at::TensorOptions().dtype(at::kBFloat16);
    auto qkv = tm_cpu::empty({M, qkv_w}, bf), q = tm_cpu::empty({M, H * D}, bf), attn = tm_cpu::empty({M, H * D}, bf);
    auto o = tm_cpu::empty({M, hid}, bf), gu = tm_cpu::empty({M, 2 * I}, bf), act = tm_cpu::empty({M, I}, bf);
    auto down = tm_cpu::empty({M, hid}, bf), logits = tm_cpu::empty({R, vocab_}, bf);
    auto logits_f32 = tm_cpu::empty({R, vocab_}, at::TensorOptions().dtype(at::kFloat));
    BF16* logits_b = logits.data_ptr<BF16>();
    float* logits_f = logits_f32.data_ptr<float>();
    std::vector<float> part_ml(S > 1 ? M * S * H * 2 : 0), part_acc(S > 1 ? M * S * H * D : 0);
    BF16* qkv_p = qkv.data_ptr<BF16>();
    BF16* q_p = q.data_ptr<BF16>();
    BF16* attn_p = attn.data_ptr<BF16>();
    BF16* o_p = o.data_ptr<BF16>();
    BF16* gu_p = gu.data_ptr<BF16>();
    BF16* act_p = act.data_ptr<BF16>();
    BF16* down_p = down.data_ptr<BF16>();
    const BF16* cos = cos_.data_ptr<BF16>();
    const BF16* sin = sin_.data_ptr<BF16>();
    StepBarrier barrier(nt, spin_ns_, adaptive_spin_);
    StepBarrier::Stats* stats = count_waits_ ? &wait_stats_ : nullptr;

#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
      // This thread's copy of the residual stream and of the normalised rows.
      std::vector<BF16> resid(M * hid), xn(M * hid);
      W8A8Acts acts{std::vector<uint8_t>(M * w8a8_max_k_), std::vector<float>(M), std::vector<int32_t>(M)};
      for (int64_t m = 0; m < M; ++m) embedding_row(embed_.w, id[m], resid.data() + m * hid);
      // Multi-LoRA (row_slots): a linear's adapted rows get their deltas with no barrier of their
      // own. Each thread computes h (the shrink, x . A) of every adapted row itself, into its own
      // buffer, from the linear's whole input (its own xn, or attn / act, complete since the
      // barrier before the linear), then adds the deltas (the expand, h . Bt) to exactly the
      // output columns its base units just wrote. The shrink is repeated on every thread, but it
      // is small: rank x K per row and slice against N x K for the base linear (rank 16 on
      // SmolLM2: 1% of gate_up, 3% of o / down, 5% of qkv's 3 slices), while a barrier (and every
      // thread idle until the slowest h) costs more on few cores. Measured (2 cores, SmolLM2, one
      // rank-16 adapter on all four linears of every layer): a 1-row step +9%, 32 rows +8%.
      // Rows of slot -1 and rank-0 slices get nothing; without row_slots nothing changes.
      std::vector<float> lora_h(lora.rows.size() * lora_h_size_);
      // Target k (4 per layer): y[:, c0:c1] and y[:, c2:c3] += the rows' deltas.
      auto add_lora = [&](int64_t k, const BF16* x, BF16* out, int64_t ldo, int64_t c0, int64_t c1, int64_t c2 = 0,
                          int64_t c3 = 0) {
        if (lora.empty() || !lora_[k]) return;
        const LoraWeights<BF16>& w = lora_[k]->w;
        for (const auto& tile : lora.tiles) lora_shrink_tile(w, lora, tile, x, w.K, lora_h.data(), lora_h_size_);
        for (const auto& tile : lora.tiles) {
          lora_expand_tile(w, lora, tile, lora_h.data(), lora_h_size_, out, ldo, c0, c1);
          if (c2 < c3) lora_expand_tile(w, lora, tile, lora_h.data(), lora_h_size_, out, ldo, c2, c3);
        }
      };
      auto linear = [&](const Linear& lin, const BF16* x, int64_t rows, BF16* out, int64_t ldo, int64_t lora_k = -1) {
        const auto [u0, u1] = share(lin.units(), t, n_t);
        run_units(lin, prepare_input(lin, x, rows, acts), u0, u1, out, ldo, acts);
        if (lora_k >= 0)
          add_lora(lora_k, x, out, ldo, u0 * lin.unit_rows(), std::min(lin.w.N, u1 * lin.unit_rows()));
      };
      for (int64_t l = 0; l < layers_; ++l) {
        const BF16* in_norm = norms_[2 * l].data_ptr<BF16>();
        for (int64_t m = 0; m < M; ++m) {
          if (l == 0) rms_norm_row(resid.data() + m * hid, in_norm, xn.data() + m * hid, hid, eps_);
          else add_rms_norm_row(down_p + m * hid, resid.data() + m * hid, in_norm, xn.data() + m * hid, hid, eps_);
        }
        linear(qkv_[l], xn.data(), M, qkv_p, qkv_w, 4 * l);
        barrier.wait(t, n_t, stats);
        if (!items_cache) {
          const auto [r0, r1] = share(M, t, n_t);
          for (int64_t r = r0; r < r1; ++r)
            cache_heads(l, qkv_p + r * qkv_w, pos[r], cos, sin, slot[r], q_p + r * H * D, 0, Hkv);
        }
        const float* k_scale = scaled_ ? kv_scales_[2 * l].data_ptr<float>() : nullptr;
        const float* v_scale = scaled_ ? kv_scales_[2 * l + 1].data_ptr<float>() : nullptr;
        with_cache<BF16>(kv_caches_[2 * l], kv_caches_[2 * l + 1], [&](const auto* k_cache, const auto* v_cache) {
          using C = std::remove_const_t<std::remove_pointer_t<decltype(k_cache)>>;
          if (by_rows) {
            // A row attends the K/V its sequence's earlier rows wrote: an item's own, or (items
            // that split a sequence's rows) any thread's: then wait for all.
            if (!items_cache) barrier.wait(t, n_t, stats);
            const RowsArgs<BF16, C> ra{q_p, k_cache, v_cache, k_scale, v_scale, block_tables.data_ptr<int64_t>(), lens,
                                       qsl, attn_p, B, H, Hkv, D, block_size_, block_tables.size(1), scale_};
            for (int64_t i; (i = next_item[l].fetch_add(1, std::memory_order_relaxed)) < n_items;) {
              const RowsItem& it = items[i];
              for (int64_t r = qsl[it.b]; items_cache && r < qsl[it.b + 1]; ++r)
                cache_heads(l, qkv_p + r * qkv_w, pos[r], cos, sin, slot[r], q_p + r * H * D, it.h0, it.h1);
              rows_item(ra, it);
            }
            barrier.wait(t, n_t, stats);
          } else {
            // (unsplit, a thread attends exactly the rows it just rotated: no wait needed)
            if (S > 1) barrier.wait(t, n_t, stats);
            const DecodeArgs<BF16, C> a{q_p, k_cache, v_cache, k_scale, v_scale, block_tables.data_ptr<int64_t>(), lens,
                                        attn_p, M, H, Hkv, D, block_size_, block_tables.size(1), scale_, S,
                                        part_ml.data(), part_acc.data()};
            {
              const auto [i0, i1] = share(M * S, t, n_t);
              decode_items(a, i0, i1);
            }
            barrier.wait(t, n_t, stats);
            if (S > 1) {
              const auto [i0, i1] = share(M * H, t, n_t);
              decode_merge(a, i0, i1);
              barrier.wait(t, n_t, stats);
            }
          }
        });
        linear(o_[l], attn_p, M, o_p, hid, 4 * l + 1);
        barrier.wait(t, n_t, stats);
        if (tp_ && !all_reduce(o_p, M * hid, t, n_t, seq, aborted, barrier, stats)) break;
        const BF16* post_norm = norms_[2 * l + 1].data_ptr<BF16>();
        for (int64_t m = 0; m < M; ++m)
          add_rms_norm_row(o_p + m * hid, resid.data() + m * hid, post_norm, xn.data() + m * hid, hid, eps_);
        {
          // gate rows and the matching up rows (one grid of units: I is a multiple of 32), then
          // silu(gate) * up on the same columns.
          const Linear& gl = gate_up_[l];
          const int64_t rows_per = gl.unit_rows(), half = I / rows_per;
          const auto [u0, u1] = share(half, t, n_t);
          const int64_t c0 = u0 * rows_per, c1 = u1 * rows_per;
          const LinearInput in = prepare_input(gl, xn.data(), M, acts);  // once for both halves
          run_units(gl, in, u0, u1, gu_p, 2 * I, acts);
          run_units(gl, in, half + u0, half + u1, gu_p, 2 * I, acts);
          add_lora(4 * l + 2, xn.data(), gu_p, 2 * I, c0, c1, I + c0, I + c1);
          for (int64_t m = 0; m < M; ++m)
            silu_mul_row(gu_p + m * 2 * I + c0, gu_p + m * 2 * I + I + c0, act_p + m * I + c0, c1 - c0);
        }
        barrier.wait(t, n_t, stats);
        linear(down_[l], act_p, M, down_p, hid, 4 * l + 3);
        barrier.wait(t, n_t, stats);
        if (tp_ && !all_reduce(down_p, M * hid, t, n_t, seq, aborted, barrier, stats)) break;
      }
      const BF16* final_norm = norms_.back().data_ptr<BF16>();
      for (int64_t m = 0; m < M; ++m)
        add_rms_norm_row(down_p + m * hid, resid.data() + m * hid, final_norm, xn.data() + m * hid, hid, eps_);
      std::vector<BF16> rows(R * hid);  // the rows that need logits
      for (int64_t r = 0; r < R; ++r)
        std::copy(xn.data() + lrows[r] * hid, xn.data() + (lrows[r] + 1) * hid, rows.data() + r * hid);
      if (R > 0 && !aborted.load()) {
        linear(lm_head_, rows.data(), R, logits_b, vocab_);
        // float32 logits of this thread's columns, while they are in its cache (= `.float()`)
        const auto [u0, u1] = share(lm_head_.units(), t, n_t);
        const int64_t c0 = u0 * lm_head_.unit_rows(), c1 = std::min(vocab_, u1 * lm_head_.unit_rows());
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = c0; c < c1; ++c) logits_f[r * vocab_ + c] = static_cast<float>(logits_b[r * vocab_ + c]);
      }
      barrier.wait(t, n_t, stats);  // so that the region's own closing barrier (libgomp's spin) finds everyone there
    }
    tp_seq_ = seq;
    TORCH_CHECK(!aborted.load(), "FusedDecoder: tensor-parallel all-reduce aborted (a rank died or the engine stopped)");
    return logits_f32;
  }

  // Tensor parallel: this rank's shard (heads, intermediate size and LM head rows are its own);
  // the outputs of o_proj and down_proj are summed over the ranks in the step (shm_allreduce.cpp),
  // and the logits returned are this rank's vocab columns. `tp_seq` continues the sequence
  // numbers of the Python side's all-reduces (distributed/comm.py).
  void set_tensor_parallel(at::Tensor slots, at::Tensor words, int64_t rank, int64_t world,
                           int64_t spin_ns) override {
    tp_args_ = shm_all_reduce_args(slots, words, rank, world, spin_ns);
    tp_slots_ = slots;
    tp_words_ = words;
    tp_ = world > 1;
  }
  StepBarrier::Stats wait_stats_;  // kept while count_waits_
  // (spun, slept after spinning, slept at once, total wait ns) over the calls since the last read
  std::tuple<int64_t, int64_t, int64_t, int64_t> take_wait_stats() override {
    auto& w = wait_stats_;
    return {w.spun.exchange(0), w.slept_after_spin.exchange(0), w.slept_at_once.exchange(0), w.wait_ns.exchange(0)};
  }
  // Multi-LoRA: 4 entries per layer (qkv, o, gate_up, down; None: no LoRA on that linear), each
  // (A, Bt, ranks, slice_bounds) as lora.h describes, bf16, for this rank's shard of the layer.
  // The tensors are kept and read at every step (Python rewrites them in place); slice_bounds is
  // copied. forward(row_slots=...) then adds each row's adapter (-1: none).
  void set_lora(std::vector<c10::optional<LoraSpec>> specs) override {
    TORCH_CHECK(static_cast<int64_t>(specs.size()) == 4 * layers_, "set_lora: 4 entries per layer (qkv, o, gate_up, "
                "down; None where a linear has no LoRA): ", 4 * layers_, " here, got ", specs.size());
    static const char* names[] = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
    std::vector<std::unique_ptr<LoraTarget>> targets(specs.size());
    int64_t slots = INT64_MAX, h_size = 0;
    for (size_t k = 0; k < specs.size(); ++k) {
      if (!specs[k].has_value()) continue;
      const int64_t l = static_cast<int64_t>(k) / 4;
      const Linear& lin = (k % 4 == 0 ? qkv_ : k % 4 == 1 ? o_ : k % 4 == 2 ? gate_up_ : down_)[l];
      targets[k] = make_lora(*specs[k], lin.w, names[k % 4]);
      slots = std::min(slots, targets[k]->w.slots);
      h_size = std::max(h_size, targets[k]->w.h_size());
    }
    lora_ = std::move(targets);
    lora_slots_ = slots == INT64_MAX ? 0 : slots;
    lora_h_size_ = std::max<int64_t>(1, h_size);
  }
  void clear_lora() override {
    lora_.clear();
    lora_slots_ = 0;
  }

  int64_t spin_ns() const override { return spin_ns_; }
  void set_spin_ns(int64_t ns) override {
    TORCH_CHECK(ns >= 0, "FusedDecoder: spin_ns must be >= 0");
    spin_ns_ = ns;
  }

 private:
  std::vector<at::Tensor> norms_, kv_caches_, kv_scales_;  // kv_scales_: int8 / float8 caches only
  bool scaled_ = false, fp8_ = false;
  at::Tensor cos_, sin_;
  std::vector<Linear> qkv_, o_, gate_up_, down_;
  Linear lm_head_, embed_;
  int64_t w8a8_max_k_ = 0;  // the widest W8A8 linear's padded inputs (0: none)
  int64_t layers_ = 0, hidden_ = 0, vocab_ = 0, embed_rows_ = 0;
  int64_t heads_, kv_heads_, head_dim_, inter_;
  float eps_;
  int64_t block_size_;
  float scale_;
  int64_t spin_ns_ = 100000;  // the most a barrier spins before it sleeps (StepBarrier)
  bool tp_ = false;
  ShmAllReduceArgs tp_args_{};
  at::Tensor tp_slots_, tp_words_;  // keep the shared buffers alive
  std::vector<std::unique_ptr<LoraTarget>> lora_;  // set_lora: 4 per layer (null: none), or empty
  int64_t lora_slots_ = 0, lora_h_size_ = 1;        // the fewest slots of any target; the most h floats of a row

  // Row `row` of the qkv projection, its q heads [h0 * G, h1 * G) (G = heads per kv head) rotated
  // into q_out, its k of kv heads [h0, h1) rotated and its v written at `slot` of layer l's caches
  // (an int8 / float8 cache: each kv head's row quantized with its scale, as write_scaled_cache
  // does after the unfused model's rotary embedding).
  void cache_heads(int64_t l, const BF16* row, int64_t position, const BF16* cos, const BF16* sin, int64_t slot,
                   BF16* q_out, int64_t h0, int64_t h1) const {
    const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, G = H / Hkv;
    if (!scaled_) {
      rope_and_cache_row(row, position, cos, sin, kv_caches_[2 * l].data_ptr<BF16>(),
                         kv_caches_[2 * l + 1].data_ptr<BF16>(), slot, q_out, H, Hkv, D, h0, h1);
      return;
    }
    const BF16* c = cos + position * D;
    const BF16* s = sin + position * D;
    for (int64_t h = h0 * G; h < h1 * G; ++h) rope_head(row + h * D, c, s, q_out + h * D, D / 2);
    auto* kc = static_cast<uint8_t*>(kv_caches_[2 * l].data_ptr()) + slot * Hkv * D;  // one byte per value
    auto* vc = static_cast<uint8_t*>(kv_caches_[2 * l + 1].data_ptr()) + slot * Hkv * D;
    float* ks = kv_scales_[2 * l].data_ptr<float>() + slot * Hkv;
    float* vs = kv_scales_[2 * l + 1].data_ptr<float>() + slot * Hkv;
    BF16 k[256];  // the largest head_dim the attention kernels take
    for (int64_t h = h0; h < h1; ++h) {
      rope_head(row + (H + h) * D, c, s, k, D / 2);
      quantize_kv_row(k, D, fp8_, kc + h * D, ks + h);
      quantize_kv_row(row + (H + Hkv + h) * D, D, fp8_, vc + h * D, vs + h);
    }
  }

  // The adapted rows of row_slots (int32 [M]), checked here: nothing inside the step may throw.
  LoraBatch lora_batch_of(const at::Tensor& row_slots, int64_t M) const {
    TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous() && row_slots.dim() == 1 &&
                    row_slots.numel() == M, "FusedDecoder: row_slots must be contiguous int32 [rows]");
    const int32_t* rs = row_slots.data_ptr<int32_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(rs[m] < 0 || !lora_.empty(), "FusedDecoder: row_slots has adapter rows but set_lora was not called");
      TORCH_CHECK(rs[m] >= -1 && rs[m] < lora_slots_, "FusedDecoder: row_slots[", m, "] = ", rs[m],
                  " is not -1 or a slot in [0, ", lora_slots_, ")");
    }
    LoraBatch batch = lora_batch(rs, M);
    for (size_t k = 0; k < lora_.size() && !batch.empty(); ++k) {
      if (!lora_[k]) continue;
      const LoraWeights<BF16>& w = lora_[k]->w;
      for (int64_t i = 0; i < w.slots * w.n_slices; ++i)
        TORCH_CHECK(w.ranks[i] >= 0 && w.ranks[i] <= w.r_max, "FusedDecoder: LoRA ranks must lie in [0, r_max]");
    }
    return batch;
  }

  // Thread 0 sums x over the ranks while the others wait; false (for every thread) if aborted.
  bool all_reduce(BF16* x, int64_t n, int t, int n_t, int64_t& seq, std::atomic<bool>& aborted, StepBarrier& barrier,
                  StepBarrier::Stats* stats) {
    if (t == 0 && !shm_all_reduce_raw(x, n, tp_args_, ++seq)) aborted.store(true);
    barrier.wait(t, n_t, stats);
    return !aborted.load();
  }
};

namespace tm_cpu {

bool fused_decoder_built() { return true; }

std::unique_ptr<FusedDecoderApi> make_fused_decoder(
    at::Tensor embed, c10::optional<at::Tensor> embed_scales, int64_t embed_bits, std::vector<at::Tensor> norms,
    std::vector<LinearSpec> linears, std::vector<at::Tensor> kv_caches, at::Tensor cos, at::Tensor sin, int64_t heads,
    int64_t kv_heads, int64_t head_dim, int64_t intermediate, int64_t vocab_size, double eps, int64_t block_size,
    double scale, std::vector<at::Tensor> kv_scales) {
  return std::make_unique<FusedDecoder>(embed, embed_scales, embed_bits, std::move(norms), std::move(linears),
                                        std::move(kv_caches), cos, sin, heads, kv_heads, head_dim, intermediate,
                                        vocab_size, eps, block_size, scale, std::move(kv_scales));
}

int64_t barrier_next_spin_budget(int64_t budget, int64_t max_spin_ns, int64_t waited_ns) {
  return StepBarrier::next_spin_budget(budget, max_spin_ns, waited_ns);
}

}  // namespace tm_cpu

#else  // neither AVX512-BF16 nor AVX2 + FMA: no panel kernel, no fused decode step (the model runs op by op)

namespace tm_cpu {

bool fused_decoder_built() { return false; }

std::unique_ptr<FusedDecoderApi> make_fused_decoder(at::Tensor, c10::optional<at::Tensor>, int64_t,
                                                    std::vector<at::Tensor>, std::vector<LinearSpec>,
                                                    std::vector<at::Tensor>, at::Tensor, at::Tensor, int64_t, int64_t,
                                                    int64_t, int64_t, int64_t, double, int64_t, double,
                                                    std::vector<at::Tensor>) {
  TORCH_CHECK(false, "FusedDecoder needs AVX512-BF16 or AVX2 with FMA");
}

int64_t barrier_next_spin_budget(int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "FusedDecoder needs AVX512-BF16 or AVX2 with FMA");
}

}  // namespace tm_cpu

#endif
