// The tensor-parallel shared-memory all-reduce (shm_allreduce.cpp), for C++ callers.
#pragma once
#include "torch_lite.h"

#include <cstdint>

struct ShmAllReduceArgs {
  float* slots;  // [2 phases, world, capacity] float32
  int64_t* words;  // [0]: abort flag; [8 + phase * world + rank]: sequence numbers
  int64_t capacity, rank, world, spin_ns;
};

ShmAllReduceArgs shm_all_reduce_args(at::Tensor slots, at::Tensor words, int64_t rank, int64_t world,
                                     int64_t spin_ns);

// Sums x[0:n] over the ranks in place (n <= capacity); false if the abort flag was raised.
template <typename T>
bool shm_all_reduce_raw(T* x, int64_t n, const ShmAllReduceArgs& g, int64_t seq);
