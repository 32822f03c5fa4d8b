// Sparse weight gradient on CPU (a sampled dense-dense product): for a linear layer
// y = x W^T + b with W [R, C] and the tokens flattened to T rows,
//   out[j] += sum_t dY[t, idx[j] / C] * X[t, idx[j] % C]      j < k, idx sorted ascending,
// with dY [T, R] and X [T, C] in fp32, bf16 or fp16 and fp32 accumulation. The contract and the
// plain-torch reference are in sift/_ops/ (sparse_weight_grad_ref).
//
// Method. Tokens are taken in blocks of Tb rows. Per block, dY is transposed into a packed fp32
// panel Dp [R, Tb], and X one column block at a time into Xp [Cb, Tb] (widening bf16/fp16 on
// the way, zero-padding Tb to a multiple of 8), so every entry's partial sum is a dot product of
// two contiguous Tb-float vectors. Cb is chosen so that Xp fills half of a 512 KiB L2: the
// entries of a column block are summed together, row by row, so each X column is read from L2
// by every entry of the block that uses it while the dY^T rows stream past in order. The
// entries are planned once per call (their row, their column within the block, and, with more
// than one column block, their place in idx order), summed four at a time (four independent FMA
// chains and one horizontal reduction; four entries of one row load its dY^T segment once), and
// each token block adds its partial sums, so the result is summed in fp32 over Tb-token blocks.
//
// Threads split the tokens, not the entries: each sums its own range of tokens for every entry,
// with its own panels, into a [k] partial sum (the first thread's is out itself when the plan
// keeps idx order), and the partial sums are added at the end. So no thread waits for another
// until that final sum: on a machine shared with other work, a barrier per token block (shared
// panels) cost a scheduler time slice whenever one thread was preempted (6x slower at 2048
// tokens, 2 cores). The price is a [k] fp32 buffer per thread, and a sum whose order of tokens
// depends on the thread count (every order is fp32 over fp32 products). Panels, partial sums
// and plan (10 bytes per entry) live in one scratch block kept from call to call.
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
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

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
// The AVX2 packing pass transposes 8 source rows at a time across a strip of this many
// columns: 8 sequential read streams (many more defeat the hardware prefetcher), and the
// strip's destination lines stay in L2 until the next 8 rows fill their other halves.
constexpr int64_t PACK_STRIP = 512;
// Tokens per block unless the caller asks for another size: longer blocks amortise each
// entry's reduction and update, shorter ones let wider X blocks fit in L2 (fewer passes over dY).
constexpr int64_t TOKEN_BLOCK = 64;
// Larger requests are clipped: the panels' row length stays small.
constexpr int64_t MAX_TOKEN_BLOCK = 4096;
// Bytes of one packed X column block [Cb, Tb]: half of a 512 KiB L2, so the block's columns,
// read by entries of every row in turn, are L2 hits and the dY^T rows stream past them.
constexpr int64_t X_BLOCK_BYTES = int64_t{256} << 10;

Isa detect_isa() {
#ifdef SIFT_X86_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::generic;
}

// log2 of the columns per X block: a power of two (the plan finds an entry's block with a
// shift), at most 2^15 (a column within its block fits 16 bits).
int64_t choose_col_block_log2(int64_t tbp, int64_t C) {
  int64_t log2 = 3;
  while (log2 < 15 && (int64_t{2} << log2) * tbp * 4 <= X_BLOCK_BYTES && (int64_t{1} << log2) < C) ++log2;
  return log2;
}

// dst[(c - c0) * ld_dst + t] = float(src[(t0 + t) * ld + c]) for c in [c0, c1), t < tb; zero for t in [tb, tbp).
template <typename S>
void pack_transposed(const S* __restrict src, int64_t ld, int64_t t0, int64_t tb, int64_t tbp, int64_t c0,
                     int64_t c1, float* __restrict dst, int64_t ld_dst) {
  for (int64_t cb = c0; cb < c1; cb += PACK_COLS) {
    const int64_t ce = std::min(c1, cb + PACK_COLS);
    for (int64_t t = 0; t < tb; ++t) {
      const S* row = src + (t0 + t) * ld;
      for (int64_t c = cb; c < ce; ++c) dst[(c - c0) * ld_dst + t] = static_cast<float>(row[c]);
    }
    for (int64_t c = cb; c < ce; ++c) {
      for (int64_t t = tb; t < tbp; ++t) dst[(c - c0) * ld_dst + t] = 0.0f;
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
                                                                   float* __restrict dst, int64_t ld_dst) {
  const int64_t t8 = tb / LANES * LANES;
  const int64_t c8 = c0 + (c1 - c0) / LANES * LANES;
  for (int64_t cs = c0; cs < c8; cs += PACK_STRIP)
  for (int64_t t = 0; t < t8; t += LANES) {
    for (int64_t c = cs, ce = std::min(cs + PACK_STRIP, c8); c < ce; c += LANES) {
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
      float* q = dst + (c - c0) * ld_dst + t;
      _mm256_storeu_ps(q, _mm256_permute2f128_ps(v0, v4, 0x20));
      _mm256_storeu_ps(q + ld_dst, _mm256_permute2f128_ps(v1, v5, 0x20));
      _mm256_storeu_ps(q + 2 * ld_dst, _mm256_permute2f128_ps(v2, v6, 0x20));
      _mm256_storeu_ps(q + 3 * ld_dst, _mm256_permute2f128_ps(v3, v7, 0x20));
      _mm256_storeu_ps(q + 4 * ld_dst, _mm256_permute2f128_ps(v0, v4, 0x31));
      _mm256_storeu_ps(q + 5 * ld_dst, _mm256_permute2f128_ps(v1, v5, 0x31));
      _mm256_storeu_ps(q + 6 * ld_dst, _mm256_permute2f128_ps(v2, v6, 0x31));
      _mm256_storeu_ps(q + 7 * ld_dst, _mm256_permute2f128_ps(v3, v7, 0x31));
    }
  }
  // The token tail (tb % 8 rows) of the full column groups, then the last c1 % 8 columns.
  if (t8 < tbp) pack_transposed(src, ld, t0 + t8, tb - t8, tbp - t8, c0, c8, dst + t8, ld_dst);
  if (c8 < c1) pack_transposed(src, ld, t0, tb, tbp, c8, c1, dst + (c8 - c0) * ld_dst, ld_dst);
}
#endif

template <typename S>
void pack(const S* src, int64_t ld, int64_t t0, int64_t tb, int64_t tbp, int64_t c0, int64_t c1, float* dst,
          int64_t ld_dst, Isa isa) {
#ifdef SIFT_X86_SIMD
  if (isa != Isa::generic) return pack_transposed_avx2(src, ld, t0, tb, tbp, c0, c1, dst, ld_dst);
#endif
  pack_transposed(src, ld, t0, tb, tbp, c0, c1, dst, ld_dst);
}

// Scratch memory kept from call to call. Fresh pages cost a page fault each on first touch,
// and the panels, partial sums and entry plan are touched once per token block: allocated
// per call, the faults cost as much as the sums at 1% density (a VM with a loaded host).
// One call at a time uses it; a concurrent call allocates its own.
struct Workspace {
  std::mutex mutex;
  std::unique_ptr<char, decltype(&std::free)> data{nullptr, &std::free};
  size_t bytes = 0;

  char* reserve(size_t want) {
    if (want > bytes) {
      data.reset();
      bytes = 0;
      void* p = std::aligned_alloc(64, (want + 63) / 64 * 64);
      TORCH_CHECK(p != nullptr, "sparse_weight_grad_: out of memory for ", want, " bytes of scratch");
      data.reset(static_cast<char*>(p));
      bytes = want;
    }
    return data.get();
  }
};

Workspace& shared_workspace() {
  static Workspace workspace;
  return workspace;
}

// Carves 64-byte aligned arrays out of one block: first a sizing pass (base null), then the real one.
struct Carver {
  char* base;
  size_t used = 0;
  template <typename T>
  T* take(int64_t n) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    return p;
  }
};

// The entries in the order they are summed: column block by column block, by row within one.
// An entry's dY^T row is row[j], its X column col[j] within its block; position[j] is its place
// in idx order (null when the order is idx order: a single column block).
struct EntryPlan {
  int32_t* row = nullptr;
  uint16_t* col = nullptr;
  int32_t* position = nullptr;
  std::vector<int64_t> block_begin;  // entries of column block b: [block_begin[b], block_begin[b + 1])
};

template <typename I>
void plan_entries(const I* idx, int64_t k, int64_t C, int64_t col_log2, EntryPlan& plan) {
  const int64_t n_blocks = ((C - 1) >> col_log2) + 1;
  const int64_t col_mask = (int64_t{1} << col_log2) - 1;
  plan.block_begin.assign(n_blocks + 1, 0);
  // Rows advance without a division: idx is sorted.
  auto for_each = [&](auto&& f) {
    int64_t row = 0, row_start = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t flat = static_cast<int64_t>(idx[j]);
      if (flat >= row_start + C) {
        row = flat / C;
        row_start = row * C;
      }
      f(j, row, flat - row_start);
    }
  };
  if (n_blocks == 1) {
    plan.position = nullptr;
    for_each([&](int64_t j, int64_t row, int64_t col) {
      plan.row[j] = static_cast<int32_t>(row);
      plan.col[j] = static_cast<uint16_t>(col);
    });
    plan.block_begin[1] = k;
    return;
  }
  for_each([&](int64_t, int64_t, int64_t col) { ++plan.block_begin[(col >> col_log2) + 1]; });
  for (int64_t b = 0; b < n_blocks; ++b) plan.block_begin[b + 1] += plan.block_begin[b];
  std::vector<int64_t> next(plan.block_begin.begin(), plan.block_begin.end() - 1);
  for_each([&](int64_t j, int64_t row, int64_t col) {
    const int64_t p = next[col >> col_log2]++;
    plan.row[p] = static_cast<int32_t>(row);
    plan.col[p] = static_cast<uint16_t>(col & col_mask);
    plan.position[p] = static_cast<int32_t>(j);
  });
}

// acc[j] += dot(dp + row[j] * ld, xp + col[j] * ld) over tbp floats, j < n.
void block_dots_generic(const float* __restrict dp, const float* __restrict xp, int64_t ld, int64_t tbp,
                        const int32_t* __restrict row, const uint16_t* __restrict col, int64_t n,
                        float* __restrict acc_out) {
  for (int64_t j = 0; j < n; ++j) {
    const float* d = dp + row[j] * ld;
    const float* x = xp + col[j] * ld;
    float acc[LANES] = {};
    for (int64_t t = 0; t < tbp; t += LANES) {
      for (int64_t l = 0; l < LANES; ++l) acc[l] += d[t + l] * x[t + l];
    }
    acc_out[j] += ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  }
}

#ifdef SIFT_X86_SIMD
// block_dots_generic with FMA, four entries at a time (four independent chains and one
// horizontal reduction for the four); four entries of one row load its dY^T segment once.
__attribute__((target("avx2,fma"))) void block_dots_avx2(const float* __restrict dp, const float* __restrict xp,
                                                           int64_t ld, int64_t tbp, const int32_t* __restrict row,
                                                           const uint16_t* __restrict col, int64_t n,
                                                           float* __restrict acc_out) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* x0 = xp + col[j] * ld;
    const float* x1 = xp + col[j + 1] * ld;
    const float* x2 = xp + col[j + 2] * ld;
    const float* x3 = xp + col[j + 3] * ld;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    if (row[j] == row[j + 3]) {
      const float* d = dp + row[j] * ld;
      for (int64_t t = 0; t < tbp; t += LANES) {
        const __m256 dv = _mm256_loadu_ps(d + t);
        a0 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x0 + t), a0);
        a1 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x1 + t), a1);
        a2 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x2 + t), a2);
        a3 = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x3 + t), a3);
      }
    } else {
      const float* d0 = dp + row[j] * ld;
      const float* d1 = dp + row[j + 1] * ld;
      const float* d2 = dp + row[j + 2] * ld;
      const float* d3 = dp + row[j + 3] * ld;
      for (int64_t t = 0; t < tbp; t += LANES) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(d0 + t), _mm256_loadu_ps(x0 + t), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(d1 + t), _mm256_loadu_ps(x1 + t), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(d2 + t), _mm256_loadu_ps(x2 + t), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(d3 + t), _mm256_loadu_ps(x3 + t), a3);
      }
    }
    // [sum a0, sum a1, sum a2, sum a3] in one register.
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    _mm_storeu_ps(acc_out + j, _mm_add_ps(_mm_loadu_ps(acc_out + j), r));
  }
  for (; j < n; ++j) {
    const float* d = dp + row[j] * ld;
    const float* x = xp + col[j] * ld;
    __m256 a = _mm256_setzero_ps();
    for (int64_t t = 0; t < tbp; t += LANES) a = _mm256_fmadd_ps(_mm256_loadu_ps(d + t), _mm256_loadu_ps(x + t), a);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    acc_out[j] += _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
}
#endif

template <typename S, typename I>
void run(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& indices, at::Tensor& out, Isa isa,
         int64_t token_block) {
  const int64_t T = dy.size(0), R = dy.size(1), C = x.size(1), k = indices.numel();
  TORCH_CHECK(R <= std::numeric_limits<int32_t>::max(), "grad_output has more columns than int32 holds");
  TORCH_CHECK(k <= std::numeric_limits<int32_t>::max(), "indices has more entries than int32 holds");
  const int64_t tb_max = std::min({token_block > 0 ? token_block : TOKEN_BLOCK, T, MAX_TOKEN_BLOCK});
  const int64_t ld = (tb_max + LANES - 1) / LANES * LANES;
  const int64_t col_log2 = choose_col_block_log2(ld, C);
  const int64_t col_block = std::min(C, int64_t{1} << col_log2);
  const int64_t n_blocks = ((C - 1) >> col_log2) + 1;
  const int64_t work = (k + R + C) * T;  // multiply-adds plus packed values
  const int64_t groups = std::clamp<int64_t>(
      std::min({static_cast<int64_t>(at::get_num_threads()), T / MIN_GROUP_TOKENS, work / MIN_THREAD_WORK}), 1,
      std::max<int64_t>(1, at::get_num_threads()));
  // Per group: its dY panel [R, ld] and X block panel [col_block, ld], and, unless it adds
  // straight into out (the first group when the plan keeps idx order), a [k] partial sum.
  const bool direct = n_blocks == 1;
  const int64_t panel_floats = (R + col_block) * ld;
  const int64_t n_partials = direct ? groups - 1 : groups;
  Workspace& shared = shared_workspace();
  std::unique_lock<std::mutex> lock(shared.mutex, std::try_to_lock);
  Workspace own;
  Workspace& ws = lock.owns_lock() ? shared : own;
  auto carve = [&](Carver& cv, float*& panels, float*& partials, EntryPlan& plan) {
    panels = cv.take<float>(groups * panel_floats);
    partials = cv.take<float>(n_partials * k);
    plan.row = cv.take<int32_t>(k);
    plan.col = cv.take<uint16_t>(k);
    plan.position = direct ? nullptr : cv.take<int32_t>(k);
  };
  float *panels, *partials;
  EntryPlan plan;
  Carver sizing{nullptr};
  carve(sizing, panels, partials, plan);
  Carver cv{ws.reserve(sizing.used)};
  carve(cv, panels, partials, plan);
  plan_entries(indices.data_ptr<I>(), k, C, col_log2, plan);
  const S* dy_ptr = dy.data_ptr<S>();
  const S* x_ptr = x.data_ptr<S>();
  float* o = out.data_ptr<float>();
  const int64_t ld_dy = dy.stride(0), ld_x = x.stride(0);
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      float* dp = panels + g * panel_floats;
      float* xp = dp + R * ld;
      float* acc = direct ? (g == 0 ? o : partials + (g - 1) * k) : partials + g * k;
      if (acc != o) std::fill(acc, acc + k, 0.0f);
      for (int64_t t0 = T * g / groups, t_end = T * (g + 1) / groups; t0 < t_end; t0 += tb_max) {
        const int64_t tb = std::min(tb_max, t_end - t0);
        const int64_t tbp = (tb + LANES - 1) / LANES * LANES;
        pack(dy_ptr, ld_dy, t0, tb, tbp, 0, R, dp, ld, isa);
        for (int64_t b = 0; b < n_blocks; ++b) {
          const int64_t j0 = plan.block_begin[b], n = plan.block_begin[b + 1] - j0;
          if (n == 0) continue;
          const int64_t c0 = b * col_block;
          pack(x_ptr, ld_x, t0, tb, tbp, c0, std::min(C, c0 + col_block), xp, ld, isa);
#ifdef SIFT_X86_SIMD
          if (isa != Isa::generic)
            block_dots_avx2(dp, xp, ld, tbp, plan.row + j0, plan.col + j0, n, acc + j0);
          else
#endif
            block_dots_generic(dp, xp, ld, tbp, plan.row + j0, plan.col + j0, n, acc + j0);
        }
      }
    }
  });
  if (n_partials > 0) {
    const int32_t* position = plan.position;
    at::parallel_for(0, k, REDUCE_GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) {
        float sum = 0.0f;
        for (int64_t g = 0; g < n_partials; ++g) sum += partials[g * k + j];
        o[position ? position[j] : j] += sum;
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

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) { m.impl("sparse_weight_grad_", &sparse_weight_grad_cpu); }

}  // namespace sift
