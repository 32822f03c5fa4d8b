"""Batched singular values of small matrices: fp64 Gram matrix, Householder
tridiagonalisation and Sturm-sequence bisection, one program per matrix, all in registers.

For a batch of matrices X_b of shape [R, K] (R >= K: the longer side is reduced, so K is
min(S, D) of the caller's [S, D]; N = K padded to a power of two >= 16):

    G = X^T X                                   [N, N] fp64 (tl.dot, no TF32); padding is zero
    for k in 0 .. N-3:                          Householder: G <- H_k G H_k, H_k = I - tau v v^T
        v = G[k+1:, k] - alpha e_1,  p = tau G v,  w = p - (tau/2)(v.p) v
        G <- G - v w^T - w v^T                  (rank-2 update, O(N^2) elementwise)
    T = tridiag(d, e)                           d = diag(G), e = first off-diagonal
    for every lane j in 0..N-1 at once:         bisection on [Gershgorin lo, hi]
        count(x) = #{i : q_i < 0},  q_0 = d_0 - x,  q_i = d_i - x - e_{i-1}^2 / q_{i-1}
        keep the half that holds the j-th smallest eigenvalue (BISECT_STEPS halvings)
    sigma = sqrt(max(lambda, 0)), written in descending order, first K kept

Why this and not Jacobi: a cyclic Jacobi sweep needs N-1 rounds, each permuting the matrix
through memory, and 6-10 sweeps; tridiagonalisation is N-2 rank-2 updates of a matrix held
in registers, and bisection touches only the 2N numbers of T. Why fp64 throughout: the Gram
matrix squares the condition number. A singular value of 1e-3 * sigma_max is an eigenvalue
of 1e-6 * lambda_max; fp32 rounding of G (~6e-8 * lambda_max) would leave it with ~5% error,
fp64 leaves ~1e-9. Householder reduction is backward stable (eigenvalue error ~ eps ||G||),
and 52 halvings of the Gershgorin interval leave ~1e-15 ||G||. Inputs of any float dtype are
upcast on load.

Register layout: G is held as a [TILE, TILE, N/TILE, N/TILE] tensor, G[bi*TILE + ti, bj*TILE + tj]
at [ti, tj, bi, bj], so that Triton's default layout gives each of the (N/TILE)^2 threads one
whole TILE x TILE block of G in its own registers. The rank-2 update then needs, per thread,
only TILE row entries and TILE column entries of each of v and w, instead of whatever slab of G
a 2-D layout hands a thread (an [N, N] tensor built by FMAs gave each thread 32 rows of one
column at N = 128, 16 warps: 64 entries of v and w on top of G, kilobytes of spills). At
N = 128, TILE = 8: 8 warps, 64 fp64 entries (128 registers) of G per thread and the rest of the
255-register budget for v, w and the reductions; bench/results/gpu-compile.md has what ptxas
makes of each specialization.
Vectors are [TILE, 1, NB, 1] when indexed by rows and [1, TILE, 1, NB] when indexed by
columns (NB = N / TILE); `tl.permute` turns one into the other.

Shapes: x [B, S, D] (any strides), sigma [B, min(S, D)] (fp32, or fp64 for fp64 input),
scratch [B, 2, N] fp64 (the diagonal and squared off-diagonal of T).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import is_recording, launchable

MAX_K = 128
"""Largest min(S, D) the kernel takes: an [N, N] fp64 matrix must fit the register file
(at 128 it takes half of it: 128 registers in each of 256 threads)."""

BISECT_STEPS = 52
"""Halvings of the Gershgorin interval: its width (<= 4 ||G||) drops below 1e-15 ||G||."""


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _total(x):
    """Sum of a [TILE, 1, NB, 1] vector: the TILE entries a thread holds first, then across threads."""
    return tl.sum(tl.sum(tl.sum(tl.sum(x, axis=0), axis=0), axis=0), axis=0)


@triton.jit
def _row_sums(x):
    """[TILE, TILE, NB, NB] -> [TILE, 1, NB, 1], summed over the columns (within a thread, then across)."""
    return tl.sum(tl.sum(x, axis=1, keep_dims=True), axis=3, keep_dims=True)


@triton.jit
def _gram_tridiag_singular_values_kernel(
    x_ptr,
    sigma_ptr,
    work_ptr,
    n_reduce,
    n_keep,
    stride_x_batch,
    stride_x_reduce,
    stride_x_keep,
    stride_sigma_batch,
    N: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GRAM_BY_DOT: tl.constexpr,
    BISECT_STEPS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = N // TILE
    x_base = x_ptr + pid * stride_x_batch
    # G is held as [TILE, TILE, NB, NB]: G[bi * TILE + ti, bj * TILE + tj] at [ti, tj, bi, bj] (one
    # TILE x TILE block per thread); a vector indexed by rows is [TILE, 1, NB, 1], by columns
    # [1, TILE, 1, NB]. rows / cols: the row / column index of each entry.
    rows = tl.arange(0, NB)[None, None, :, None] * TILE + tl.arange(0, TILE)[:, None, None, None]
    cols = tl.arange(0, NB)[None, None, None, :] * TILE + tl.arange(0, TILE)[None, :, None, None]

    if GRAM_BY_DOT:
        offs = tl.arange(0, N)
        offs_keep = offs.to(tl.int64)
        keep_mask = offs < n_keep
        g = tl.zeros([N, N], dtype=tl.float64)
        for r0 in range(0, n_reduce, BLOCK_R):
            # int64: one matrix of a strided view may span more than 2**31 elements.
            offs_r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            x = tl.load(
                x_base + offs_r[:, None] * stride_x_reduce + offs_keep[None, :] * stride_x_keep,
                mask=(offs_r[:, None] < n_reduce) & keep_mask[None, :],
                other=0.0,
            ).to(tl.float64)
            g = tl.dot(tl.trans(x), x, g, input_precision="ieee", out_dtype=tl.float64)
        # [bi * TILE + ti, bj * TILE + tj] -> [ti, tj, bi, bj]
        a = tl.permute(tl.reshape(g, [NB, TILE, NB, TILE]), (1, 3, 0, 2))
    else:
        a = tl.zeros([TILE, TILE, NB, NB], dtype=tl.float64)
        # Rank-1 updates with plain fp64 FMAs, for Triton builds without an fp64 tl.dot.
        # The row pointer advances by the stride (64-bit pointer arithmetic, no int32 r * stride).
        # Each thread loads the TILE entries of its block's rows and the TILE of its columns.
        row_ptr = x_base
        for r in range(0, n_reduce):
            x_r = tl.load(row_ptr + rows.to(tl.int64) * stride_x_keep, mask=rows < n_keep, other=0.0)
            x_c = tl.load(row_ptr + cols.to(tl.int64) * stride_x_keep, mask=cols < n_keep, other=0.0)
            a += x_r.to(tl.float64) * x_c.to(tl.float64)
            row_ptr += stride_x_reduce

    # Everything that is squared below (column norms, v.v, e^2) is taken relative to
    # max |G_ij| = max_i G_ii (G is a Gram matrix): it would underflow or overflow for fp64 inputs
    # far from 1 (|x| ~ 1e-100). Scaling v leaves H = I - 2 v v^T / v.v unchanged; G itself is not
    # rescaled.
    g_diag = _row_sums(tl.where(rows == cols, a, 0.0))
    g_max = tl.max(tl.max(tl.max(tl.max(g_diag, axis=0), axis=0), axis=0), axis=0)
    g_scale = tl.where(g_max > 0.0, g_max, 1.0)
    inv_scale = 1.0 / g_scale
    # Householder tridiagonalisation, the symmetric matrix kept whole in registers.
    for k in range(0, N - 2):
        col = _row_sums(tl.where(cols == k, a, 0.0))  # col[i] = a[i, k]
        below = tl.where(rows > k, col, 0.0) * inv_scale
        # |below|^2 and head = below[k + 1] in one reduction (the entries a thread holds first).
        norm2, head = tl.reduce((below * below, tl.where(rows == k + 1, below, 0.0)), 0, _add2, keep_dims=True)
        norm2, head = tl.reduce((norm2, head), 2, _add2, keep_dims=True)
        norm2, head = tl.reduce((norm2, head), 1, _add2, keep_dims=True)
        norm2, head = tl.reduce((norm2, head), 3, _add2, keep_dims=True)
        norm = tl.sqrt(norm2)
        # alpha takes the sign opposite to the head so that v has no cancellation.
        alpha = tl.where(head > 0.0, -norm, norm)
        v = tl.where(rows == k + 1, below - alpha, below)
        # |v|^2 = |below|^2 - 2 alpha head + alpha^2 = 2 norm (norm + |head|): no second reduction.
        v_norm2 = 2.0 * norm * (norm + tl.abs(head))
        # A column already zero below the subdiagonal needs no reflection (tau = 0).
        tau = tl.where(v_norm2 > 0.0, 2.0 / tl.where(v_norm2 > 0.0, v_norm2, 1.0), 0.0)
        v_col = tl.permute(v, (1, 0, 3, 2))  # [TILE, 1, NB, 1] -> [1, TILE, 1, NB]
        p = tau * _row_sums(a * v_col)
        w = p - (0.5 * tau * _total(v * p)) * v
        a = a - v * tl.permute(w, (1, 0, 3, 2)) - w * v_col

    # T / g_scale: its eigenvalues are scaled back at the end.
    diag = _row_sums(tl.where(rows == cols, a, 0.0)) * inv_scale
    sub = _row_sums(tl.where(rows + 1 == cols, a, 0.0)) * inv_scale  # sub[i] = a[i, i+1]
    # e2[i] = a[i-1, i]^2 (e2[0] = 0), the term the Sturm recurrence needs at row i.
    sub_shifted = _row_sums(tl.where(rows == cols + 1, a, 0.0)) * inv_scale  # a[i, i-1]
    w_base = work_ptr + pid * (2 * N)
    tl.store(w_base + rows, diag)
    tl.store(w_base + N + rows, sub_shifted * sub_shifted)
    radius = tl.abs(sub) + tl.abs(sub_shifted)
    lo_bound = tl.min(tl.min(tl.min(tl.min(diag - radius, axis=0), axis=0), axis=0), axis=0)
    hi_bound = tl.max(tl.max(tl.max(tl.max(diag + radius, axis=0), axis=0), axis=0), axis=0)
    tl.debug_barrier()

    # Lane j looks for the j-th smallest eigenvalue of T.
    offs = tl.arange(0, N)
    lo = tl.zeros([N], dtype=tl.float64) + lo_bound
    hi = tl.zeros([N], dtype=tl.float64) + hi_bound
    for _ in range(BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        below_mid = tl.zeros([N], dtype=tl.int32)
        q = tl.zeros([N], dtype=tl.float64) + 1.0
        for i in range(0, N):
            d_i = tl.load(w_base + i)
            e2_i = tl.load(w_base + N + i)
            q = d_i - mid - e2_i / q
            # An exact zero pivot is nudged negative (LAPACK's pivmin rule, in spirit).
            q = tl.where(q == 0.0, -1e-300, q)
            below_mid += (q < 0.0).to(tl.int32)
        left = below_mid > offs
        hi = tl.where(left, mid, hi)
        lo = tl.where(left, lo, mid)
    eig = 0.5 * (lo + hi) * g_scale
    # Not tl.maximum(eig, 0): that maps NaN (a non-finite input) to 0, a silent "no signal".
    sigma = tl.sqrt(tl.where(eig < 0.0, 0.0, eig))
    # Lane j holds the j-th smallest: write it to position N-1-j (descending); padding
    # contributes zero eigenvalues, which land past the K kept values.
    out_pos = N - 1 - offs
    tl.store(sigma_ptr + pid * stride_sigma_batch + out_pos, sigma.to(sigma_ptr.dtype.element_ty),
             mask=out_pos < n_keep)


_TILE = {16: 2, 32: 4, 64: 4, 128: 8}
"""Per padded size N, the side of the block of G each thread holds: (N / TILE)^2 threads, that is
2, 2, 8 and 8 warps. At N = 128 a smaller tile would need 16 warps, whose 128-register cap cannot
hold a 4 x 8 block (64 registers) with its v and w entries and the reductions' temporaries."""

_gram_by_dot = True  # set to False once if this Triton build cannot compile an fp64 tl.dot


def singular_values(x: torch.Tensor, *, gram_by_dot: bool | None = None) -> torch.Tensor:
    """Singular values of every matrix in `x`, descending.

    Args:
        x: [..., S, D] floating tensor with min(S, D) <= 128, on CUDA (or CPU under
            TRITON_INTERPRET=1).
        gram_by_dot: build G with fp64 `tl.dot` (True) or rank-1 FMA updates (False); None
            uses `tl.dot` unless it failed to compile before.

    Returns:
        [..., min(S, D)], fp64 for fp64 input, fp32 otherwise.
    """
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims [..., S, D], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"x must be a floating tensor (fp16, bf16, fp32, fp64), got {x.dtype}")
    *batch, s, d = x.shape
    k = min(s, d)
    if k > MAX_K:
        raise ValueError(f"min(S, D) must be <= {MAX_K} for the Triton kernel, got {k}")
    out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    n_mat = math.prod(batch)
    x3 = x.reshape(n_mat, s, d)  # not -1: ambiguous for an empty matrix (S or D = 0)
    sigma = torch.empty(n_mat, k, dtype=out_dtype, device=x.device)
    if n_mat == 0 or k == 0:
        return sigma.reshape(*batch, k)
    if s >= d:
        n_reduce, stride_reduce, stride_keep = s, x3.stride(1), x3.stride(2)
    else:
        n_reduce, stride_reduce, stride_keep = d, x3.stride(2), x3.stride(1)
    # tl.dot needs every dimension >= 16.
    n_pad = max(16, triton.next_power_of_2(k))
    # Rows of X per tl.dot. At N = 128 the accumulator alone is 128 registers a thread, and the
    # [BLOCK_R, N] operand fragments come on top: 16 rows spilled (sm_90, fp64 input), 8 do not
    # (fp64 tl.dot takes K >= 4).
    block_r = 32 if n_pad <= 64 else 8
    tile = _TILE[n_pad]
    work = torch.empty(n_mat, 2, n_pad, dtype=torch.float64, device=x.device)

    def launch(by_dot: bool) -> None:
        launchable(_gram_tridiag_singular_values_kernel)[(n_mat,)](
            x3, sigma, work, n_reduce, k, x3.stride(0), stride_reduce, stride_keep, sigma.stride(0),
            N=n_pad, TILE=tile, BLOCK_R=block_r, GRAM_BY_DOT=by_dot, BISECT_STEPS=BISECT_STEPS,
            num_warps=(n_pad // tile) ** 2 // 32,
        )

    global _gram_by_dot
    if gram_by_dot is not None:
        launch(gram_by_dot)
    elif not _gram_by_dot or is_recording():
        # A recorded launch compiles later, out of this try: it takes what eager calls found.
        launch(_gram_by_dot)
    else:
        try:
            launch(True)
        except Exception as exc:  # a compile error: fp64 MMA lowering is backend-dependent
            import logging

            logging.getLogger("sift").warning("sift: fp64 tl.dot failed to compile (%s); Gram by FMA instead", exc)
            _gram_by_dot = False
            launch(False)
    return sigma.reshape(*batch, k)
