// Mixed sparse deltas in one batch on CPU: for y = x W^T over T tokens, W [R, C], and a bank
// of n sparse deltas of W in CSR form (row_ptr [n, R + 1] int64 global offsets, col [nnz] int32,
// val [nnz] fp32), with d = ids[t]:
//   d == -1:  y[t] untouched
//   d >= 0:   y[t, i] = S(float(y[t, i]) + sum_{e in row i of delta d} val[e] * float(x[t, col[e]]))
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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace sift {
namespace {

// Tokens summed together: tokens with one delta share each entry's column and value, loaded once
// for all of them.
constexpr int64_t LANES = 8;
// Output rows per task when there are too few token groups to keep every thread busy (decode
// steps: one token per row); with enough groups a task takes all rows of its group.
constexpr int64_t ROW_BLOCK = 256;

struct TokenGroup {
  int64_t begin, count;  // tokens order[begin, begin + count), count <= LANES
  int32_t delta;
};

// The tokens with a delta (id != -1) ordered by delta, in token order within one (a counting
// sort), and cut into groups of at most LANES tokens of one delta: the tokens of a row in a
// prefill, or the rows of a decode step that share a delta.
std::vector<TokenGroup> token_groups(const int32_t* ids, int64_t T, int64_t n, std::vector<int64_t>& order) {
  std::vector<int64_t> start(n + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    if (ids[t] >= 0) ++start[ids[t] + 1];
  }
  for (int64_t d = 0; d < n; ++d) start[d + 1] += start[d];
  order.resize(start[n]);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    if (ids[t] >= 0) order[next[ids[t]]++] = t;
  }
  std::vector<TokenGroup> groups;
  for (int64_t d = 0; d < n; ++d) {
    for (int64_t b = start[d]; b < start[d + 1]; b += LANES) {
      groups.push_back({b, std::min(LANES, start[d + 1] - b), static_cast<int32_t>(d)});
    }
  }
  return groups;
}

template <typename S>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& row_ptr,
         const at::Tensor& col, const at::Tensor& val, std::atomic<int64_t>& bad_col) {
  const int64_t T = y.size(0), R = y.size(1), C = x.size(1);
  const int64_t ld_y = y.stride(0), ld_x = x.stride(0);
  S* __restrict yp = y.data_ptr<S>();
  const S* __restrict xp = x.data_ptr<S>();
  const int64_t* __restrict ptr = row_ptr.data_ptr<int64_t>();
  const int32_t* __restrict cp = col.data_ptr<int32_t>();
  const float* __restrict vp = val.data_ptr<float>();
  std::vector<int64_t> order;
  const std::vector<TokenGroup> groups = token_groups(ids.data_ptr<int32_t>(), T, row_ptr.size(0), order);
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  if (n_groups == 0) return;
  const int64_t row_block = n_groups >= 2 * at::get_num_threads() ? R : std::min(R, ROW_BLOCK);
  const int64_t blocks = (R + row_block - 1) / row_block;
  at::parallel_for(0, n_groups * blocks, 1, [&](int64_t lo, int64_t hi) {
    // The group's inputs as fp32, column-major: panel[c * LANES + l] = x[order[begin + l], c] (0 past count).
    std::vector<float> panel;
    for (int64_t task = lo; task < hi; ++task) {
      const TokenGroup& g = groups[task / blocks];
      const int64_t r0 = (task % blocks) * row_block, r1 = std::min(R, r0 + row_block);
      const int64_t* rows = ptr + static_cast<int64_t>(g.delta) * (R + 1);
      if (g.count == 1) {  // a token alone with its delta: its input read where it lies, no panel
        const int64_t t = order[g.begin];
        const S* xt = xp + t * ld_x;
        S* yt = yp + t * ld_y;
        for (int64_t i = r0; i < r1; ++i) {
          const int64_t e0 = rows[i], e1 = rows[i + 1];
          if (e0 == e1) continue;  // float(y) rounds back to y: nothing to write
          float acc = 0.0f;
          for (int64_t e = e0; e < e1; ++e) {
            const int32_t c = cp[e];
            if (static_cast<uint32_t>(c) >= static_cast<uint64_t>(C)) {
              bad_col.store(e, std::memory_order_relaxed);
              break;
            }
            acc += vp[e] * static_cast<float>(xt[c]);
          }
          yt[i] = static_cast<S>(static_cast<float>(yt[i]) + acc);
        }
        continue;
      }
      if (panel.empty()) panel.resize(C * LANES);
      std::fill(panel.begin(), panel.end(), 0.0f);
      for (int64_t l = 0; l < g.count; ++l) {
        const S* xt = xp + order[g.begin + l] * ld_x;
        for (int64_t c = 0; c < C; ++c) panel[c * LANES + l] = static_cast<float>(xt[c]);
      }
      const float* __restrict pp = panel.data();
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t e0 = rows[i], e1 = rows[i + 1];
        if (e0 == e1) continue;
        float acc[LANES] = {};
        for (int64_t e = e0; e < e1; ++e) {
          const int32_t c = cp[e];
          if (static_cast<uint32_t>(c) >= static_cast<uint64_t>(C)) {
            bad_col.store(e, std::memory_order_relaxed);
            break;
          }
          const float v = vp[e];
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
  TORCH_CHECK(row_ptr.dim() == 2 && row_ptr.is_contiguous() && row_ptr.scalar_type() == at::kLong &&
                  row_ptr.size(1) == R + 1,
              "row_ptr must be a contiguous int64 [n_deltas, R + 1] tensor with R + 1 = ", R + 1);
  TORCH_CHECK(col_indices.dim() == 1 && col_indices.is_contiguous() && col_indices.scalar_type() == at::kInt,
              "col_indices must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && values.scalar_type() == at::kFloat &&
                  values.numel() == col_indices.numel(),
              "values must be a contiguous float32 tensor with one value per column index");
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
  const int64_t* ptr = row_ptr.data_ptr<int64_t>();
  for (int64_t d = 0; d < n; ++d) {
    const int64_t* rows = ptr + d * (R + 1);
    TORCH_CHECK(rows[0] >= 0 && rows[R] <= nnz, "row_ptr[", d, "] spans [", rows[0], ", ", rows[R], "), outside [0, ",
                nnz, ")");
    for (int64_t i = 0; i < R; ++i) {
      TORCH_CHECK(rows[i] <= rows[i + 1], "row_ptr[", d, "] decreases at row ", i);
    }
  }
  if (T == 0 || R == 0 || n == 0) return;
  std::atomic<int64_t> bad_col{-1};
  switch (dtype) {
    case at::kFloat:
      run<float>(y, x, delta_ids, row_ptr, col_indices, values, bad_col);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(y, x, delta_ids, row_ptr, col_indices, values, bad_col);
      break;
    default:
      run<c10::Half>(y, x, delta_ids, row_ptr, col_indices, values, bad_col);
      break;
  }
  const int64_t e = bad_col.load();
  TORCH_CHECK(e < 0, "col_indices has ", e < 0 ? 0 : col_indices.data_ptr<int32_t>()[e], " at position ", e,
              ", outside [0, ", x.size(1), ") (y was partly written)");
}

// Switching the weights from one delta of the banks to another, in place: for each layer's weight
// W [R, C] (a strided view: Conv1D's [C, R] weight transposed) and bank, the entries of delta
// `off` get back the base values saved when it went in (originals_off), then those of delta `on`
// save theirs (originals_on) and become W(float(w) + val). Threads take blocks of rows; within a
// row the restore and the apply follow each other, so the row's cache lines are fetched once for
// both. Every column is checked (one parallel read of the two deltas' columns) before anything is
// written.
// Entries ahead whose weight line is prefetched: the entries of a delta fall on scattered lines
// (at 1% density, one in three lines of a 4096-wide row), each a cache miss without it.
constexpr int64_t SWITCH_PREFETCH = 16;

// A cursor over a delta's entries in rows [r0, r1) that knows each entry's row: the prefetch runs
// SWITCH_PREFETCH entries ahead of the writes, across row ends.
struct EntryCursor {
  const int64_t* rows;
  int64_t row, entry, end_row;

  template <typename W>
  void advance_and_prefetch(const W* wp, const int32_t* cp, int64_t ld_r, int64_t ld_c) {
    ++entry;
    while (row < end_row && entry >= rows[row + 1]) ++row;
    if (row < end_row) __builtin_prefetch(wp + row * ld_r + static_cast<int64_t>(cp[entry]) * ld_c, 1, 3);
  }
};

EntryCursor ahead_of(const int64_t* rows, int64_t r0, int64_t r1) {
  EntryCursor c{rows, r0, rows[r0] - 1, r1};
  while (c.row < r1 && rows[c.row + 1] <= rows[r0]) ++c.row;
  return c;
}

template <typename W>
void switch_rows(const at::Tensor& w, const int64_t* off_rows, const int64_t* on_rows, const int32_t* cp,
                 const float* vp, const at::Tensor* saved_off, const at::Tensor* saved_on, int64_t r0, int64_t r1) {
  W* __restrict wp = w.data_ptr<W>();
  const int64_t ld_r = w.stride(0), ld_c = w.stride(1);
  const W* __restrict old_off = saved_off ? saved_off->data_ptr<W>() - off_rows[0] : nullptr;
  W* __restrict old_on = saved_on ? saved_on->data_ptr<W>() - on_rows[0] : nullptr;
  EntryCursor off_ahead{}, on_ahead{};
  if (off_rows) {
    off_ahead = ahead_of(off_rows, r0, r1);
    for (int64_t j = 0; j < SWITCH_PREFETCH; ++j) off_ahead.advance_and_prefetch(wp, cp, ld_r, ld_c);
  }
  if (on_rows) {
    on_ahead = ahead_of(on_rows, r0, r1);
    for (int64_t j = 0; j < SWITCH_PREFETCH; ++j) on_ahead.advance_and_prefetch(wp, cp, ld_r, ld_c);
  }
  for (int64_t i = r0; i < r1; ++i) {
    W* row = wp + i * ld_r;
    if (off_rows) {
      for (int64_t e = off_rows[i]; e < off_rows[i + 1]; ++e) {
        off_ahead.advance_and_prefetch(wp, cp, ld_r, ld_c);
        row[cp[e] * ld_c] = old_off[e];
      }
    }
    if (on_rows) {
      for (int64_t e = on_rows[i]; e < on_rows[i + 1]; ++e) {
        on_ahead.advance_and_prefetch(wp, cp, ld_r, ld_c);
        W* at = row + cp[e] * ld_c;
        const W old = *at;
        old_on[e] = old;
        *at = static_cast<W>(static_cast<float>(old) + vp[e]);
      }
    }
  }
}

// Rows per task of the switch: a few thousand entries at the densities deltas have.
constexpr int64_t SWITCH_ROWS = 64;
constexpr int64_t SWITCH_GRAIN = 1 << 16;

void delta_bank_switch_cpu(at::TensorList weights, at::TensorList row_ptrs, at::TensorList col_indices,
                           at::TensorList values, int64_t off, int64_t on, at::TensorList originals_off,
                           at::TensorList originals_on) {
  const size_t L = weights.size();
  TORCH_CHECK(row_ptrs.size() == L && col_indices.size() == L && values.size() == L,
              "row_ptrs, col_indices and values must have one tensor per weight");
  TORCH_CHECK(originals_off.size() == (off >= 0 ? L : 0),
              "originals_off must have one tensor per weight when off >= 0, else none");
  TORCH_CHECK(originals_on.size() == (on >= 0 ? L : 0),
              "originals_on must have one tensor per weight when on >= 0, else none");
  struct Task {
    size_t layer;
    int64_t r0, r1;
  };
  std::vector<Task> tasks;
  int64_t entries = 0;
  for (size_t l = 0; l < L; ++l) {
    const at::Tensor& w = weights[l];
    const at::Tensor& ptr = row_ptrs[l];
    TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "weights[", l, "] must be a 2-D CPU tensor [R, C]");
    const auto dtype = w.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "weights[", l, "] must be float32, bfloat16 or float16, got ", dtype);
    const int64_t R = w.size(0), n = ptr.size(0);
    TORCH_CHECK(ptr.dim() == 2 && ptr.is_contiguous() && ptr.scalar_type() == at::kLong && ptr.device().is_cpu(),
                "row_ptrs[", l, "] must be a contiguous int64 CPU tensor [n_deltas, R + 1]");
    TORCH_CHECK(ptr.size(1) == R + 1, "weights[", l, "] has ", R, " rows, but its bank's row_ptrs[", l, "] is for ",
                ptr.size(1) - 1);
    TORCH_CHECK(off >= -1 && off < n && on >= -1 && on < n && (off != on || off < 0),
                "off and on must be two deltas in [-1, ", n, ") (-1: none)");
    const at::Tensor& col = col_indices[l];
    const at::Tensor& val = values[l];
    TORCH_CHECK(col.dim() == 1 && col.is_contiguous() && col.scalar_type() == at::kInt && col.device().is_cpu(),
                "col_indices[", l, "] must be a contiguous 1-D int32 CPU tensor");
    TORCH_CHECK(val.dim() == 1 && val.is_contiguous() && val.scalar_type() == at::kFloat &&
                    val.numel() == col.numel() && val.device().is_cpu(),
                "values[", l, "] must be a contiguous float32 CPU tensor with one value per column index");
    const int64_t nnz = col.numel();
    for (int64_t d : {off, on}) {
      if (d < 0) continue;
      const int64_t* rows = ptr.data_ptr<int64_t>() + d * (R + 1);
      TORCH_CHECK(rows[0] >= 0 && rows[R] <= nnz, "row_ptrs[", l, "][", d, "] spans [", rows[0], ", ", rows[R],
                  "), outside [0, ", nnz, ")");
      for (int64_t i = 0; i < R; ++i) {
        TORCH_CHECK(rows[i] <= rows[i + 1], "row_ptrs[", l, "][", d, "] decreases at row ", i);
      }
      const at::Tensor& saved = d == off ? originals_off[l] : originals_on[l];
      TORCH_CHECK(saved.dim() == 1 && saved.is_contiguous() && saved.scalar_type() == dtype &&
                      saved.numel() == rows[R] - rows[0] && saved.device().is_cpu(),
                  d == off ? "originals_off[" : "originals_on[", l, "] must be a contiguous CPU tensor of the "
                  "weight's dtype with one value per entry of its delta (", rows[R] - rows[0], ")");
    }
    for (int64_t d : {off, on}) {
      if (d >= 0) entries += ptr.data_ptr<int64_t>()[d * (R + 1) + R] - ptr.data_ptr<int64_t>()[d * (R + 1)];
    }
    for (int64_t r = 0; r < R; r += SWITCH_ROWS) tasks.push_back({l, r, std::min(R, r + SWITCH_ROWS)});
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // A thread's share is at least SWITCH_GRAIN entries: waking threads costs more than a small switch.
  const int64_t grain = std::max<int64_t>(1, n_tasks * SWITCH_GRAIN / std::max<int64_t>(entries, 1));
  std::atomic<int64_t> bad_layer{-1};
  at::parallel_for(0, n_tasks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const Task& task = tasks[t];
      const int64_t R = weights[task.layer].size(0), C = weights[task.layer].size(1);
      const int64_t* ptr = row_ptrs[task.layer].data_ptr<int64_t>();
      const int32_t* cp = col_indices[task.layer].data_ptr<int32_t>();
      bool ok = true;
      for (int64_t d : {off, on}) {
        if (d < 0) continue;
        const int64_t* rows = ptr + d * (R + 1);
        for (int64_t e = rows[task.r0]; e < rows[task.r1]; ++e) ok &= static_cast<uint32_t>(cp[e]) < static_cast<uint64_t>(C);
      }
      if (!ok) bad_layer.store(static_cast<int64_t>(task.layer), std::memory_order_relaxed);
    }
  });
  TORCH_CHECK(bad_layer.load() < 0, "col_indices[", bad_layer.load(), "] holds a column outside the weight's ",
              weights[bad_layer.load() < 0 ? 0 : bad_layer.load()].size(1), " (nothing was written)");
  at::parallel_for(0, n_tasks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const Task& task = tasks[t];
      const at::Tensor& w = weights[task.layer];
      const int64_t R = w.size(0);
      const int64_t* ptr = row_ptrs[task.layer].data_ptr<int64_t>();
      const int64_t* off_rows = off >= 0 ? ptr + off * (R + 1) : nullptr;
      const int64_t* on_rows = on >= 0 ? ptr + on * (R + 1) : nullptr;
      const int32_t* cp = col_indices[task.layer].data_ptr<int32_t>();
      const float* vp = values[task.layer].data_ptr<float>();
      const at::Tensor* saved_off = off >= 0 ? &originals_off[task.layer] : nullptr;
      const at::Tensor* saved_on = on >= 0 ? &originals_on[task.layer] : nullptr;
      switch (w.scalar_type()) {
        case at::kFloat:
          switch_rows<float>(w, off_rows, on_rows, cp, vp, saved_off, saved_on, task.r0, task.r1);
          break;
        case at::kBFloat16:
          switch_rows<c10::BFloat16>(w, off_rows, on_rows, cp, vp, saved_off, saved_on, task.r0, task.r1);
          break;
        default:
          switch_rows<c10::Half>(w, off_rows, on_rows, cp, vp, saved_off, saved_on, task.r0, task.r1);
          break;
      }
    }
  });
}

}  // namespace

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) {
  m.impl("mixed_delta_matmul_", &mixed_delta_matmul_cpu);
  m.impl("delta_bank_switch_", &delta_bank_switch_cpu);
}

}  // namespace sift
