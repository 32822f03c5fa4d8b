// Mixed sparse deltas in one batch on CPU: for y = x W^T over T tokens, W [R, C], and a bank
// of n sparse deltas of W in CSR form (row_ptr [n, R + 1] int32/int64 global offsets, col [nnz]
// int16/int32, val [nnz] fp32/bf16/fp16: delta_bank.h), with d = ids[t]:
//   d == -1:  y[t] untouched
//   d >= 0:   y[t, i] = S(float(y[t, i]) + sum_{e in row i of delta d} float(val[e]) * float(x[t, col[e]]))
// with y [T, R] and x [T, C] in fp32, bf16 or fp16 (S), sums in fp32 in entry order. The contract
// and the plain-torch reference are in sift/_ops/ (mixed_delta_matmul_ref).
//
// Tokens are taken in groups: up to 8 tokens with one delta (the tokens of a row of the batch, or
// the rows of a decode step that share a delta), their inputs packed into an fp32 panel [C, 8] so
// that each entry's column and value are loaded once and multiplied into 8 sums (one vector); a
// token alone with its delta is read where it lies. Threads take (group, block of output rows)
// tasks: each writes its own part of y, so no two threads touch one value; with few groups (a
// decode step) the rows are split in blocks so every core has work. Tokens with id -1 are
// skipped. The op is public (torch.ops.sift.*): ids and row pointers are checked before anything
// is written (O(T + n R)), and each column index as it is read (a branch that is never taken on
// valid input); a bad column stops the call with an error.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "delta_bank.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace sift {
namespace {

// Output rows per task when there are too few token groups to keep every thread busy (decode
// steps: one token per row); with enough groups a task takes all rows of its group.
constexpr int64_t ROW_BLOCK = 256;
constexpr int64_t LANES = delta_bank::LANES;

template <typename S, typename P, typename I, typename V>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& row_ptr,
         const at::Tensor& col, const at::Tensor& val, std::atomic<int64_t>& bad_col) {
  const int64_t T = y.size(0), R = y.size(1), C = x.size(1);
  const int64_t ld_y = y.stride(0), ld_x = x.stride(0);
  S* __restrict yp = y.data_ptr<S>();
  const S* __restrict xp = x.data_ptr<S>();
  const P* __restrict ptr = row_ptr.data_ptr<P>();
  const I* __restrict cp = col.data_ptr<I>();
  const V* __restrict vp = val.data_ptr<V>();
  std::vector<int64_t> order;
  const std::vector<delta_bank::TokenGroup> groups =
      delta_bank::token_groups(ids.data_ptr<int32_t>(), T, row_ptr.size(0), order);
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  if (n_groups == 0) return;
  const int64_t row_block = n_groups >= 2 * at::get_num_threads() ? R : std::min(R, ROW_BLOCK);
  const int64_t blocks = (R + row_block - 1) / row_block;
  at::parallel_for(0, n_groups * blocks, 1, [&](int64_t lo, int64_t hi) {
    // The group's inputs as fp32, column-major (delta_bank::fill_panel).
    std::vector<float> panel;
    for (int64_t task = lo; task < hi; ++task) {
      const delta_bank::TokenGroup& g = groups[task / blocks];
      const int64_t r0 = (task % blocks) * row_block, r1 = std::min(R, r0 + row_block);
      const P* rows = ptr + static_cast<int64_t>(g.delta) * (R + 1);
      if (g.count == 1) {  // a token alone with its delta: its input read where it lies, no panel
        const int64_t t = order[g.begin];
        const S* xt = xp + t * ld_x;
        S* yt = yp + t * ld_y;
        for (int64_t i = r0; i < r1; ++i) {
          const int64_t e0 = rows[i], e1 = rows[i + 1];
          if (e0 == e1) continue;  // float(y) rounds back to y: nothing to write
          float acc = 0.0f;
          for (int64_t e = e0; e < e1; ++e) {
            const I c = cp[e];
            if (delta_bank::outside(c, C)) {
              bad_col.store(e, std::memory_order_relaxed);
              break;
            }
            acc += static_cast<float>(vp[e]) * static_cast<float>(xt[c]);
          }
          yt[i] = static_cast<S>(static_cast<float>(yt[i]) + acc);
        }
        continue;
      }
      delta_bank::fill_panel(g, order.data(), xp, ld_x, C, panel);
      const float* __restrict pp = panel.data();
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t e0 = rows[i], e1 = rows[i + 1];
        if (e0 == e1) continue;
        float acc[LANES] = {};
        for (int64_t e = e0; e < e1; ++e) {
          const I c = cp[e];
          if (delta_bank::outside(c, C)) {
            bad_col.store(e, std::memory_order_relaxed);
            break;
          }
          const float v = static_cast<float>(vp[e]);
          const float* xc = pp + static_cast<int64_t>(c) * LANES;
          for (int64_t l = 0; l < LANES; ++l) acc[l] += v * xc[l];
        }
        for (int64_t l = 0; l < g.count; ++l) {
          S* out = yp + order[g.begin + l] * ld_y + i;
          *out = static_cast<S>(static_cast<float>(*out) + acc[l]);
        }
      }
    }
  });
}

void mixed_delta_matmul_cpu(at::Tensor& y, const at::Tensor& x, const at::Tensor& delta_ids,
                            const at::Tensor& row_ptr, const at::Tensor& col_indices, const at::Tensor& values,
                            int64_t max_row_entries) {
  TORCH_CHECK(y.dim() == 2, "y must be 2-D [T, R], got ", y.dim(), "-D");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [T, C], got ", x.dim(), "-D");
  TORCH_CHECK(y.size(0) == x.size(0), "y and x must have the same number of rows, got ", y.size(0), " and ",
              x.size(0));
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "y and x must have the same dtype, got ", y.scalar_type(), " and ",
              x.scalar_type());
  const auto dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "y must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(y.size(1) <= 1 || y.stride(1) == 1, "y rows must be contiguous");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, "x rows must be contiguous");
  const int64_t T = y.size(0), R = y.size(1);
  TORCH_CHECK(delta_ids.dim() == 1 && delta_ids.is_contiguous() && delta_ids.scalar_type() == at::kInt &&
                  delta_ids.numel() == T,
              "delta_ids must be a contiguous 1-D int32 tensor of T = ", T, " ids");
  TORCH_CHECK(row_ptr.dim() == 2 && row_ptr.is_contiguous() && delta_bank::row_ptr_type_ok(row_ptr) &&
                  row_ptr.size(1) == R + 1,
              "row_ptr must be a contiguous int32 or int64 [n_deltas, R + 1] tensor with R + 1 = ", R + 1);
  TORCH_CHECK(col_indices.dim() == 1 && col_indices.is_contiguous() && delta_bank::col_type_ok(col_indices),
              "col_indices must be a contiguous 1-D int16 or int32 tensor");
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && delta_bank::value_type_ok(values) &&
                  values.numel() == col_indices.numel(),
              "values must be a contiguous float32, bfloat16 or float16 tensor with one value per column index");
  TORCH_CHECK(max_row_entries >= 0, "max_row_entries must be >= 0, got ", max_row_entries);
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&y), &x, &delta_ids, &row_ptr, &col_indices, &values}) {
    TORCH_CHECK(t->device().is_cpu(), "mixed_delta_matmul_ takes CPU tensors");
  }
  const int64_t n = row_ptr.size(0), nnz = col_indices.numel();
  // Every read the kernel makes through an id or a row pointer stays inside its tensor.
  const int32_t* idp = delta_ids.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(idp[t] >= -1 && idp[t] < n, "delta_ids has ", idp[t], " at position ", t, ", outside [-1, ", n, ")");
  }
  std::atomic<int64_t> bad_col{-1};
  delta_bank::dispatch(row_ptr, col_indices, values, [&](auto p, auto c, auto v) {
    using P = decltype(p);
    const P* ptr = row_ptr.data_ptr<P>();
    for (int64_t d = 0; d < n; ++d) {
      const P* rows = ptr + d * (R + 1);
      TORCH_CHECK(rows[0] >= 0 && rows[R] <= nnz, "row_ptr[", d, "] spans [", rows[0], ", ", rows[R],
                  "), outside [0, ", nnz, ")");
      for (int64_t i = 0; i < R; ++i) {
        TORCH_CHECK(rows[i] <= rows[i + 1], "row_ptr[", d, "] decreases at row ", i);
      }
    }
    if (T == 0 || R == 0 || n == 0) return;
    using I = decltype(c);
    using V = decltype(v);
    delta_bank::by_float(dtype, [&](auto s) {
      run<decltype(s), P, I, V>(y, x, delta_ids, row_ptr, col_indices, values, bad_col);
    });
  });
  const int64_t e = bad_col.load();
  TORCH_CHECK(e < 0, "col_indices has ", e < 0 ? 0 : delta_bank::column_at(col_indices, e), " at position ", e,
              ", outside [0, ", x.size(1), ") (y was partly written)");
}

}  // namespace

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) {
  m.impl("mixed_delta_matmul_", &mixed_delta_matmul_cpu);
}

}  // namespace sift
