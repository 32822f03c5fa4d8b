// SIMD body of the lean SparseAdamW step (csrc/sparse_adamw_lean.cpp): the entries of one
// chunk, whose flat positions are decoded to int32. Included once per instruction set inside a
// namespace compiled under that set's `#pragma GCC target` with fp-contract off. The namespace
// provides V (W floats), VI (W 32-bit integer lanes), lanes(n), set1, loadu, load_idx, scatter,
// vsqrt, load16 (n 16-bit values, zero-extended), pack16 (the low halves of W lanes), widen_f16,
// narrow_f16, nan_lanes, widen_i8 and narrow_i8 (the residuals); the rest is GCC's vector
// operators. Each line does one operation of the scalar loop (lean_entries), in its order and
// with no fused multiply-add, so the bits agree with it (only a NaN made from two NaN operands
// may differ in payload, as in the exact step).

#include "sparse_adamw_simd_common.h"
typedef int32_t I32 __attribute__((vector_size(sizeof(V))));
typedef float F32 __attribute__((vector_size(sizeof(V))));

// The exponent field E of 16-bit weights w (in 32-bit lanes), clamped as unit(w) clamps it.
template <typename T>
inline U32 unit_exponent(U32 w) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const U32 e = (w >> 7) & 0xFFu;
    return e < 16u ? U32{} + 16u : e;
  } else {
    const U32 e = (w >> 10) & 0x1Fu;
    return e < 1u ? U32{} + 1u : e;
  }
}

template <typename T>
inline V unit(U32 w) {
  const U32 e = unit_exponent<T>(w);
  return (V)(std::is_same_v<T, c10::BFloat16> ? (e - 15u) << 23 : (e + 94u) << 23);
}

template <typename T>
inline V inv_unit(U32 w) {
  const U32 e = unit_exponent<T>(w);
  return (V)(std::is_same_v<T, c10::BFloat16> ? (269u - e) << 23 : (160u - e) << 23);
}

// random_bits of the scalar loop, W lanes at a time (uint32 arithmetic wraps the same way).
inline U32 random_bits_v(U32 idx, uint32_t step) {
  U32 x = idx * 0x9E3779B1u + step * 0x632BE5ABu;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 bits by stochastic rounding with 16 random bits per lane (NaN -> 0x7FC0).
inline VI round_bf16_stochastic_v(V x, U32 random16) {
  const U32 nan = (U32)(x != x);
  return (VI)((((U32)x + random16) >> 16 & ~nan) | (nan & 0x7FC0u));
}

// n (<= W) bf16 values of x into out.
inline void store_bf16(c10::BFloat16* out, VI x, int64_t n) {
  if (n == W) return pack16(reinterpret_cast<uint16_t*>(out), x);
  alignas(64) uint16_t buf[W];
  pack16(buf, x);
  std::memcpy(out, buf, static_cast<size_t>(n) * sizeof(uint16_t));
}

// The values at flat positions p[0..n) (n <= W) of `base`, one lane each (lanes past n zero), as
// 32-bit lanes: a 16-bit value zero-extended, a float's bits. One scalar load a lane rather than a
// VPGATHERDD: on the AMD EPYC (Zen 5) a gather whose lines miss held the loop back, and the loads
// were measured faster (bench/results/README.md). Nothing past an element is read.
template <typename E>
inline U32 load_at(const E* __restrict base, const int32_t* __restrict p, int64_t n) {
  static_assert(sizeof(E) == 2 || sizeof(E) == 4);
  using Bits = std::conditional_t<sizeof(E) == 2, uint16_t, uint32_t>;
  const auto* b = reinterpret_cast<const Bits*>(base);
  U32 x{};
  if (n == W) {  // a constant trip count: whole vectors' loads unroll
    for (int64_t u = 0; u < W; ++u) x[u] = b[p[u]];
  } else {
    for (int64_t u = 0; u < n; ++u) x[u] = b[p[u]];
  }
  return x;
}

// Entries [t, t + nn) of a chunk starting at entry `begin` of its tensor, flat positions in
// `flat` (n_ahead of them, the ones past the chunk only prefetched). M is Mask (the first nn
// lanes) or Full (all W lanes, no masked instruction).
template <typename T, typename G, bool COMPACT, typename M>
inline void lean_block(T* __restrict w, const G* __restrict g_src, const int32_t* __restrict flat,
                       c10::BFloat16* __restrict m, c10::BFloat16* __restrict v, int8_t* __restrict residual,
                       int64_t begin, int64_t t, int64_t nn, int64_t n_ahead, uint32_t step, const Coeffs& c, M mask) {
  constexpr bool LOW_PRECISION = !std::is_same_v<T, float>;
  auto* w16 = reinterpret_cast<uint16_t*>(w);
  const auto* m16 = reinterpret_cast<const uint16_t*>(m + begin);
  const auto* v16 = reinterpret_cast<const uint16_t*>(v + begin);
  for (int64_t a = t + LEAN_PREFETCH_DISTANCE, stop = std::min(n_ahead, a + nn); a < stop; ++a) {
    if (!COMPACT) __builtin_prefetch(g_src + flat[a], 0, 3);
    __builtin_prefetch(w + flat[a], 1, 3);  // PREFETCHW where the target has it
  }
  const auto q = load_idx(flat + t, mask);
  V gj;
  if constexpr (COMPACT) gj = loadu(g_src + begin + t, mask);
  else if constexpr (LOW_PRECISION) gj = widen<T>((VI)load_at(g_src, flat + t, nn));
  else gj = (V)load_at(g_src, flat + t, nn);
  gj = c.sign * gj;
  V wj;
  if constexpr (LOW_PRECISION) {
    const U32 stored = load_at(w, flat + t, nn);
    wj = widen<T>((VI)stored) + widen_i8(residual + begin + t, nn) * unit<T>(stored);
  } else {
    wj = (V)load_at(w, flat + t, nn);
  }
  const V mj = c.beta1 * widen<c10::BFloat16>(load16(m16 + t, nn)) + c.one_minus_b1 * gj;
  const V vj = c.beta2 * widen<c10::BFloat16>(load16(v16 + t, nn)) + c.one_minus_b2 * gj * gj;
  const V upd = c.neg_decay * wj - c.vstep * mj / (vsqrt(vj) * c.vinv + c.eps);
  const V fresh = wj + upd;
  if constexpr (LOW_PRECISION) {
    alignas(64) uint16_t out[W];
    narrow<T>(out, fresh);
    for (int64_t u = 0; u < nn; ++u) w16[flat[t + u]] = out[u];
    const VI rounded = load16(out, W);
    const V back = widen<T>(rounded);
    V r = (fresh - back) * inv_unit<T>((U32)rounded);
    // Clamping before rounding to an integer gives the scalar loop's clamp(rint(r)): rint is
    // monotone and keeps -128 and 127. Adding and taking away 1.5 * 2^23 rounds |r| <= 2^22
    // to the nearest integer, ties to even, as nearbyint does.
    r = r < -128.0f ? set1(-128.0f) : r;
    r = r > 127.0f ? set1(127.0f) : r;
    const I32 finite = ((U32)back & 0x7F800000u) != 0x7F800000u;
    r = finite ? r : set1(0.0f);
    r = (r + 12582912.0f) - 12582912.0f;
    narrow_i8(residual + begin + t, (VI)__builtin_convertvector((F32)r, I32), nn);
  } else {
    scatter(w, flat + t, q, fresh, mask, nn);
  }
  const U32 bits = random_bits_v((U32)q, step);
  store_bf16(m + begin + t, round_bf16_stochastic_v(mj, bits & 0xFFFFu), nn);
  store_bf16(v + begin + t, round_bf16_stochastic_v(vj, bits >> 16), nn);
}

// Entries [0, n) of a chunk starting at entry `begin` of its tensor, flat positions in `flat`
// (n_ahead >= n of them, the rest only prefetched).
template <typename T, typename G, bool COMPACT>
void lean_entries_simd(T* __restrict w, const G* __restrict g_src, const int32_t* __restrict flat,
                       c10::BFloat16* __restrict m, c10::BFloat16* __restrict v, int8_t* __restrict residual,
                       int64_t begin, int64_t n, int64_t n_ahead, uint32_t step, float step_size, float inv_bc2_sqrt,
                       const Hyper& h) {
  const Coeffs c(h, step_size, inv_bc2_sqrt);
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    lean_block<T, G, COMPACT>(w, g_src, flat, m, v, residual, begin, t, W, n_ahead, step, c, Full{});
  }
  if (t < n) lean_block<T, G, COMPACT>(w, g_src, flat, m, v, residual, begin, t, n - t, n_ahead, step, c, lanes(n - t));
}
