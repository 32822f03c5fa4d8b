"""Mixed sparse deltas in one batch: each token's output gains its own delta's product.

For y = x W^T over T tokens, W [R, C], and a `DeltaBank` of n deltas of W (CSR per delta,
concatenated: row_ptr [n, R + 1] int32/int64, col [nnz] int16/int32, val [nnz] fp32/bf16/fp16),
with d = ids[t]:

    d == -1:  y[t] untouched
    d >= 0:   y[t, i] = dtype(fp32(y[t, i]) + sum_e fp32(val[e]) * fp32(x[t, col[e]]))
              over e in [row_ptr[d, i], row_ptr[d, i + 1])

y [T, R] and x [T, C] (fp32, bf16 or fp16, one dtype, any strides), ids [T] int32.

Each program takes a [BLOCK_T, BLOCK_R] tile of (token, output row) pairs. Every pair reads its
row's bounds in its token's delta and walks the row's entries in lock step with the tile, for
`max_row_entries` steps (a host-side bound kept in the bank; shorter rows are masked), gathering
x[t, col] and summing in fp32. Tokens of one row of a batch carry one id, so a tile's tokens
mostly read the same delta rows, from cache. Tokens with id -1 load and store nothing.

The argument contract (and its checks, shared by every backend) is in `sift._ops`
(`check_mixed_delta_matmul_args`); the launcher here checks only what the kernel relies on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._delta_bank import DeltaBank
from ._launch import launchable
from ._rounding import round_to_bf16


@triton.jit
def _mixed_delta_matmul_kernel(
    y_ptr,
    x_ptr,
    ids_ptr,
    row_ptr_ptr,
    col_ptr,
    val_ptr,
    T,
    R,
    max_row_entries,
    stride_y_t,
    stride_y_r,
    stride_x_t,
    stride_x_c,
    IS_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    ids = tl.load(ids_ptr + offs_t, mask=offs_t < T, other=-1).to(tl.int64)
    mask = (ids >= 0)[:, None] & (offs_r < R)[None, :]
    bounds = row_ptr_ptr + ids[:, None] * (R + 1) + offs_r[None, :]
    # The bank's narrow forms widen on load: int32 row pointers to int64 offsets, 16-bit values to fp32.
    start = tl.load(bounds, mask=mask, other=0).to(tl.int64)
    end = tl.load(bounds + 1, mask=mask, other=0).to(tl.int64)
    x_rows = x_ptr + offs_t[:, None] * stride_x_t
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for j in range(max_row_entries):
        entry = start + j
        live = entry < end
        col = tl.load(col_ptr + entry, mask=live, other=0).to(tl.int64)
        val = tl.load(val_ptr + entry, mask=live, other=0.0).to(tl.float32)
        xv = tl.load(x_rows + col * stride_x_c, mask=live, other=0.0).to(tl.float32)
        acc += val * xv
    y_tile = y_ptr + offs_t[:, None] * stride_y_t + offs_r[None, :] * stride_y_r
    new = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32) + acc
    if IS_BF16:
        tl.store(y_tile, round_to_bf16(new), mask=mask)
    else:
        tl.store(y_tile, new.to(y_ptr.dtype.element_ty), mask=mask)


def mixed_delta_matmul_(
    y: torch.Tensor,
    x: torch.Tensor,
    delta_ids: torch.Tensor,
    bank: DeltaBank,
    *,
    block_t: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """Launch the mixed-delta product into `y` in place; see the module docstring.

    Args:
        y: `[T, R]` fp32/bf16/fp16, any strides; written in place.
        x: `[T, C]`, y's dtype and device, any strides.
        delta_ids: `[T]` int32/int64 in `[-1, bank.n_deltas)` (checked by the caller).
        bank: the deltas of W `[R, C]`, on y's device (values checked by the caller).
        block_t: tokens per tile (default 16 on GPU, 4 under the CPU interpreter).
        block_r: output rows per tile (default 64 on GPU, 16 under the CPU interpreter).

    Returns:
        `y`.

    Example:
        >>> y, x = torch.zeros(2, 3, device="cuda"), torch.randn(2, 4, device="cuda")  # doctest: +SKIP
        >>> bank = DeltaBank.from_rows_and_cols((3, 4), [(torch.tensor([1]), torch.tensor([2]),
        ...                                                torch.tensor([0.5]))], device="cuda")  # doctest: +SKIP
        >>> mixed_delta_matmul_(y, x, torch.tensor([0, -1], device="cuda"), bank)  # doctest: +SKIP
    """
    if y.dim() != 2 or x.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y [T, R] and x [T, C] must be 2-D with one T, got {tuple(y.shape)} and {tuple(x.shape)}")
    if y.dtype != x.dtype:
        raise ValueError(f"x must have y's dtype {y.dtype}, got {x.dtype}")
    if delta_ids.dim() != 1 or delta_ids.numel() != y.shape[0] or delta_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"delta_ids must be a 1-D int32 or int64 tensor of {y.shape[0]} ids, got "
                         f"{delta_ids.dtype} {tuple(delta_ids.shape)}")
    T, R = y.shape
    if bank.row_ptr.shape[-1] != R + 1 or not bank.row_ptr.is_contiguous():
        raise ValueError(f"bank.row_ptr must be contiguous [n_deltas, {R + 1}], got {tuple(bank.row_ptr.shape)}")
    if T == 0 or R == 0 or bank.n_deltas == 0:
        return y
    on_gpu = y.device.type == "cuda"
    block_t = block_t or (16 if on_gpu else 4)
    block_r = block_r or (64 if on_gpu else 16)
    grid = (triton.cdiv(T, block_t), triton.cdiv(R, block_r))
    launchable(_mixed_delta_matmul_kernel)[grid](
        y, x, delta_ids.contiguous(), bank.row_ptr, bank.col_indices, bank.values, T, R, bank.max_row_entries,
        y.stride(0), y.stride(1), x.stride(0), x.stride(1),
        IS_BF16=y.dtype == torch.bfloat16, BLOCK_T=block_t, BLOCK_R=block_r,
    )
    return y
