"""Fused SparseAdamW step: one launch for all sparse tensors of one device and dtype.

For tensor i with k_i chosen entries at sorted flat positions `idx_i` (the contract is
`sparse_adamw_ref` in `sift/_ops/sparse_adamw.py`):

    g = grad_i[idx_i]                (dense grad)  or  compact_grad_i   ([k_i] fp32)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g^2
    w = param_i[idx_i]               (fp32, no base) or  base_i + delta_i (with a base: bf16/fp16)
    upd = -lr * wd * w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    delta_i += upd
    param_i[idx_i] = w + upd         (no base)     or  round(base_i + delta_i)

Multi-tensor layout. A segment table `table[n_tensors, N_COLS]` (int64) holds per tensor:
`k_i` and the addresses of param, grad, indices, exp_avg, exp_avg_sq, delta, base (0 if none)
and step (a 0-d fp32 device tensor, so bias correction needs no host sync), at the columns
`COL_*`; a block table maps each program to (tensor, first entry). How the tables are built
and kept in the caller's `table_cache` (CUDA graph replays) is `_segments.py`.

Hyper-parameters are runtime scalars (a new value never recompiles); `lr` may instead
live in a device tensor (`LR_ON_DEVICE`) so a captured CUDA graph follows a scheduler.

While torch.compile records the launch (`_launch.is_recording()`), a graph cannot hold a table
of addresses: the launcher then launches the same kernel once per tensor with `DIRECT=True`,
the tensor's operands passed as arguments.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from . import _segments
from ._adam import (TL_DTYPES, adam_update, launch_step, load_grad, operand, program_segment, shared_columns,
                    shared_operands, to_weight_dtype, weight_increment)
from ._launch import is_recording
from ._step_args import AdamWHyper, ExactState, check_state_lengths, check_step, takes_step_lists

# Segment table columns, one int64 row per tensor: the host builder and the kernel both use
# these names, so the layout is written only here. The columns every step table shares (param,
# grad, moments, step) are `_segments.py`'s, read by `_adam.shared_operands`.
COL_NUMEL = tl.constexpr(_segments.COL_NUMEL)  # k_i, entries of the tensor
COL_INDICES = tl.constexpr(_segments.N_SHARED_COLS)
COL_DELTA = tl.constexpr(_segments.N_SHARED_COLS + 1)
COL_BASE = tl.constexpr(_segments.N_SHARED_COLS + 2)  # 0 without bases
N_COLS = tl.constexpr(_segments.N_SHARED_COLS + 3)
# Block table columns, one row per program (the layout of `_segments.py`).
BLOCK_COL_TENSOR = tl.constexpr(_segments.BLOCK_COL_TENSOR)
BLOCK_COL_START = tl.constexpr(_segments.BLOCK_COL_START)
N_BLOCK_COLS = tl.constexpr(_segments.N_BLOCK_COLS)


@triton.jit
def _sparse_adamw_kernel(
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
    I_DTYPE: tl.constexpr,
    COMPACT_GRAD: tl.constexpr,
    HAS_BASE: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    ALIGNED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
    # DIRECT: one tensor per launch, its operands these arguments instead of table columns.
    DIRECT: tl.constexpr = False,
    w_arg=None, g_arg=None, i_arg=None, m_arg=None, v_arg=None, d_arg=None, b_arg=None, step_arg=None, k=0,
):
    row, offs, mask = program_segment(table_ptr, blocks_ptr, k, N_COLS, BLOCK, DIRECT)
    w_ptr, g_ptr, m_ptr, v_ptr, step_ptr = shared_operands(row, w_arg, g_arg, m_arg, v_arg, step_arg, W_DTYPE, G_DTYPE,
                                                           tl.float32, DIRECT)
    i_ptr = operand(row, COL_INDICES, i_arg, I_DTYPE, DIRECT)
    d_ptr = operand(row, COL_DELTA, d_arg, tl.float32, DIRECT)
    if ALIGNED:
        # Addresses read from a table carry no alignment facts; without these hints the
        # compiler cannot emit 16-byte vector loads for the contiguous compact arrays.
        i_ptr = tl.multiple_of(i_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        d_ptr = tl.multiple_of(d_ptr, 16)

    # The compact arrays are read once per step: with EVICT_FIRST they do not push the
    # gathered weight/grad sectors out of L2.
    idx = tl.load(i_ptr + offs, mask=mask, other=0, eviction_policy="evict_first" if EVICT_FIRST else "").to(tl.int64)
    g = load_grad(g_ptr, idx, offs, mask, COMPACT_GRAD, MAXIMIZE)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")
    v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")
    d = tl.load(d_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")
    m, v, lr_value, step_size, inv_bc2_sqrt = adam_update(
        g, m, v, tl.load(step_ptr), lr_ptr, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1,
        log2_beta2, LR_ON_DEVICE)

    if HAS_BASE:
        b_ptr = operand(row, COL_BASE, b_arg, W_DTYPE, DIRECT)
        base = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = base + d
    else:
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)

    upd = weight_increment(w, m, v, lr_value, weight_decay, step_size, inv_bc2_sqrt, eps)
    d = d + upd
    if HAS_BASE:
        w_new = base + d
    else:
        w_new = w + upd

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(d_ptr + offs, d, mask=mask)
    tl.store(w_ptr + idx, to_weight_dtype(w_new, W_DTYPE), mask=mask)


# Chosen by bench/adamw_gpu_sweep.py, where the launch configuration barely matters (figures:
# bench/results/adamw-gpu-sweep.md).
_BLOCK = 512
_NUM_WARPS = 8
_EVICT_FIRST = False
# The launcher's entry in an owner's `table_cache` dict.
_CACHE_KEY = "sparse_adamw_"
# Looked up at every launch, so a test can wrap it and watch the tables it builds.
_build_tables = _segments.build_tables


def owner_tables(table_cache: dict) -> list[torch.Tensor]:
    """The segment and block tables `sparse_adamw_` keeps in an owner's `table_cache`.

    Args:
        table_cache: the dict passed as `table_cache=` (e.g. `SparseAdamW._kernel_cache`).

    Returns:
        The tables alive in it, `[n_tensors, N_COLS]` and `[n_blocks, N_BLOCK_COLS]` int64 each.

    Example:
        >>> [t.shape for t in owner_tables(opt._kernel_cache)]
        [torch.Size([2, 9]), torch.Size([3, 2])]
    """
    return _segments.owner_tables(table_cache, _CACHE_KEY)


@takes_step_lists(ExactState)
def sparse_adamw_(
    state: ExactState,
    hyper: AdamWHyper,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    evict_first: bool | None = None,
    table_cache: dict | None = None,
) -> None:
    """One fused SparseAdamW step over tensors sharing one device, dtype and index dtype.

    Called as `sparse_adamw_(state, hyper)` through `.structured`, or with the eight tensor
    lists of `ExactState` (shapes and dtypes there) and the keywords of `AdamWHyper` plus
    `compact_grads`. With bases, fp32 weights are rebuilt as base + delta and only written.

    Args:
        state: the operands; `indices` all int32 or all int64 (one kernel instance).
        hyper: lr (a float, or a one-element device tensor read inside the kernel), betas,
            eps, weight decay, maximize.
        block, num_warps, evict_first: launch configuration (entries per program, warps,
            L2 eviction hint on the compact arrays); None takes the tuned defaults.
        table_cache: the caller's dict for this launcher's tables (an optimizer keeps one for
            its lifetime). A CUDA graph captured over the call reads the tables kept there,
            so it replays only while the dict lives. None builds the tables for this call only
            (no capture then: the table's host-to-device copy cannot be captured).

    Example:
        >>> sparse_adamw_([w], [w.grad], [idx], [m], [v], [d], [], [step], lr=1e-3, beta1=0.9,
        ...               beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, compact_grads=False)
    """
    params, indices = state.params, state.indices
    if not params:
        return
    # The block table, built from all indices, would point the kernel at the table rows of
    # params past a shorter list; the full check runs only when a table is (re)built.
    check_state_lengths(state)
    device, w_dtype, i_dtype = params[0].device, params[0].dtype, indices[0].dtype
    if len({t.dtype for t in indices}) != 1:
        raise ValueError("indices must share one dtype")
    has_base = bool(state.bases)
    options = dict(I_DTYPE=TL_DTYPES[i_dtype], HAS_BASE=has_base,
                   EVICT_FIRST=_EVICT_FIRST if evict_first is None else evict_first)
    if is_recording():
        # A torch.compile trace holds no addresses: one launch per tensor, its operands as
        # arguments (Triton then knows their alignment itself).
        check_step(state, hyper)

        def direct(i: int) -> dict:
            return dict(w_arg=params[i], g_arg=state.grads[i], i_arg=indices[i], m_arg=state.exp_avgs[i],
                        v_arg=state.exp_avg_sqs[i], d_arg=state.deltas[i],
                        b_arg=state.bases[i] if has_base else None, step_arg=state.steps[i], k=indices[i].numel())

        launch_step(_sparse_adamw_kernel, None, state, hyper, w_dtype, num_warps or _NUM_WARPS, block or _BLOCK,
                    direct, ALIGNED=False, **options)
        return
    # The Python side runs every step over every tensor (hundreds in a large model): C-level
    # map/zip instead of per-element Python, and the table is rebuilt only when an address moves.
    ptr = torch.Tensor.data_ptr
    cols = shared_columns(state, map(torch.Tensor.numel, indices), int(N_COLS))
    param_ptrs = cols[_segments.COL_PARAM]
    cols[COL_INDICES] = map(ptr, indices)
    cols[COL_DELTA] = map(ptr, state.deltas)
    cols[COL_BASE] = map(ptr, state.bases) if has_base else itertools.repeat(0)
    tables = _segments.launch_tables(
        table_cache, _CACHE_KEY, (str(device), w_dtype, i_dtype, state.compact_grads, param_ptrs),
        tuple(zip(*cols)), int(N_COLS), block or _BLOCK, device, lambda: check_step(state, hyper),
        aligned_cols=(int(COL_INDICES), _segments.COL_EXP_AVG, _segments.COL_EXP_AVG_SQ, int(COL_DELTA)),
        build=_build_tables)
    launch_step(_sparse_adamw_kernel, tables, state, hyper, w_dtype, num_warps or _NUM_WARPS, tables.block,
                ALIGNED=tables.aligned, **options)
