// SparseAdamW step on the lean state (at most 8 bytes per entry) on CPU. The math and the
// layout are the contract in sift/_ops/ (sparse_adamw_lean_ref); this file is its
// C++/OpenMP implementation.
//
// Work is cut into chunks of CHUNK entries over all tensors so OpenMP balances tensors of
// very different sizes. A chunk finds its first window by binary search over the window
// offsets and then walks the windows it spans; within a window the flat index is the
// window's base plus the 16-bit low half. Each entry is gathered, updated and scattered in one
// pass, the weight and gradient lines prefetched PREFETCH_DISTANCE entries ahead, across the
// chunk's end: the flat positions of the chunk and of the next PREFETCH_DISTANCE entries are
// decoded first into a small local array.
// The scalar loop is compiled with fp-contract off and does the reference's operations in
// its order, so results match the torch reference bit for bit.
//
// With AVX2 (and F16C) the pass also has a SIMD form (sparse_adamw_lean_simd.h), for params
// below 2^31 elements, run by isa="auto" where sift's loader measured it faster than the scalar
// loop (cpu_isa.h, sift/_simd.py): 8 entries per step, grads and weights loaded one lane at a time
// (faster than VPGATHERDD on the AMD EPYC), the hash and both stochastic roundings in vector
// registers, the same operations in the same order, so the bits agree with the scalar loop.
// AVX-512 CPUs run the AVX2 form.

#include "sparse_adamw_common.h"

#include <limits>

namespace sift {
namespace {

constexpr int64_t LEAN_CHUNK = 512;
// Twice the exact step's: the lean loop does more arithmetic per entry, and on the AMD EPYC
// (Zen 5) 64 entries ahead kept more lines in flight (bench/results/README.md).
constexpr int64_t LEAN_PREFETCH_DISTANCE = 64;
constexpr int LEAN_WINDOW_BITS = 16;

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// unit(w) = the residual's step and its inverse, powers of two in fp32's normal range (see
// the contract: bf16 2^(max(E, 16) - 142), fp16 2^(max(E, 1) - 33), E the exponent field).
template <typename W>
struct Unit;

template <>
struct Unit<c10::BFloat16> {
  static uint32_t exponent(c10::BFloat16 w) { return std::max<uint32_t>((w.x >> 7) & 0xFF, 16); }
  static float unit(c10::BFloat16 w) { return bits_to_float((exponent(w) - 15) << 23); }
  static float inv_unit(c10::BFloat16 w) { return bits_to_float((269 - exponent(w)) << 23); }
};

template <>
struct Unit<c10::Half> {
  static uint32_t exponent(c10::Half w) { return std::max<uint32_t>((w.x >> 10) & 0x1F, 1); }
  static float unit(c10::Half w) { return bits_to_float((exponent(w) + 94) << 23); }
  static float inv_unit(c10::Half w) { return bits_to_float((160 - exponent(w)) << 23); }
};

// 32 random bits from (flat index, step): the hash of the contract, modulo 2^32.
inline uint32_t random_bits(int64_t idx, uint32_t step) {
  uint32_t x = static_cast<uint32_t>(idx) * 0x9E3779B1u + step * 0x632BE5ABu;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 by stochastic rounding with 16 random bits (NaN -> the quiet NaN 0x7FC0).
inline c10::BFloat16 round_bf16_stochastic(float x, uint32_t random16) {
  const uint16_t out = std::isnan(x) ? uint16_t{0x7FC0} : static_cast<uint16_t>((float_to_bits(x) + random16) >> 16);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// Entries [t0, n) of a chunk starting at entry `begin` of its tensor, flat positions in
// `flat` (n_ahead >= n of them, the rest only prefetched). W: weight dtype, G: gathered grad
// dtype, I: the decoded position's type.
template <typename W, typename G, typename I, bool COMPACT>
void lean_entries(W* __restrict w, const G* __restrict g_src, const I* __restrict flat, c10::BFloat16* __restrict m,
                  c10::BFloat16* __restrict v, int8_t* __restrict residual, int64_t begin, int64_t t0, int64_t n,
                  int64_t n_ahead, uint32_t step, float step_size, float inv_bc2_sqrt, const Hyper& h) {
  constexpr bool LOW_PRECISION = !std::is_same_v<W, float>;
  const float sign = h.maximize ? -1.0f : 1.0f;
  const float decay = h.lr * h.weight_decay;
  for (int64_t t = t0; t < n; ++t) {
    if (t + LEAN_PREFETCH_DISTANCE < n_ahead) {
      const int64_t ahead = flat[t + LEAN_PREFETCH_DISTANCE];
      if (!COMPACT) __builtin_prefetch(g_src + ahead, 0, 3);
      __builtin_prefetch(w + ahead, 1, 3);
    }
    const int64_t j = begin + t;
    const int64_t q = flat[t];
    const float gj = sign * static_cast<float>(COMPACT ? g_src[j] : g_src[q]);
    const W stored = w[q];
    float wj = static_cast<float>(stored);
    if constexpr (LOW_PRECISION) wj = wj + static_cast<float>(residual[j]) * Unit<W>::unit(stored);
    const float mj = h.beta1 * static_cast<float>(m[j]) + h.one_minus_b1 * gj;
    const float vj = h.beta2 * static_cast<float>(v[j]) + h.one_minus_b2 * gj * gj;
    const float upd = -decay * wj - step_size * mj / (std::sqrt(vj) * inv_bc2_sqrt + h.eps);
    const float fresh = wj + upd;
    const W rounded = static_cast<W>(fresh);
    w[q] = rounded;
    if constexpr (LOW_PRECISION) {
      const float back = static_cast<float>(rounded);
      float r = std::nearbyint((fresh - back) * Unit<W>::inv_unit(rounded));
      r = std::min(127.0f, std::max(-128.0f, r));
      residual[j] = std::isfinite(back) ? static_cast<int8_t>(r) : int8_t{0};
    }
    const uint32_t bits = random_bits(q, step);
    m[j] = round_bf16_stochastic(mj, bits & 0xFFFFu);
    v[j] = round_bf16_stochastic(vj, bits >> 16);
  }
}
#pragma GCC pop_options

#ifdef SIFT_X86_SIMD
// The AVX2 primitives, shared with sparse_adamw.cpp's AVX2 form.
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#pragma GCC optimize("fp-contract=off")
namespace lean_avx2 {
#include "simd_avx2.h"
#include "sparse_adamw_lean_simd.h"
}  // namespace lean_avx2
#pragma GCC pop_options
#endif  // SIFT_X86_SIMD

// The form "auto" runs (cpu_isa.h): the lean step has no AVX-512 form, AVX-512 CPUs run AVX2.
AutoIsa& lean_isa() {
  static AutoIsa isa(std::min(detect_step_isa(), Isa::avx2), detect_step_isa());
  return isa;
}

// Entries [begin, end) of one tensor: flat positions decoded (int32 for the SIMD form), then
// the update pass.
template <typename W, typename G, bool COMPACT>
void lean_chunk(W* __restrict w, const G* __restrict g_src, const int16_t* __restrict low,
                const int32_t* __restrict offsets, int64_t n_windows, c10::BFloat16* __restrict m,
                c10::BFloat16* __restrict v, int8_t* __restrict residual, int64_t begin, int64_t end, int64_t k,
                int64_t numel, uint32_t step, float step_size, float inv_bc2_sqrt, const Hyper& h, Isa isa) {
  const int64_t n = end - begin;
  // The next chunk's first entries are decoded too, for the prefetches (their low halves are
  // checked with that chunk; a prefetch never faults).
  const int64_t decode_end = std::min(k, end + LEAN_PREFETCH_DISTANCE);
  const int64_t n_ahead = decode_end - begin;
  const bool simd = isa != Isa::generic && numel <= std::numeric_limits<int32_t>::max();
  // The flat positions of the chunk first (the window walk stays out of the update loop, and
  // the prefetches use exact addresses).
  int64_t flat64[LEAN_CHUNK + LEAN_PREFETCH_DISTANCE];
  alignas(64) int32_t flat32[LEAN_CHUNK + LEAN_PREFETCH_DISTANCE];
  int64_t win = std::upper_bound(offsets, offsets + n_windows + 1, static_cast<int32_t>(begin)) - offsets - 1;
  for (int64_t j = begin; j < decode_end; ++win) {
    const int64_t stop = std::min<int64_t>(decode_end, offsets[win + 1]);
    const int64_t window_base = win << LEAN_WINDOW_BITS;
    if (simd) {
      for (; j < stop; ++j) flat32[j - begin] = static_cast<int32_t>(window_base + static_cast<uint16_t>(low[j]));
    } else {
      for (; j < stop; ++j) flat64[j - begin] = window_base + static_cast<uint16_t>(low[j]);
    }
  }
  for (int64_t t = 0; t < std::min<int64_t>(n, LEAN_PREFETCH_DISTANCE); ++t) {
    const int64_t q = simd ? flat32[t] : flat64[t];
    if (!COMPACT) __builtin_prefetch(g_src + q, 0, 3);
    __builtin_prefetch(w + q, 1, 3);
  }
#ifdef SIFT_X86_SIMD
  if (simd) {
    return lean_avx2::lean_entries_simd<W, G, COMPACT>(w, g_src, flat32, m, v, residual, begin, n, n_ahead, step,
                                                       step_size, inv_bc2_sqrt, h);
  }
#endif
  if (simd) {
    lean_entries<W, G, int32_t, COMPACT>(w, g_src, flat32, m, v, residual, begin, 0, n, n_ahead, step, step_size,
                                         inv_bc2_sqrt, h);
  } else {
    lean_entries<W, G, int64_t, COMPACT>(w, g_src, flat64, m, v, residual, begin, 0, n, n_ahead, step, step_size,
                                         inv_bc2_sqrt, h);
  }
}

// First position in [begin, end) of tensor i whose low half breaks the layout (not above the
// previous entry of its window, or past the weight in the last window), else -1. Checked per
// chunk, just before the chunk is stepped, as the exact step does.
int64_t first_bad_low(const int16_t* low, const int32_t* offsets, int64_t n_windows, int64_t numel, int64_t begin,
                      int64_t end) {
  int64_t win = std::upper_bound(offsets, offsets + n_windows + 1, static_cast<int32_t>(begin)) - offsets - 1;
  for (int64_t j = begin; j < end; ++win) {
    const int64_t stop = std::min<int64_t>(end, offsets[win + 1]);
    const int64_t limit = std::min<int64_t>(int64_t{1} << LEAN_WINDOW_BITS, numel - (win << LEAN_WINDOW_BITS));
    for (; j < stop; ++j) {
      const int64_t a = static_cast<uint16_t>(low[j]);
      if (a >= limit || (j > offsets[win] && a <= static_cast<uint16_t>(low[j - 1]))) return j;
    }
  }
  return -1;
}

template <typename W>
void dispatch_lean(W* w, const at::Tensor& grad, bool compact, const int16_t* low, const int32_t* off,
                   int64_t n_windows, c10::BFloat16* m, c10::BFloat16* v, int8_t* res, int64_t begin, int64_t end,
                   int64_t k, int64_t numel, uint32_t step, float step_size, float inv_bc2_sqrt, const Hyper& h,
                   Isa isa) {
  if (compact)
    lean_chunk<W, float, true>(w, grad.data_ptr<float>(), low, off, n_windows, m, v, res, begin, end, k, numel, step,
                               step_size, inv_bc2_sqrt, h, isa);
  else
    lean_chunk<W, W, false>(w, grad.data_ptr<W>(), low, off, n_windows, m, v, res, begin, end, k, numel, step,
                            step_size, inv_bc2_sqrt, h, isa);
}

void sparse_adamw_lean_cpu(at::TensorList params, at::TensorList grads, at::TensorList indices_low,
                           at::TensorList window_offsets, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                           at::TensorList residuals, at::TensorList steps, double lr, double beta1, double beta2,
                           double eps, double weight_decay, bool maximize, bool compact_grads,
                           c10::string_view isa_request) {
  const Isa isa = lean_isa().resolve(std::string(isa_request));
  const auto n = static_cast<int64_t>(params.size());
  check_one_per_param(n, {{"grads", grads.size()}, {"indices_low", indices_low.size()},
                          {"window_offsets", window_offsets.size()}, {"exp_avgs", exp_avgs.size()},
                          {"exp_avg_sqs", exp_avg_sqs.size()}, {"steps", steps.size()}});
  const auto dtype = n ? params[0].scalar_type() : at::kFloat;
  const bool low_precision = dtype != at::kFloat;
  if (low_precision) {
    TORCH_CHECK(static_cast<int64_t>(residuals.size()) == n, "residuals must have one tensor per bf16/fp16 param");
  } else {
    TORCH_CHECK(residuals.empty(), "residuals must be empty for float32 params");
  }
  std::vector<float> step_size(n), inv_bc2_sqrt(n);
  std::vector<uint32_t> step_count(n);
  std::vector<Segment> work;
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    const int64_t k = indices_low[i].numel();
    const int64_t numel = p.numel();
    const int64_t n_windows = (numel + (int64_t{1} << LEAN_WINDOW_BITS) - 1) >> LEAN_WINDOW_BITS;
    const double t = check_param_grad_step(p, grads[i], steps[i], dtype, compact_grads, k, i);
    TORCH_CHECK(indices_low[i].device().is_cpu() && indices_low[i].scalar_type() == at::kShort &&
                    indices_low[i].dim() == 1 && indices_low[i].is_contiguous(),
                "indices_low must be contiguous 1-D int16 CPU tensors");
    TORCH_CHECK(window_offsets[i].device().is_cpu() && window_offsets[i].scalar_type() == at::kInt &&
                    window_offsets[i].is_contiguous() && window_offsets[i].numel() == n_windows + 1,
                "window_offsets[", i, "] must be contiguous int32 with ceil(numel / 65536) + 1 = ", n_windows + 1,
                " entries, got ", window_offsets[i].numel());
    const int32_t* off = window_offsets[i].data_ptr<int32_t>();
    TORCH_CHECK(off[0] == 0 && off[n_windows] == k, "window_offsets[", i, "] must start at 0 and end at k = ", k);
    for (int64_t w = 0; w < n_windows; ++w) {
      TORCH_CHECK(off[w + 1] >= off[w], "window_offsets[", i, "] must be non-decreasing (position ", w + 1, ")");
    }
    check_compact({&exp_avgs[i], &exp_avg_sqs[i]}, at::kBFloat16, k, "exp_avgs and exp_avg_sqs");
    if (low_precision) check_compact({&residuals[i]}, at::kChar, k, "residuals");
    step_count[i] = static_cast<uint32_t>(static_cast<uint64_t>(t));
    // lr is taken in fp32 (as a device tensor lr is), then lr / bc1 in double.
    const StepScales scales = step_scales(static_cast<double>(static_cast<float>(lr)), beta1, beta2, t);
    step_size[i] = scales.step_size;
    inv_bc2_sqrt[i] = scales.inv_bc2_sqrt;
    for (int64_t b = 0; b < k; b += LEAN_CHUNK) work.push_back({i, b, std::min(k, b + LEAN_CHUNK)});
  }
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, maximize);
  std::vector<int64_t> found(work.size(), -1);
  // A grain of 16 chunks keeps small steps on the calling thread.
  at::parallel_for(0, static_cast<int64_t>(work.size()), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Segment& s = work[c];
      const int64_t i = s.tensor, k = indices_low[i].numel(), numel = params[i].numel();
      const int64_t n_windows = window_offsets[i].numel() - 1;
      const int16_t* low = indices_low[i].data_ptr<int16_t>();
      const int32_t* off = window_offsets[i].data_ptr<int32_t>();
      found[c] = first_bad_low(low, off, n_windows, numel, s.begin, s.end);
      if (found[c] >= 0) continue;
      auto* m = exp_avgs[i].data_ptr<c10::BFloat16>();
      auto* v = exp_avg_sqs[i].data_ptr<c10::BFloat16>();
      int8_t* res = low_precision ? residuals[i].data_ptr<int8_t>() : nullptr;
      switch (dtype) {
        case at::kFloat:
          dispatch_lean<float>(params[i].data_ptr<float>(), grads[i], compact_grads, low, off, n_windows, m, v, res,
                               s.begin, s.end, k, numel, step_count[i], step_size[i], inv_bc2_sqrt[i], h, isa);
          break;
        case at::kBFloat16:
          dispatch_lean<c10::BFloat16>(params[i].data_ptr<c10::BFloat16>(), grads[i], compact_grads, low, off,
                                       n_windows, m, v, res, s.begin, s.end, k, numel, step_count[i], step_size[i],
                                       inv_bc2_sqrt[i], h, isa);
          break;
        case at::kHalf:
          dispatch_lean<c10::Half>(params[i].data_ptr<c10::Half>(), grads[i], compact_grads, low, off, n_windows, m,
                                   v, res, s.begin, s.end, k, numel, step_count[i], step_size[i], inv_bc2_sqrt[i], h,
                                   isa);
          break;
        default:
          TORCH_CHECK(false, "params must be float32, bfloat16 or float16");
      }
    }
  });
  for (size_t c = 0; c < work.size(); ++c) {
    if (found[c] < 0) continue;
    const int64_t i = work[c].tensor;
    TORCH_CHECK(false, "indices_low[", i, "] has ", static_cast<uint16_t>(indices_low[i].data_ptr<int16_t>()[found[c]]),
                " at position ", found[c],
                ": within a window the low halves must be strictly increasing and below the param's end");
  }
}

std::string sparse_adamw_lean_isa() { return isa_name(lean_isa().get()); }
std::string sparse_adamw_lean_isa_levels() { return isa_levels(lean_isa().widest()); }
void sparse_adamw_lean_use_isa(c10::string_view isa) { lean_isa().set(std::string(isa)); }

}  // namespace

// As for the exact step (sparse_adamw.cpp): the form "auto" runs, the forms, the setter.
TORCH_LIBRARY_FRAGMENT(sift, m) {
  m.def("sparse_adamw_lean_isa() -> str", &sparse_adamw_lean_isa);
  m.def("sparse_adamw_lean_isa_levels() -> str", &sparse_adamw_lean_isa_levels);
  m.def("sparse_adamw_lean_use_isa(str isa) -> ()", &sparse_adamw_lean_use_isa);
}

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) { m.impl("sparse_adamw_lean_", &sparse_adamw_lean_cpu); }

}  // namespace sift
