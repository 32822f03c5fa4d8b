// What the exact (sparse_adamw.cpp) and lean (sparse_adamw_lean.cpp) CPU steps share: the
// hyper-parameters as their kernels take them, the bias corrections, and the checks of the
// operands both layouts have (params, grads, steps). The op's argument checks proper are
// check_step (triton_kernels/_step_args.py); these guard memory when the kernel is called directly.
#pragma once

// Whether c10::Half(float) converts with F16C (when the build's own flags enable it): then it
// keeps NaN payloads as the SIMD forms' hardware conversion does. Included first, so read
// before any `#pragma GCC target`, which would define __F16C__ for the code that follows it.
#ifdef __F16C__
#define SIFT_C10_HALF_USES_F16C 1
#else
#define SIFT_C10_HALF_USES_F16C 0
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef SIFT_X86_SIMD
#include <immintrin.h>
#endif

namespace sift {
namespace {

#ifdef SIFT_X86_SIMD
// The mask of a whole vector of W entries, for the SIMD forms' memory primitives: they then use
// the plain instruction instead of the masked one.
struct Full {};

// n (< W) 16-bit values into a zeroed W-value buffer, for the short last block of a chunk.
template <int64_t W>
struct Tail16 {
  alignas(64) uint16_t v[W] = {};
  Tail16(const uint16_t* p, int64_t n) { std::memcpy(v, p, static_cast<size_t>(n) * sizeof(uint16_t)); }
};
#endif

// 1 - beta is taken in double on the host, as torch's AdamW does: in fp32, 1 - 0.999f is off
// by 5e-5 relative, a bias every second moment would carry.
struct Hyper {
  float lr, beta1, beta2, one_minus_b1, one_minus_b2, eps, weight_decay;
  bool maximize;
};

inline Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize) {
  return Hyper{static_cast<float>(lr),          static_cast<float>(beta1), static_cast<float>(beta2),
               static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2), static_cast<float>(eps),
               static_cast<float>(weight_decay), maximize};
}

// lr / (1 - beta1^t) and 1 / sqrt(1 - beta2^t) in double, then fp32.
struct StepScales {
  float step_size, inv_bc2_sqrt;
};

inline StepScales step_scales(double lr, double beta1, double beta2, double t) {
  return {static_cast<float>(lr / (1.0 - std::pow(beta1, t))),
          static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, t)))};
}

// Every list of a step holds one tensor per param.
inline void check_one_per_param(int64_t n, std::initializer_list<std::pair<const char*, size_t>> lists) {
  for (const auto& [name, size] : lists) {
    TORCH_CHECK(static_cast<int64_t>(size) == n, name, " must have one tensor per param");
  }
}

// A chunk of work: entries [begin, end) of tensor `tensor`, stepped by one thread.
struct Segment {
  int64_t tensor, begin, end;
};

// The dtype names the Python API uses, for error messages.
inline const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kChar: return "int8";
    default: return c10::toString(dtype);
  }
}

// Checks tensor i's param, grad and step (k chosen entries); returns the step count t.
inline double check_param_grad_step(const at::Tensor& p, const at::Tensor& grad, const at::Tensor& step,
                                    at::ScalarType dtype, bool compact_grads, int64_t k, int64_t i) {
  TORCH_CHECK(p.device().is_cpu() && grad.device().is_cpu() && step.device().is_cpu(),
              "params, grads and steps must be CPU tensors");
  TORCH_CHECK(p.is_contiguous(), "params must be contiguous");
  TORCH_CHECK(p.scalar_type() == dtype, "params must share one dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "params must be float32, bfloat16 or float16");
  TORCH_CHECK(grad.is_contiguous(), "grads must be contiguous");
  if (compact_grads) {
    TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.numel() == k,
                "grads must be fp32 with one entry per index when compact_grads=True");
  } else {
    TORCH_CHECK(grad.scalar_type() == dtype && grad.numel() == p.numel(), "grads must match their params in dtype and numel");
  }
  TORCH_CHECK(step.numel() == 1, "steps must hold one value per param, got ", step.numel(), " in steps[", i, "]");
  const double t = step.item<double>();
  TORCH_CHECK(t >= 1, "steps must be >= 1 (incremented before the update)");
  return t;
}

// The compact state tensors of tensor i: contiguous CPU `dtype` with k entries.
inline void check_compact(std::initializer_list<const at::Tensor*> tensors, at::ScalarType dtype, int64_t k,
                          const char* what) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype && t->is_contiguous() && t->numel() == k, what,
                " must be contiguous CPU ", dtype_name(dtype), " tensors with one entry per index");
  }
}

}  // namespace
}  // namespace sift
