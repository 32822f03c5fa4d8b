// Sparse deltas on CPU: k-way merge of index-sorted (indices, values) lists, scatter-add apply
// with a fused gather of the overwritten values, and the scatter that restores them. The math
// is the contract in sift/_ops/ (merge_sorted_deltas_ref, sparse_delta_apply_ref,
// sparse_delta_restore_ref); this file is its C++/OpenMP implementation.
//
// Merge. Each output tensor g has n_g inputs, each a strictly increasing index list with fp32
// values and a weight w_i. The output is the sorted union of the indices; at every index the
// contributions c_i = w_i * v_i (double) of the inputs holding it are either summed, or, with
// `ties`, reduced by sign election: s = sign(sum c_i), value = mean of the c_i whose sign is s
// (0 when the sum is 0). Threads merge disjoint ranges of the index space: splitters are picked
// from per-input quantiles, every input is cut at each splitter by binary search, and a
// tournament tree of packed (index, input) keys merges the k sub-lists of a range. Ranges may
// share no index, so a range's output fits below the sum of its inputs' start offsets plus its
// own length; a thread writes its ranges back to back from there into a buffer sized for the
// sum of the inputs. Where inputs share indices, the ranges' blocks are then copied, in
// parallel, into a tensor of the union's size: a resize_ would keep the whole buffer's storage
// (merging 8 copies of one delta would hold 8x its entries); counting the union first would cost
// one more merge pass.
//
// Apply. w[idx[j]] = W(float(w[idx[j]]) + float(scale) * v[j]) for unique sorted idx, with the
// old w[idx[j]] optionally saved, in chunks over all tensors with software prefetch ahead.
//
// Index validation. The ops are public (torch.ops.sift.*), so they do not trust the sortedness
// the Python API checks: before anything is planned or written, one parallel pass over all index
// tensors checks every position (in range, and above its predecessor), and the first violation
// (lowest tensor, then lowest position) raises naming the tensor and the position.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "index_check.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace sift {
namespace {

using index_check::at_position;
using index_check::describe_violation;
using index_check::first_violation_in;
using index_check::Violation;

constexpr int64_t APPLY_CHUNK = 1 << 14;
constexpr int64_t PREFETCH_DISTANCE = 32;
// Ranges smaller than this are not worth a thread: the merge of one costs ~microseconds.
constexpr int64_t MIN_RANGE_ENTRIES = 1 << 16;
constexpr int64_t NO_INDEX = std::numeric_limits<int64_t>::max();
// Entries per task of the index validation pass (a streaming read of <= 512 KB).
constexpr int64_t CHECK_CHUNK = 1 << 16;

struct Chunk {
  int64_t tensor, begin, end;
};

// ------------------------------------------------------------------------------------------
// Index validation
// ------------------------------------------------------------------------------------------

// Checks every index of every tensor (int32 or int64, contiguous 1-D, already checked) against
// its tensor's limit, in parallel; returns the first violation in (tensor, position) order.
Violation find_violation(at::TensorList indices, const std::vector<int64_t>& limits) {
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < static_cast<int64_t>(indices.size()); ++i) {
    const int64_t k = indices[i].numel();
    for (int64_t b = 0; b < k; b += CHECK_CHUNK) chunks.push_back({i, b, std::min(k, b + CHECK_CHUNK)});
  }
  std::vector<int64_t> found(chunks.size(), -1);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& ch = chunks[c];
      found[c] = first_violation_in(indices[ch.tensor], ch.begin, ch.end, limits[ch.tensor]);
    }
  });
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (found[c] >= 0) return {chunks[c].tensor, found[c]};
  }
  return {};
}

// ------------------------------------------------------------------------------------------
// Merge
// ------------------------------------------------------------------------------------------

struct MergeRange {
  int64_t group;         // output tensor
  int64_t out_offset;    // upper bound of its final offset: the sum of its inputs' starts
  int64_t write_offset;  // where it wrote: right after the previous range of the same thread
  std::vector<int64_t> begin, end;  // per input of the group
  int64_t written = 0;
};

// Reduces the contributions of the inputs sharing one index.
inline float reduce_ties(const double* c, int64_t n) {
  double total = 0;
  for (int64_t j = 0; j < n; ++j) total += c[j];
  if (total == 0) return 0.0f;
  double agree = 0;
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {
    if ((total > 0 && c[j] > 0) || (total < 0 && c[j] < 0)) {
      agree += c[j];
      ++count;
    }
  }
  return static_cast<float>(agree / static_cast<double>(count));
}

// Merges one range of the k inputs of a group, one output entry per step().
//
// Tournament (winner) tree over p leaves, p the power of two >= k. A node holds the packed key
// (index << id_bits | input), so a replay is a chain of branch-free integer mins and equal
// indices pop in input order (shared indices are reduced in input order, deterministically).
template <typename I, bool TIES>
struct RangeMerger {
  static constexpr uint64_t DONE = std::numeric_limits<uint64_t>::max();
  int id_bits = 0;
  int64_t p = 1;
  uint64_t id_mask = 0;
  std::vector<uint64_t> node;
  std::vector<const I*> ip, iend;
  std::vector<const float*> vp;
  std::vector<uint64_t> ahead;  // packed key of the entry after each input's head
  std::vector<double> contrib;
  const double* weight = nullptr;
  I* out_idx = nullptr;
  float* out_val = nullptr;
  int64_t written = 0;
  uint64_t top = DONE;

  RangeMerger(const std::vector<const I*>& idx, const std::vector<const float*>& val, const double* w,
              const std::vector<int64_t>& begin, const std::vector<int64_t>& end, I* oi, float* ov)
      : weight(w), out_idx(oi), out_val(ov) {
    const int64_t k = static_cast<int64_t>(idx.size());
    while ((int64_t{1} << id_bits) < k) ++id_bits;
    p = int64_t{1} << id_bits;
    id_mask = static_cast<uint64_t>(p - 1);
    node.assign(2 * p, DONE);
    ip.resize(k);
    iend.resize(k);
    vp.resize(k);
    ahead.resize(k);
    contrib.resize(k);
    for (int64_t i = 0; i < k; ++i) {
      ip[i] = idx[i] + begin[i];
      iend[i] = idx[i] + end[i];
      vp[i] = val[i] + begin[i];
      node[p + i] = key_at(i, ip[i]);
      ahead[i] = ip[i] < iend[i] ? key_at(i, ip[i] + 1) : DONE;
    }
    for (int64_t n = p - 1; n >= 1; --n) node[n] = std::min(node[2 * n], node[2 * n + 1]);
    top = node[1];
  }

  inline uint64_t key_at(int64_t i, const I* q) const {
    return q < iend[i] ? (static_cast<uint64_t>(*q) << id_bits) | static_cast<uint64_t>(i) : DONE;
  }

  // Emits the next output entry; false once the range is exhausted.
  inline bool step() {
    if (top == DONE) return false;
    uint64_t* __restrict t = node.data();
    const uint64_t at = top >> id_bits;
    uint64_t key = top;
    double acc = 0;
    int64_t n_contrib = 0;
    do {
      const int64_t i = static_cast<int64_t>(key & id_mask);
      const double c = weight[i] * static_cast<double>(*vp[i]++);
      acc += c;
      if (TIES) contrib[n_contrib++] = c;
      // The new head's key was loaded one pop earlier: inputs share cache sets (page-aligned
      // tensors walked at similar rates), so a load here would put an L2 miss on the chain.
      key = ahead[i];
      const I* q = ++ip[i];
      ahead[i] = key == DONE ? DONE : key_at(i, q + 1);
      int64_t n = p + i;
      t[n] = key;
      while (n > 1) {
        key = std::min(key, t[n ^ 1]);
        n >>= 1;
        t[n] = key;
      }
    } while ((key >> id_bits) == at);
    top = key;
    out_idx[written] = static_cast<I>(at);
    // One contribution elects its own sign: the ties value is the plain sum then.
    out_val[written] = TIES && n_contrib > 1 ? reduce_ties(contrib.data(), n_contrib) : static_cast<float>(acc);
    ++written;
    return true;
  }
};

struct MergeInputs {
  at::TensorList indices, values;
  at::ArrayRef<double> weights;
  at::IntArrayRef group_sizes;
  const std::vector<int64_t>& first;
  const std::vector<at::Tensor>& out_idx;
  const std::vector<at::Tensor>& out_val;
};

template <typename I, bool TIES>
void merge_one_range(const MergeInputs& in, MergeRange& range) {
  const int64_t g = range.group;
  const int64_t k = in.group_sizes[g];
  const int64_t f = in.first[g];
  I* oi = in.out_idx[g].template data_ptr<I>() + range.write_offset;
  float* ov = in.out_val[g].template data_ptr<float>() + range.write_offset;
  if (k == 1) {
    // One input (the identity merge, or a tensor only one delta touches): a scaled copy.
    const int64_t b = range.begin[0], n = range.end[0] - b;
    const float* v = in.values[f].template data_ptr<float>() + b;
    const double w = in.weights[f];
    std::memcpy(oi, in.indices[f].template data_ptr<I>() + b, n * sizeof(I));
    for (int64_t j = 0; j < n; ++j) ov[j] = static_cast<float>(w * static_cast<double>(v[j]));
    range.written = n;
    return;
  }
  std::vector<const I*> ix(k);
  std::vector<const float*> val(k);
  for (int64_t i = 0; i < k; ++i) {
    ix[i] = in.indices[f + i].template data_ptr<I>();
    val[i] = in.values[f + i].template data_ptr<float>();
  }
  RangeMerger<I, TIES> merger(ix, val, in.weights.data() + f, range.begin, range.end, oi, ov);
  while (merger.step()) {
  }
  range.written = merger.written;
}

template <typename I>
int64_t lower_bound_in(const at::Tensor& t, int64_t value) {
  const I* p = t.data_ptr<I>();
  const int64_t n = t.numel();
  return std::lower_bound(p, p + n, value, [](I a, int64_t b) { return static_cast<int64_t>(a) < b; }) - p;
}

// Cuts the inputs of one group into ranges of roughly equal total size.
template <typename I>
void plan_group(at::TensorList indices, int64_t first, int64_t n_inputs, int64_t group, int64_t n_ranges,
                std::vector<MergeRange>& ranges) {
  std::vector<int64_t> splitters;
  if (n_ranges > 1) {
    // Quantiles of every input, sorted: every n_inputs-th one approximates a quantile of the
    // union even when the inputs cover disjoint parts of the index space.
    std::vector<int64_t> candidates;
    for (int64_t i = 0; i < n_inputs; ++i) {
      const int64_t len = indices[first + i].numel();
      if (len == 0) continue;
      for (int64_t r = 1; r < n_ranges; ++r) candidates.push_back(at_position<I>(indices[first + i], r * len / n_ranges));
    }
    std::sort(candidates.begin(), candidates.end());
    const int64_t c = static_cast<int64_t>(candidates.size());
    for (int64_t r = 1; r < n_ranges; ++r) {
      const int64_t s = candidates[std::min(c - 1, r * c / n_ranges)];
      if (splitters.empty() || s > splitters.back()) splitters.push_back(s);
    }
  }
  int64_t offset = 0;
  const int64_t n_cut = static_cast<int64_t>(splitters.size()) + 1;
  std::vector<int64_t> prev(n_inputs, 0);
  for (int64_t r = 0; r < n_cut; ++r) {
    MergeRange range;
    range.group = group;
    range.out_offset = offset;
    range.begin = prev;
    range.end.resize(n_inputs);
    for (int64_t i = 0; i < n_inputs; ++i) {
      range.end[i] = r + 1 < n_cut ? lower_bound_in<I>(indices[first + i], splitters[r]) : indices[first + i].numel();
      offset += range.end[i] - range.begin[i];
    }
    prev = range.end;
    ranges.push_back(std::move(range));
  }
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> merge_sorted_deltas_cpu(
    at::TensorList indices, at::TensorList values, at::ArrayRef<double> weights, at::IntArrayRef group_sizes,
    bool ties) {
  const auto n_in = static_cast<int64_t>(indices.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == n_in, "values must have one tensor per indices tensor");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_in, "weights must have one entry per indices tensor");
  int64_t total_inputs = 0;
  for (int64_t g : group_sizes) {
    TORCH_CHECK(g >= 1, "group_sizes must be >= 1");
    // Bounded before the sum, which huge sizes would overflow (and wrap back to n_in).
    TORCH_CHECK(g <= n_in - total_inputs, "group_sizes must add up to the number of indices tensors");
    total_inputs += g;
  }
  TORCH_CHECK(total_inputs == n_in, "group_sizes must add up to the number of indices tensors");
  const int64_t n_groups = static_cast<int64_t>(group_sizes.size());
  std::vector<int64_t> first(n_groups);
  for (int64_t g = 0, acc = 0; g < n_groups; acc += group_sizes[g], ++g) first[g] = acc;

  const int64_t threads = at::get_num_threads();
  std::vector<MergeRange> ranges;
  std::vector<at::Tensor> out_idx(n_groups), out_val(n_groups);
  std::vector<int64_t> range_first(n_groups + 1, 0), totals(n_groups, 0), limits(n_in), limit_bits(n_in);
  for (int64_t g = 0; g < n_groups; ++g) {
    const auto dtype = indices[first[g]].scalar_type();
    int64_t& total = totals[g];
    for (int64_t i = first[g]; i < first[g] + group_sizes[g]; ++i) {
      const auto& ix = indices[i];
      const auto& v = values[i];
      TORCH_CHECK(ix.device().is_cpu() && v.device().is_cpu(), "indices and values must be CPU tensors");
      TORCH_CHECK(ix.dim() == 1 && ix.is_contiguous(), "indices must be contiguous 1-D tensors");
      TORCH_CHECK(ix.scalar_type() == at::kInt || ix.scalar_type() == at::kLong, "indices must be int32 or int64");
      TORCH_CHECK(ix.scalar_type() == dtype, "indices merged into one tensor must share one dtype");
      TORCH_CHECK(v.scalar_type() == at::kFloat && v.dim() == 1 && v.is_contiguous(),
                  "values must be contiguous 1-D float32 tensors");
      TORCH_CHECK(v.numel() == ix.numel(), "values must have one entry per index");
      total += ix.numel();
    }
    // The tree packs (index << id_bits | input) into 64 bits, so indices must stay below
    // 2**(62 - id_bits); the ranges, the tree and the output bounds rely on each input being
    // strictly increasing. Both are checked on every index below, before any planning.
    int id_bits = 0;
    while ((int64_t{1} << id_bits) < group_sizes[g]) ++id_bits;
    for (int64_t i = first[g]; i < first[g] + group_sizes[g]; ++i) {
      limit_bits[i] = 62 - std::min(id_bits, 40);
      limits[i] = int64_t{1} << limit_bits[i];
    }
  }
  const Violation bad = find_violation(indices, limits);
  if (bad.tensor >= 0) {
    const int64_t bits = limit_bits[bad.tensor];
    TORCH_CHECK(false, "indices must be non-negative, strictly increasing and below 2**", bits, ": ",
                describe_violation(indices, bad, limits[bad.tensor], c10::str("2**", bits)));
  }
  for (int64_t g = 0; g < n_groups; ++g) {
    const auto dtype = indices[first[g]].scalar_type();
    const int64_t total = totals[g];
    out_idx[g] = at::empty({total}, indices[first[g]].options());
    out_val[g] = at::empty({total}, values[first[g]].options());
    const int64_t n_ranges = std::max<int64_t>(1, std::min<int64_t>(16 * threads, total / MIN_RANGE_ENTRIES));
    range_first[g] = static_cast<int64_t>(ranges.size());
    if (dtype == at::kInt) plan_group<int32_t>(indices, first[g], group_sizes[g], g, n_ranges, ranges);
    else plan_group<int64_t>(indices, first[g], group_sizes[g], g, n_ranges, ranges);
  }
  range_first[n_groups] = static_cast<int64_t>(ranges.size());

  const MergeInputs in{indices, values, weights, group_sizes, first, out_idx, out_val};
  at::parallel_for(0, static_cast<int64_t>(ranges.size()), 1, [&](int64_t lo, int64_t hi) {
    // A thread writes its consecutive ranges of one tensor back to back (a range never writes
    // past its own upper bound), so only the gaps between threads' blocks are left to close.
    for (int64_t r = lo; r < hi; ++r) {
      MergeRange& range = ranges[r];
      const bool chained = r > lo && ranges[r - 1].group == range.group;
      range.write_offset = chained ? ranges[r - 1].write_offset + ranges[r - 1].written : range.out_offset;
      const bool i32 = out_idx[range.group].scalar_type() == at::kInt;
      if (i32) ties ? merge_one_range<int32_t, true>(in, range) : merge_one_range<int32_t, false>(in, range);
      else ties ? merge_one_range<int64_t, true>(in, range) : merge_one_range<int64_t, false>(in, range);
    }
  });

  // Pack each tensor with gaps (shared indices) into a right-sized one; ranges copy in parallel.
  std::vector<int64_t> packed_at(ranges.size());
  std::vector<at::Tensor> packed_idx(out_idx), packed_val(out_val);
  for (int64_t g = 0; g < n_groups; ++g) {
    int64_t size = 0;
    for (int64_t r = range_first[g]; r < range_first[g + 1]; ++r) {
      packed_at[r] = size;
      size += ranges[r].written;
    }
    if (size != totals[g]) {
      packed_idx[g] = at::empty({size}, out_idx[g].options());
      packed_val[g] = at::empty({size}, out_val[g].options());
    }
  }
  at::parallel_for(0, static_cast<int64_t>(ranges.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const MergeRange& range = ranges[r];
      const int64_t g = range.group;
      if (range.written == 0 || packed_idx[g].is_same(out_idx[g])) continue;
      const int64_t isz = out_idx[g].element_size();
      std::memcpy(static_cast<char*>(packed_idx[g].data_ptr()) + packed_at[r] * isz,
                  static_cast<const char*>(out_idx[g].data_ptr()) + range.write_offset * isz, range.written * isz);
      std::memcpy(packed_val[g].data_ptr<float>() + packed_at[r], out_val[g].data_ptr<float>() + range.write_offset,
                  range.written * sizeof(float));
    }
  });
  return {packed_idx, packed_val};
}

// ------------------------------------------------------------------------------------------
// Apply and restore
// ------------------------------------------------------------------------------------------

// Both loops prefetch the weight line PREFETCH_DISTANCE entries ahead, across chunk ends (k is
// the tensor's entry count): sorted indices make the line known long before it is needed.
template <typename W, typename I>
void apply_chunk(W* __restrict w, const I* __restrict idx, const float* __restrict v, W* __restrict saved,
                 float scale, int64_t begin, int64_t end, int64_t k) {
  for (int64_t j = begin; j < end; ++j) {
    if (j + PREFETCH_DISTANCE < k) __builtin_prefetch(w + idx[j + PREFETCH_DISTANCE], 1, 3);
    const int64_t at = static_cast<int64_t>(idx[j]);
    const W old = w[at];
    if (saved) saved[j] = old;
    w[at] = static_cast<W>(static_cast<float>(old) + scale * v[j]);
  }
}

template <typename W, typename I>
void restore_chunk(W* __restrict w, const I* __restrict idx, const W* __restrict saved, int64_t begin, int64_t end,
                   int64_t k) {
  for (int64_t j = begin; j < end; ++j) {
    if (j + PREFETCH_DISTANCE < k) __builtin_prefetch(w + idx[j + PREFETCH_DISTANCE], 1, 3);
    w[static_cast<int64_t>(idx[j])] = saved[j];
  }
}

// Lengths, devices, dtypes and layouts of the params and their index lists.
void check_params_indices(at::TensorList params, at::TensorList indices) {
  TORCH_CHECK(indices.size() == params.size(), "indices must have one tensor per param");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const auto& ix = indices[i];
    TORCH_CHECK(p.device().is_cpu() && ix.device().is_cpu(), "params and indices must be CPU tensors");
    TORCH_CHECK(p.is_contiguous(), "params must be contiguous");
    TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf,
                "params must be float32, bfloat16 or float16");
    TORCH_CHECK(ix.dim() == 1 && ix.is_contiguous(), "indices must be contiguous 1-D tensors");
    TORCH_CHECK(ix.scalar_type() == at::kInt || ix.scalar_type() == at::kLong, "indices must be int32 or int64");
  }
}

// One list of per-entry tensors (values or originals) against checked params and indices.
void check_entry_values(at::TensorList params, at::TensorList indices, at::TensorList values,
                        const char* values_name, bool values_in_param_dtype) {
  TORCH_CHECK(values.size() == params.size(), values_name, " must have one tensor per param");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& v = values[i];
    TORCH_CHECK(v.device().is_cpu(), values_name, " must be CPU tensors");
    TORCH_CHECK(v.dim() == 1 && v.is_contiguous() && v.numel() == indices[i].numel(), values_name,
                " must be contiguous 1-D with one entry per index");
    TORCH_CHECK(v.scalar_type() == (values_in_param_dtype ? params[i].scalar_type() : at::kFloat), values_name,
                values_in_param_dtype ? " must have the dtype of their params" : " must be float32");
  }
}

// The chunks of work over every tensor's entries, after checking every index of every tensor.
std::vector<Chunk> plan_chunks(at::TensorList params, at::TensorList indices) {
  std::vector<Chunk> work;
  std::vector<int64_t> limits(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t k = indices[i].numel();
    limits[i] = params[i].numel();
    for (int64_t b = 0; b < k; b += APPLY_CHUNK) work.push_back({static_cast<int64_t>(i), b, std::min(k, b + APPLY_CHUNK)});
  }
  // Before any param is written: a bad tensor late in the list leaves the earlier params untouched.
  const Violation bad = find_violation(indices, limits);
  if (bad.tensor >= 0) {
    const int64_t numel = limits[bad.tensor];
    TORCH_CHECK(false, "indices must lie in [0, param.numel()) and be strictly increasing: ",
                describe_violation(indices, bad, numel, c10::str(numel)));
  }
  return work;
}

template <typename W>
void apply_dispatch_index(const at::Tensor& p, const at::Tensor& ix, const at::Tensor& v, const at::Tensor* saved,
                          float scale, int64_t begin, int64_t end) {
  W* w = p.data_ptr<W>();
  W* s = saved ? saved->data_ptr<W>() : nullptr;
  const int64_t k = ix.numel();
  if (ix.scalar_type() == at::kInt) apply_chunk<W, int32_t>(w, ix.data_ptr<int32_t>(), v.data_ptr<float>(), s, scale, begin, end, k);
  else apply_chunk<W, int64_t>(w, ix.data_ptr<int64_t>(), v.data_ptr<float>(), s, scale, begin, end, k);
}

template <typename W>
void restore_dispatch_index(const at::Tensor& p, const at::Tensor& ix, const at::Tensor& saved, int64_t begin,
                            int64_t end) {
  W* w = p.data_ptr<W>();
  const int64_t k = ix.numel();
  if (ix.scalar_type() == at::kInt) restore_chunk<W, int32_t>(w, ix.data_ptr<int32_t>(), saved.data_ptr<W>(), begin, end, k);
  else restore_chunk<W, int64_t>(w, ix.data_ptr<int64_t>(), saved.data_ptr<W>(), begin, end, k);
}

// `originals` is empty (nothing saved) or one [k_i] tensor per param in its dtype, written
// with the overwritten values: an out list, so the op returns nothing and torch.compile can
// functionalize it.
void sparse_delta_apply_cpu(at::TensorList params, at::TensorList indices, at::TensorList values, double scale,
                            at::TensorList originals) {
  check_params_indices(params, indices);
  check_entry_values(params, indices, values, "values", false);
  const bool save = !originals.empty();
  if (save) check_entry_values(params, indices, originals, "originals", true);
  const std::vector<Chunk> work = plan_chunks(params, indices);
  const float s = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& ch = work[c];
      const auto& p = params[ch.tensor];
      const at::Tensor* out = save ? &originals[ch.tensor] : nullptr;
      switch (p.scalar_type()) {
        case at::kFloat: apply_dispatch_index<float>(p, indices[ch.tensor], values[ch.tensor], out, s, ch.begin, ch.end); break;
        case at::kBFloat16: apply_dispatch_index<c10::BFloat16>(p, indices[ch.tensor], values[ch.tensor], out, s, ch.begin, ch.end); break;
        case at::kHalf: apply_dispatch_index<c10::Half>(p, indices[ch.tensor], values[ch.tensor], out, s, ch.begin, ch.end); break;
        default: TORCH_CHECK(false, "params must be float32, bfloat16 or float16");
      }
    }
  });
}

void sparse_delta_restore_cpu(at::TensorList params, at::TensorList indices, at::TensorList originals) {
  check_params_indices(params, indices);
  check_entry_values(params, indices, originals, "originals", true);
  const std::vector<Chunk> work = plan_chunks(params, indices);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& ch = work[c];
      const auto& p = params[ch.tensor];
      switch (p.scalar_type()) {
        case at::kFloat: restore_dispatch_index<float>(p, indices[ch.tensor], originals[ch.tensor], ch.begin, ch.end); break;
        case at::kBFloat16: restore_dispatch_index<c10::BFloat16>(p, indices[ch.tensor], originals[ch.tensor], ch.begin, ch.end); break;
        case at::kHalf: restore_dispatch_index<c10::Half>(p, indices[ch.tensor], originals[ch.tensor], ch.begin, ch.end); break;
        default: TORCH_CHECK(false, "params must be float32, bfloat16 or float16");
      }
    }
  });
}

}  // namespace

// CPU kernels of the schemas in sift/_ops/ (see module.cpp).
TORCH_LIBRARY_IMPL(sift, CPU, m) {
  m.impl("merge_sorted_deltas", &merge_sorted_deltas_cpu);
  m.impl("sparse_delta_apply_", &sparse_delta_apply_cpu);
  m.impl("sparse_delta_restore_", &sparse_delta_restore_cpu);
}

}  // namespace sift
