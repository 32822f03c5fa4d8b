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

Multi-tensor layout. A segment table `table[n_tensors, N_COLS]` (int64) holds per tensor:
`k_i` and the addresses of param, grad, indices, exp_avg, exp_avg_sq, delta, base (0 if none)
and step (a 0-d fp32 device tensor, so bias correction needs no host sync), at the columns
`COL_*`. A block table `blocks[n_blocks, N_BLOCK_COLS]` maps each program to (tensor, first
entry); a block never straddles two tensors.

Table lifetime. A captured CUDA graph keeps reading the tables it was captured with, so a
table must live as long as its owner (the optimizer) may replay it. The caller passes its own
dict (`table_cache`); the launcher keeps there one slot per param set, rebuilt only when an
address or a size changes (a new dense gradient each step in plain mode), and every table a
capture used until the dict is dropped. Without a `table_cache` (a direct call) the tables
are built for the call and nothing outlives it.

Hyper-parameters are runtime scalars (a new value never recompiles); `lr` may instead
live in a device tensor (`LR_ON_DEVICE`) so a captured CUDA graph follows a scheduler.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import check_lengths
from ._rounding import round_to_bf16

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.int32: tl.int32, torch.int64: tl.int64}

# Segment table columns, one int64 row per tensor: the host builder and the kernel both use
# these names, so the layout is written only here.
COL_NUMEL = tl.constexpr(0)  # k_i, entries of the tensor
COL_PARAM = tl.constexpr(1)
COL_GRAD = tl.constexpr(2)
COL_INDICES = tl.constexpr(3)
COL_EXP_AVG = tl.constexpr(4)
COL_EXP_AVG_SQ = tl.constexpr(5)
COL_DELTA = tl.constexpr(6)
COL_BASE = tl.constexpr(7)  # 0 without bases
COL_STEP = tl.constexpr(8)
N_COLS = tl.constexpr(9)
# Block table columns, one row per program.
BLOCK_COL_TENSOR = tl.constexpr(0)  # row of the segment table
BLOCK_COL_START = tl.constexpr(1)  # first entry of the tensor the program updates
N_BLOCK_COLS = tl.constexpr(2)


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
):
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(blocks_ptr + N_BLOCK_COLS * pid + BLOCK_COL_TENSOR)
    start = tl.load(blocks_ptr + N_BLOCK_COLS * pid + BLOCK_COL_START)
    row = table_ptr + tensor * N_COLS
    n = tl.load(row + COL_NUMEL)
    w_ptr = tl.load(row + COL_PARAM).to(tl.pointer_type(W_DTYPE))
    g_ptr = tl.load(row + COL_GRAD).to(tl.pointer_type(G_DTYPE))
    i_ptr = tl.load(row + COL_INDICES).to(tl.pointer_type(I_DTYPE))
    m_ptr = tl.load(row + COL_EXP_AVG).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + COL_EXP_AVG_SQ).to(tl.pointer_type(tl.float32))
    d_ptr = tl.load(row + COL_DELTA).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(row + COL_STEP).to(tl.pointer_type(tl.float32))
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

    # 1 - beta comes from the host in double precision, as torch's AdamW takes it: in fp32,
    # 1 - 0.999 is 5e-5 off and would bias every second moment.
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g

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
        b_ptr = tl.load(row + COL_BASE).to(tl.pointer_type(W_DTYPE))
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
# The launcher's entry in an owner's `table_cache` dict.
_CACHE_KEY = "sparse_adamw_"


class _Tables(NamedTuple):
    """The device tables of one launch and what they were built from."""

    columns: tuple[tuple[int, ...], ...]  # the segment table's rows, on the host
    table: torch.Tensor  # [n_tensors, N_COLS] int64
    aligned: bool  # whether every compact array is 16-byte aligned
    block: int
    blocks: torch.Tensor  # [n_blocks, N_BLOCK_COLS] int64


class _OwnerTables:
    """The tables of one owner: one slot per param set, and every table a capture used.

    A slot is keyed by its params' addresses and rebuilt when any column changes. A param is
    stepped in one launch per step, so a new param set first drops the slots it overlaps: the
    slots stay fewer than the params. Tables a CUDA graph captured stay until the owner drops
    the dict, since a replay reads them after the slot has moved on.
    """

    __slots__ = ("slots", "captured")

    def __init__(self) -> None:
        self.slots: dict[tuple, _Tables] = {}
        self.captured: dict[int, _Tables] = {}  # id(table) -> its tables

    def tables(self) -> list[torch.Tensor]:
        """Every segment and block table alive here, each once."""
        alive = {id(t): t for kept in (*self.slots.values(), *self.captured.values())
                 for t in (kept.table, kept.blocks)}
        return list(alive.values())

    def get(self, slot: tuple, columns: tuple[tuple[int, ...], ...], block: int, device: torch.device,
            check: Callable[[], None]) -> _Tables:
        """The tables of `slot` for `columns` (the last item of `slot` is the params' addresses)."""
        old = self.slots.get(slot)
        if old is not None and old.columns == columns and old.block == block:
            return old
        # The block table depends only on the sizes, which a moved gradient keeps.
        same_sizes = old is not None and old.block == block and \
            [row[COL_NUMEL] for row in old.columns] == [row[COL_NUMEL] for row in columns]
        new = _build_tables(columns, block, device, check, old.blocks if same_sizes else None)
        if old is None:
            params = set(slot[-1])
            for stale in [key for key in self.slots if not params.isdisjoint(key[-1])]:
                del self.slots[stale]
        self.slots[slot] = new
        return new


def _build_tables(columns: tuple[tuple[int, ...], ...], block: int, device: torch.device, check: Callable[[], None],
                  blocks: torch.Tensor | None = None) -> _Tables:
    """Device tables for `columns`, after `check` validated the tensors behind the addresses."""
    check()
    host = torch.tensor(columns, dtype=torch.int64).reshape(-1, int(N_COLS))
    table = host.to(device, non_blocking=True) if device.type == "cuda" else host
    aligned = all(row[c] % 16 == 0 for row in columns for c in (COL_INDICES, COL_EXP_AVG, COL_EXP_AVG_SQ, COL_DELTA))
    if blocks is None:
        rows = [(t, s) for t, row in enumerate(columns) for s in range(0, row[COL_NUMEL], block)]
        blocks = torch.tensor(rows, dtype=torch.int64).reshape(-1, int(N_BLOCK_COLS)).to(device)
    return _Tables(columns, table, aligned, block, blocks)


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
    owner = table_cache.get(_CACHE_KEY)
    return owner.tables() if owner is not None else []


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
    table_cache: dict | None = None,
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
        table_cache: the caller's dict for this launcher's tables (an optimizer keeps one for
            its lifetime). A CUDA graph captured over the call reads the tables kept there,
            so it replays only while the dict lives. None builds the tables for this call only
            (no capture then: the table's host-to-device copy cannot be captured).

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
    param_ptrs = tuple(map(ptr, params))
    cols: list = [None] * int(N_COLS)
    cols[COL_NUMEL] = sizes
    cols[COL_PARAM] = param_ptrs
    cols[COL_GRAD] = map(ptr, grads)
    cols[COL_INDICES] = map(ptr, indices)
    cols[COL_EXP_AVG] = map(ptr, exp_avgs)
    cols[COL_EXP_AVG_SQ] = map(ptr, exp_avg_sqs)
    cols[COL_DELTA] = map(ptr, deltas)
    cols[COL_BASE] = map(ptr, bases) if has_base else itertools.repeat(0)
    cols[COL_STEP] = map(ptr, steps)
    columns = tuple(zip(*cols))
    block = block or _BLOCK

    def check() -> None:
        _check_tensors(params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps, sizes, compact_grads,
                       device)

    if table_cache is None:
        tables = _build_tables(columns, block, device, check)
    else:
        owner = table_cache.get(_CACHE_KEY)
        if owner is None:
            owner = table_cache[_CACHE_KEY] = _OwnerTables()
        tables = owner.get((str(device), w_dtype, i_dtype, compact_grads, param_ptrs), columns, block, device, check)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            owner.captured.setdefault(id(tables.table), tables)
    table, aligned, blocks = tables.table, tables.aligned, tables.blocks
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
        1.0 - float(beta1),
        1.0 - float(beta2),
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
