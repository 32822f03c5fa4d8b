// Validation of sorted index lists, shared by the ops that take them (delta.cpp,
// sparse_adamw.cpp). The ops are public (torch.ops.sift.*), so they check every index instead
// of trusting the sortedness the Python API checks: an index outside its tensor would be a
// wild write, a repeated one a race between threads.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace sift {
namespace index_check {

template <typename I>
int64_t at_position(const at::Tensor& t, int64_t pos) {
  return static_cast<int64_t>(t.data_ptr<I>()[pos]);
}

inline int64_t index_at(const at::Tensor& t, int64_t pos) {
  return t.scalar_type() == at::kInt ? at_position<int32_t>(t, pos) : at_position<int64_t>(t, pos);
}

// First position j in [begin, end) breaking the contract, or -1: idx[0] must lie in [0, limit),
// and idx[j] (j > 0) in (idx[j - 1], limit), idx[j - 1] possibly in the previous chunk. Whether a
// position breaks it depends on that position alone, so the lowest over the chunks of a tensor is
// the tensor's first violation, and with none, every index is in [0, limit) by induction.
template <typename I>
int64_t first_violation(const I* __restrict idx, int64_t begin, int64_t end, int64_t limit) {
  using U = std::make_unsigned_t<I>;
  if (begin >= end) return -1;
  // Fast test, branch-free and vectorizable (SSE2 has no 64-bit compare, but has 64-bit sub/or):
  // the sign bit of a | (last - a) | (a - prev - 1) is set iff a is outside [0, last] or, both
  // in range (no overflow then), a <= prev. Wrapped garbage from an out-of-range prev can only
  // err at `begin` after an out-of-range idx[begin - 1], which its own chunk reports; any hit is
  // confirmed by the exact scan below.
  const I last = static_cast<I>(std::min<int64_t>(limit - 1, std::numeric_limits<I>::max()));
  const U ulast = static_cast<U>(last);
  U acc = 0;
  if (begin == 0) acc = static_cast<U>(idx[0]) | (ulast - static_cast<U>(idx[0]));
  for (int64_t j = std::max<int64_t>(begin, 1); j < end; ++j) {
    const U a = static_cast<U>(idx[j]);
    acc |= a | (ulast - a) | (a - static_cast<U>(idx[j - 1]) - U{1});
  }
  if (static_cast<I>(acc) >= 0) return -1;
  for (int64_t j = begin; j < end; ++j) {
    const int64_t a = idx[j];
    if (a >= limit || (j == 0 ? a < 0 : a <= static_cast<int64_t>(idx[j - 1]))) return j;
  }
  return -1;
}

// first_violation over t[begin, end) of an int32 or int64 index tensor.
inline int64_t first_violation_in(const at::Tensor& t, int64_t begin, int64_t end, int64_t limit) {
  return t.scalar_type() == at::kInt ? first_violation<int32_t>(t.data_ptr<int32_t>(), begin, end, limit)
                                     : first_violation<int64_t>(t.data_ptr<int64_t>(), begin, end, limit);
}

struct Violation {
  int64_t tensor = -1, position = -1;
};

// "indices[i] has V at position j, outside [0, L)" or "..., not above U at position j - 1".
inline std::string describe_violation(at::TensorList indices, const Violation& v, int64_t limit,
                               const std::string& limit_text) {
  const at::Tensor& t = indices[v.tensor];
  const int64_t value = index_at(t, v.position);
  std::string out = c10::str("indices[", v.tensor, "] has ", value, " at position ", v.position);
  if (value < 0 || value >= limit) return out + c10::str(", outside [0, ", limit_text, ")");
  return out + c10::str(", not above ", index_at(t, v.position - 1), " at position ", v.position - 1);
}

}  // namespace index_check
}  // namespace sift
