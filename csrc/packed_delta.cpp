// The serving kernels over the packed bank (PackedDeltaBank in sift/triton_kernels/_delta_bank.py):
// each delta's sorted flat positions p = i * C + j as a low byte per entry and the buckets p >> 8 in
// unary (entry e of the delta, from 0, is the set bit e + (p >> 8) of its words), with an entry
// offset at every block of PACK_ROWS rows. The two ops compute what their CSR forms compute
// (mixed_delta_matmul.cpp, delta_bank_switch.cpp), entry for entry in the same order, so the
// results are the same bits; only the reading of positions differs:
//   mixed_delta_matmul_packed_(y, x, ids, block_ptr, low, high, high_start, values)
//   delta_bank_switch_packed_(weights, block_ptrs, lows, highs, high_starts, values, off, on,
//                             originals_off, originals_on)
// A task decodes its rows from their block's first entry: that entry's bit is (its place in the
// delta) + (the buckets before the block's first row), so no thread reads another's bits. The ops
// are public (torch.ops.sift.*): every pointer is checked before anything is written, and every
// position as it is decoded (inside the task's rows, ascending, inside the delta's words); the
// switch decodes every task once to check before it writes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "delta_bank.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace sift {
namespace {

constexpr int64_t PACK_ROWS = 32;
constexpr int LOW_BITS = 8;
constexpr int64_t LANES = delta_bank::LANES;
constexpr int64_t ROW_BLOCK = 256;   // rows per matmul task with few token groups (a multiple of PACK_ROWS)
constexpr int64_t SWITCH_ROWS = 64;  // rows per switch task (a multiple of PACK_ROWS)
constexpr int64_t CHUNK = 64;        // positions a Decoder writes at a time
constexpr int64_t SWITCH_GRAIN = 1 << 16;

// A delta's entries from one of its blocks on, decoded CHUNK at a time into flat positions: first
// the set bits' indices, word by word (a count-trailing-zeros and a clear per entry, the clear the
// only carried dependency), then the positions ((bit - place) << LOW_BITS) | low in a loop the
// compiler vectorizes, checked ascending and below `end` the same way. The kernels' loops then
// cut the positions into rows.
struct Decoder {
  const uint64_t* __restrict words;
  const uint8_t* __restrict low;
  int64_t w, w_end, e, e1, place, prev, end;
  uint64_t cur;

  // The next min(CHUNK, e1 - e) entries' positions into pos (entries e, e + 1, ...): their count; 0 at
  // the end; -1 where the bank is malformed.
  int64_t next(int64_t* __restrict pos) {
    const int64_t m = std::min(CHUNK, e1 - e);
    int64_t q = 0;
    while (q < m) {
      if (cur == 0) {
        if (++w >= w_end) return -1;
        cur = words[w];
        continue;
      }
      const int64_t wb = w << 6;
      do {
        pos[q++] = wb + __builtin_ctzll(cur);
        cur &= cur - 1;
      } while (cur && q < m);
    }
    const uint8_t* __restrict lo = low + e;
    const int64_t first = place;
    int64_t bad = 0;
    for (int64_t k = 0; k < m; ++k) pos[k] = ((pos[k] - first - k) << LOW_BITS) | lo[k];
    for (int64_t k = 1; k < m; ++k) bad |= ~(pos[k - 1] - pos[k]);  // negative where not ascending
    if (m && (pos[0] <= prev || pos[m - 1] >= end || bad < 0)) return -1;
    if (m) prev = pos[m - 1];
    e += m;
    place += m;
    return m;
  }
};

// A decoder's entries in one loop: add(j, e) for each entry e (j its column), done(i) after the last
// entry of each row i. The decode's carried chain (a clear per entry) runs beside the caller's sum;
// a position outside the current row is the row's end, or, before the row or past the rows, a
// malformed bank (false; done has run for the rows before). Within a row the positions are not
// checked ascending: an out-of-order column still lies in the row (the checked entry point decodes
// the whole bank first).
template <typename Add, typename Done>
bool fused(const Decoder& dec, int64_t C, Add&& add, Done&& done) {
  const uint64_t* __restrict words = dec.words;
  const uint8_t* __restrict lows = dec.low;
  const int64_t e1 = dec.e1, w_end = dec.w_end, end = dec.end;
  const int64_t shift = dec.e - dec.place;  // entry e's place in its delta is e - shift
  uint64_t cur = dec.cur;
  // row_begin far below any position: the first entry starts its row through the same branch.
  int64_t w = dec.w, e = dec.e, row = -1, row_begin = INT64_MIN / 2, prev = dec.prev;
  while (e < e1) {
    if (cur == 0) {
      if (++w >= w_end) break;
      cur = words[w];
      continue;
    }
    const int64_t wb = (w << 6) + shift;
    do {  // the word's set bits
      const int64_t p = ((wb + __builtin_ctzll(cur) - e) << LOW_BITS) | lows[e];
      cur &= cur - 1;
      if (static_cast<uint64_t>(p - row_begin) >= static_cast<uint64_t>(C)) {  // a new row
        if (p <= prev || p >= end) {
          if (row >= 0) done(row);
          return false;
        }
        if (row < 0) {
          row = p / C;
          row_begin = row * C;
        } else {
          done(row);
          do {  // ascending: the row only moves on, a few rows at most at a delta's densities
            ++row;
            row_begin += C;
          } while (p >= row_begin + C);
        }
      }
      prev = p;
      add(p - row_begin, e);
      ++e;
    } while (cur && e < e1);
  }
  if (row >= 0) done(row);
  return e == e1;
}

// One packed bank's operands.
template <typename P>
struct Packed {
  const P* block_ptr;  // [n, nb + 1]
  const uint8_t* low;
  const uint64_t* high;
  const int64_t* high_start;  // [n + 1]
  int64_t nb, R, C;

  // A decoder of delta d's entries in rows [r0, r1) (r0 a multiple of PACK_ROWS, r1 one or R); `ok`
  // false when its first bit lies past the delta's words.
  Decoder decoder(int64_t d, int64_t r0, int64_t r1, bool& ok) const {
    const P* bp = block_ptr + d * (nb + 1);
    const int64_t e0 = bp[r0 / PACK_ROWS], e1 = bp[(r1 + PACK_ROWS - 1) / PACK_ROWS];
    const uint64_t* words = high + high_start[d];
    const int64_t w_end = high_start[d + 1] - high_start[d];
    // The block's first entry's bit: its place in the delta plus the buckets before the block's first row.
    const int64_t place = e0 - bp[0], bit = place + ((r0 * C) >> LOW_BITS), w = bit >> 6;
    ok = e0 >= e1 || w < w_end;
    const uint64_t cur = ok && e0 < e1 ? words[w] & (~uint64_t{0} << (bit & 63)) : 0;
    return {words, low, w, w_end, e0, ok ? e1 : e0, place, r0 * C - 1, r1 * C, cur};
  }

  // Whether delta d's entries in rows [r0, r1) decode to positions inside those rows, ascending, within
  // the delta's words (the Decoder checks each chunk).
  bool valid(int64_t d, int64_t r0, int64_t r1) const {
    bool ok;
    Decoder dec = decoder(d, r0, r1, ok);
    int64_t pos[CHUNK], m = 0;
    while (ok && (m = dec.next(pos)) > 0) {
    }
    return ok && m == 0;
  }
};

// Checks a packed bank's pointers (per delta: block pointers non-decreasing inside [0, nnz], words
// inside high) for a [R, C] weight; `what` names the bank in the message.
template <typename P>
void check_pointers(const at::Tensor& block_ptr, const at::Tensor& high_start, int64_t nnz, int64_t words,
                    const char* what) {
  const int64_t n = block_ptr.size(0), nb = block_ptr.size(1) - 1;
  const P* bp = block_ptr.data_ptr<P>();
  const int64_t* hs = high_start.data_ptr<int64_t>();
  TORCH_CHECK(n == 0 || (hs[0] >= 0 && hs[n] <= words), what, ": high_start spans [", n ? hs[0] : 0, ", ",
              n ? hs[n] : 0, "), outside the ", words, " words of high");
  for (int64_t d = 0; d < n; ++d) {
    TORCH_CHECK(hs[d] <= hs[d + 1], what, ": high_start decreases at delta ", d);
    const P* rows = bp + d * (nb + 1);
    TORCH_CHECK(rows[0] >= 0 && rows[nb] <= nnz, what, ": block_ptr[", d, "] spans [", rows[0], ", ", rows[nb],
                "), outside [0, ", nnz, ")");
    for (int64_t b = 0; b < nb; ++b) {
      TORCH_CHECK(rows[b] <= rows[b + 1], what, ": block_ptr[", d, "] decreases at block ", b);
    }
  }
}

void check_fields(const at::Tensor& block_ptr, const at::Tensor& low, const at::Tensor& high,
                  const at::Tensor& high_start, const at::Tensor& values, int64_t R, const char* what) {
  TORCH_CHECK(block_ptr.dim() == 2 && block_ptr.is_contiguous() && delta_bank::row_ptr_type_ok(block_ptr) &&
                  block_ptr.device().is_cpu(),
              what, ": block_ptr must be a contiguous int32 or int64 CPU tensor [n_deltas, blocks + 1]");
  TORCH_CHECK(block_ptr.size(1) == (R + PACK_ROWS - 1) / PACK_ROWS + 1, what, ": block_ptr has ",
              block_ptr.size(1), " pointers per delta; a weight of ", R, " rows needs ",
              (R + PACK_ROWS - 1) / PACK_ROWS + 1, " (one per block of ", PACK_ROWS, " rows, and the end)");
  TORCH_CHECK(low.dim() == 1 && low.is_contiguous() && low.scalar_type() == at::kByte && low.device().is_cpu(), what,
              ": low must be a contiguous 1-D uint8 CPU tensor");
  TORCH_CHECK(high.dim() == 1 && high.is_contiguous() && high.scalar_type() == at::kLong && high.device().is_cpu(),
              what, ": high must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(high_start.dim() == 1 && high_start.is_contiguous() && high_start.scalar_type() == at::kLong &&
                  high_start.numel() == block_ptr.size(0) + 1 && high_start.device().is_cpu(),
              what, ": high_start must be a contiguous int64 CPU tensor [n_deltas + 1]");
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && delta_bank::value_type_ok(values) &&
                  values.numel() == low.numel() && values.device().is_cpu(),
              what, ": values must be a contiguous float32, bfloat16 or float16 CPU tensor, one value per entry");
  delta_bank::by_row_ptr(block_ptr, [&](auto p) {
    check_pointers<decltype(p)>(block_ptr, high_start, low.numel(), high.numel(), what);
  });
}

template <typename P>
Packed<P> view(const at::Tensor& block_ptr, const at::Tensor& low, const at::Tensor& high,
               const at::Tensor& high_start, int64_t R, int64_t C) {
  return {block_ptr.data_ptr<P>(), low.data_ptr<uint8_t>(), reinterpret_cast<const uint64_t*>(high.data_ptr<int64_t>()),
          high_start.data_ptr<int64_t>(), block_ptr.size(1) - 1, R, C};
}

// ------------------------------------------------------------------------------ mixed matmul

// y[t] += x[t] D^T for the tokens of one group (count <= LANES tokens of one delta) over rows whose
// entries are given row by row: each(f) calls f(i, cols, e, n) for row i's n entries e, e + 1, ...
// with columns cols[0, n). The CSR kernel's arithmetic: per row, products summed in entry order, a
// lone token's input read where it lies, several tokens' through an fp32 panel [C, LANES].
template <typename S, typename V, typename Rows>
void group_rows(const delta_bank::TokenGroup& g, const int64_t* order, const S* xp, S* yp, int64_t ld_x,
                int64_t ld_y, int64_t C, const V* vp, std::vector<float>& panel, Rows&& each) {
  if (g.count == 1) {  // a token alone with its delta: its input read where it lies
    const S* xt = xp + order[g.begin] * ld_x;
    S* yt = yp + order[g.begin] * ld_y;
    each([&](int64_t i, const int32_t* cols, int64_t e, int64_t n) {
      float acc = 0.0f;
      for (int64_t q = 0; q < n; ++q) acc += static_cast<float>(vp[e + q]) * static_cast<float>(xt[cols[q]]);
      yt[i] = static_cast<S>(static_cast<float>(yt[i]) + acc);
    });
    return;
  }
  delta_bank::fill_panel(g, order, xp, ld_x, C, panel);
  const float* __restrict pp = panel.data();
  each([&](int64_t i, const int32_t* cols, int64_t e, int64_t n) {
    float acc[LANES] = {};
    for (int64_t q = 0; q < n; ++q) {
      const float v = static_cast<float>(vp[e + q]);
      const float* xc = pp + static_cast<int64_t>(cols[q]) * LANES;
      for (int64_t l = 0; l < LANES; ++l) acc[l] += v * xc[l];
    }
    for (int64_t l = 0; l < g.count; ++l) {
      S* out = yp + order[g.begin + l] * ld_y + i;
      *out = static_cast<S>(static_cast<float>(*out) + acc[l]);
    }
  });
}

// Threads take (delta, block of rows) tasks. A delta with one token (a decode step's row) decodes
// its entries in the loop that sums them (`fused`); one with more (a prefill's tokens) decodes the
// block once into columns per row, which each group of up to LANES tokens then reads as CSR.
template <typename S, typename P, typename V>
void run_matmul(at::Tensor& y, const at::Tensor& x, const int32_t* ids, const Packed<P>& bank, const V* vp,
                int64_t n, std::atomic<int64_t>& bad_delta) {
  const int64_t T = y.size(0), R = y.size(1), C = x.size(1);
  const int64_t ld_y = y.stride(0), ld_x = x.stride(0);
  S* __restrict yp = y.data_ptr<S>();
  const S* __restrict xp = x.data_ptr<S>();
  std::vector<int64_t> order;
  const std::vector<delta_bank::TokenGroup> groups = delta_bank::token_groups(ids, T, n, order);
  // The groups of each delta that has any: [first, end) in `groups` (they come ordered by delta).
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t k = 0; k < static_cast<int64_t>(groups.size()); ++k) {
    if (spans.empty() || groups[spans.back().first].delta != groups[k].delta) spans.push_back({k, k});
    spans.back().second = k + 1;
  }
  const int64_t n_spans = static_cast<int64_t>(spans.size());
  if (n_spans == 0) return;
  const int64_t row_block = n_spans >= 2 * at::get_num_threads() ? R : std::min(R, ROW_BLOCK);
  const int64_t blocks = (R + row_block - 1) / row_block;
  at::parallel_for(0, n_spans * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> panel;
    std::vector<int32_t> cols;                   // the block's columns, row after row
    std::vector<std::array<int64_t, 3>> rows;  // (row, first column's place in cols, count)
    for (int64_t task = lo; task < hi; ++task) {
      const auto [first, end] = spans[task / blocks];
      const int64_t delta = groups[first].delta;
      const int64_t r0 = (task % blocks) * row_block, r1 = std::min(R, r0 + row_block);
      bool ok;
      const Decoder dec = bank.decoder(delta, r0, r1, ok);
      if (ok && end - first == 1 && groups[first].count == 1) {
        // A token alone with its delta (a decode step): the decode runs in the loop that sums.
        const S* xt = xp + order[groups[first].begin] * ld_x;
        S* yt = yp + order[groups[first].begin] * ld_y;
        float acc = 0.0f;
        ok = fused(
            dec, C, [&](int64_t j, int64_t e) { acc += static_cast<float>(vp[e]) * static_cast<float>(xt[j]); },
            [&](int64_t i) {
              yt[i] = static_cast<S>(static_cast<float>(yt[i]) + acc);
              acc = 0.0f;
            });
      } else if (ok) {
        if (static_cast<int64_t>(cols.size()) < dec.e1 - dec.e) cols.resize(dec.e1 - dec.e);
        rows.clear();
        int32_t* __restrict out = cols.data();
        int64_t written = 0, start = 0;
        ok = fused(
            dec, C, [&](int64_t j, int64_t) { out[written++] = static_cast<int32_t>(j); },
            [&](int64_t i) {
              rows.push_back({i, start, written - start});
              start = written;
            });
        if (ok) {
          for (int64_t k = first; k < end; ++k) {
            group_rows(groups[k], order.data(), xp, yp, ld_x, ld_y, C, vp, panel, [&](auto f) {
              for (const auto& r : rows) f(r[0], cols.data() + r[1], dec.e + r[1], r[2]);
            });
          }
        }
      }
      if (!ok) bad_delta.store(delta, std::memory_order_relaxed);
    }
  });
}

void mixed_delta_matmul_packed_cpu(at::Tensor& y, const at::Tensor& x, const at::Tensor& delta_ids,
                                   const at::Tensor& block_ptr, const at::Tensor& low, const at::Tensor& high,
                                   const at::Tensor& high_start, const at::Tensor& values, bool check_positions) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "y and x must be [T, R] and [T, C], got ",
              y.sizes(), " and ", x.sizes());
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "y and x must have the same dtype, got ", y.scalar_type(), " and ",
              x.scalar_type());
  const auto dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "y must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && delta_ids.device().is_cpu(),
              "mixed_delta_matmul_packed_ takes CPU tensors");
  TORCH_CHECK(y.size(1) <= 1 || y.stride(1) == 1, "y rows must be contiguous");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, "x rows must be contiguous");
  const int64_t T = y.size(0), R = y.size(1), C = x.size(1);
  TORCH_CHECK(delta_ids.dim() == 1 && delta_ids.is_contiguous() && delta_ids.scalar_type() == at::kInt &&
                  delta_ids.numel() == T,
              "delta_ids must be a contiguous 1-D int32 tensor of T = ", T, " ids");
  check_fields(block_ptr, low, high, high_start, values, R, "the packed bank");
  const int64_t n = block_ptr.size(0);
  const int32_t* idp = delta_ids.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(idp[t] >= -1 && idp[t] < n, "delta_ids has ", idp[t], " at position ", t, ", outside [-1, ", n, ")");
  }
  if (T == 0 || R == 0 || C == 0 || n == 0) return;
  std::atomic<int64_t> bad_delta{-1};
  delta_bank::by_row_ptr(block_ptr, [&](auto p) {
    using P = decltype(p);
    const Packed<P> bank = view<P>(block_ptr, low, high, high_start, R, C);
    if (check_positions) {  // every position of every delta the ids name, ascending inside its rows, first
      std::vector<char> named(n, 0);
      for (int64_t t = 0; t < T; ++t) {
        if (idp[t] >= 0) named[idp[t]] = 1;
      }
      for (int64_t d = 0; d < n; ++d) {
        TORCH_CHECK(!named[d] || bank.valid(d, 0, R), "the packed bank's delta ",
                    d, " decodes to positions outside its weight or out of order (nothing was written)");
      }
    }
    delta_bank::by_float(values.scalar_type(), [&](auto v) {
      using V = decltype(v);
      const V* vp = values.data_ptr<V>();
      delta_bank::by_float(dtype, [&](auto s) { run_matmul<decltype(s), P, V>(y, x, idp, bank, vp, n, bad_delta); });
    });
  });
  TORCH_CHECK(bad_delta.load() < 0, "the packed bank's delta ", bad_delta.load(), " decodes to positions outside ",
              "its rows or out of order (y was partly written)");
}

// ------------------------------------------------------------------------------------ switch

struct Layer {
  const at::Tensor* w;
  const at::Tensor *block_ptr, *low, *high, *high_start, *val;
  const at::Tensor* saved_off;
  const at::Tensor* saved_on;
  int64_t R, C;
};

// Rows [r0, r1) of one layer: delta off's entries get their saved values back, then delta on's save
// theirs and gain their values. A chunk of positions is decoded and each of its places prefetched
// before any of its writes: the chunk's cache misses are in flight together. False where the bank
// is malformed (the chunks before it were written).
template <typename W, typename P, typename V>
bool switch_rows(const Layer& layer, int64_t off, int64_t on, int64_t r0, int64_t r1) {
  W* __restrict wp = layer.w->data_ptr<W>();
  const int64_t ld_r = layer.w->stride(0), ld_c = layer.w->stride(1), C = layer.C;
  const Packed<P> bank = view<P>(*layer.block_ptr, *layer.low, *layer.high, *layer.high_start, layer.R, layer.C);
  const V* __restrict vp = layer.val->data_ptr<V>();
  int64_t pos[CHUNK];
  for (int64_t d : {off, on}) {
    if (d < 0) continue;
    const int64_t first = bank.block_ptr[d * (bank.nb + 1)];
    const W* __restrict restore = d == off ? layer.saved_off->data_ptr<W>() - first : nullptr;
    W* __restrict save = d == on ? layer.saved_on->data_ptr<W>() - first : nullptr;
    bool ok;
    Decoder dec = bank.decoder(d, r0, r1, ok);
    if (!ok) return false;
    int64_t m, e = dec.e, row = r0, row_begin = r0 * C;
    while ((m = dec.next(pos)) > 0) {
      for (int64_t q = 0; q < m; ++q) {  // positions -> places (ascending: the row only moves on)
        while (pos[q] >= row_begin + C) {
          ++row;
          row_begin += C;
        }
        pos[q] = row * ld_r + (pos[q] - row_begin) * ld_c;
        __builtin_prefetch(wp + pos[q], 1, 3);
      }
      if (restore) {
        for (int64_t q = 0; q < m; ++q) wp[pos[q]] = restore[e + q];
      } else {
        for (int64_t q = 0; q < m; ++q) {
          W* at = wp + pos[q];
          const W was = *at;
          save[e + q] = was;
          *at = static_cast<W>(static_cast<float>(was) + static_cast<float>(vp[e + q]));
        }
      }
      e += m;
    }
    if (m < 0) return false;
  }
  return true;
}

void delta_bank_switch_packed_cpu(at::TensorList weights, at::TensorList block_ptrs, at::TensorList lows,
                                  at::TensorList highs, at::TensorList high_starts, at::TensorList values,
                                  int64_t off, int64_t on, at::TensorList originals_off,
                                  at::TensorList originals_on, bool check_positions) {
  const size_t L = weights.size();
  TORCH_CHECK(block_ptrs.size() == L && lows.size() == L && highs.size() == L && high_starts.size() == L &&
                  values.size() == L,
              "block_ptrs, lows, highs, high_starts and values must have one tensor per weight");
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
    TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "weights[", l, "] must be a 2-D CPU tensor [R, C]");
    const auto dtype = w.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "weights[", l, "] must be float32, bfloat16 or float16, got ", dtype);
    const int64_t R = w.size(0);
    const std::string what = "bank " + std::to_string(l);
    check_fields(block_ptrs[l], lows[l], highs[l], high_starts[l], values[l], R, what.c_str());
    const int64_t n = block_ptrs[l].size(0);
    TORCH_CHECK(off >= -1 && off < n && on >= -1 && on < n && (off != on || off < 0),
                "off and on must be two deltas in [-1, ", n, ") (-1: none)");
    for (int64_t d : {off, on}) {
      if (d < 0) continue;
      const int64_t first = delta_bank::row_ptr_at(block_ptrs[l], d, 0);
      const int64_t last = delta_bank::row_ptr_at(block_ptrs[l], d, block_ptrs[l].size(1) - 1);
      const at::Tensor& saved = d == off ? originals_off[l] : originals_on[l];
      TORCH_CHECK(saved.dim() == 1 && saved.is_contiguous() && saved.scalar_type() == dtype &&
                      saved.numel() == last - first && saved.device().is_cpu(),
                  d == off ? "originals_off[" : "originals_on[", l, "] must be a contiguous CPU tensor of the "
                  "weight's dtype with one value per entry of its delta (", last - first, ")");
      entries += last - first;
    }
    layers[l] = {&w, &block_ptrs[l], &lows[l], &highs[l], &high_starts[l], &values[l],
                 off >= 0 ? &originals_off[l] : nullptr, on >= 0 ? &originals_on[l] : nullptr, R, w.size(1)};
    for (int64_t r = 0; r < R; r += SWITCH_ROWS) tasks.push_back({l, r, std::min(R, r + SWITCH_ROWS)});
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = std::max<int64_t>(1, n_tasks * SWITCH_GRAIN / std::max<int64_t>(entries, 1));
  // Every position is decoded and checked once before anything is written, unless the caller built the
  // banks (check_positions false): the writes then still decode each position checked, so a malformed
  // bank stops the switch partway (an error) but never writes outside a weight.
  std::atomic<int64_t> bad_layer{-1};
  if (check_positions) at::parallel_for(0, n_tasks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const Task& task = tasks[t];
      const Layer& layer = layers[task.layer];
      auto check = [&](auto p) {
        using P = decltype(p);
        const Packed<P> bank = view<P>(*layer.block_ptr, *layer.low, *layer.high, *layer.high_start, layer.R,
                                       layer.C);
        bool ok = true;
        for (int64_t d : {off, on}) {
          if (d >= 0) ok &= bank.valid(d, task.r0, task.r1);
        }
        return ok;
      };
      bool ok = true;
      delta_bank::by_row_ptr(*layer.block_ptr, [&](auto p) { ok = check(p); });
      if (!ok) bad_layer.store(static_cast<int64_t>(task.layer), std::memory_order_relaxed);
    }
  });
  TORCH_CHECK(bad_layer.load() < 0, "bank ", bad_layer.load(), " decodes to positions outside its weight or out of ",
              "order (nothing was written)");
  at::parallel_for(0, n_tasks, grain, [&](int64_t lo, int64_t hi) {
    bool ok = true;
    for (int64_t t = lo; t < hi; ++t) {
      const Task& task = tasks[t];
      const Layer& layer = layers[task.layer];
      delta_bank::by_row_ptr(*layer.block_ptr, [&](auto p) {
        delta_bank::by_float(layer.val->scalar_type(), [&](auto v) {
          delta_bank::by_float(layer.w->scalar_type(), [&](auto w) {
            ok &= switch_rows<decltype(w), decltype(p), decltype(v)>(layer, off, on, task.r0, task.r1);
          });
        });
      });
      if (!ok) {
        bad_layer.store(static_cast<int64_t>(task.layer), std::memory_order_relaxed);
        ok = true;
      }
    }
  });
  TORCH_CHECK(bad_layer.load() < 0, "bank ", bad_layer.load(), " decodes to positions outside its weight or out of ",
              "order (the weights were partly switched)");
}

}  // namespace

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) {
  m.impl("mixed_delta_matmul_packed_", &mixed_delta_matmul_packed_cpu);
  m.impl("delta_bank_switch_packed_", &delta_bank_switch_packed_cpu);
}

}  // namespace sift
