"""Fused SparseAdamW step: one launch for all sparse tensors of one device and dtype.

For tensor i with k_i chosen entries at sorted flat positions `idx_i` (the contract is
`sparse_adamw_ref` in `sift/_ops.py`):

    g = grad_i[idx_i]                (dense grad)  or  compact_grad_i   ([k_i] fp32)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g^2
    w = param_i[idx_i]               (fp32, no base) or  base_i + delta_i (with a base: bf16/fp16)
    upd = -lr * wd * w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    delta_i += upd
    param_i[idx_i] = w + upd         (no base)     or  round(base_i + delta_i)

Multi-tensor layout. A segment table `table[n_tensors, 9]` (int64) holds per tensor:
`k_i` and the addresses of param, grad, indices, exp_avg, exp_avg_sq, delta, base (0 if none)
and step (a 0-d fp32 device tensor, so bias correction needs no host sync). A block table
`blocks[n_blocks, 2]` maps each program to (tensor, first entry); a block never straddles
two tensors. The block table depends only on the k_i and is built once; the segment table
is rebuilt only when an address changes (a new dense gradient each step in plain mode).

Hyper-parameters are runtime scalars (a new value never recompiles); `lr` may instead
live in a device tensor (`LR_ON_DEVICE`) so a captured CUDA graph follows a scheduler.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ._checks import check_lengths
from ._rounding import round_to_bf16

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.int32: tl.int32, torch.int64: tl.int64}


@triton.jit
def _sparse_adamw_kernel(
    table_ptr,
    blocks_ptr,
    lr_ptr,
    lr,
    beta1,
    beta2,
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
):
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(blocks_ptr + 2 * pid)
    start = tl.load(blocks_ptr + 2 * pid + 1)
    row = table_ptr + tensor * 9
    n = tl.load(row)
    w_ptr = tl.load(row + 1).to(tl.pointer_type(W_DTYPE))
    g_ptr = tl.load(row + 2).to(tl.pointer_type(G_DTYPE))
    i_ptr = tl.load(row + 3).to(tl.pointer_type(I_DTYPE))
    m_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    d_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(row + 8).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        # Addresses read from a table carry no alignment facts; without these hints the
        # compiler cannot emit 16-byte vector loads for the contiguous compact arrays.
        i_ptr = tl.multiple_of(i_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        d_ptr = tl.multiple_of(d_ptr, 16)

    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    # The compact arrays are read once per step: with EVICT_FIRST they do not push the
    # gathered weight/grad sectors out of L2.
    idx = tl.load(i_ptr + offs, mask=mask, other=0, eviction_policy="evict_first" if EVICT_FIRST else "").to(tl.int64)
    if COMPACT_GRAD:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")
    v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")
    d = tl.load(d_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")

    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g

    # Bias corrections in fp64 (scalars, once per program): in fp32, 1 - beta^t cancels for
    # beta near 1 (beta2 = 0.99999 at t = 1 leaves 1e-5 with an absolute error of ~6e-8).
    step = tl.load(step_ptr).to(tl.float64)
    bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
    bias_correction2 = 1.0 - tl.exp2(step * log2_beta2)
    if LR_ON_DEVICE:
        lr_value = tl.load(lr_ptr).to(tl.float32)
    else:
        lr_value = lr
    step_size = (lr_value / bias_correction1).to(tl.float32)
    inv_bc2_sqrt = (1.0 / tl.sqrt(bias_correction2)).to(tl.float32)

    if HAS_BASE:
        b_ptr = tl.load(row + 7).to(tl.pointer_type(W_DTYPE))
        base = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = base + d
    else:
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)

    upd = -(lr_value * weight_decay) * w - step_size * m / (tl.sqrt_rn(v) * inv_bc2_sqrt + eps)
    d = d + upd
    if HAS_BASE:
        w_new = base + d
    else:
        w_new = w + upd

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(d_ptr + offs, d, mask=mask)
    if W_DTYPE == tl.bfloat16:
        tl.store(w_ptr + idx, round_to_bf16(w_new), mask=mask)
    else:
        tl.store(w_ptr + idx, w_new.to(W_DTYPE), mask=mask)


# Chosen by bench/adamw_gpu_sweep.py, where the launch configuration barely matters (figures:
# bench/results/adamw-gpu-sweep.md).
_BLOCK = 512
_NUM_WARPS = 8
_EVICT_FIRST = False
_block_cache: dict[tuple, torch.Tensor] = {}
# Segment tables by their exact contents. A captured CUDA graph keeps reading the table it was
# captured with, so tables are not overwritten in place: the most recent ones stay alive.
_TABLE_CACHE_SIZE = 32
_table_cache: OrderedDict[tuple, tuple[torch.Tensor, bool]] = OrderedDict()


def _block_table(sizes: tuple[int, ...], device: torch.device, block: int) -> torch.Tensor:
    key = (sizes, str(device), block)
    blocks = _block_cache.get(key)
    if blocks is None:
        rows = [(t, s) for t, k in enumerate(sizes) for s in range(0, k, block)]
        blocks = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(device)
        _block_cache[key] = blocks
    return blocks


def _segment_table(key: tuple, columns: tuple[tuple[int, ...], ...], device: torch.device,
                   check: Callable[[], None]) -> tuple[torch.Tensor, bool]:
    """The device copy of `columns` (cached by content) and whether the compact arrays are 16-byte aligned.

    `check` validates the tensors behind a table before it is built; a cached table stands for
    addresses that passed it.
    """
    full_key = (key, columns)  # a tuple of tuples: hashed and compared in C
    hit = _table_cache.get(full_key)
    if hit is not None:
        _table_cache.move_to_end(full_key)
        return hit
    check()
    host = torch.tensor(columns, dtype=torch.int64)
    table = host.to(device, non_blocking=True) if device.type == "cuda" else host
    aligned = all(col[c] % 16 == 0 for col in columns for c in (3, 4, 5, 6))
    _table_cache[full_key] = (table, aligned)
    if len(_table_cache) > _TABLE_CACHE_SIZE:
        _table_cache.popitem(last=False)
    return table, aligned


def _check_tensors(params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps, sizes, compact_grads,
                   device) -> None:
    # The kernel reads every tensor through a raw address at flat offsets 0..k_i-1: a strided
    # view, a short or wrong-dtype state tensor or one on another device is read and written
    # wrongly (or out of bounds) without any error.
    for i, (p, g, idx, k) in enumerate(zip(params, grads, indices, sizes)):
        if idx.dim() != 1 or not idx.is_contiguous() or idx.device != device:
            raise ValueError(f"indices[{i}] must be a contiguous 1-D tensor on {device}")
        if compact_grads:
            if g.dtype != torch.float32 or g.numel() != k or g.device != device:
                raise ValueError(f"grads[{i}] must be float32 with one entry per index on {device} (compact_grads)")
        elif g.dtype != p.dtype or g.numel() != p.numel() or g.device != device:
            raise ValueError(f"grads[{i}] must have the shape and dtype of params[{i}] and be on {device}")
        state = [("exp_avgs", exp_avgs[i], torch.float32), ("exp_avg_sqs", exp_avg_sqs[i], torch.float32),
                 ("deltas", deltas[i], torch.float32)]
        if bases:
            state.append(("bases", bases[i], p.dtype))
        for name, t, dtype in state:
            if t.dtype != dtype or t.numel() != k or not t.is_contiguous() or t.device != device:
                raise ValueError(f"{name}[{i}] must be a contiguous {dtype} tensor with one entry per index on {device}")
        if steps[i].dtype != torch.float32 or steps[i].numel() != 1 or steps[i].device != device:
            raise ValueError(f"steps[{i}] must be a one-element float32 tensor on {device}")


def sparse_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    deltas: list[torch.Tensor],
    bases: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    compact_grads: bool,
    block: int | None = None,
    num_warps: int | None = None,
    evict_first: bool | None = None,
) -> None:
    """One fused SparseAdamW step over tensors sharing one device, dtype and index dtype.

    Args:
        params: weights, any shape, contiguous; written only at their indices.
        grads: dense grads (param shape and dtype) or, with `compact_grads`, [k_i] fp32.
        indices: [k_i] sorted flat positions, all int32 or all int64.
        exp_avgs, exp_avg_sqs, deltas: [k_i] fp32, updated in place.
        bases: [k_i] in the param dtype, required for bf16/fp16 params; for fp32 params either
            empty (the weight is read at its indices) or given (the weight is rebuilt as
            base + delta and only written: no random read of the weight).
        steps: 0-d fp32 device tensors, already incremented for this step.
        lr: float, or a 0-d device tensor read inside the kernel.
        beta1, beta2, eps, weight_decay, maximize: AdamW hyper-parameters.
        compact_grads: whether `grads` are already gathered.
        block, num_warps, evict_first: launch configuration (entries per program, warps,
            L2 eviction hint on the compact arrays); None takes the tuned defaults.

    Example:
        >>> sparse_adamw_([w], [w.grad], [idx], [m], [v], [d], [], [step], lr=1e-3, beta1=0.9,
        ...               beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, compact_grads=False)
    """
    if not params:
        return
    # The block table, built from all indices, would point the kernel at the table rows of
    # params past a shorter list.
    check_lengths(len(params), grads=grads, indices=indices, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                  deltas=deltas, steps=steps, **({"bases": bases} if bases else {}))
    device = params[0].device
    w_dtype = params[0].dtype
    i_dtype = indices[0].dtype
    # The Python side runs every step over every tensor (hundreds in a large model): C-level
    # map/zip instead of per-element Python, and the table is rebuilt only when an address moves.
    if len({(p.device, p.dtype) for p in params}) != 1 or len({t.dtype for t in indices}) != 1:
        raise ValueError("params must share one device and dtype, and indices one dtype")
    if not (all(map(torch.Tensor.is_contiguous, params)) and all(map(torch.Tensor.is_contiguous, grads))):
        raise ValueError("params and grads must be contiguous")
    if w_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params must be float32, bfloat16 or float16, got {w_dtype}")
    has_base = bool(bases)
    if not has_base and w_dtype != torch.float32:
        raise ValueError("bases are required for bf16/fp16 params")
    lr_on_device = isinstance(lr, torch.Tensor)
    if lr_on_device and (lr.device != device or lr.numel() != 1):
        raise ValueError(f"lr must be a float or a one-element tensor on {device}, got {lr.device} with {lr.numel()}")
    sizes = tuple(map(torch.Tensor.numel, indices))
    ptr = torch.Tensor.data_ptr
    columns = tuple(zip(
        sizes, map(ptr, params), map(ptr, grads), map(ptr, indices), map(ptr, exp_avgs), map(ptr, exp_avg_sqs),
        map(ptr, deltas), map(ptr, bases) if has_base else itertools.repeat(0), map(ptr, steps),
    ))
    key = (str(device), w_dtype, i_dtype, compact_grads, sizes)
    table, aligned = _segment_table(key, columns, device, lambda: _check_tensors(
        params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps, sizes, compact_grads, device))
    block = block or _BLOCK
    blocks = _block_table(sizes, device, block)
    n_blocks = blocks.shape[0]
    if n_blocks == 0:
        return
    log2_beta1 = _log2(beta1)
    log2_beta2 = _log2(beta2)
    g_dtype = torch.float32 if compact_grads else w_dtype
    _sparse_adamw_kernel[(n_blocks,)](
        table,
        blocks,
        lr if lr_on_device else table,
        0.0 if lr_on_device else float(lr),
        float(beta1),
        float(beta2),
        log2_beta1,
        log2_beta2,
        float(eps),
        float(weight_decay),
        W_DTYPE=_TL_DTYPES[w_dtype],
        G_DTYPE=_TL_DTYPES[g_dtype],
        I_DTYPE=_TL_DTYPES[i_dtype],
        COMPACT_GRAD=compact_grads,
        HAS_BASE=has_base,
        LR_ON_DEVICE=lr_on_device,
        MAXIMIZE=bool(maximize),
        ALIGNED=aligned,
        EVICT_FIRST=_EVICT_FIRST if evict_first is None else evict_first,
        BLOCK=block,
        num_warps=num_warps or _NUM_WARPS,
    )


def _log2(beta: float) -> float:
    # beta == 0 gives bias correction 1 at every step: exp2(-inf) == 0.
    return math.log2(beta) if beta > 0 else float("-inf")
