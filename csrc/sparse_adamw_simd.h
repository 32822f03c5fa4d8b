// SIMD body of the fused SparseAdamW step (csrc/sparse_adamw.cpp) for int32 indices: fp32
// weights (chunk) and bf16/fp16 weights (chunk_lowp). Included once per instruction set
// inside a namespace compiled under that set's `#pragma GCC target` with fp-contract off. The
// namespace provides the vector type V of W floats, lanes(n) (a mask of the first n lanes),
// set1, vsqrt, and loadu, storeu, load_idx, gather and scatter under a mask or Full (all lanes),
// and PREFETCH_WRITTEN_WEIGHTS; arithmetic is GCC's vector operators. Lanes outside the mask are
// loaded as zero and never stored. Each line
// does one operation of the scalar loop (adamw_chunk), in its order and with no fused
// multiply-add, so results are bit-identical to it, except for the payload (and, for fp16
// weights, the sign) of a NaN made from two NaN operands: GCC may swap the operands of a
// commutative operation, and x86 keeps the first one's payload.

#include "sparse_adamw_simd_common.h"

// Prefetch the lines of entries [j + PREFETCH_DISTANCE, + n) the update reads: the grad's
// (unless compact) and, when the weight is gathered (`WEIGHTS`), the weight's. A weight that
// is only written (rebuilt from base + delta) is prefetched only where the namespace asks
// (PREFETCH_WRITTEN_WEIGHTS): its store waits in the store buffer, off the critical path, and
// on the AMD EPYC (AVX2) prefetching it made the step slower (bench/results/README.md).
template <bool COMPACT, bool WEIGHTS, typename E>
inline void prefetch_ahead(const E* g, const E* w, const int32_t* idx, int64_t j, int64_t n, int64_t k) {
  constexpr bool PREFETCH_W = WEIGHTS || PREFETCH_WRITTEN_WEIGHTS;
  if constexpr (COMPACT && !PREFETCH_W) return;
  for (int64_t a = j + PREFETCH_DISTANCE, stop = std::min(k, a + n); a < stop; ++a) {
    const int64_t ahead = idx[a];
    if (!COMPACT) __builtin_prefetch(g + ahead, 0, 3);
    if (PREFETCH_W) __builtin_prefetch(w + ahead, 1, 3);  // PREFETCHW where the target has it
  }
}

// Moments of entries [j, j + lanes) updated in place from the signed grad gj; returns the
// weight's increment for the weight wj. M is Mask (the first n lanes) or Full (all W lanes,
// no masked instruction: AVX2's masked stores are slow on AMD cores).
template <typename M>
inline V adamw_update(const Coeffs& c, V gj, V wj, float* m, float* v, M mask) {
  const V mj = c.beta1 * loadu(m, mask) + c.one_minus_b1 * gj;
  const V vj = c.beta2 * loadu(v, mask) + c.one_minus_b2 * gj * gj;
  storeu(m, mj, mask);
  storeu(v, vj, mask);
  return c.neg_decay * wj - c.vstep * mj / (vsqrt(vj) * c.vinv + c.eps);
}

// Entries [j, j + n) of the fp32 step. With a base (fp32 weights kept with keep_base=True),
// the weight is rebuilt as base + delta instead of gathered, and base + the new delta is
// scattered.
template <bool COMPACT, bool HAS_BASE, typename M>
inline void block(float* __restrict w, const float* __restrict g_src, const int32_t* __restrict idx,
                  float* __restrict m, float* __restrict v, float* __restrict d, const float* __restrict base,
                  int64_t j, int64_t n, int64_t k, const Coeffs& c, M mask) {
  prefetch_ahead<COMPACT, !HAS_BASE>(g_src, w, idx, j, n, k);
  const auto q = load_idx(idx + j, mask);
  const V gj = c.sign * (COMPACT ? loadu(g_src + j, mask) : gather(g_src, q, mask));
  const V d_old = loadu(d + j, mask);
  if constexpr (HAS_BASE) {
    const V bj = loadu(base + j, mask);
    const V dj = d_old + adamw_update(c, gj, bj + d_old, m + j, v + j, mask);
    storeu(d + j, dj, mask);
    scatter(w, idx + j, q, bj + dj, mask, n);
  } else {
    const V wj = gather(w, q, mask);
    const V upd = adamw_update(c, gj, wj, m + j, v + j, mask);
    storeu(d + j, d_old + upd, mask);
    scatter(w, idx + j, q, wj + upd, mask, n);
  }
}

template <bool COMPACT, bool HAS_BASE>
void chunk(float* __restrict w, const float* __restrict g_src, const int32_t* __restrict idx, float* __restrict m,
           float* __restrict v, float* __restrict d, const float* __restrict base, int64_t begin, int64_t end,
           int64_t k, float step_size, float inv_bc2_sqrt, const Hyper& h) {
  const Coeffs c(h, step_size, inv_bc2_sqrt);
  // Full vectors, then one masked vector for the last (end - begin) % W entries: staying in
  // vector code avoids a call into the scalar loop, whose transition drained the pipeline at
  // the end of every chunk.
  int64_t j = begin;
  for (; j + W <= end; j += W) block<COMPACT, HAS_BASE>(w, g_src, idx, m, v, d, base, j, W, k, c, Full{});
  if (j < end) block<COMPACT, HAS_BASE>(w, g_src, idx, m, v, d, base, j, end - j, k, c, lanes(end - j));
}

// Low-precision weights (bf16 or fp16, T) keep a copy of the chosen weights in T ("base") and
// the exact fp32 increment: the weight is rebuilt as base + delta, never read from the param,
// and written rounded as the scalar loop's static_cast<T> rounds (round to nearest even; a
// NaN becomes torch's NaN of that type). The namespace adds VI (W 32-bit integer lanes),
// load16 (n 16-bit values, zero-extended), gather16 (one 16-bit value per lane; where it is a
// gather instruction, read as a 4-byte word), pack16 (the low halves of W lanes, stored), the
// hardware fp16 conversions widen_f16 and narrow_f16 (round to nearest even), and nan_lanes
// (bit t set for a NaN lane t), from which sparse_adamw_simd_common.h builds widen<T> and narrow<T>.
template <typename T, bool COMPACT, typename M>
inline void block_lowp(uint16_t* __restrict w16, const void* __restrict g_src, const int32_t* __restrict idx,
                       float* __restrict m, float* __restrict v, float* __restrict d, const uint16_t* __restrict b16,
                       int64_t j, int64_t n, int64_t k, const Coeffs& c, M mask) {
  const auto* g16 = static_cast<const uint16_t*>(g_src);
  const auto* g32 = static_cast<const float*>(g_src);
  prefetch_ahead<COMPACT, false>(g16, w16, idx, j, n, k);
  const auto q = load_idx(idx + j, mask);
  const V gj = c.sign * (COMPACT ? loadu(g32 + j, mask) : widen<T>(gather16(g16, q, mask)));
  const V bj = widen<T>(load16(b16 + j, n));
  const V d_old = loadu(d + j, mask);
  const V dj = d_old + adamw_update(c, gj, bj + d_old, m + j, v + j, mask);
  storeu(d + j, dj, mask);
  alignas(64) uint16_t out[W];
  narrow<T>(out, bj + dj);
  for (int64_t t = 0; t < n; ++t) w16[idx[j + t]] = out[t];
}

template <typename T, bool COMPACT>
void chunk_lowp(T* __restrict w, const void* __restrict g_src, const int32_t* __restrict idx, float* __restrict m,
                float* __restrict v, float* __restrict d, const T* __restrict base, int64_t begin, int64_t end,
                int64_t k, int64_t numel, float step_size, float inv_bc2_sqrt, const Hyper& h) {
  using G = std::conditional_t<COMPACT, float, T>;
  const auto* b16 = reinterpret_cast<const uint16_t*>(base);
  auto* w16 = reinterpret_cast<uint16_t*>(w);
  const Coeffs c(h, step_size, inv_bc2_sqrt);
  // gather16 reads 2 bytes past each grad: a last block holding the tensor's last element goes
  // through the scalar loop instead, so nothing past the gradient's end is read. In a checked
  // chunk only its last entry can be numel - 1 (a later one would not be above it); the chunk
  // need not be the tensor's last when a later one fails the index check.
  const int64_t vector_end = !COMPACT && idx[end - 1] == numel - 1 ? end - 1 - (end - 1 - begin) % W : end;
  int64_t j = begin;
  for (; j + W <= vector_end; j += W) block_lowp<T, COMPACT>(w16, g_src, idx, m, v, d, b16, j, W, k, c, Full{});
  if (j < vector_end) block_lowp<T, COMPACT>(w16, g_src, idx, m, v, d, b16, j, vector_end - j, k, c, lanes(vector_end - j));
  if (vector_end < end) {
    adamw_chunk<T, G, int32_t, COMPACT, true>(w, static_cast<const G*>(g_src), idx, m, v, d, base, vector_end, end, k,
                                              step_size, inv_bc2_sqrt, h);
  }
}
