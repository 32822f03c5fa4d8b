// SIMD body of the fused SparseAdamW step for fp32 weights and int32 indices
// (csrc/sparse_adamw.cpp), included once per instruction set inside a namespace compiled
// under that set's `#pragma GCC target` with fp-contract off. The namespace provides the
// vector type V of W floats, lanes(n) (a mask of the first n lanes), and masked set1, loadu,
// storeu, vsqrt, load_idx, gather and scatter; arithmetic is GCC's vector operators. Lanes
// outside the mask are loaded as zero and never stored. Each line does one operation of the
// scalar loop (adamw_chunk), in its order and with no fused multiply-add, so results are
// bit-identical to it.

template <bool COMPACT>
void chunk(float* __restrict w, const float* __restrict g_src, const int32_t* __restrict idx, float* __restrict m,
           float* __restrict v, float* __restrict d, int64_t begin, int64_t end, int64_t k, float step_size,
           float inv_bc2_sqrt, const Hyper& h) {
  const V sign = set1(h.maximize ? -1.0f : 1.0f), beta1 = set1(h.beta1), beta2 = set1(h.beta2);
  const V one_minus_b1 = set1(1.0f - h.beta1), one_minus_b2 = set1(1.0f - h.beta2);
  const V neg_decay = set1(-(h.lr * h.weight_decay)), vstep = set1(step_size), vinv = set1(inv_bc2_sqrt);
  const V eps = set1(h.eps);
  // Full vectors, then one masked vector for the last (end - begin) % W entries: staying in
  // vector code avoids a call into the scalar loop, whose transition drained the pipeline at
  // the end of every chunk (measured: a quarter of the time with the data in L2).
  for (int64_t j = begin; j < end; j += W) {
    const int64_t n = std::min<int64_t>(W, end - j);
    for (int64_t a = j + PREFETCH_DISTANCE, stop = std::min(k, a + n); a < stop; ++a) {
      const int64_t ahead = idx[a];
      if (!COMPACT) __builtin_prefetch(g_src + ahead, 0, 3);
      __builtin_prefetch(w + ahead, 1, 3);  // PREFETCHW: fetched ready to be written
    }
    const auto mask = lanes(n);
    const auto q = load_idx(idx + j, mask);
    const V gj = sign * (COMPACT ? loadu(g_src + j, mask) : gather(g_src, q, mask));
    const V wj = gather(w, q, mask);
    const V mj = beta1 * loadu(m + j, mask) + one_minus_b1 * gj;
    const V vj = beta2 * loadu(v + j, mask) + one_minus_b2 * gj * gj;
    storeu(m + j, mj, mask);
    storeu(v + j, vj, mask);
    const V upd = neg_decay * wj - vstep * mj / (vsqrt(vj) * vinv + eps);
    storeu(d + j, loadu(d + j, mask) + upd, mask);
    scatter(w, idx + j, q, wj + upd, mask, n);
  }
}
