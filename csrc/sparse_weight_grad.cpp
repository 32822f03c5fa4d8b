// Sparse weight gradient on CPU (a sampled dense-dense product): for a linear layer
// y = x W^T + b with W [R, C] and the tokens flattened to T rows,
//   out[j] += sum_t dY[t, idx[j] / C] * X[t, idx[j] % C]      j < k, idx sorted ascending,
// with dY [T, R] and X [T, C] in fp32, bf16 or fp16 and fp32 accumulation. The contract and the
// plain-torch reference are in sift/_ops.py (sparse_weight_grad_ref).
//
// Method. Tokens are taken in blocks of Tb rows. Per block, dY and X are transposed into packed
// fp32 panels Dp [R, Tb] and Xp [C, Tb] (widening bf16/fp16 on the way, zero-padding Tb to a
// multiple of 8), so every entry's partial sum is a dot product of two contiguous Tb-float
// vectors. The sorted indices are walked row by row: the dY^T row stays in L1 while it is
// dotted with each of its columns, four columns at a time (four independent FMA chains and one
// horizontal reduction for the four), with the X columns of later entries prefetched. Each
// block adds its partial sums into out, so the result is summed in fp32 over Tb-token blocks.
//
// Threads split the tokens, not the entries: each sums its own range of tokens for every entry,
// with its own panels, into a [k] partial sum (the first thread's is out itself), and the
// partial sums are added at the end. So no thread waits for another until that final sum: on
// a machine shared with other work, a barrier per token block (shared panels) cost a
// scheduler time slice whenever one thread was preempted (6x slower at 2048 tokens, 2 cores).
// The price is a [k] fp32 buffer per extra thread, and a sum whose order of tokens depends on
// the thread count (every order is fp32 over fp32 products).
//
// The dot-product body is compiled for AVX2+FMA and generically, and chosen at run time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_isa.h"
#include "index_check.h"

#ifdef SIFT_X86_SIMD
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace sift {
namespace {

// Packed token rows are padded to a multiple of this (one AVX2 vector of fp32).
constexpr int64_t LANES = 8;
// Columns transposed per tile of the scalar packing pass: the tile's destination lines stay in L1.
constexpr int64_t PACK_COLS = 64;
// Each thread sums a range of at least this many tokens for every entry.
constexpr int64_t MIN_GROUP_TOKENS = 32;
// Multiply-adds (and packed values) a thread should have before another one helps: below
// about 100 microseconds of work, waking a thread costs more than it saves.
constexpr int64_t MIN_THREAD_WORK = int64_t{1} << 18;
// Entries per task of the final sum of the threads' partial sums.
constexpr int64_t REDUCE_GRAIN = int64_t{1} << 14;
// The X columns of the entry this far ahead are prefetched: the columns of a row are scattered
// over the packed panel, which the hardware prefetcher cannot follow.
constexpr int64_t PREFETCH_ENTRIES = 8;

Isa detect_isa() {
#ifdef SIFT_X86_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::generic;
}

// Tokens per block. Each entry reads a Tb-float segment of the packed X panel [C, Tb]: longer
// segments amortise the reduction and the update of out, and let the prefetched lines stream,
// while a smaller panel stays nearer the core. Measured on a 2-core EPYC (Zen 3): 16 tokens
// was 2x slower than 64 at C = 11008; 64 to 256 were alike within the noise.
int64_t choose_token_block(int64_t T, int64_t C) {
  int64_t tb = (int64_t{1} << 20) / (4 * std::max<int64_t>(C, 1));
  tb = std::clamp<int64_t>(tb / LANES * LANES, 64, 256);
  return std::min(tb, (T + LANES - 1) / LANES * LANES);
}

// dst[c * tbp + t] = float(src[(t0 + t) * ld + c]) for c in [c0, c1), t < tb; zero for t in [tb, tbp).
template <typename S>
void pack_transposed(const S* __restrict src, int64_t ld, int64_t t0, int64_t tb, int64_t tbp, int64_t c0,
                     int64_t c1, float* __restrict dst, int64_t dst_ld) {
  for (int64_t cb = c0; cb < c1; cb += PACK_COLS) {
    const int64_t ce = std::min(c1, cb + PACK_COLS);
    for (int64_t t = 0; t < tb; ++t) {
      const S* row = src + (t0 + t) * ld;
      for (int64_t c = cb; c < ce; ++c) dst[c * dst_ld + t] = static_cast<float>(row[c]);
    }
    for (int64_t c = cb; c < ce; ++c) {
      for (int64_t t = tb; t < tbp; ++t) dst[c * dst_ld + t] = 0.0f;
    }
  }
}

#ifdef SIFT_X86_SIMD
// 8 consecutive values of src widened to fp32.
template <typename S>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load8(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<S, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// pack_transposed with 8 x 8 register transposes: 32-byte loads and stores instead of
// one strided store per element.
template <typename S>
__attribute__((target("avx2,fma,f16c"))) void pack_transposed_avx2(const S* __restrict src, int64_t ld, int64_t t0,
                                                                   int64_t tb, int64_t tbp, int64_t c0, int64_t c1,
                                                                   float* __restrict dst) {
  const int64_t t8 = tb / LANES * LANES;
  int64_t c = c0;
  for (; c + LANES <= c1; c += LANES) {
    for (int64_t t = 0; t < t8; t += LANES) {
      const S* p = src + (t0 + t) * ld + c;
      const __m256 r0 = load8(p), r1 = load8(p + ld), r2 = load8(p + 2 * ld), r3 = load8(p + 3 * ld);
      const __m256 r4 = load8(p + 4 * ld), r5 = load8(p + 5 * ld), r6 = load8(p + 6 * ld), r7 = load8(p + 7 * ld);
      const __m256 u0 = _mm256_unpacklo_ps(r0, r1), u1 = _mm256_unpackhi_ps(r0, r1);
      const __m256 u2 = _mm256_unpacklo_ps(r2, r3), u3 = _mm256_unpackhi_ps(r2, r3);
      const __m256 u4 = _mm256_unpacklo_ps(r4, r5), u5 = _mm256_unpackhi_ps(r4, r5);
      const __m256 u6 = _mm256_unpacklo_ps(r6, r7), u7 = _mm256_unpackhi_ps(r6, r7);
      const __m256 v0 = _mm256_shuffle_ps(u0, u2, 0x44), v1 = _mm256_shuffle_ps(u0, u2, 0xEE);
      const __m256 v2 = _mm256_shuffle_ps(u1, u3, 0x44), v3 = _mm256_shuffle_ps(u1, u3, 0xEE);
      const __m256 v4 = _mm256_shuffle_ps(u4, u6, 0x44), v5 = _mm256_shuffle_ps(u4, u6, 0xEE);
      const __m256 v6 = _mm256_shuffle_ps(u5, u7, 0x44), v7 = _mm256_shuffle_ps(u5, u7, 0xEE);
      float* q = dst + c * tbp + t;
      _mm256_storeu_ps(q, _mm256_permute2f128_ps(v0, v4, 0x20));
      _mm256_storeu_ps(q + tbp, _mm256_permute2f128_ps(v1, v5, 0x20));
      _mm256_storeu_ps(q + 2 * tbp, _mm256_permute2f128_ps(v2, v6, 0x20));
      _mm256_storeu_ps(q + 3 * tbp, _mm256_permute2f128_ps(v3, v7, 0x20));
      _mm256_storeu_ps(q + 4 * tbp, _mm256_permute2f128_ps(v0, v4, 0x31));
      _mm256_storeu_ps(q + 5 * tbp, _mm256_permute2f128_ps(v1, v5, 0x31));
      _mm256_storeu_ps(q + 6 * tbp, _mm256_permute2f128_ps(v2, v6, 0x31));
      _mm256_storeu_ps(q + 7 * tbp, _mm256_permute2f128_ps(v3, v7, 0x31));
    }
  }
  // The token tail (tb % 8 rows) of the full column groups, then the last c1 % 8 columns.
  if (t8 < tbp) pack_transposed(src, ld, t0 + t8, tb - t8, tbp - t8, c0, c, dst + t8, tbp);
  if (c < c1) pack_transposed(src, ld, t0, tb, tbp, c, c1, dst, tbp);
}
#endif

// out[j] += dot(d, xp + cols[j] * tbp) over tbp floats, for j in [j0, j1): one row's entries.
void row_dots_generic(const float* __restrict d, const float* __restrict xp, int64_t tbp,
                      const int32_t* __restrict cols, int64_t j0, int64_t j1, float* __restrict out) {
  for (int64_t j = j0; j < j1; ++j) {
    const float* x = xp + static_cast<int64_t>(cols[j]) * tbp;
    float acc[LANES] = {};
    for (int64_t t = 0; t < tbp; t += LANES) {
      for (int64_t l = 0; l < LANES; ++l) acc[l] += d[t + l] * x[t + l];
    }
    out[j] += ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  }
}

#ifdef SIFT_X86_SIMD
// row_dots_generic with FMA, four entries at a time; `k` bounds the prefetch look-ahead.
__attribute__((target("avx2,fma"))) void row_dots_avx2(const float* __restrict d, const float* __restrict xp,
                                                         int64_t tbp, const int32_t* __restrict cols, int64_t j0,
                                                         int64_t j1, int64_t k, float* __restrict out) {
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    for (int64_t a = j + PREFETCH_ENTRIES, stop = std::min(k, a + 4); a < stop; ++a) {
      const char* p = reinterpret_cast<const char*>(xp + static_cast<int64_t>(cols[a]) * tbp);
      for (int64_t b = 0; b < tbp * 4; b += 64) __builtin_prefetch(p + b, 0, 3);
    }
    const float* x0 = xp + static_cast<int64_t>(cols[j]) * tbp;
    const float* x1 = xp + static_cast<int64_t>(cols[j + 1]) * tbp;
    const float* x2 = xp + static_cast<int64_t>(cols[j + 2]) * tbp;
    const float* x3 = xp + static_cast<int64_t>(cols[j + 3]) * tbp;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t t = 0; t < tbp; t += LANES) {
      const __m256 dv = _mm256_loadu_ps(d + t);
      a0 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x0 + t), a0);
      a1 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x1 + t), a1);
      a2 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x2 + t), a2);
      a3 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x3 + t), a3);
    }
    // [sum a0, sum a1, sum a2, sum a3] in one register.
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    _mm_storeu_ps(out + j, _mm_add_ps(_mm_loadu_ps(out + j), r));
  }
  for (; j < j1; ++j) {
    const float* x = xp + static_cast<int64_t>(cols[j]) * tbp;
    __m256 a = _mm256_setzero_ps();
    for (int64_t t = 0; t < tbp; t += LANES) a = _mm256_fmadd_ps(_mm256_loadu_ps(d + t), _mm256_loadu_ps(x + t), a);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[j] += _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
}
#endif

template <typename S>
void pack(const S* src, int64_t ld, int64_t t0, int64_t tb, int64_t tbp, int64_t c0, int64_t c1, float* dst, Isa isa) {
#ifdef SIFT_X86_SIMD
  if (isa != Isa::generic) return pack_transposed_avx2(src, ld, t0, tb, tbp, c0, c1, dst);
#endif
  pack_transposed(src, ld, t0, tb, tbp, c0, c1, dst, tbp);
}

// Adds one token block's partial sums of entries [j0, j1) into out, one run of a row's entries
// at a time (its dY^T row stays in L1 across them).
template <typename I>
void chunk_dots(const float* dp, const float* xp, int64_t tbp, const I* idx, const int32_t* cols, int64_t j0,
                int64_t j1, int64_t k, int64_t n_cols, float* out, Isa isa) {
  for (int64_t j = j0; j < j1;) {
    const int64_t row = static_cast<int64_t>(idx[j]) / n_cols;
    const int64_t next_row = (row + 1) * n_cols;
    int64_t e = j + 1;
    while (e < j1 && static_cast<int64_t>(idx[e]) < next_row) ++e;
    const float* d = dp + row * tbp;
#ifdef SIFT_X86_SIMD
    if (isa != Isa::generic)
      row_dots_avx2(d, xp, tbp, cols, j, e, k, out);
    else
#endif
      row_dots_generic(d, xp, tbp, cols, j, e, out);
    j = e;
  }
}

template <typename S, typename I>
void run(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& indices, at::Tensor& out, Isa isa,
         int64_t token_block) {
  const int64_t T = dy.size(0), R = dy.size(1), C = x.size(1), k = indices.numel();
  const int64_t tb_max = token_block > 0 ? token_block : choose_token_block(T, C);
  const int64_t tbp_max = (tb_max + LANES - 1) / LANES * LANES;
  const int64_t work = (k + R + C) * T;  // multiply-adds plus packed values
  const int64_t groups = std::clamp<int64_t>(
      std::min({static_cast<int64_t>(at::get_num_threads()), T / MIN_GROUP_TOKENS, work / MIN_THREAD_WORK}), 1,
      std::max<int64_t>(1, at::get_num_threads()));
  // Column of every entry, computed once for all token blocks (no division in the dot loops).
  const at::Tensor col_tensor = indices.remainder(C).to(at::kInt);
  const int32_t* cols = col_tensor.data_ptr<int32_t>();
  // Per group: its panels Dp [R, Tb] and Xp [C, Tb]; groups after the first also a [k] partial sum.
  const int64_t panel_floats = (R + C) * tbp_max;
  at::Tensor scratch = at::empty({groups * panel_floats + (groups - 1) * k}, out.options());
  float* panels = scratch.data_ptr<float>();
  float* partials = panels + groups * panel_floats;
  const S* dy_ptr = dy.data_ptr<S>();
  const S* x_ptr = x.data_ptr<S>();
  const I* idx = indices.data_ptr<I>();
  float* o = out.data_ptr<float>();
  const int64_t ld_dy = dy.stride(0), ld_x = x.stride(0);
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      float* dp = panels + g * panel_floats;
      float* xp = dp + R * tbp_max;
      float* acc = g == 0 ? o : partials + (g - 1) * k;
      if (g > 0) std::fill(acc, acc + k, 0.0f);
      for (int64_t t0 = T * g / groups, t_end = T * (g + 1) / groups; t0 < t_end; t0 += tb_max) {
        const int64_t tb = std::min(tb_max, t_end - t0);
        const int64_t tbp = (tb + LANES - 1) / LANES * LANES;
        pack(dy_ptr, ld_dy, t0, tb, tbp, 0, R, dp, isa);
        pack(x_ptr, ld_x, t0, tb, tbp, 0, C, xp, isa);
        chunk_dots<I>(dp, xp, tbp, idx, cols, 0, k, k, C, acc, isa);
      }
    }
  });
  if (groups > 1) {
    at::parallel_for(0, k, REDUCE_GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t g = 1; g < groups; ++g) {
        const float* part = partials + (g - 1) * k;
        for (int64_t j = lo; j < hi; ++j) o[j] += part[j];
      }
    });
  }
}

void sparse_weight_grad_cpu(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& indices,
                            at::Tensor& out, c10::string_view isa_request, int64_t token_block) {
  static const Isa best = detect_isa();
  const Isa isa = isa_from_request(std::string(isa_request), best);
  TORCH_CHECK(grad_output.dim() == 2, "grad_output must be 2-D [T, R], got ", grad_output.dim(), "-D");
  TORCH_CHECK(input.dim() == 2, "input must be 2-D [T, C], got ", input.dim(), "-D");
  TORCH_CHECK(grad_output.size(0) == input.size(0), "grad_output and input must have the same number of rows, got ",
              grad_output.size(0), " and ", input.size(0));
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "grad_output and input must have the same dtype, got ",
              grad_output.scalar_type(), " and ", input.scalar_type());
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "input must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(grad_output.size(1) == 0 || grad_output.stride(1) == 1, "grad_output rows must be contiguous");
  TORCH_CHECK(input.size(1) == 0 || input.stride(1) == 1, "input rows must be contiguous");
  TORCH_CHECK(indices.dim() == 1 && indices.is_contiguous(), "indices must be 1-D and contiguous");
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong,
              "indices must be int32 or int64, got ", indices.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == indices.numel(),
              "out must be a contiguous float32 [k] tensor with k = indices.numel() = ", indices.numel());
  for (const at::Tensor* t : {&grad_output, &input, &indices, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu(), "sparse_weight_grad_ takes CPU tensors");
  }
  const int64_t k = indices.numel();
  const int64_t limit = grad_output.size(1) * input.size(1);
  // The op is public (torch.ops.sift.*): an index outside [0, R * C) would be a wild read, a
  // repeated one a race on out between threads.
  if (k > 0) {
    const int64_t bad = index_check::first_violation_in(indices, 0, k, limit);
    if (bad >= 0) {
      const int64_t value = index_check::index_at(indices, bad);
      TORCH_CHECK(value >= 0 && value < limit, "indices has ", value, " at position ", bad, ", outside [0, ", limit,
                  ")");
      TORCH_CHECK(false, "indices must be strictly increasing: ", value, " at position ", bad, " is not above ",
                  index_check::index_at(indices, bad - 1));
    }
  }
  TORCH_CHECK(input.size(1) <= std::numeric_limits<int32_t>::max(), "input has more columns than int32 holds");
  TORCH_CHECK(token_block >= 0, "token_block must be >= 0 (0 chooses it), got ", token_block);
  if (k == 0 || input.size(0) == 0) return;
  at::Tensor dy = grad_output, x = input;
  const bool i32 = indices.scalar_type() == at::kInt;
  switch (dtype) {
    case at::kFloat:
      i32 ? run<float, int32_t>(dy, x, indices, out, isa, token_block)
          : run<float, int64_t>(dy, x, indices, out, isa, token_block);
      break;
    case at::kBFloat16:
      i32 ? run<c10::BFloat16, int32_t>(dy, x, indices, out, isa, token_block)
          : run<c10::BFloat16, int64_t>(dy, x, indices, out, isa, token_block);
      break;
    default:
      i32 ? run<c10::Half, int32_t>(dy, x, indices, out, isa, token_block)
          : run<c10::Half, int64_t>(dy, x, indices, out, isa, token_block);
      break;
  }
}

std::string sparse_weight_grad_isa() {
  static const Isa best = detect_isa();
  return isa_name(best);
}

}  // namespace

// Which SIMD form the kernel picked on this CPU (python -m sift.env): C++-only, so defined here.
TORCH_LIBRARY_FRAGMENT(sift, m) { m.def("sparse_weight_grad_isa() -> str", &sparse_weight_grad_isa); }

// The op's schema, argument checks and fake kernel are defined once in sift/_ops.py; this is its CPU
// kernel. The checks kept here guard memory when the kernel is called directly (torch.ops.sift.*).
TORCH_LIBRARY_IMPL(sift, CPU, m) { m.impl("sparse_weight_grad_", &sparse_weight_grad_cpu); }

}  // namespace sift
