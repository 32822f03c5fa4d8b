// Fused SparseAdamW step on CPU: gather grad[idx] and w[idx], update the compact fp32
// moments, scatter the new weights. The math is the contract in sift/_ops/
// (sparse_adamw_ref); this file is its C++/OpenMP implementation.
//
// Work is cut into chunks of CHUNK entries over all tensors so OpenMP balances tensors of
// very different sizes. Each entry is gathered, updated and scattered in one pass; the sorted
// indices let the loop prefetch the lines it reads (the grad's, and the weight's when there is
// no base) PREFETCH_DISTANCE entries ahead, across chunk boundaries. One pass beats gathering
// into buffers, vectorising the math and scattering: the gathers dominate, and the buffered
// form's short-range prefetch fought the hardware prefetcher (figures in bench/results/README.md).
//
// With int32 indices the pass also has SIMD forms (sparse_adamw_simd.h); isa="auto" runs the one
// sift's loader measured fastest on this machine (cpu_isa.h, sift/_simd.py). fp32 weights:
// AVX-512 gathers 16 grads and weights per instruction and scatters the 16 new weights; AVX2
// gathers 8 and stores them one by one. bf16/fp16 weights (rebuilt from base + delta): the 16-bit
// grads are gathered as 4-byte words, and the new weights rounded in vector registers exactly as
// c10's conversions round, then stored one by one (there is no 16-bit scatter). The AVX-512 form
// prefetches the weight lines with PREFETCHW, which fetches a line ready to be written; the AVX2
// form and the scalar loop leave a weight they only write to the store buffer (faster on the AMD
// EPYC measured). With the data in cache the scalar loop is bound by its divide and square root,
// which the SIMD forms widen; on large tensors the step waits on memory, so there wider math wins
// less. The figures are in bench/results/README.md ("Performance notes"). The SIMD forms and the
// scalar loop are compiled with fp-contract off (also under -march flags that enable FMA) and do
// the same operations in the same order: every form gives bit-identical results, rounding ties
// included (tested); only a NaN made from two NaN operands may differ in payload.

#include "sparse_adamw_common.h"
#include "index_check.h"

namespace sift {
namespace {

constexpr int64_t CHUNK = 512;
constexpr int64_t PREFETCH_DISTANCE = 32;

// fp-contract off: with -march flags that enable FMA, GCC would otherwise fuse a multiply
// and an add here and no longer agree with the SIMD forms (or with the operation order the
// reference documents).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename W, typename G, typename I, bool COMPACT, bool HAS_BASE>
void adamw_chunk(W* __restrict w, const G* __restrict g_src, const I* __restrict idx, float* __restrict m,
                 float* __restrict v, float* __restrict d, const W* __restrict base, int64_t begin, int64_t end,
                 int64_t k, float step_size, float inv_bc2_sqrt, const Hyper& h) {
  const float sign = h.maximize ? -1.0f : 1.0f;
  const float one_minus_b1 = h.one_minus_b1;
  const float one_minus_b2 = h.one_minus_b2;
  const float decay = h.lr * h.weight_decay;
  for (int64_t j = begin; j < end; ++j) {
    // Only lines the update reads are prefetched: with a base the weight is only written, and
    // its store waits on the line in the store buffer, off the loop's critical path.
    if ((!COMPACT || !HAS_BASE) && j + PREFETCH_DISTANCE < k) {
      const int64_t ahead = static_cast<int64_t>(idx[j + PREFETCH_DISTANCE]);
      if (!COMPACT) __builtin_prefetch(g_src + ahead, 0, 3);
      if (!HAS_BASE) __builtin_prefetch(w + ahead, 1, 3);
    }
    const int64_t q = static_cast<int64_t>(idx[j]);
    const float gj = sign * static_cast<float>(COMPACT ? g_src[j] : g_src[q]);
    const float wj = HAS_BASE ? static_cast<float>(base[j]) + d[j] : static_cast<float>(w[q]);
    const float mj = h.beta1 * m[j] + one_minus_b1 * gj;
    const float vj = h.beta2 * v[j] + one_minus_b2 * gj * gj;
    m[j] = mj;
    v[j] = vj;
    const float upd = -decay * wj - step_size * mj / (std::sqrt(vj) * inv_bc2_sqrt + h.eps);
    const float dj = d[j] + upd;
    d[j] = dj;
    w[q] = static_cast<W>(HAS_BASE ? static_cast<float>(base[j]) + dj : wj + upd);
  }
}
#pragma GCC pop_options

#ifdef SIFT_X86_SIMD
// The SIMD forms (sparse_adamw_simd.h), one namespace per instruction set. The AVX-512 form
// prefetches the weight lines it only writes with PREFETCHW (every AVX-512 CPU has it;
// detect_step_isa checks); the AVX2 form, which also serves Haswell (no PREFETCHW), prefetches
// only the lines it reads, with PREFETCHT0.

#pragma GCC push_options
#pragma GCC target("avx512f,prfchw")
#pragma GCC optimize("fp-contract=off")
namespace adamw_avx512 {
using V = __m512;
using Mask = __mmask16;
constexpr int64_t W = 16;
inline Mask lanes(int64_t n) { return static_cast<Mask>((1u << n) - 1u); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V loadu(const float* p, Mask k) { return _mm512_maskz_loadu_ps(k, p); }
inline V loadu(const float* p, Full) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, V x, Mask k) { _mm512_mask_storeu_ps(p, k, x); }
inline void storeu(float* p, V x, Full) { _mm512_storeu_ps(p, x); }
inline V vsqrt(V x) { return _mm512_sqrt_ps(x); }
inline __m512i load_idx(const int32_t* p, Mask k) { return _mm512_maskz_loadu_epi32(k, p); }
inline __m512i load_idx(const int32_t* p, Full) { return _mm512_loadu_si512(p); }
inline V gather(const float* base, __m512i q, Mask k) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, q, base, 4);
}
inline V gather(const float* base, __m512i q, Full) { return _mm512_i32gather_ps(q, base, 4); }
inline void scatter(float* base, const int32_t*, __m512i q, V x, Mask k, int64_t) {
  _mm512_mask_i32scatter_ps(base, k, q, x, 4);
}
inline void scatter(float* base, const int32_t*, __m512i q, V x, Full, int64_t) { _mm512_i32scatter_ps(base, q, x, 4); }
using VI = __m512i;
inline VI load16(const uint16_t* p, int64_t n) {
  if (n == W) return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const Tail16<W> tail(p, n);
  return _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(tail.v)));
}
inline VI gather16(const uint16_t* base, __m512i q, Mask k) {
  const VI words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, q, base, 2);
  return _mm512_and_si512(words, _mm512_set1_epi32(0xFFFF));
}
inline VI gather16(const uint16_t* base, __m512i q, Full) {
  return _mm512_and_si512(_mm512_i32gather_epi32(q, base, 2), _mm512_set1_epi32(0xFFFF));
}
inline void pack16(uint16_t* out, VI x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(x)); }
inline V widen_f16(VI x) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)); }
inline void narrow_f16(uint16_t* out, V x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
inline unsigned nan_lanes(V x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
constexpr bool PREFETCH_WRITTEN_WEIGHTS = true;  // PREFETCHW ahead of the scatter (not measured against none)
#include "sparse_adamw_simd.h"
}  // namespace adamw_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#pragma GCC optimize("fp-contract=off")
namespace adamw_avx2 {
#include "simd_avx2.h"
constexpr bool PREFETCH_WRITTEN_WEIGHTS = false;  // measured slower on the AMD EPYC
#include "sparse_adamw_simd.h"
}  // namespace adamw_avx2
#pragma GCC pop_options
#endif  // SIFT_X86_SIMD

// The form "auto" runs (cpu_isa.h); every form of the step exists for the CPU's widest level.
AutoIsa& adamw_isa() {
  static AutoIsa isa(detect_step_isa(), detect_step_isa());
  return isa;
}

// Each chunk's indices are checked (index_check.h) just before the chunk is stepped: they then
// sit in L1 for the step, where a separate pass over all indices would read them cold from
// memory once more. A bad chunk is skipped and afterwards the first bad index raises: the step may then be
// partly applied, but nothing outside the params is ever written.
void raise_first_bad_index(at::TensorList indices, const std::vector<Segment>& work,
                           const std::vector<int64_t>& found, at::TensorList params) {
  for (size_t c = 0; c < work.size(); ++c) {
    if (found[c] < 0) continue;
    const int64_t i = work[c].tensor, numel = params[i].numel();
    TORCH_CHECK(false, "indices must lie in [0, param.numel()) and be strictly increasing: ",
                index_check::describe_violation(indices, {i, found[c]}, numel, c10::str(numel)));
  }
}

// One chunk's operands: tensor i of the lists, entries [begin, end) of its indices.
struct ChunkArgs {
  const at::Tensor& p;
  const at::Tensor& grad;
  const at::Tensor& idx;
  const at::Tensor& m;
  const at::Tensor& v;
  const at::Tensor& d;
  const at::Tensor* base;
  int64_t begin, end;
  float step_size, inv_bc2_sqrt;
};

template <typename W, typename G, typename I, bool COMPACT, bool HAS_BASE>
void run_chunk(const ChunkArgs& a, const Hyper& h, Isa isa) {
  W* w = a.p.data_ptr<W>();
  const G* g = a.grad.data_ptr<G>();
  const I* idx = a.idx.data_ptr<I>();
  float *m = a.m.data_ptr<float>(), *v = a.v.data_ptr<float>(), *d = a.d.data_ptr<float>();
  const int64_t k = a.idx.numel();
#ifdef SIFT_X86_SIMD
  if constexpr (std::is_same_v<W, float> && std::is_same_v<I, int32_t>) {
    const float* base = HAS_BASE ? a.base->data_ptr<float>() : nullptr;
    if (isa == Isa::avx512)
      return adamw_avx512::chunk<COMPACT, HAS_BASE>(w, g, idx, m, v, d, base, a.begin, a.end, k, a.step_size,
                                                    a.inv_bc2_sqrt, h);
    if (isa == Isa::avx2)
      return adamw_avx2::chunk<COMPACT, HAS_BASE>(w, g, idx, m, v, d, base, a.begin, a.end, k, a.step_size,
                                                  a.inv_bc2_sqrt, h);
  }
  if constexpr (!std::is_same_v<W, float> && std::is_same_v<I, int32_t> && HAS_BASE) {
    const W* base = a.base->data_ptr<W>();
    const int64_t numel = a.p.numel();
    if (isa == Isa::avx512)
      return adamw_avx512::chunk_lowp<W, COMPACT>(w, g, idx, m, v, d, base, a.begin, a.end, k, numel, a.step_size,
                                                  a.inv_bc2_sqrt, h);
    if (isa == Isa::avx2)
      return adamw_avx2::chunk_lowp<W, COMPACT>(w, g, idx, m, v, d, base, a.begin, a.end, k, numel, a.step_size,
                                                a.inv_bc2_sqrt, h);
  }
#endif
  adamw_chunk<W, G, I, COMPACT, HAS_BASE>(w, g, idx, m, v, d, HAS_BASE ? a.base->data_ptr<W>() : nullptr, a.begin,
                                          a.end, k, a.step_size, a.inv_bc2_sqrt, h);
}

template <typename W, typename I, bool HAS_BASE>
void dispatch_grad(const ChunkArgs& a, bool compact, const Hyper& h, Isa isa) {
  if (compact) run_chunk<W, float, I, true, HAS_BASE>(a, h, isa);
  else run_chunk<W, W, I, false, HAS_BASE>(a, h, isa);
}

template <typename W>
void dispatch_chunk(const ChunkArgs& a, bool compact, const Hyper& h, Isa isa) {
  const bool i32 = a.idx.scalar_type() == at::kInt;
  if (a.base) {
    if (i32) dispatch_grad<W, int32_t, true>(a, compact, h, isa);
    else dispatch_grad<W, int64_t, true>(a, compact, h, isa);
  } else {
    if (i32) dispatch_grad<W, int32_t, false>(a, compact, h, isa);
    else dispatch_grad<W, int64_t, false>(a, compact, h, isa);
  }
}

void sparse_adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList indices, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList deltas, at::TensorList bases, at::TensorList steps,
                      double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                      bool compact_grads, c10::string_view isa_request) {
  const Isa isa = adamw_isa().resolve(std::string(isa_request));
  const auto n = static_cast<int64_t>(params.size());
  check_one_per_param(n, {{"grads", grads.size()}, {"indices", indices.size()}, {"exp_avgs", exp_avgs.size()},
                          {"exp_avg_sqs", exp_avg_sqs.size()}, {"deltas", deltas.size()}, {"steps", steps.size()}});
  TORCH_CHECK(bases.empty() || static_cast<int64_t>(bases.size()) == n, "bases must be empty or one tensor per param");
  std::vector<float> step_size(n), inv_bc2_sqrt(n);
  std::vector<Segment> work;
  const auto dtype = n ? params[0].scalar_type() : at::kFloat;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = indices[i].numel();
    const double t = check_param_grad_step(params[i], grads[i], steps[i], dtype, compact_grads, k, i);
    TORCH_CHECK(indices[i].device().is_cpu() && indices[i].dim() == 1 && indices[i].is_contiguous(),
                "indices must be contiguous 1-D CPU tensors");
    TORCH_CHECK(indices[i].scalar_type() == at::kInt || indices[i].scalar_type() == at::kLong,
                "indices must be int32 or int64");
    check_compact({&exp_avgs[i], &exp_avg_sqs[i], &deltas[i]}, at::kFloat, k, "exp_avgs, exp_avg_sqs and deltas");
    if (!bases.empty()) {
      check_compact({&bases[i]}, dtype, k, "bases");
    } else {
      TORCH_CHECK(dtype == at::kFloat, "bases are required for non-fp32 params");
    }
    const StepScales scales = step_scales(lr, beta1, beta2, t);
    step_size[i] = scales.step_size;
    inv_bc2_sqrt[i] = scales.inv_bc2_sqrt;
    for (int64_t b = 0; b < k; b += CHUNK) work.push_back({i, b, std::min(k, b + CHUNK)});
  }
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, maximize);
  // A grain of 16 chunks (8192 entries) keeps small steps on the calling thread, where
  // waking the pool would cost more than the work.
  std::vector<int64_t> found(work.size(), -1);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Segment& s = work[c];
      const int64_t i = s.tensor;
      found[c] = index_check::first_violation_in(indices[i], s.begin, s.end, params[i].numel());
      if (found[c] >= 0) continue;
      const ChunkArgs args{params[i], grads[i], indices[i], exp_avgs[i], exp_avg_sqs[i], deltas[i],
                           bases.empty() ? nullptr : &bases[i], s.begin, s.end, step_size[i], inv_bc2_sqrt[i]};
      switch (dtype) {
        case at::kFloat:
          dispatch_chunk<float>(args, compact_grads, h, isa);
          break;
        case at::kBFloat16:
          dispatch_chunk<c10::BFloat16>(args, compact_grads, h, isa);
          break;
        case at::kHalf:
          dispatch_chunk<c10::Half>(args, compact_grads, h, isa);
          break;
        default:
          TORCH_CHECK(false, "params must be float32, bfloat16 or float16");
      }
    }
  });
  raise_first_bad_index(indices, work, found, params);
}

std::string sparse_adamw_isa() { return isa_name(adamw_isa().get()); }
std::string sparse_adamw_isa_levels() { return isa_levels(adamw_isa().widest()); }
void sparse_adamw_use_isa(c10::string_view isa) { adamw_isa().set(std::string(isa)); }

}  // namespace

// The SIMD form isa="auto" runs now, the forms this CPU runs ("generic,avx2"), and the setter
// sift's loader calls with the fastest it measured (sift/_simd.py; python -m sift.env says
// which and why): C++-only, so defined here.
TORCH_LIBRARY_FRAGMENT(sift, m) {
  m.def("sparse_adamw_isa() -> str", &sparse_adamw_isa);
  m.def("sparse_adamw_isa_levels() -> str", &sparse_adamw_isa_levels);
  m.def("sparse_adamw_use_isa(str isa) -> ()", &sparse_adamw_use_isa);
}

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) { m.impl("sparse_adamw_", &sparse_adamw_cpu); }

}  // namespace sift
