// The machine's limit for the sparse AdamW step's access pattern: for each tensor, gather the
// gradient and the weight at k sorted flat positions, update fp32 Adam moments and the weight
// with AdamW's math, scatter the weight back. Nothing else: no checks, no delta, no base, one
// plain loop that the compiler optimises for this CPU (-O3 -march=native). With a prefetch
// distance d the loop also prefetches the gradient's and the weight's lines d entries ahead, as
// the steps do (the exact step 32 entries ahead, the lean step 64): the sorted indices are known
// ahead, a hardware prefetcher cannot follow them, and without the hint the plain loop is slower
// than the step it is meant to bound.
// `python -m sift.bench adamw` compiles it with the system compiler into a small shared library
// (loaded with ctypes; OpenMP through the libgomp torch has already loaded) and times
// SparseAdamW's step against it on the same weights, gradients and indices.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

struct Scalars {
  float beta1, beta2, one_minus_b1, one_minus_b2, neg_decay, step_size, inv_bc2_sqrt, eps;
};

inline float bf16_to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (no NaN handling: finite data)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float load(const float* p, int64_t q) { return p[q]; }
inline float load(const uint16_t* p, int64_t q) { return bf16_to_float(p[q]); }
inline void store(float* p, int64_t q, float x) { p[q] = x; }
inline void store(uint16_t* p, int64_t q, float x) { p[q] = float_to_bf16(x); }

template <typename T, bool PREFETCH>
void step(int n, T* const* w, const T* const* g, const int32_t* const* idx, float* const* m, float* const* v,
          const int64_t* k, const Scalars& s, int threads, int64_t distance) {
#pragma omp parallel num_threads(threads)
  for (int i = 0; i < n; ++i) {
    T* wi = w[i];
    const T* gi = g[i];
    const int32_t* ii = idx[i];
    float *mi = m[i], *vi = v[i];
#pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < k[i]; ++j) {
      if (PREFETCH && j + distance < k[i]) {
        __builtin_prefetch(gi + ii[j + distance], 0, 3);
        __builtin_prefetch(wi + ii[j + distance], 1, 3);
      }
      const int64_t q = ii[j];
      const float gj = load(gi, q), wj = load(wi, q);
      const float mj = s.beta1 * mi[j] + s.one_minus_b1 * gj;
      const float vj = s.beta2 * vi[j] + s.one_minus_b2 * gj * gj;
      mi[j] = mj;
      vi[j] = vj;
      const float upd = s.neg_decay * wj - s.step_size * mj / (std::sqrt(vj) * s.inv_bc2_sqrt + s.eps);
      store(wi, q, wj + upd);
    }
  }
}

}  // namespace

extern "C" {

// One step over n tensors: weights w[i] and gradients g[i] (fp32, or bf16 when bf16 != 0) at the
// k[i] sorted positions idx[i], moments m[i], v[i] ([k[i]] fp32), on `threads` OpenMP threads;
// with software prefetch `prefetch` entries ahead when prefetch > 0.
void adamw_probe_step(int n, void* const* w, const void* const* g, const int32_t* const* idx, float* const* m,
                      float* const* v, const int64_t* k, int bf16, float lr, float beta1, float beta2, float eps,
                      float weight_decay, float step_size, float inv_bc2_sqrt, int threads, int prefetch) {
  const Scalars s{beta1, beta2, 1.0f - beta1, 1.0f - beta2, -lr * weight_decay, step_size, inv_bc2_sqrt, eps};
  auto* wb = reinterpret_cast<uint16_t* const*>(w);
  auto* gb = reinterpret_cast<const uint16_t* const*>(g);
  auto* wf = reinterpret_cast<float* const*>(w);
  auto* gf = reinterpret_cast<const float* const*>(g);
  const int64_t d = prefetch;
  if (bf16 && d > 0) step<uint16_t, true>(n, wb, gb, idx, m, v, k, s, threads, d);
  else if (bf16) step<uint16_t, false>(n, wb, gb, idx, m, v, k, s, threads, d);
  else if (d > 0) step<float, true>(n, wf, gf, idx, m, v, k, s, threads, d);
  else step<float, false>(n, wf, gf, idx, m, v, k, s, threads, d);
}
}
