"""Sparse delta apply and restore on CUDA (Triton).

For one weight with flat view `w` ([numel], fp32/bf16/fp16), `idx` ([k] int32/int64, sorted,
unique, in [0, numel)) and `val` ([k] fp32):

    apply:    old = w[idx];  w[idx] = dtype(fp32(old) + fp32(scale * val))   (old saved when asked)
    restore:  w[idx] = saved                                            (saved: [k], w's dtype)

Indices are unique, so every program writes its own entries and no atomics are needed. `scale`
is a runtime scalar (a new value does not recompile). The merge of sorted lists has no Triton
kernel: on CUDA it runs the sort-based torch reference (`sift._ops.merge_sorted_deltas_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_lengths
from ._launch import launchable
from ._rounding import mul_rn, round_to_bf16

BLOCK = 1024


@triton.jit
def _sparse_delta_apply_kernel(w_ptr, idx_ptr, val_ptr, saved_ptr, scale, k, SAVE: tl.constexpr,
                               IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    idx = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int64)
    old = tl.load(w_ptr + idx, mask=mask)
    if SAVE:
        tl.store(saved_ptr + offs, old, mask=mask)
    val = tl.load(val_ptr + offs, mask=mask, other=0.0)
    # The contract rounds scale * val before the add (`mul_rn`: no fused multiply-add).
    new = old.to(tl.float32) + mul_rn(scale, val)
    if IS_BF16:
        tl.store(w_ptr + idx, round_to_bf16(new), mask=mask)
    else:
        tl.store(w_ptr + idx, new.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sparse_delta_restore_kernel(w_ptr, idx_ptr, saved_ptr, k, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    idx = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int64)
    saved = tl.load(saved_ptr + offs, mask=mask)
    tl.store(w_ptr + idx, saved, mask=mask)


def _check(p: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    if not p.is_contiguous():
        raise ValueError("params must be contiguous")
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64) or not idx.is_contiguous():
        raise ValueError("indices must be contiguous 1-D int32 or int64 tensors")
    if vals.shape != idx.shape or vals.dtype != dtype or not vals.is_contiguous():
        raise ValueError(f"{what} must be contiguous {dtype} with one entry per index")
    if p.device != idx.device or p.device != vals.device:
        raise ValueError("params, indices and values must be on one device")


def sparse_delta_apply_(params: list[torch.Tensor], indices: list[torch.Tensor], values: list[torch.Tensor],
                        scale: float, originals: list[torch.Tensor]) -> None:
    """Adds `scale * values[i]` at `indices[i]` of each param in place; see the module docstring.

    Args:
        params: weights of any shape, contiguous, fp32/bf16/fp16.
        indices: [k_i] sorted unique flat positions per weight.
        values: [k_i] fp32 per weight.
        scale: multiplier of the values.
        originals: [] or [k_i] per weight in its dtype, written with the overwritten values.

    Example:
        >>> w = torch.zeros(10, device="cuda")
        >>> old = [torch.empty(2, device="cuda")]
        >>> sparse_delta_apply_([w], [torch.tensor([2, 7], device="cuda")],
        ...                     [torch.ones(2, device="cuda")], 0.5, old)
    """
    check_lengths(len(params), indices=indices, values=values)
    save = bool(originals)
    if save:
        check_lengths(len(params), originals=originals)
    # Every operand before the first write: a bad tensor late in the list changes nothing.
    for i, (p, idx, val) in enumerate(zip(params, indices, values)):
        _check(p, idx, val, "values", torch.float32)
        if save:
            _check(p, idx, originals[i], "originals", p.dtype)
    for i, (p, idx, val) in enumerate(zip(params, indices, values)):
        k = idx.numel()
        if k:
            launchable(_sparse_delta_apply_kernel)[(triton.cdiv(k, BLOCK),)](
                p, idx, val, originals[i] if save else val, float(scale), k, SAVE=save,
                IS_BF16=p.dtype == torch.bfloat16, BLOCK=BLOCK)


def sparse_delta_restore_(params: list[torch.Tensor], indices: list[torch.Tensor],
                          originals: list[torch.Tensor]) -> None:
    """Writes `originals[i]` back at `indices[i]` of each param (the inverse of a saving apply).

    Args:
        params: weights of any shape, contiguous.
        indices: [k_i] flat positions per weight.
        originals: [k_i] per weight, in the weight's dtype.

    Example:
        >>> w = torch.zeros(10, device="cuda")
        >>> idx = torch.tensor([2, 7], device="cuda")
        >>> old = [torch.empty(2, device="cuda")]
        >>> sparse_delta_apply_([w], [idx], [torch.ones(2, device="cuda")], 1.0, old)
        >>> sparse_delta_restore_([w], [idx], old)
    """
    check_lengths(len(params), indices=indices, originals=originals)
    for p, idx, old in zip(params, indices, originals):
        _check(p, idx, old, "originals", p.dtype)
        k = idx.numel()
        if k:
            launchable(_sparse_delta_restore_kernel)[(triton.cdiv(k, BLOCK),)](p, idx, old, k, BLOCK=BLOCK)
