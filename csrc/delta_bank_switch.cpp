// Switching the weights from one delta of the banks to another, in place: for each layer's weight
// W [R, C] (a strided view: Conv1D's [C, R] weight transposed) and bank (delta_bank.h's forms),
// the entries of delta `off` get back the base values saved when it went in (originals_off), then
// those of delta `on` save theirs (originals_on) and become W(float(w) + float(val)). The contract
// and the plain-torch reference are in sift/_ops/ (delta_bank_switch_ref).
//
// Threads take blocks of rows of any layer; within a row the restore and the apply follow each
// other, so the row's cache lines are fetched once for both. The op is public (torch.ops.sift.*):
// every tensor, row pointer and column is checked before anything is written (the columns in one
// parallel pass of unsigned maxima over the two deltas' entries).
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

// Entries ahead whose weight line is prefetched: the entries of a delta fall on scattered lines
// (at 1% density, one in three lines of a 4096-wide bf16 row), each a cache miss without it.
constexpr int64_t SWITCH_PREFETCH = 16;

// A cursor over a delta's entries in rows [r0, r1) that knows each entry's row: the prefetch runs
// SWITCH_PREFETCH entries ahead of the writes, across row ends.
template <typename P, typename I>
struct EntryCursor {
  const P* rows;
  int64_t row, entry, end_row;

  template <typename W>
  void advance_and_prefetch(const W* wp, const I* cp, int64_t ld_r, int64_t ld_c) {
    ++entry;
    while (row < end_row && entry >= rows[row + 1]) ++row;
    if (row < end_row) __builtin_prefetch(wp + row * ld_r + static_cast<int64_t>(cp[entry]) * ld_c, 1, 3);
  }
};

template <typename P, typename I>
EntryCursor<P, I> ahead_of(const P* rows, int64_t r0, int64_t r1) {
  EntryCursor<P, I> c{rows, r0, static_cast<int64_t>(rows[r0]) - 1, r1};
  while (c.row < r1 && rows[c.row + 1] <= rows[r0]) ++c.row;
  return c;
}

// One layer's operands, looked up once per call.
struct Layer {
  const at::Tensor* w;
  const at::Tensor* ptr;
  const at::Tensor* col;
  const at::Tensor* val;
  const at::Tensor* saved_off;  // null when off < 0
  const at::Tensor* saved_on;   // null when on < 0
  int64_t R, C;
};

template <typename W, typename P, typename I, typename V>
void switch_rows(const Layer& layer, int64_t off, int64_t on, int64_t r0, int64_t r1) {
  W* __restrict wp = layer.w->data_ptr<W>();
  const int64_t ld_r = layer.w->stride(0), ld_c = layer.w->stride(1);
  const P* ptr = layer.ptr->data_ptr<P>();
  const I* __restrict cp = layer.col->data_ptr<I>();
  const V* __restrict vp = layer.val->data_ptr<V>();
  const P* off_rows = off >= 0 ? ptr + off * (layer.R + 1) : nullptr;
  const P* on_rows = on >= 0 ? ptr + on * (layer.R + 1) : nullptr;
  // The saved values are indexed by the entry's place in its delta: e - rows[0].
  const W* __restrict old_off = off_rows ? layer.saved_off->data_ptr<W>() - static_cast<int64_t>(off_rows[0]) : nullptr;
  W* __restrict old_on = on_rows ? layer.saved_on->data_ptr<W>() - static_cast<int64_t>(on_rows[0]) : nullptr;
  EntryCursor<P, I> off_ahead{}, on_ahead{};
  if (off_rows) {
    off_ahead = ahead_of<P, I>(off_rows, r0, r1);
    for (int64_t j = 0; j < SWITCH_PREFETCH; ++j) off_ahead.advance_and_prefetch(wp, cp, ld_r, ld_c);
  }
  if (on_rows) {
    on_ahead = ahead_of<P, I>(on_rows, r0, r1);
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
        *at = static_cast<W>(static_cast<float>(old) + static_cast<float>(vp[e]));
      }
    }
  }
}

template <typename P>
int64_t first_decrease(const P* rows, int64_t R) {
  for (int64_t i = 0; i < R; ++i) {
    if (rows[i] > rows[i + 1]) return i;
  }
  return -1;
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
  delta_bank::check_originals(L, off, on, originals_off, originals_on);
  struct Task {
    size_t layer;
    int64_t r0, r1;
  };
  std::vector<Layer> layers(L);
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
    TORCH_CHECK(ptr.dim() == 2 && ptr.is_contiguous() && delta_bank::row_ptr_type_ok(ptr) && ptr.device().is_cpu(),
                "row_ptrs[", l, "] must be a contiguous int32 or int64 CPU tensor [n_deltas, R + 1]");
    TORCH_CHECK(ptr.size(1) == R + 1, "weights[", l, "] has ", R, " rows, but its bank's row_ptrs[", l, "] is for ",
                ptr.size(1) - 1);
    TORCH_CHECK(off >= -1 && off < n && on >= -1 && on < n && (off != on || off < 0),
                "off and on must be two deltas in [-1, ", n, ") (-1: none)");
    const at::Tensor& col = col_indices[l];
    const at::Tensor& val = values[l];
    TORCH_CHECK(col.dim() == 1 && col.is_contiguous() && delta_bank::col_type_ok(col) && col.device().is_cpu(),
                "col_indices[", l, "] must be a contiguous 1-D int16 or int32 CPU tensor");
    TORCH_CHECK(val.dim() == 1 && val.is_contiguous() && delta_bank::value_type_ok(val) &&
                    val.numel() == col.numel() && val.device().is_cpu(),
                "values[", l, "] must be a contiguous float32, bfloat16 or float16 CPU tensor with one value per "
                "column index");
    const int64_t nnz = col.numel();
    for (int64_t d : {off, on}) {
      if (d < 0) continue;
      const int64_t first = delta_bank::row_ptr_at(ptr, d, 0), last = delta_bank::row_ptr_at(ptr, d, R);
      TORCH_CHECK(first >= 0 && last <= nnz, "row_ptrs[", l, "][", d, "] spans [", first, ", ", last,
                  "), outside [0, ", nnz, ")");
      const int64_t bad = ptr.scalar_type() == at::kInt ? first_decrease(ptr.data_ptr<int32_t>() + d * (R + 1), R)
                                                        : first_decrease(ptr.data_ptr<int64_t>() + d * (R + 1), R);
      TORCH_CHECK(bad < 0, "row_ptrs[", l, "][", d, "] decreases at row ", bad);
      const at::Tensor& saved = d == off ? originals_off[l] : originals_on[l];
      TORCH_CHECK(saved.dim() == 1 && saved.is_contiguous() && saved.scalar_type() == dtype &&
                      saved.numel() == last - first && saved.device().is_cpu(),
                  d == off ? "originals_off[" : "originals_on[", l, "] must be a contiguous CPU tensor of the "
                  "weight's dtype with one value per entry of its delta (", last - first, ")");
      entries += last - first;
    }
    layers[l] = {&w, &ptr, &col, &val, off >= 0 ? &originals_off[l] : nullptr, on >= 0 ? &originals_on[l] : nullptr,
                 R, w.size(1)};
    for (int64_t r = 0; r < R; r += SWITCH_ROWS) tasks.push_back({l, r, std::min(R, r + SWITCH_ROWS)});
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // A thread's share is at least SWITCH_GRAIN entries: waking threads costs more than a small switch.
  const int64_t grain = std::max<int64_t>(1, n_tasks * SWITCH_GRAIN / std::max<int64_t>(entries, 1));
  std::atomic<int64_t> bad_layer{-1};
  at::parallel_for(0, n_tasks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const Task& task = tasks[t];
      const Layer& layer = layers[task.layer];
      bool ok = true;
      for (int64_t d : {off, on}) {
        if (d < 0) continue;
        const int64_t e0 = delta_bank::row_ptr_at(*layer.ptr, d, task.r0);
        const int64_t e1 = delta_bank::row_ptr_at(*layer.ptr, d, task.r1);
        ok &= layer.col->scalar_type() == at::kShort
                  ? delta_bank::columns_inside(layer.col->data_ptr<int16_t>(), e0, e1, layer.C)
                  : delta_bank::columns_inside(layer.col->data_ptr<int32_t>(), e0, e1, layer.C);
      }
      if (!ok) bad_layer.store(static_cast<int64_t>(task.layer), std::memory_order_relaxed);
    }
  });
  TORCH_CHECK(bad_layer.load() < 0, "col_indices[", bad_layer.load(), "] holds a column outside the weight's ",
              weights[bad_layer.load() < 0 ? 0 : bad_layer.load()].size(1), " (nothing was written)");
  at::parallel_for(0, n_tasks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const Task& task = tasks[t];
      const Layer& layer = layers[task.layer];
      delta_bank::dispatch(*layer.ptr, *layer.col, *layer.val, [&](auto p, auto c, auto v) {
        using P = decltype(p);
        using I = decltype(c);
        using V = decltype(v);
        delta_bank::by_float(layer.w->scalar_type(),
                             [&](auto w) { switch_rows<decltype(w), P, I, V>(layer, off, on, task.r0, task.r1); });
      });
    }
  });
}

}  // namespace

// CPU kernel of the schema in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) { m.impl("delta_bank_switch_", &delta_bank_switch_cpu); }

}  // namespace sift
