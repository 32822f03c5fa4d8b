"""Batched singular values of small matrices: fp64 Gram matrix + parallel cyclic Jacobi.

For a batch of matrices X_b of shape [R, K] (R >= K: the longer side is reduced, so K is
min(S, D) of the caller's [S, D]) one program owns one matrix:

    G     = X^T X                                  [K, K], fp64 (tl.dot, no TF32)
    repeat (one sweep = N - 1 rounds; N = K padded to a power of two >= 16):
        pairs (p_i, q_i), i < N/2, disjoint, from the round-robin "circle" schedule
        c_i, s_i such that [[c, s], [-s, c]]^T [[g_pp, g_pq], [g_pq, g_qq]] [[c, s], [-s, c]]
                 is diagonal (Golub & Van Loan, Alg. 8.4.1)
        G <- J^T G J                               all N/2 rotations at once, O(N^2)
    until ||offdiag(G)||_F <= tol * ||G||_F or max_sweeps
    sigma = sort(sqrt(max(diag(G), 0)), descending)[:K]          [K]

Why fp64 throughout: the Gram matrix squares the condition number. A singular value of
1e-3 * sigma_max is an eigenvalue of 1e-6 * lambda_max; fp32 rounding of G (~6e-8 * lambda_max)
would leave it with ~5% error, fp64 leaves ~1e-9. Inputs of any float dtype are upcast on load.

Why O(N^2) rounds instead of two dense products with a rotation matrix per round: the
rotations of one round act on disjoint (row, column) pairs, so with the matrix split into the
four blocks G[top, top], G[top, bot], G[bot, top], G[bot, bot] each rotation is an elementwise
combination of two blocks. The round-robin permutation between rounds is done by gathering the
blocks from a per-program fp64 scratch copy of G (L1/L2 resident: 32 KB for N = 64), so no
register shuffles are needed. Padded rows/columns of G are zero; their rotations are identities
and they contribute zero eigenvalues that sort after the real ones.

Shapes: x [B, S, D] (any strides), sigma [B, min(S, D)] (fp32, or fp64 for fp64 input),
scratch [B, N, N] fp64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 128
"""Largest min(S, D) the kernel takes: 4 fp64 blocks of [64, 64] fill the register file."""


@triton.jit
def _jacobi_rotation(app, aqq, apq):
    # Rotation zeroing a_pq; pairs whose a_pq is already exactly zero (padding) get the identity.
    nonzero = apq != 0.0
    tau = (aqq - app) / (2.0 * tl.where(nonzero, apq, 1.0))
    # The smaller root of t^2 + 2 tau t - 1 = 0 keeps |theta| <= pi/4, which makes Jacobi converge.
    t = tl.where(tau >= 0.0, 1.0, -1.0) / (tl.abs(tau) + tl.sqrt(1.0 + tau * tau))
    t = tl.where(nonzero, t, 0.0)
    c = 1.0 / tl.sqrt(1.0 + t * t)
    return c, t * c


@triton.jit
def _gram_jacobi_singular_values_kernel(
    x_ptr,
    sigma_ptr,
    work_ptr,
    n_reduce,
    n_keep,
    stride_x_batch,
    stride_x_reduce,
    stride_x_keep,
    stride_sigma_batch,
    tol,
    max_sweeps,
    N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GRAM_BY_DOT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = N // 2
    offs = tl.arange(0, N)
    keep_mask = offs < n_keep
    x_base = x_ptr + pid * stride_x_batch

    gram = tl.zeros([N, N], dtype=tl.float64)
    if GRAM_BY_DOT:
        for r0 in range(0, n_reduce, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            x = tl.load(
                x_base + offs_r[:, None] * stride_x_reduce + offs[None, :] * stride_x_keep,
                mask=(offs_r[:, None] < n_reduce) & keep_mask[None, :],
                other=0.0,
            ).to(tl.float64)
            gram = tl.dot(tl.trans(x), x, gram, input_precision="ieee", out_dtype=tl.float64)
    else:
        # Rank-1 updates with plain fp64 FMAs, for Triton builds without an fp64 tl.dot.
        for r in range(0, n_reduce):
            row = x_base + r * stride_x_reduce + offs * stride_x_keep
            x_i = tl.load(row, mask=keep_mask, other=0.0).to(tl.float64)
            gram += x_i[:, None] * x_i[None, :]

    w_base = work_ptr + pid * (N * N)
    full = offs[:, None] * N + offs[None, :]
    eye_full = offs[:, None] == offs[None, :]
    tl.store(w_base + full, gram)
    diag = tl.sum(tl.where(eye_full, gram, 0.0), axis=1)
    total = tl.sum(tl.sum(gram * gram, axis=1), axis=0)
    off = total - tl.sum(diag * diag, axis=0)
    tl.debug_barrier()

    half = tl.arange(0, HALF)
    eye = half[:, None] == half[None, :]
    sweep = 0
    while (off > tol * tol * total) & (sweep < max_sweeps):
        for rnd in range(N - 1):
            # Circle schedule: index N-1 stays put, the others rotate; N-1 rounds pair everyone once.
            top = tl.where(half == 0, rnd, (rnd + half) % (N - 1))
            bot = tl.where(half == 0, N - 1, (rnd - half + (N - 1)) % (N - 1))
            a_tt = tl.load(w_base + top[:, None] * N + top[None, :])
            a_tb = tl.load(w_base + top[:, None] * N + bot[None, :])
            a_bt = tl.load(w_base + bot[:, None] * N + top[None, :])
            a_bb = tl.load(w_base + bot[:, None] * N + bot[None, :])
            # Every thread must have read the old G before any thread overwrites it.
            tl.debug_barrier()
            # The angles are needed along rows and along columns; reducing the same exact values
            # along either axis gives bit-identical (c, s) in both layouts.
            c_r, s_r = _jacobi_rotation(
                tl.sum(tl.where(eye, a_tt, 0.0), axis=1),
                tl.sum(tl.where(eye, a_bb, 0.0), axis=1),
                tl.sum(tl.where(eye, a_tb, 0.0), axis=1),
            )
            c_c, s_c = _jacobi_rotation(
                tl.sum(tl.where(eye, a_tt, 0.0), axis=0),
                tl.sum(tl.where(eye, a_bb, 0.0), axis=0),
                tl.sum(tl.where(eye, a_tb, 0.0), axis=0),
            )
            r_tt = c_r[:, None] * a_tt - s_r[:, None] * a_bt
            r_bt = s_r[:, None] * a_tt + c_r[:, None] * a_bt
            r_tb = c_r[:, None] * a_tb - s_r[:, None] * a_bb
            r_bb = s_r[:, None] * a_tb + c_r[:, None] * a_bb
            tl.store(w_base + top[:, None] * N + top[None, :], r_tt * c_c[None, :] - r_tb * s_c[None, :])
            tl.store(w_base + top[:, None] * N + bot[None, :], r_tt * s_c[None, :] + r_tb * c_c[None, :])
            tl.store(w_base + bot[:, None] * N + top[None, :], r_bt * c_c[None, :] - r_bb * s_c[None, :])
            tl.store(w_base + bot[:, None] * N + bot[None, :], r_bt * s_c[None, :] + r_bb * c_c[None, :])
            tl.debug_barrier()
        a = tl.load(w_base + full)
        diag = tl.sum(tl.where(eye_full, a, 0.0), axis=1)
        total = tl.sum(tl.sum(a * a, axis=1), axis=0)
        off = total - tl.sum(diag * diag, axis=0)
        sweep += 1

    a = tl.load(w_base + full)
    eig = tl.sum(tl.where(eye_full, a, 0.0), axis=1)
    # Rounding can leave eigenvalues of a rank-deficient G slightly negative.
    sigma = tl.sort(tl.sqrt(tl.maximum(eig, 0.0)), descending=True)
    tl.store(sigma_ptr + pid * stride_sigma_batch + offs, sigma.to(sigma_ptr.dtype.element_ty), mask=keep_mask)


_gram_by_dot = True  # set to False once if this Triton build cannot compile an fp64 tl.dot


def singular_values(
    x: torch.Tensor, *, tol: float = 1e-14, max_sweeps: int = 20, gram_by_dot: bool | None = None
) -> torch.Tensor:
    """Singular values of every matrix in `x`, descending.

    Args:
        x: [..., S, D] floating tensor with min(S, D) <= 128, on CUDA (or CPU under
            TRITON_INTERPRET=1).
        tol: stop when ||offdiag(G)||_F <= tol * ||G||_F (G the fp64 Gram matrix).
        max_sweeps: cap on Jacobi sweeps (fp64 typically needs 6-10).
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
    x3 = x.reshape(-1, s, d)
    n_mat = x3.shape[0]
    sigma = torch.empty(n_mat, k, dtype=out_dtype, device=x.device)
    if n_mat == 0 or k == 0:
        return sigma.reshape(*batch, k)
    if s >= d:
        n_reduce, stride_reduce, stride_keep = s, x3.stride(1), x3.stride(2)
    else:
        n_reduce, stride_reduce, stride_keep = d, x3.stride(2), x3.stride(1)
    # tl.dot needs every dimension >= 16.
    n_pad = max(16, triton.next_power_of_2(k))
    block_r = 32 if n_pad <= 64 else 16
    work = torch.empty(n_mat, n_pad, n_pad, dtype=torch.float64, device=x.device)

    def launch(by_dot: bool) -> None:
        _gram_jacobi_singular_values_kernel[(n_mat,)](
            x3, sigma, work, n_reduce, k, x3.stride(0), stride_reduce, stride_keep, sigma.stride(0), tol,
            max_sweeps, N=n_pad, BLOCK_R=block_r, GRAM_BY_DOT=by_dot, num_warps=4 if n_pad <= 64 else 8,
        )

    global _gram_by_dot
    if gram_by_dot is not None:
        launch(gram_by_dot)
    elif not _gram_by_dot:
        launch(False)
    else:
        try:
            launch(True)
        except Exception as exc:  # a compile error: fp64 MMA lowering is backend-dependent
            import logging

            logging.getLogger("sift").warning("sift: fp64 tl.dot failed to compile (%s); Gram by FMA instead", exc)
            _gram_by_dot = False
            launch(False)
    return sigma.reshape(*batch, k)
