// The tensor-parallel all-reduce through shared memory (layout and protocol: distributed/comm.py).
//
// Each rank converts its partial sums into its float32 slot of the call's phase, publishes the
// call's sequence number (a release store), waits for every other rank's (acquire loads), then
// sums the slots in rank order, so every rank gets bit-identical activations. The wait spins for
// up to `spin_ns` (the other rank is usually microseconds behind), then yields the CPU (a rank may
// share its core with the one it waits for), looking at the abort flag (word 0) as it goes.
// Called with the GIL released: a rank waiting here does not stall the server's event loop.
#include "torch_lite.h"

#include <immintrin.h>
#include <sched.h>
#include <time.h>

#include <cstdint>

#include "shm_allreduce.h"

namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Waits until *word >= seq; false if the abort flag was raised first.
bool wait_for(const int64_t* word, const int64_t* abort_flag, int64_t seq, int64_t spin_ns) {
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= seq) return true;
  const int64_t deadline = now_ns() + spin_ns;
  while (now_ns() < deadline) {
    for (int i = 0; i < 64; ++i) {
      if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= seq) return true;
      _mm_pause();
    }
  }
  for (int64_t n = 1;; ++n) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= seq) return true;
    if ((n & 255) == 0 && __atomic_load_n(abort_flag, __ATOMIC_RELAXED)) return false;
    if (n > 100000) {  // a long wait (a rank loading, or descheduled): sleep, do not burn the core
      timespec ts{0, 200000};
      nanosleep(&ts, nullptr);
    } else {
      sched_yield();
    }
  }
}

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void sum_slots(const float* slots, int64_t stride, int64_t world, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = slots[i];
    for (int64_t r = 1; r < world; ++r) acc += slots[r * stride + i];
    out[i] = static_cast<T>(acc);  // c10::BFloat16(float) rounds to nearest even
  }
}

}  // namespace

// The all-reduce of n elements at x (n <= the slots' capacity); false if aborted. Also called
// from inside the fused decode step (decode_step.cpp), by one thread while the others wait.
template <typename T>
bool shm_all_reduce_raw(T* x, int64_t n, const ShmAllReduceArgs& g, int64_t seq) {
  const int64_t phase = seq & 1;
  float* phase_slots = g.slots + phase * g.world * g.capacity;
  to_float(x, phase_slots + g.rank * g.capacity, n);
  __atomic_store_n(&g.words[8 + phase * g.world + g.rank], seq, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < g.world; ++r) {
    if (r != g.rank && !wait_for(&g.words[8 + phase * g.world + r], &g.words[0], seq, g.spin_ns)) return false;
  }
  sum_slots(phase_slots, g.capacity, g.world, x, n);
  return true;
}
template bool shm_all_reduce_raw<at::BFloat16>(at::BFloat16*, int64_t, const ShmAllReduceArgs&, int64_t);

ShmAllReduceArgs shm_all_reduce_args(at::Tensor slots, at::Tensor words, int64_t rank, int64_t world,
                                     int64_t spin_ns) {
  TORCH_CHECK(slots.is_contiguous() && words.is_contiguous());
  TORCH_CHECK(slots.scalar_type() == at::kFloat && words.scalar_type() == at::kLong);
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == 2 && slots.size(1) == world);
  TORCH_CHECK(words.numel() >= 8 + 2 * world && rank >= 0 && rank < world);
  return {slots.data_ptr<float>(), words.data_ptr<int64_t>(), slots.size(2), rank, world, spin_ns};
}

// x: contiguous float32 / bfloat16, at most `capacity` elements (callers split larger ones).
// slots: float32 [2, world, capacity]; words: int64 (abort flag, then sequence numbers).
bool shm_all_reduce(at::Tensor x, at::Tensor slots, at::Tensor words, int64_t rank, int64_t world,
                    int64_t seq, int64_t spin_ns) {
  const ShmAllReduceArgs g = shm_all_reduce_args(slots, words, rank, world, spin_ns);
  TORCH_CHECK(x.is_contiguous());
  const int64_t n = x.numel();
  TORCH_CHECK(n <= g.capacity, "shm_all_reduce: ", n, " elements, slot holds ", g.capacity);
  if (x.scalar_type() == at::kFloat) return shm_all_reduce_raw(x.data_ptr<float>(), n, g, seq);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "shm_all_reduce: float32 or bfloat16");
  return shm_all_reduce_raw(x.data_ptr<at::BFloat16>(), n, g, seq);
}
