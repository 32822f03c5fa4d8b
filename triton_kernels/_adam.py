"""What both step kernels (`sparse_adamw.py`, `sparse_adamw_lean.py`) share: finding a
program's segment, the gradient load, the moment update, the bias corrections, the weight's
increment and its rounding, and the launch with the arguments every step kernel takes
(`launch_step`). Every product an add consumes goes through `mul_rn` (and the fp64 bias
corrections through `add_rn`): both kernels round each operation on its own, whatever fp-fusion
setting they are compiled with."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import triton
import triton.language as tl

from . import _segments
from ._launch import launchable
from ._rounding import add_rn, mul_rn, round_to_bf16
from ._step_args import AdamWHyper, ExactState, LeanState

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
             torch.int32: tl.int32, torch.int64: tl.int64}

_COL_NUMEL = tl.constexpr(_segments.COL_NUMEL)
_COL_PARAM = tl.constexpr(_segments.COL_PARAM)
_COL_GRAD = tl.constexpr(_segments.COL_GRAD)
_COL_EXP_AVG = tl.constexpr(_segments.COL_EXP_AVG)
_COL_EXP_AVG_SQ = tl.constexpr(_segments.COL_EXP_AVG_SQ)
_COL_STEP = tl.constexpr(_segments.COL_STEP)
_BLOCK_COL_TENSOR = tl.constexpr(_segments.BLOCK_COL_TENSOR)
_BLOCK_COL_START = tl.constexpr(_segments.BLOCK_COL_START)
_N_BLOCK_COLS = tl.constexpr(_segments.N_BLOCK_COLS)


@triton.jit
def program_segment(table_ptr, blocks_ptr, k, N_COLS: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr):
    """(row pointer of this program's tensor in the segment table, [BLOCK] entry offsets, mask).

    DIRECT: one tensor of `k` entries per launch, its operands passed as arguments (the
    launches torch.compile records, which cannot hold addresses); no table, `row` is unused.
    """
    pid = tl.program_id(0).to(tl.int64)
    if DIRECT:
        row = pid
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < k
    else:
        tensor = tl.load(blocks_ptr + _N_BLOCK_COLS * pid + _BLOCK_COL_TENSOR)
        start = tl.load(blocks_ptr + _N_BLOCK_COLS * pid + _BLOCK_COL_START)
        row = table_ptr + tensor * N_COLS
        offs = start + tl.arange(0, BLOCK)
        mask = offs < tl.load(row + _COL_NUMEL)
    return row, offs, mask


@triton.jit
def operand(row, col, arg, DTYPE: tl.constexpr, DIRECT: tl.constexpr):
    """The address of one operand: the argument `arg` (DIRECT), else column `col` of the segment
    table row as a DTYPE pointer (DTYPE None: the column's integer value)."""
    if DIRECT and DTYPE is None:
        out = arg + tl.zeros([], dtype=tl.int64)  # an int Triton may have made a constant
    elif DIRECT:
        out = arg
    elif DTYPE is None:
        out = tl.load(row + col)
    else:
        out = tl.load(row + col).to(tl.pointer_type(DTYPE))
    return out


@triton.jit
def shared_operands(row, w_arg, g_arg, m_arg, v_arg, step_arg, W_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
                    M_DTYPE: tl.constexpr, DIRECT: tl.constexpr):
    """The addresses every step kernel reads: (weight, grad, exp_avg, exp_avg_sq, step count)."""
    return (operand(row, _COL_PARAM, w_arg, W_DTYPE, DIRECT), operand(row, _COL_GRAD, g_arg, G_DTYPE, DIRECT),
            operand(row, _COL_EXP_AVG, m_arg, M_DTYPE, DIRECT), operand(row, _COL_EXP_AVG_SQ, v_arg, M_DTYPE, DIRECT),
            operand(row, _COL_STEP, step_arg, tl.float32, DIRECT))


@triton.jit
def load_grad(g_ptr, idx, offs, mask, COMPACT_GRAD: tl.constexpr, MAXIMIZE: tl.constexpr):
    """[BLOCK] fp32 gradient at the chosen entries (compact: at `offs`; dense: at `idx`)."""
    if COMPACT_GRAD:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def adam_update(g, m, v, step, lr_ptr, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2,
                LR_ON_DEVICE: tl.constexpr):
    """New moments and the step's scales: (m, v, lr, lr / bc1, 1 / sqrt(bc2)), the scales fp32."""
    # 1 - beta comes from the host in double precision, as torch's AdamW takes it: in fp32,
    # 1 - 0.999 is 5e-5 off and would bias every second moment.
    m = mul_rn(beta1, m) + mul_rn(one_minus_beta1, g)
    v = mul_rn(beta2, v) + mul_rn(one_minus_beta2 * g, g)
    # Bias corrections in fp64 (scalars, once per program), from the device step count: in
    # fp32, 1 - beta^t cancels for beta near 1 (beta2 = 0.99999 at t = 1 leaves 1e-5 with an
    # absolute error of ~6e-8).
    # Rounded op by op as well: a product or a sum fused into the inlined exp2 would move them.
    step64 = step.to(tl.float64)
    one = tl.full([], 1.0, tl.float64)
    bias_correction1 = add_rn(one, -tl.exp2(mul_rn(step64, log2_beta1)))
    bias_correction2 = add_rn(one, -tl.exp2(mul_rn(step64, log2_beta2)))
    if LR_ON_DEVICE:
        lr_value = tl.load(lr_ptr).to(tl.float32)
    else:
        lr_value = lr
    step_size = (lr_value / bias_correction1).to(tl.float32)
    inv_bc2_sqrt = (1.0 / tl.sqrt(bias_correction2)).to(tl.float32)
    return m, v, lr_value, step_size, inv_bc2_sqrt


@triton.jit
def weight_increment(w, m, v, lr_value, weight_decay, step_size, inv_bc2_sqrt, eps):
    """[BLOCK] fp32 AdamW increment of the weights w: -lr * wd * w - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)."""
    return mul_rn(-(lr_value * weight_decay), w) - step_size * m / (mul_rn(tl.sqrt_rn(v), inv_bc2_sqrt) + eps)


@triton.jit
def to_weight_dtype(x, W_DTYPE: tl.constexpr):
    """[BLOCK] fp32 -> W_DTYPE, round to nearest even (by hand for bf16, see `_rounding.py`)."""
    if W_DTYPE == tl.bfloat16:
        out = round_to_bf16(x)
    else:
        out = x.to(W_DTYPE)
    return out


def shared_columns(state: ExactState | LeanState, numels: Iterable[int], n_cols: int) -> list:
    """A step table's columns as `n_cols` iterables over the tensors: COL_NUMEL (`numels`) and the
    shared addresses filled (COL_PARAM a tuple: launchers key their tables by it), the rest None."""
    ptr = torch.Tensor.data_ptr
    cols: list = [None] * n_cols
    cols[_segments.COL_NUMEL] = numels
    cols[_segments.COL_PARAM] = tuple(map(ptr, state.params))
    cols[_segments.COL_GRAD] = map(ptr, state.grads)
    cols[_segments.COL_EXP_AVG] = map(ptr, state.exp_avgs)
    cols[_segments.COL_EXP_AVG_SQ] = map(ptr, state.exp_avg_sqs)
    cols[_segments.COL_STEP] = map(ptr, state.steps)
    return cols


def launch_step(kernel, tables: _segments.Tables | None, state: ExactState | LeanState, hyper: AdamWHyper,
                w_dtype: torch.dtype, num_warps: int, block: int, direct: Callable[[int], dict] | None = None,
                **options) -> None:
    """Launch a step kernel: one program per row of `tables.blocks` (none: no launch), or with
    `tables` None one DIRECT launch per tensor, `direct(i)` giving tensor i's operands as the
    kernel's keyword arguments (`k` among them, its entry count).

    Passes what every step kernel takes: the segment and block tables (None when DIRECT),
    `hyper`'s runtime scalars (`AdamWHyper.kernel_args`), and the constexprs W_DTYPE, G_DTYPE,
    COMPACT_GRAD, LR_ON_DEVICE, MAXIMIZE, BLOCK and DIRECT; `options` adds the kernel's own
    constexprs.
    """
    g_dtype = torch.float32 if state.compact_grads else w_dtype
    constexprs = dict(W_DTYPE=TL_DTYPES[w_dtype], G_DTYPE=TL_DTYPES[g_dtype], COMPACT_GRAD=state.compact_grads,
                      LR_ON_DEVICE=hyper.lr_on_device, MAXIMIZE=bool(hyper.maximize), BLOCK=block,
                      num_warps=num_warps, **options)
    if tables is not None:
        n_blocks = tables.blocks.shape[0]
        if n_blocks:
            kernel[(n_blocks,)](tables.table, tables.blocks, *hyper.kernel_args(tables.table), **constexprs)
        return
    for i in range(len(state.params)):
        operands = direct(i)
        if operands["k"]:
            launchable(kernel)[(triton.cdiv(operands["k"], block),)](
                None, None, *hyper.kernel_args(None), DIRECT=True, **operands, **constexprs)
