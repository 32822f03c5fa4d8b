"""SparseAdamW step on the lean state: one launch for all sparse tensors of one device and dtype.

The contract is `sparse_adamw_lean_ref` in `sift/_ops/sparse_adamw_lean.py`. For tensor i with k_i entries:

    window_offsets_i [ceil(n_i / 65536) + 1] int32   CSR over 65536-element windows
    indices_low_i    [k_i] int16                      idx = w * 65536 + uint16(low), w the window of the entry
    exp_avg_i, exp_avg_sq_i  [k_i] bf16               moments, stored by stochastic rounding
    residual_i       [k_i] int8 (bf16/fp16 weights)   exact weight = w + residual * unit(w)

    g   = grad_i[idx]  (dense grad)  or  compact_grad_i  ([k_i] fp32)
    m   = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
    w   = param_i[idx] (+ residual * unit(param_i[idx]))
    upd = -lr * wd * w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    new = w + upd;  param_i[idx] = round(new);  residual = rint((new - param_i[idx]) / unit)
    m, v -> bf16: (fp32 bits + 16 random bits) >> 16, the bits hashed from (idx, t)

Each entry finds its window by binary search over the window offsets (ceil(log2(windows))
probes of a table that stays in cache); a program covers BLOCK consecutive entries of one
tensor. A segment table `[n_tensors, N_COLS]` (int64) holds per tensor `k_i`, the search depth
and the addresses of the operands (residual 0 for fp32); a block table `[n_blocks, 2]` maps
each program to (tensor, first entry). The tables are built and kept in the caller's
`table_cache` by `_segments.py`, as for `sparse_adamw.py`.

Hyper-parameters are runtime scalars; 1 - beta is taken in fp64 on the host. The kernel rounds
every operation as the reference does: each product an add consumes is `_rounding.mul_rn`, so
no fused multiply-add appears, however it is compiled (torch.compile drops launch options). While torch.compile
records the launch, the kernel runs once per tensor with `DIRECT=True` (no tables), as in
`sparse_adamw.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _segments
from ._adam import (adam_update, launch_step, load_grad, operand, program_segment, shared_columns, shared_operands,
                    to_weight_dtype, weight_increment)
from ._launch import is_recording
from ._rounding import mul_rn
from ._step_args import LEAN_WINDOW_BITS, AdamWHyper, LeanState, check_state_lengths, check_step, takes_step_lists

# Segment table columns: those every step table shares (param, grad, moments, step: `_segments.py`),
# then the lean ones.
COL_NUMEL = tl.constexpr(_segments.COL_NUMEL)  # k_i
COL_WINDOWS = tl.constexpr(_segments.N_SHARED_COLS)  # ceil(n_i / 65536)
COL_SEARCH_STEPS = tl.constexpr(_segments.N_SHARED_COLS + 1)  # ceil(log2(windows)): binary-search probes
COL_LOW = tl.constexpr(_segments.N_SHARED_COLS + 2)
COL_OFFSETS = tl.constexpr(_segments.N_SHARED_COLS + 3)
COL_RESIDUAL = tl.constexpr(_segments.N_SHARED_COLS + 4)  # 0 for fp32 params
N_COLS = tl.constexpr(_segments.N_SHARED_COLS + 5)

_BLOCK = 512
_NUM_WARPS = 8
_CACHE_KEY = "sparse_adamw_lean_"
# Looked up at every launch, so a test can wrap it and watch the tables it builds.
_build_tables = _segments.build_tables


@triton.jit
def _stochastic_bf16(x, random16):
    """[...] fp32 -> bf16: (bits + random16) >> 16; NaN -> 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + random16) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _sparse_adamw_lean_kernel(
    table_ptr,
    blocks_ptr,
    lr_ptr,
    lr,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    log2_beta1,
    log2_beta2,
    eps,
    weight_decay,
    W_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    COMPACT_GRAD: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    # DIRECT: one tensor per launch, its operands these arguments instead of table columns.
    DIRECT: tl.constexpr = False,
    w_arg=None, g_arg=None, low_arg=None, off_arg=None, m_arg=None, v_arg=None, r_arg=None, step_arg=None,
    windows=0, search_steps_arg=0, k=0,
):
    row, offs, mask = program_segment(table_ptr, blocks_ptr, k, N_COLS, BLOCK, DIRECT)
    search_steps = operand(row, COL_SEARCH_STEPS, search_steps_arg, None, DIRECT).to(tl.int32)
    w_ptr, g_ptr, m_ptr, v_ptr, step_ptr = shared_operands(row, w_arg, g_arg, m_arg, v_arg, step_arg, W_DTYPE, G_DTYPE,
                                                           tl.bfloat16, DIRECT)
    low_ptr = operand(row, COL_LOW, low_arg, tl.int16, DIRECT)
    off_ptr = operand(row, COL_OFFSETS, off_arg, tl.int32, DIRECT)

    low = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.int64) & 0xFFFF
    # The window of each entry: the last w with offsets[w] <= position (offsets[0] = 0 and
    # offsets[windows] = k bracket every position).
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = lo + operand(row, COL_WINDOWS, windows, None, DIRECT).to(tl.int32)
    for _ in range(search_steps):
        mid = (lo + hi) >> 1
        below = tl.load(off_ptr + mid, mask=mask, other=0) <= offs
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    idx = (lo.to(tl.int64) << 16) + low

    g = load_grad(g_ptr, idx, offs, mask, COMPACT_GRAD, MAXIMIZE)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    step = tl.load(step_ptr)
    m, v, lr_value, step_size, inv_bc2_sqrt = adam_update(
        g, m, v, step, lr_ptr, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2,
        LR_ON_DEVICE)

    stored = tl.load(w_ptr + idx, mask=mask, other=0.0)
    w = stored.to(tl.float32)
    if W_DTYPE != tl.float32:
        r_ptr = operand(row, COL_RESIDUAL, r_arg, tl.int8, DIRECT)
        residual = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.float32)
        w = w + mul_rn(residual, _unit(stored, W_DTYPE, False))
    fresh = w + weight_increment(w, m, v, lr_value, weight_decay, step_size, inv_bc2_sqrt, eps)
    rounded = to_weight_dtype(fresh, W_DTYPE)
    tl.store(w_ptr + idx, rounded, mask=mask)
    if W_DTYPE != tl.float32:
        back = rounded.to(tl.float32)
        q = mul_rn(fresh - back, _unit(rounded, W_DTYPE, True))
        # Round half to even: |q| <= 128 here, far below 2^22, where adding and removing
        # 1.5 * 2^23 leaves the nearest integer (q is rounded before the add: no fusion).
        q = (q + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        q = tl.where((back - back) == 0.0, q, 0.0)  # 0 where the weight is inf or NaN
        tl.store(r_ptr + offs, q.to(tl.int8), mask=mask)

    # Random bits: MurmurHash3's fmix32 of idx * 0x9E3779B1 + t * 0x632BE5AB, modulo 2^32.
    t = step.to(tl.uint32)
    x = idx.to(tl.uint32) * tl.full([BLOCK], 0x9E3779B1, tl.uint32) + t * tl.full([BLOCK], 0x632BE5AB, tl.uint32)
    x = x ^ (x >> 16)
    x = x * tl.full([BLOCK], 0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full([BLOCK], 0xC2B2AE35, tl.uint32)
    x = x ^ (x >> 16)
    tl.store(m_ptr + offs, _stochastic_bf16(m, x & 0xFFFF), mask=mask)
    tl.store(v_ptr + offs, _stochastic_bf16(v, x >> 16), mask=mask)


@triton.jit
def _unit(w, W_DTYPE: tl.constexpr, INVERSE: tl.constexpr):
    """unit(w) (or 1 / unit(w)) of bf16/fp16 `w` as fp32: bf16 2^(max(E, 16) - 142), fp16 2^(max(E, 1) - 33)."""
    bits = w.to(tl.uint16, bitcast=True).to(tl.uint32)
    if W_DTYPE == tl.bfloat16:
        exponent = tl.maximum((bits >> 7) & 0xFF, 16)
        if INVERSE:
            out = (269 - exponent) << 23
        else:
            out = (exponent - 15) << 23
    else:
        exponent = tl.maximum((bits >> 10) & 0x1F, 1)
        if INVERSE:
            out = (160 - exponent) << 23
        else:
            out = (exponent + 94) << 23
    return out.to(tl.float32, bitcast=True)


@takes_step_lists(LeanState)
def sparse_adamw_lean_(
    state: LeanState,
    hyper: AdamWHyper,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    table_cache: dict | None = None,
) -> None:
    """One SparseAdamW step on the lean state over tensors sharing one device and dtype.

    Called as `sparse_adamw_lean_(state, hyper)` through `.structured`, or with the eight
    tensor lists of `LeanState` (shapes and dtypes there) and the keywords of `AdamWHyper`
    plus `compact_grads`.

    Args:
        state: the operands.
        hyper: lr (a float, or a one-element device tensor read inside the kernel), betas,
            eps, weight decay, maximize.
        block, num_warps: launch configuration; None takes the defaults.
        table_cache: the caller's dict for this launcher's tables (kept per param set while it
            lives, and every table a CUDA graph captured); None builds them for this call only.

    Example:
        >>> sparse_adamw_lean_([w], [w.grad], [low], [off], [m], [v], [], [step], lr=1e-3, beta1=0.9,
        ...                    beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, compact_grads=False)
    """
    params = state.params
    if not params:
        return
    check_state_lengths(state)
    device, w_dtype = params[0].device, params[0].dtype
    windows = [-(-p.numel() >> LEAN_WINDOW_BITS) for p in params]
    search_steps = [max(0, (n - 1).bit_length()) for n in windows]
    if is_recording():
        # A torch.compile trace holds no addresses: one launch per tensor, operands as arguments.
        check_step(state, hyper)

        def direct(i: int) -> dict:
            return dict(w_arg=params[i], g_arg=state.grads[i], low_arg=state.indices_low[i],
                        off_arg=state.window_offsets[i], m_arg=state.exp_avgs[i], v_arg=state.exp_avg_sqs[i],
                        r_arg=state.residuals[i] if state.residuals else None, step_arg=state.steps[i],
                        windows=windows[i], search_steps_arg=search_steps[i], k=state.indices_low[i].numel())

        launch_step(_sparse_adamw_lean_kernel, None, state, hyper, w_dtype, num_warps or _NUM_WARPS, block or _BLOCK,
                    direct)
        return
    ptr = torch.Tensor.data_ptr
    cols = shared_columns(state, map(torch.Tensor.numel, state.indices_low), int(N_COLS))
    param_ptrs = cols[_segments.COL_PARAM]
    cols[COL_WINDOWS] = windows
    cols[COL_SEARCH_STEPS] = search_steps
    cols[COL_LOW] = map(ptr, state.indices_low)
    cols[COL_OFFSETS] = map(ptr, state.window_offsets)
    cols[COL_RESIDUAL] = map(ptr, state.residuals) if state.residuals else [0] * len(params)
    tables = _segments.launch_tables(
        table_cache, _CACHE_KEY, (str(device), w_dtype, state.compact_grads, param_ptrs), tuple(zip(*cols)),
        int(N_COLS), block or _BLOCK, device, lambda: check_step(state, hyper), build=_build_tables)
    launch_step(_sparse_adamw_lean_kernel, tables, state, hyper, w_dtype, num_warps or _NUM_WARPS, tables.block)
