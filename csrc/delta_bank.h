// The forms of a DeltaBank's fields (sift/triton_kernels/_delta_bank.py) the CPU kernels take, and
// the dispatch over them: row pointers int32 or int64, columns int16 or int32, values fp32, bf16
// or fp16 (each read as fp32, exact). DeltaBank stores the narrowest that holds a bank; the
// kernels are instantiated for each form so that no call widens a field into a temporary. Also the
// token groups both mixed-delta products (CSR and packed) take their tokens in.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace sift {
namespace delta_bank {

inline bool row_ptr_type_ok(const at::Tensor& t) {
  return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
}
inline bool col_type_ok(const at::Tensor& t) {
  return t.scalar_type() == at::kShort || t.scalar_type() == at::kInt;
}
inline bool value_type_ok(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// f(T{}) with T the element type of a float32, bfloat16 or float16 tensor (checked by the caller).
template <typename F>
void by_float(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    default:
      f(c10::Half{});
      break;
  }
}

// f(P{}) with P the element type of an int32 or int64 pointer tensor (row or block pointers).
template <typename F>
void by_row_ptr(const at::Tensor& ptr, F&& f) {
  if (ptr.scalar_type() == at::kInt) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

// f(P{}, I{}, V{}) with P the row pointers' type, I the columns', V the values'.
template <typename F>
void dispatch(const at::Tensor& row_ptr, const at::Tensor& col, const at::Tensor& val, F&& f) {
  by_row_ptr(row_ptr, [&](auto p) {
    auto by_value = [&](auto i) { by_float(val.scalar_type(), [&](auto v) { f(p, i, v); }); };
    if (col.scalar_type() == at::kShort) {
      by_value(int16_t{});
    } else {
      by_value(int32_t{});
    }
  });
}

// Whether column c is outside [0, C): a negative column reads as a huge unsigned one.
template <typename I>
inline bool outside(I c, int64_t C) {
  return static_cast<uint64_t>(static_cast<std::make_unsigned_t<I>>(c)) >= static_cast<uint64_t>(C);
}

// Whether every column of cp[begin, end) lies in [0, C): one pass of unsigned maxima (vectorized),
// since a negative column reads as a huge unsigned one.
template <typename I>
bool columns_inside(const I* __restrict cp, int64_t begin, int64_t end, int64_t C) {
  using U = std::make_unsigned_t<I>;
  U top = 0;
  for (int64_t e = begin; e < end; ++e) top = std::max(top, static_cast<U>(cp[e]));
  return begin >= end || static_cast<uint64_t>(top) < static_cast<uint64_t>(C);
}

// The column at position e of an int16 or int32 column tensor, for error messages.
inline int64_t column_at(const at::Tensor& col, int64_t e) {
  return col.scalar_type() == at::kShort ? col.data_ptr<int16_t>()[e] : col.data_ptr<int32_t>()[e];
}

// Row pointer i of delta d, for checks and messages.
inline int64_t row_ptr_at(const at::Tensor& ptr, int64_t d, int64_t i) {
  const int64_t at = d * ptr.size(1) + i;
  return ptr.scalar_type() == at::kInt ? ptr.data_ptr<int32_t>()[at] : ptr.data_ptr<int64_t>()[at];
}

// The switch's lists of saved values: one per weight for each delta that is not -1, else none.
inline void check_originals(size_t L, int64_t off, int64_t on, at::TensorList originals_off,
                            at::TensorList originals_on) {
  TORCH_CHECK(originals_off.size() == (off >= 0 ? L : 0),
              "originals_off must have one tensor per weight when off >= 0, else none");
  TORCH_CHECK(originals_on.size() == (on >= 0 ? L : 0),
              "originals_on must have one tensor per weight when on >= 0, else none");
}

// Tokens summed together by the mixed-delta products: tokens with one delta share each entry's
// column and value, loaded once for all of them.
constexpr int64_t LANES = 8;

struct TokenGroup {
  int64_t begin, count;  // tokens order[begin, begin + count), count <= LANES
  int32_t delta;
};

// The inputs of group g's tokens as fp32, column-major: panel[c * LANES + l] = x[order[g.begin + l], c],
// 0 past g.count; panel is sized [C * LANES] on first use.
template <typename S>
void fill_panel(const TokenGroup& g, const int64_t* order, const S* xp, int64_t ld_x, int64_t C,
                std::vector<float>& panel) {
  if (panel.empty()) panel.resize(C * LANES);
  std::fill(panel.begin(), panel.end(), 0.0f);
  for (int64_t l = 0; l < g.count; ++l) {
    const S* xt = xp + order[g.begin + l] * ld_x;
    for (int64_t c = 0; c < C; ++c) panel[c * LANES + l] = static_cast<float>(xt[c]);
  }
}

// The tokens with a delta (id != -1) ordered by delta, in token order within one (a counting
// sort), and cut into groups of at most LANES tokens of one delta: the tokens of a row in a
// prefill, or the rows of a decode step that share a delta.
inline std::vector<TokenGroup> token_groups(const int32_t* ids, int64_t T, int64_t n, std::vector<int64_t>& order) {
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

}  // namespace delta_bank
}  // namespace sift
