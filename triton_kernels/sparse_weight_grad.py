"""Sparse weight gradient (a sampled dense-dense product) for the sparse backward.

For a linear layer y = x W^T + b with W [R, C] and the tokens flattened to T rows:

    out[j] += sum_t dY[t, idx[j] // C] * X[t, idx[j] % C]        j < k

grad_output dY [T, R] and input X [T, C] (fp32, bf16 or fp16, one dtype, any strides),
indices idx [k] int32/int64 sorted ascending, out [k] fp32 (zeros when not given). Products
and sums are fp32.

Each program takes BLOCK_K consecutive sorted indices and walks T in BLOCK_T tiles, loading
the gathered tiles dY[t, row] and X[t, col] ([BLOCK_T, BLOCK_K]) and summing their product
over t. Sorted indices make the rows of a block mostly one row of dY, read once per tile.

The argument contract (and its checks, shared by every backend) is in `sift._ops`
(`check_sparse_weight_grad_args`); the launcher here checks only what the kernel relies on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launchable


@triton.jit
def _sparse_weight_grad_kernel(
    dy_ptr,
    x_ptr,
    idx_ptr,
    out_ptr,
    T,
    C,
    k,
    stride_dy_t,
    stride_dy_r,
    stride_x_t,
    stride_x_c,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs_k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k
    idx = tl.load(idx_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
    rows = idx // C
    cols = idx - rows * C
    dy_cols = dy_ptr + rows * stride_dy_r
    x_cols = x_ptr + cols * stride_x_c
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask = (offs_t < T)[:, None] & mask_k[None, :]
        a = tl.load(dy_cols[None, :] + offs_t[:, None] * stride_dy_t, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_cols[None, :] + offs_t[:, None] * stride_x_t, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(a * b, axis=0)
    prev = tl.load(out_ptr + offs_k, mask=mask_k, other=0.0)
    tl.store(out_ptr + offs_k, prev + acc, mask=mask_k)


def sparse_weight_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_k: int | None = None,
    block_t: int | None = None,
) -> torch.Tensor:
    """Launch the sampled product: `out[j] += sum_t grad_output[t, row_j] * input[t, col_j]`.

    Args:
        grad_output: dY `[T, R]`, fp32/bf16/fp16, any strides.
        input: X `[T, C]`, grad_output's dtype and device, any strides.
        indices: `[k]` int32/int64, sorted ascending, in `[0, R * C)` (checked by the caller).
        out: `[k]` fp32 contiguous to add into; allocated as zeros when None.
        block_k: entries per program (default 64 on GPU, 16 under the CPU interpreter).
        block_t: tokens per tile (default 32 on GPU, 16 under the CPU interpreter).

    Returns:
        `out`, `[k]` fp32.

    Example:
        >>> dy, x = torch.randn(9, 3), torch.randn(9, 4)  # doctest: +SKIP
        >>> sparse_weight_grad(dy, x, torch.tensor([1, 6, 11]))  # doctest: +SKIP
    """
    if grad_output.dim() != 2 or input.dim() != 2 or grad_output.shape[0] != input.shape[0]:
        raise ValueError(f"grad_output [T, R] and input [T, C] must be 2-D with one T, got "
                         f"{tuple(grad_output.shape)} and {tuple(input.shape)}")
    if grad_output.dtype != input.dtype:
        raise ValueError(f"input must have grad_output's dtype {grad_output.dtype}, got {input.dtype}")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be a 1-D int32 or int64 tensor, got {indices.dtype} {tuple(indices.shape)}")
    k = indices.numel()
    if out is None:
        out = torch.zeros(k, dtype=torch.float32, device=grad_output.device)
    elif out.dtype != torch.float32 or out.shape != (k,) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{k}] tensor, got {out.dtype} {tuple(out.shape)}")
    if k == 0:
        return out
    on_gpu = grad_output.device.type == "cuda"
    block_k = block_k or (64 if on_gpu else 16)
    block_t = block_t or (32 if on_gpu else 16)
    indices = indices.contiguous()
    T, C = input.shape
    grid = (triton.cdiv(k, block_k),)
    launchable(_sparse_weight_grad_kernel)[grid](
        grad_output, input, indices, out, T, C, k,
        grad_output.stride(0), grad_output.stride(1), input.stride(0), input.stride(1),
        BLOCK_K=block_k, BLOCK_T=block_t,
    )
    return out
