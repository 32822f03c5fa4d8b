"""SparseAdamW step on the lean state: one launch for all sparse tensors of one device and dtype.

The contract is `sparse_adamw_lean_ref` in `sift/_ops.py`. For tensor i with k_i entries:

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
each program to (tensor, first entry). The caller's `table_cache` keeps the tables of one param
set between steps (and every table a CUDA graph captured), as `sparse_adamw.py` does.

Hyper-parameters are runtime scalars; 1 - beta is taken in fp64 on the host. The launch turns
off fp fusion, so the kernel rounds every operation as the reference does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import check_lengths
from ._rounding import round_to_bf16

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

COL_NUMEL = tl.constexpr(0)  # k_i
COL_WINDOWS = tl.constexpr(1)  # ceil(n_i / 65536)
COL_SEARCH_STEPS = tl.constexpr(2)  # ceil(log2(windows)): binary-search probes
COL_PARAM = tl.constexpr(3)
COL_GRAD = tl.constexpr(4)
COL_LOW = tl.constexpr(5)
COL_OFFSETS = tl.constexpr(6)
COL_EXP_AVG = tl.constexpr(7)
COL_EXP_AVG_SQ = tl.constexpr(8)
COL_RESIDUAL = tl.constexpr(9)  # 0 for fp32 params
COL_STEP = tl.constexpr(10)
N_COLS = tl.constexpr(11)
BLOCK_COL_TENSOR = tl.constexpr(0)
BLOCK_COL_START = tl.constexpr(1)
N_BLOCK_COLS = tl.constexpr(2)

_WINDOW_BITS = 16
_BLOCK = 512
_NUM_WARPS = 8
_CACHE_KEY = "sparse_adamw_lean_"


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
):
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(blocks_ptr + N_BLOCK_COLS * pid + BLOCK_COL_TENSOR)
    start = tl.load(blocks_ptr + N_BLOCK_COLS * pid + BLOCK_COL_START)
    row = table_ptr + tensor * N_COLS
    n = tl.load(row + COL_NUMEL)
    search_steps = tl.load(row + COL_SEARCH_STEPS).to(tl.int32)
    w_ptr = tl.load(row + COL_PARAM).to(tl.pointer_type(W_DTYPE))
    g_ptr = tl.load(row + COL_GRAD).to(tl.pointer_type(G_DTYPE))
    low_ptr = tl.load(row + COL_LOW).to(tl.pointer_type(tl.int16))
    off_ptr = tl.load(row + COL_OFFSETS).to(tl.pointer_type(tl.int32))
    m_ptr = tl.load(row + COL_EXP_AVG).to(tl.pointer_type(tl.bfloat16))
    v_ptr = tl.load(row + COL_EXP_AVG_SQ).to(tl.pointer_type(tl.bfloat16))
    step_ptr = tl.load(row + COL_STEP).to(tl.pointer_type(tl.float32))

    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    low = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.int64) & 0xFFFF
    # The window of each entry: the last w with offsets[w] <= position (offsets[0] = 0 and
    # offsets[windows] = k bracket every position).
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = lo + tl.load(row + COL_WINDOWS).to(tl.int32)
    for _ in range(search_steps):
        mid = (lo + hi) >> 1
        below = tl.load(off_ptr + mid, mask=mask, other=0) <= offs
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    idx = (lo.to(tl.int64) << 16) + low

    if COMPACT_GRAD:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g

    # Bias corrections in fp64 (scalars, once per program), from the device step count.
    step = tl.load(step_ptr)
    step64 = step.to(tl.float64)
    bias_correction1 = 1.0 - tl.exp2(step64 * log2_beta1)
    bias_correction2 = 1.0 - tl.exp2(step64 * log2_beta2)
    if LR_ON_DEVICE:
        lr_value = tl.load(lr_ptr).to(tl.float32)
    else:
        lr_value = lr
    step_size = (lr_value / bias_correction1).to(tl.float32)
    inv_bc2_sqrt = (1.0 / tl.sqrt(bias_correction2)).to(tl.float32)

    stored = tl.load(w_ptr + idx, mask=mask, other=0.0)
    w = stored.to(tl.float32)
    if W_DTYPE != tl.float32:
        r_ptr = tl.load(row + COL_RESIDUAL).to(tl.pointer_type(tl.int8))
        residual = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.float32)
        w = w + residual * _unit(stored, W_DTYPE, False)
    upd = -(lr_value * weight_decay) * w - step_size * m / (tl.sqrt_rn(v) * inv_bc2_sqrt + eps)
    fresh = w + upd
    if W_DTYPE == tl.bfloat16:
        rounded = round_to_bf16(fresh)
    else:
        rounded = fresh.to(W_DTYPE)
    tl.store(w_ptr + idx, rounded, mask=mask)
    if W_DTYPE != tl.float32:
        back = rounded.to(tl.float32)
        q = (fresh - back) * _unit(rounded, W_DTYPE, True)
        # Round half to even: |q| <= 128 here, far below 2^22, where adding and removing
        # 1.5 * 2^23 leaves the nearest integer (no fp fusion or reassociation in this launch).
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


class _Tables:
    """The device tables of one launch and the host rows they were built from."""

    __slots__ = ("columns", "table", "blocks")

    def __init__(self, columns: tuple[tuple[int, ...], ...], block: int, device: torch.device) -> None:
        self.columns = columns
        host = torch.tensor(columns, dtype=torch.int64).reshape(-1, int(N_COLS))
        self.table = host.to(device, non_blocking=True) if device.type == "cuda" else host
        rows = [(t, s) for t, row in enumerate(columns) for s in range(0, row[COL_NUMEL], block)]
        self.blocks = torch.tensor(rows, dtype=torch.int64).reshape(-1, int(N_BLOCK_COLS)).to(device)


def _check_tensors(params, grads, indices_low, window_offsets, exp_avgs, exp_avg_sqs, residuals, steps,
                   compact_grads, device) -> None:
    # The kernel reads every tensor through a raw address: a strided view, a short or
    # wrong-dtype tensor or one on another device would be read and written out of bounds.
    for i, (p, g, low, off) in enumerate(zip(params, grads, indices_low, window_offsets)):
        k = low.numel()
        windows = -(-p.numel() // (1 << _WINDOW_BITS))
        if not p.is_contiguous() or p.device != device:
            raise ValueError(f"params[{i}] must be contiguous and on {device}")
        if low.dtype != torch.int16 or low.dim() != 1 or not low.is_contiguous() or low.device != device:
            raise ValueError(f"indices_low[{i}] must be a contiguous 1-D int16 tensor on {device}")
        if off.dtype != torch.int32 or off.shape != (windows + 1,) or not off.is_contiguous() or off.device != device:
            raise ValueError(f"window_offsets[{i}] must be a contiguous int32 tensor of shape ({windows + 1},) on {device}")
        if compact_grads:
            if g.dtype != torch.float32 or g.numel() != k or not g.is_contiguous() or g.device != device:
                raise ValueError(f"grads[{i}] must be float32 with one entry per index on {device} (compact_grads)")
        elif g.dtype != p.dtype or g.numel() != p.numel() or not g.is_contiguous() or g.device != device:
            raise ValueError(f"grads[{i}] must have the shape and dtype of params[{i}] and be on {device}")
        state = [("exp_avgs", exp_avgs[i], torch.bfloat16), ("exp_avg_sqs", exp_avg_sqs[i], torch.bfloat16)]
        if residuals:
            state.append(("residuals", residuals[i], torch.int8))
        for name, t, dtype in state:
            if t.dtype != dtype or t.numel() != k or not t.is_contiguous() or t.device != device:
                raise ValueError(f"{name}[{i}] must be a contiguous {dtype} tensor with one entry per index on {device}")
        if steps[i].dtype != torch.float32 or steps[i].numel() != 1 or steps[i].device != device:
            raise ValueError(f"steps[{i}] must be a one-element float32 tensor on {device}")


def sparse_adamw_lean_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices_low: list[torch.Tensor],
    window_offsets: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    residuals: list[torch.Tensor],
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
    table_cache: dict | None = None,
) -> None:
    """One SparseAdamW step on the lean state over tensors sharing one device and dtype.

    Args:
        params: weights, any shape, contiguous; written only at their entries.
        grads: dense grads (param shape and dtype) or, with `compact_grads`, [k_i] fp32.
        indices_low: [k_i] int16, the low 16 bits of the sorted flat positions.
        window_offsets: [ceil(numel_i / 65536) + 1] int32, the entries of each 65536-element window.
        exp_avgs, exp_avg_sqs: [k_i] bf16, updated in place.
        residuals: [k_i] int8 per bf16/fp16 param, updated in place; empty for fp32 params.
        steps: 0-d fp32 device tensors, already incremented for this step.
        lr: float, or a 0-d device tensor read inside the kernel.
        beta1, beta2, eps, weight_decay, maximize: AdamW hyper-parameters.
        compact_grads: whether `grads` are already gathered.
        block, num_warps: launch configuration; None takes the defaults.
        table_cache: the caller's dict for this launcher's tables (kept per param set while it
            lives, and every table a CUDA graph captured); None builds them for this call only.

    Example:
        >>> sparse_adamw_lean_([w], [w.grad], [low], [off], [m], [v], [], [step], lr=1e-3, beta1=0.9,
        ...                    beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, compact_grads=False)
    """
    if not params:
        return
    check_lengths(len(params), grads=grads, indices_low=indices_low, window_offsets=window_offsets,
                  exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps)
    device, w_dtype = params[0].device, params[0].dtype
    if len({(p.device, p.dtype) for p in params}) != 1:
        raise ValueError("params must share one device and dtype")
    if w_dtype not in _TL_DTYPES:
        raise ValueError(f"params must be float32, bfloat16 or float16, got {w_dtype}")
    if w_dtype == torch.float32:
        if residuals:
            raise ValueError("residuals must be empty for float32 params")
    else:
        check_lengths(len(params), residuals=residuals)
    lr_on_device = isinstance(lr, torch.Tensor)
    if lr_on_device and (lr.device != device or lr.numel() != 1):
        raise ValueError(f"lr must be a float or a one-element tensor on {device}, got {lr.device} with {lr.numel()}")
    ptr = torch.Tensor.data_ptr
    windows = [-(-p.numel() // (1 << _WINDOW_BITS)) for p in params]
    param_ptrs = tuple(map(ptr, params))
    columns = tuple(zip(
        map(torch.Tensor.numel, indices_low), windows, [max(0, (n - 1).bit_length()) for n in windows], param_ptrs,
        map(ptr, grads), map(ptr, indices_low), map(ptr, window_offsets), map(ptr, exp_avgs), map(ptr, exp_avg_sqs),
        map(ptr, residuals) if residuals else [0] * len(params), map(ptr, steps)))
    block = block or _BLOCK

    def build() -> _Tables:
        _check_tensors(params, grads, indices_low, window_offsets, exp_avgs, exp_avg_sqs, residuals, steps,
                       compact_grads, device)
        return _Tables(columns, block, device)

    if table_cache is None:
        tables = build()
    else:
        owner = table_cache.setdefault(_CACHE_KEY, {"slots": {}, "captured": []})
        slot = (str(device), w_dtype, compact_grads, block, param_ptrs)
        tables = owner["slots"].get(slot)
        if tables is None or tables.columns != columns:
            tables = build()
            if slot not in owner["slots"]:  # a new param set: drop the slots it overlaps
                for stale in [key for key in owner["slots"] if not set(param_ptrs).isdisjoint(key[-1])]:
                    del owner["slots"][stale]
            owner["slots"][slot] = tables
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            owner["captured"].append(tables)  # a replay reads them after the slot moved on
    n_blocks = tables.blocks.shape[0]
    if n_blocks == 0:
        return
    g_dtype = torch.float32 if compact_grads else w_dtype
    _sparse_adamw_lean_kernel[(n_blocks,)](
        tables.table,
        tables.blocks,
        lr if lr_on_device else tables.table,
        0.0 if lr_on_device else float(lr),
        float(beta1),
        float(beta2),
        1.0 - float(beta1),
        1.0 - float(beta2),
        _log2(beta1),
        _log2(beta2),
        float(eps),
        float(weight_decay),
        W_DTYPE=_TL_DTYPES[w_dtype],
        G_DTYPE=_TL_DTYPES[g_dtype],
        COMPACT_GRAD=compact_grads,
        LR_ON_DEVICE=lr_on_device,
        MAXIMIZE=bool(maximize),
        BLOCK=block,
        num_warps=num_warps or _NUM_WARPS,
        enable_fp_fusion=False,
    )


def _log2(beta: float) -> float:
    # beta == 0 gives bias correction 1 at every step: exp2(-inf) == 0.
    return math.log2(beta) if beta > 0 else float("-inf")
