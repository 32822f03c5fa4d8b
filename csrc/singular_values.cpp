// Batched singular values on CPU: x [B, S, D] -> [B, min(S, D)], descending.
//
// The contract and the reference are in sift/_ops/ (singular_values_ref, fp64 svdvals).
// Method, per matrix: the fp64 Gram matrix of the shorter side (n = min(S, D)), Householder
// tridiagonalisation of it (LAPACK's dsytd2), then the eigenvalues of the tridiagonal by
// implicit QL with shifts (tqli), and sigma = sqrt(max(lambda, 0)) sorted descending. In fp64
// the squared condition number costs nothing the op promises (values above 1e-3 * sigma_max
// to 1e-4 relative; in practice ~1e-10).
//
// Speed comes from batching across matrices rather than within one: 8 matrices share every
// SIMD instruction, one per 64-bit lane (csrc/singular_values_simd.h). LAPACK's per-matrix
// tridiagonal solvers are latency bound (one dependent divide and square root per element);
// 8 independent lanes hide that, and the Gram, the reduction and the QL sweeps all run at
// vector width. Groups of 8 matrices are spread over threads with at::parallel_for. The SIMD body is compiled three times
// (generic, AVX2+FMA, AVX-512) and chosen at run time from the CPU's features.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

namespace sift {
namespace sv_generic {
#include "singular_values_simd.h"
}  // namespace sv_generic

#ifdef SIFT_X86_SIMD
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace sv_avx2 {
#include "singular_values_simd.h"
}  // namespace sv_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")
namespace sv_avx512 {
#include "singular_values_simd.h"
}  // namespace sv_avx512
#pragma GCC pop_options
#endif

namespace {

constexpr int LANES = sv_generic::LANES;
// Rows of the long side packed per Gram pass: 64 rows x 128 columns x 64 B = 512 KB of panel,
// which stays in L2 next to the Gram itself.
constexpr int64_t PANEL_ROWS = 64;
// Largest n = min(S, D) this kernel takes: the Gram of 8 matrices is n^2 x 64 B (16 MB at
// 512); beyond that the per-matrix LAPACK path in sift/_ops/ is used.
constexpr int64_t MAX_N = 512;

Isa detect_isa() {
#ifdef SIFT_X86_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::generic;
}

// Square register tile of the Gram (T x T v8d accumulators) per instruction set: 16
// accumulators fit the 32 zmm registers; AVX2 splits each v8d into two ymm of 16 registers.
// The Gram's padded size is a multiple of it.
constexpr int tile_size(Isa isa) { return isa == Isa::avx512 ? 4 : 2; }

template <typename T>
inline double to_double(T v) {
  return static_cast<double>(static_cast<float>(v));
}
template <>
inline double to_double<double>(double v) {
  return v;
}

// Aligned scratch for one thread: panel [PANEL_ROWS][np], Gram [np][np], vectors [np].
// Plain aligned new, not at::empty: it is built inside at::parallel_for, whose worker threads
// do not carry the caller's dispatcher state, so no ATen op belongs there.
struct AlignedFree {
  void operator()(double* p) const { ::operator delete[](p, std::align_val_t{64}); }
};

struct Workspace {
  std::unique_ptr<double[], AlignedFree> storage;
  double* panel = nullptr;
  double* gram = nullptr;
  double* vecs = nullptr;  // v, y, d, e: 4 x [np] v8d
  Workspace(int64_t np) {
    const int64_t doubles = (PANEL_ROWS * np + np * np + 4 * np) * LANES;
    storage.reset(static_cast<double*>(::operator new[](sizeof(double) * doubles, std::align_val_t{64})));
    panel = storage.get();
    gram = panel + PANEL_ROWS * np * LANES;
    vecs = gram + np * np * LANES;
  }
};

struct Problem {
  int64_t batch, n, long_dim, np;
  int64_t stride_b, stride_i, stride_r;  // element strides: matrix, short side, long side
};

// Entry points per instruction set. The SIMD code is always_inline and carries its
// namespace's target, so it can only be inlined into functions compiled for that target:
// these, one struct per ISA, looked up by `Kernels<ISA>`.
template <Isa ISA>
struct Kernels;
#define SIFT_SV_KERNELS(ISA, NS, ATTR)                                                                 \
  template <>                                                                                        \
  struct Kernels<ISA> {                                                                              \
    using V = NS::v8d;                                                                               \
    ATTR static void gram(const double* panel, double* gram, int64_t np, int64_t rows) {             \
      constexpr int T = tile_size(ISA);                                                              \
      NS::gram_accumulate<T, T>(reinterpret_cast<const V*>(panel), reinterpret_cast<V*>(gram), np, rows); \
    }                                                                                                \
    ATTR static void eigenvalues(double* gram, int64_t np, int64_t n, double* vecs, bool* ok) {      \
      V* vv = reinterpret_cast<V*>(vecs);                                                            \
      NS::gram_eigenvalues(reinterpret_cast<V*>(gram), np, n, vv, vv + np, vv + 2 * np, vv + 3 * np, ok); \
    }                                                                                                \
  };
#ifdef SIFT_X86_SIMD
SIFT_SV_KERNELS(Isa::avx512, sv_avx512, __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma"))))
SIFT_SV_KERNELS(Isa::avx2, sv_avx2, __attribute__((target("avx2,fma"))))
#endif
SIFT_SV_KERNELS(Isa::generic, sv_generic, )
#undef SIFT_SV_KERNELS

// Gram of the group of matrices [g0, g0 + LANES) into ws.gram; missing lanes are zero.
template <Isa ISA, typename T>
void group_gram(const T* x, const Problem& pb, int64_t g0, Workspace& ws) {
  const int64_t np = pb.np, n = pb.n;
  const int lanes = static_cast<int>(std::min<int64_t>(LANES, pb.batch - g0));
  std::memset(ws.gram, 0, sizeof(double) * np * np * LANES);
  const T* src[LANES];
  for (int q = 0; q < LANES; ++q) src[q] = x + (g0 + std::min(q, lanes - 1)) * pb.stride_b;
  for (int64_t r0 = 0; r0 < pb.long_dim; r0 += PANEL_ROWS) {
    const int64_t rows = std::min(PANEL_ROWS, pb.long_dim - r0);
    // Pack: row r of the panel is row r0 + r of the long side, columns interleaved by lane.
    for (int64_t r = 0; r < rows; ++r) {
      double* row = ws.panel + r * np * LANES;
      const int64_t base = (r0 + r) * pb.stride_r;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t off = base + i * pb.stride_i;
        for (int q = 0; q < LANES; ++q) row[i * LANES + q] = q < lanes ? to_double(src[q][off]) : 0.0;
      }
      std::fill(row + n * LANES, row + np * LANES, 0.0);
    }
    Kernels<ISA>::gram(ws.panel, ws.gram, np, rows);
  }
}

template <Isa ISA, typename T, typename Out>
void solve_groups(const T* x, const Problem& pb, Out* out, int64_t group_begin, int64_t group_end) {
  Workspace ws(pb.np);
  std::vector<double> sigma(pb.n);
  bool ok[LANES];
  for (int64_t g = group_begin; g < group_end; ++g) {
    const int64_t g0 = g * LANES;
    group_gram<ISA, T>(x, pb, g0, ws);
    Kernels<ISA>::eigenvalues(ws.gram, pb.np, pb.n, ws.vecs, ok);
    const double* d = ws.vecs + 2 * pb.np * LANES;
    const int lanes = static_cast<int>(std::min<int64_t>(LANES, pb.batch - g0));
    for (int q = 0; q < lanes; ++q) {
      Out* o = out + (g0 + q) * pb.n;
      if (!ok[q]) {
        std::fill(o, o + pb.n, std::numeric_limits<Out>::quiet_NaN());
        continue;
      }
      for (int64_t i = 0; i < pb.n; ++i) sigma[i] = std::sqrt(std::max(d[i * LANES + q], 0.0));
      std::sort(sigma.begin(), sigma.end(), [](double a, double b) { return a > b; });
      for (int64_t i = 0; i < pb.n; ++i) o[i] = static_cast<Out>(sigma[i]);
    }
  }
}

template <typename T, typename Out>
void run(const T* x, const Problem& pb, Out* out, Isa isa) {
  const int64_t groups = (pb.batch + LANES - 1) / LANES;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    switch (isa) {
#ifdef SIFT_X86_SIMD  // elsewhere detect_isa() only ever answers generic
      case Isa::avx512:
        solve_groups<Isa::avx512, T, Out>(x, pb, out, begin, end);
        break;
      case Isa::avx2:
        solve_groups<Isa::avx2, T, Out>(x, pb, out, begin, end);
        break;
#endif
      default:
        solve_groups<Isa::generic, T, Out>(x, pb, out, begin, end);
    }
  });
}

at::Tensor singular_values_cpu(const at::Tensor& x, c10::string_view isa_request) {
  TORCH_CHECK(x.dim() == 3, "x must be [B, S, D], got ", x.dim(), " dims");
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "x must be fp32, fp64, bf16 or fp16, got ", dtype);
  const int64_t batch = x.size(0), s = x.size(1), dd = x.size(2);
  const bool tall = s >= dd;
  const int64_t n = std::min(s, dd);
  TORCH_CHECK(n <= MAX_N, "min(S, D) must be at most ", MAX_N, " for this kernel, got ", n);
  const auto out_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty({batch, n}, x.options().dtype(out_dtype));
  if (batch == 0 || n == 0) return out;
  static const Isa best = detect_isa();
  const Isa isa = isa_from_request(std::string(isa_request), best);
  const int64_t tile = tile_size(isa);
  Problem pb{batch,
             n,
             tall ? s : dd,
             (n + tile - 1) / tile * tile,
             x.stride(0),
             tall ? x.stride(2) : x.stride(1),
             tall ? x.stride(1) : x.stride(2)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "sift_singular_values", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    if (out_dtype == at::kDouble)
      run<scalar_t, double>(xp, pb, out.data_ptr<double>(), isa);
    else
      run<scalar_t, float>(xp, pb, out.data_ptr<float>(), isa);
  });
  return out;
}

std::string singular_values_isa() { return isa_name(detect_isa()); }

}  // namespace

// Which SIMD form the kernel picked on this CPU (python -m sift.env): C++-only, so defined here.
TORCH_LIBRARY_FRAGMENT(sift, m) { m.def("singular_values_isa() -> str", &singular_values_isa); }

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) { m.impl("singular_values", &singular_values_cpu); }

}  // namespace sift
