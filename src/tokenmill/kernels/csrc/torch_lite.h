// What a kernel unit sees of torch: the Tensor type, its dtypes, TORCH_CHECK and ATen's thread
// pool. Not torch/extension.h, which brings pybind11 and every op's declaration: ~25 s and 1.5 GB
// of compiler per unit against ~2 s here, and the kernel units are compiled once per ISA level
// (kernels/build.py), which also precompiles this header once per level. Only bindings.cpp
// (compiled once) includes torch/extension.h; it also defines the allocation helpers below, so no
// kernel unit needs ATen's op headers.
#pragma once
// (and a guard: build.py also force-includes a copy of this file, for its precompiled form)
#ifndef TOKENMILL_TORCH_LITE_H
#define TOKENMILL_TORCH_LITE_H

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

namespace tm_cpu {

at::Tensor empty(at::IntArrayRef sizes, at::TensorOptions options);
at::Tensor empty_like(const at::Tensor& x);
at::Tensor zeros(at::IntArrayRef sizes, at::TensorOptions options);
inline at::TensorOptions dtype(at::ScalarType t) { return at::TensorOptions().dtype(t); }

}  // namespace tm_cpu

#endif  // TOKENMILL_TORCH_LITE_H
