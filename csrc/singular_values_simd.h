// SIMD body of the batched singular-value kernel (csrc/singular_values.cpp), included once
// per instruction set inside its own namespace: the file is compiled as generic x86-64/ARM
// code, and again under `#pragma GCC target("avx2,fma")` and `("avx512f,...")`, and the
// caller picks one at run time. Nothing here includes a header; it relies on <cmath>,
// <cstdint> and <algorithm> being included before it.
//
// Layout: one v8d holds the same element of LANES = 8 different matrices, so every operation
// below works on 8 matrices at once with no shuffles, and each lane runs the textbook scalar
// algorithm. All buffers are 64-byte aligned.

constexpr int LANES = 8;
typedef double v8d __attribute__((vector_size(64)));
typedef long long v8l __attribute__((vector_size(64)));

#define SIFT_SV_INLINE static inline __attribute__((always_inline))

SIFT_SV_INLINE v8d vsqrt(v8d x) {
  v8d r;
  for (int q = 0; q < LANES; ++q) r[q] = __builtin_sqrt(x[q]);
  return r;
}

// Lane-wise select through bit operations: GCC lowers `mask ? a : b` on vectors to per-lane
// branches in some contexts; this form always stays in vector registers.
SIFT_SV_INLINE v8d vsel(v8l m, v8d a, v8d b) { return (v8d)(((v8l)a & m) | ((v8l)b & ~m)); }

// G[i][j] (tiles TI x TJ on and below the diagonal) += sum_r P[r][i] P[r][j], r < kr.
template <int TI, int TJ>
SIFT_SV_INLINE void gram_accumulate(const v8d* __restrict panel, v8d* __restrict a, int64_t np, int64_t kr) {
  for (int64_t i0 = 0; i0 < np; i0 += TI) {
    for (int64_t j0 = 0; j0 < i0 + TI; j0 += TJ) {
      v8d acc[TI][TJ];
      for (int t = 0; t < TI; ++t)
        for (int u = 0; u < TJ; ++u) acc[t][u] = a[(i0 + t) * np + j0 + u];
      const v8d* p = panel;
      for (int64_t r = 0; r < kr; ++r, p += np) {
        v8d xi[TI];
        for (int t = 0; t < TI; ++t) xi[t] = p[i0 + t];
        for (int u = 0; u < TJ; ++u) {
          const v8d xj = p[j0 + u];
          for (int t = 0; t < TI; ++t) acc[t][u] += xi[t] * xj;
        }
      }
      for (int t = 0; t < TI; ++t)
        for (int u = 0; u < TJ; ++u) a[(i0 + t) * np + j0 + u] = acc[t][u];
    }
  }
}

// Householder reduction of the lower triangle of a [n x n] (row stride np) to tridiagonal
// d[0..n), e[0..n-1) (e[n-1] = 0). dsytd2's algorithm, all lanes at once.
SIFT_SV_INLINE void tridiagonalize(v8d* __restrict a, int64_t np, int64_t n, v8d* __restrict v, v8d* __restrict y,
                              v8d* __restrict d, v8d* __restrict e) {
  const v8d zero{};
  for (int64_t k = 0; k + 2 < n; ++k) {
    const int64_t b = k + 1;  // first row/col of the trailing block
    v8d alpha = a[b * np + k];
    v8d sigma{};
    for (int64_t i = b + 1; i < n; ++i) sigma += a[i * np + k] * a[i * np + k];
    const v8d norm = vsqrt(alpha * alpha + sigma);
    const v8l trivial = sigma == zero;
    const v8d beta = vsel(alpha >= zero, -norm, norm);
    const v8d safe_beta = vsel(trivial, zero + 1.0, beta);
    const v8d tau = vsel(trivial, zero, (beta - alpha) / safe_beta);
    const v8d scal = vsel(trivial, zero, 1.0 / (alpha - safe_beta));
    e[k] = vsel(trivial, alpha, beta);
    d[k] = a[k * np + k];
    v[b] = zero + 1.0;
    for (int64_t i = b + 1; i < n; ++i) v[i] = a[i * np + k] * scal;
    // y = A22 v (lower storage, symmetric)
    for (int64_t i = b; i < n; ++i) y[i] = zero;
    for (int64_t i = b; i < n; ++i) {
      const v8d* row = a + i * np;
      const v8d vi = v[i];
      v8d acc = row[i] * vi;
      for (int64_t j = b; j < i; ++j) {
        acc += row[j] * v[j];
        y[j] += row[j] * vi;
      }
      y[i] += acc;
    }
    v8d pv{};
    for (int64_t i = b; i < n; ++i) {
      y[i] *= tau;
      pv += y[i] * v[i];
    }
    const v8d kk = -0.5 * tau * pv;
    for (int64_t i = b; i < n; ++i) y[i] += kk * v[i];  // y is now w
    for (int64_t i = b; i < n; ++i) {
      v8d* row = a + i * np;
      const v8d vi = v[i], wi = y[i];
      for (int64_t j = b; j <= i; ++j) row[j] -= vi * y[j] + wi * v[j];
    }
  }
  if (n >= 2) {
    d[n - 2] = a[(n - 2) * np + n - 2];
    e[n - 2] = a[(n - 1) * np + n - 2];
  }
  d[n - 1] = a[(n - 1) * np + n - 1];
  e[n - 1] = zero;
}

// Eigenvalues of the symmetric tridiagonal (d, e) by implicit QL with Wilkinson-like shifts
// (tqli), all lanes in lockstep: each lane keeps its own converging index l and block end m;
// a lane takes part in a sweep step i only when l <= i < m. Returns false for a lane that
// did not converge in 30 n iterations (its values are then NaN).
SIFT_SV_INLINE void tridiagonal_eigenvalues(v8d* __restrict d, v8d* __restrict e, int64_t n, bool* ok) {
  const double eps = 2.220446049250313e-16;
  double tol_abs[LANES];
  int64_t l[LANES], iters[LANES];
  for (int q = 0; q < LANES; ++q) {
    double norm = 0;
    for (int64_t i = 0; i < n; ++i)
      norm = std::max(norm, std::fabs(d[i][q]) + std::fabs(e[i][q]) + (i ? std::fabs(e[i - 1][q]) : 0.0));
    tol_abs[q] = eps * norm;
    l[q] = 0;
    iters[q] = 0;
    ok[q] = true;
  }
  const v8d zero{};
  for (;;) {
    v8d g0{};
    v8d lv{}, mv{};
    int64_t lo = n, hi = -1;
    for (int q = 0; q < LANES; ++q) {
      int64_t lq = l[q], mq = lq;
      while (lq < n) {
        for (mq = lq; mq + 1 < n; ++mq) {
          const double em = std::fabs(e[mq][q]);
          if (em <= eps * (std::fabs(d[mq][q]) + std::fabs(d[mq + 1][q])) || em <= tol_abs[q]) break;
        }
        if (mq + 1 >= n) mq = n - 1;
        if (mq != lq) break;
        ++lq;
      }
      l[q] = lq;
      if (lq >= n || ++iters[q] > 30 * n) {
        if (lq < n) {
          ok[q] = false;
          l[q] = n;
        }
        lv[q] = n;
        mv[q] = -1;  // never active
        continue;
      }
      // shift from the leading 2x2 of the block
      double g = (d[lq + 1][q] - d[lq][q]) / (2.0 * e[lq][q]);
      double r = std::hypot(g, 1.0);
      g = d[mq][q] - d[lq][q] + e[lq][q] / (g + std::copysign(r, g));
      g0[q] = g;
      lv[q] = lq;
      mv[q] = mq;
      lo = std::min(lo, lq);
      hi = std::max(hi, mq);
    }
    if (hi < 0) break;

    v8d s = zero + 1.0, c = zero + 1.0, p = zero, g = g0;
    for (int64_t i = hi - 1; i >= lo; --i) {
      const v8d di = zero + (double)i;
      const v8l act = (lv <= di) & (mv > di);
      const v8d f = s * e[i], bb = c * e[i];
      const v8d r = vsqrt(f * f + g * g);
      const v8d rs = vsel(r == zero, zero + 1.0, r);
      const v8d sn = f / rs, cn = vsel(r == zero, zero + 1.0, g / rs);
      const v8d g2 = d[i + 1] - p;
      const v8d r2 = (d[i] - g2) * sn + 2.0 * cn * bb;
      const v8d pn = sn * r2;
      e[i + 1] = vsel(act, r, e[i + 1]);
      d[i + 1] = vsel(act, g2 + pn, d[i + 1]);
      g = vsel(act, cn * r2 - bb, g);
      s = vsel(act, sn, s);
      c = vsel(act, cn, c);
      p = vsel(act, pn, p);
    }
    for (int q = 0; q < LANES; ++q) {
      if (mv[q] < 0) continue;
      d[l[q]][q] -= p[q];
      e[l[q]][q] = g[q];
      e[static_cast<int64_t>(mv[q])][q] = 0.0;
    }
  }
}

// One group of LANES matrices: Gram already packed row by row into `panel` chunks by the
// caller through `gram_accumulate`; this solves the eigenvalues of the n x n Gram in `a`.
// On return d[0..n) holds the (unsorted) eigenvalues of each lane; ok[q] is false for a lane
// that did not converge.
SIFT_SV_INLINE void gram_eigenvalues(v8d* a, int64_t np, int64_t n, v8d* v, v8d* y, v8d* d, v8d* e, bool* ok) {
  tridiagonalize(a, np, n, v, y, d, e);
  tridiagonal_eigenvalues(d, e, n, ok);
}

#undef SIFT_SV_INLINE
