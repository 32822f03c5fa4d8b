"""The `sparse_adamw_lean_` op: the SparseAdamW step on the lean state, the state's index
encoding (16-bit halves under a window table), the residual unit and the stochastic rounding."""

from __future__ import annotations

from typing import Any

import torch

# The index encoding lives a floor down, where the loader's SIMD timing (sift/_simd.py) reaches it too.
from sift._index import LEAN_WINDOW, LEAN_WINDOW_BITS, encode_lean_indices, lean_num_windows  # noqa: F401
from sift._ops.step import _bias_corrections, _define_step, _step_grad
from sift.triton_kernels._step_args import AdamWHyper, LeanState, check_step, takes_step_lists


# ---------------------------------------------------------------------------------------
# sparse_adamw_lean_: the SparseAdamW step on the lean state (SparseAdamW(state="lean")),
# at most 8 bytes per trainable entry.
#
# Layout of tensor i (numel n_i, k_i chosen entries at sorted flat positions idx):
#   window_offsets[i]  [ceil(n_i / 65536) + 1] int32, CSR over 65536-element windows of the
#                      flat weight: window w holds entries off[w] .. off[w+1]-1; off[0] = 0,
#                      off[-1] = k_i
#   indices_low[i]     [k_i] int16, idx & 0xFFFF (read as uint16): idx = w * 65536 + uint16(low)
#   exp_avgs[i], exp_avg_sqs[i]  [k_i] bf16, read as fp32, stored by stochastic rounding
#   residuals[i]       [k_i] int8, bf16/fp16 weights only (empty list for fp32): the exact
#                      weight is fp32(w) + residual * unit(w), unit(w) = ulp(w) / 256
#   steps[i]           0-d fp32, already incremented
# The step (fp32 math, the order of sparse_adamw_ref):
#   g   = grads[i] (compact, [k_i] fp32) | grads[i].view(-1)[idx] (dense);  g = -g if maximize
#   m   = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g * g
#   w   = fp32(p[idx]) (+ residual * unit(p[idx]) for bf16/fp16)
#   upd = -lr * wd * w - lr / bc1 * m / (sqrt(v) * (1 / sqrt(bc2)) + eps)
#         (lr rounded to fp32; lr / bc1 and 1 / sqrt(bc2) in fp64, then fp32; each fp32 operation
#         rounded, no fused multiply-add)
#   new = w + upd;  p[idx] = round_to_nearest(new)
#   residual = clamp(rint((new - fp32(p[idx])) / unit(p[idx])), -128, 127), 0 where p[idx] is inf/NaN
#   m, v -> bf16 by stochastic rounding: fp32 bits + r >> 16, r 16 random bits (m the low half
#           of lean_random_bits(idx, t), v the high half); NaN stores the quiet NaN 0x7FC0
# unit(w): bf16 2^(max(E, 16) - 142), fp16 2^(max(E, 1) - 33), E the stored exponent field.
# For normal weights that is ulp / 256 (bf16 ulp 2^(e-7), fp16 2^(e-10)); fp16 subnormals
# and zero get the subnormal spacing's; bf16 weights below 2^-111 in magnitude get 2^-126
# (coarser than ulp / 256 there, so no fp32 subnormal is ever formed). new - fp32(p[idx]) and
# the products by powers of two are exact in fp32, so the residual is the same on every backend.
# Why stochastic rounding: bf16 moments rounded to nearest stall once an update is below half
# a bf16 ulp of the moment; with beta2 = 0.999 the second moment ends at 0.28x (constant
# gradients) or 1.33x (Gaussian) of fp32's (figures: bench/results/README.md). Random bits
# from a hash of (flat index, step) make the rounding unbiased and the same on every backend,
# so a reloaded state continues identically.
# ---------------------------------------------------------------------------------------

def checked_lean_indices(indices_low: Any, window_offsets: Any, numel: int, what: str,
                         names: tuple[str, str] = ("indices_low", "window_offsets"),
                         allow_empty: bool = False) -> torch.Tensor:
    """Validate a saved lean index pair for a weight of `numel` elements; its decoded positions.

    Raises:
        ValueError: naming `what` and the offending tensor (`names`): wrong dtype or shape, offsets
            that do not rise from 0 to k, or decoded positions unsorted or out of range.
    """
    from sift._index import check_indices

    low_name, offsets_name = names
    windows = lean_num_windows(numel)
    if not isinstance(indices_low, torch.Tensor) or indices_low.dtype != torch.int16 or indices_low.dim() != 1:
        raise ValueError(f"{what}: {low_name} must be a 1-D int16 tensor")
    if (not isinstance(window_offsets, torch.Tensor) or window_offsets.dtype != torch.int32
            or window_offsets.shape != (windows + 1,)):
        raise ValueError(f"{what}: {offsets_name} must be int32 of shape ({windows + 1},) for a param of "
                         f"{numel} elements")
    k = indices_low.numel()
    if int(window_offsets[0]) != 0 or int(window_offsets[-1]) != k or bool((window_offsets.diff() < 0).any()):
        raise ValueError(f"{what}: {offsets_name} must rise from 0 to k = {k}")
    decoded = decode_lean_indices(indices_low.cpu(), window_offsets.cpu())
    check_indices(decoded, numel, f"{what}: decoded {low_name}", allow_empty=allow_empty)
    return decoded


def decode_lean_indices(indices_low: torch.Tensor, window_offsets: torch.Tensor,
                        dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """(indices_low, window_offsets) -> [k] sorted flat positions in `dtype`.

    Example:
        >>> decode_lean_indices(torch.tensor([3, 1], dtype=torch.int16), torch.tensor([0, 1, 2], dtype=torch.int32))
        tensor([    3, 65537])
    """
    counts = window_offsets.diff().long()
    windows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                      output_size=indices_low.numel())
    return ((windows << LEAN_WINDOW_BITS) | (indices_low.long() & 0xFFFF)).to(dtype)


def lean_unit(w: torch.Tensor) -> torch.Tensor:
    """unit(w) of the contract above: the residual's step for bf16/fp16 weights `w` (fp32, exact)."""
    bits = w.view(torch.int16).int() & 0xFFFF
    if w.dtype == torch.bfloat16:
        exponent = ((bits >> 7) & 0xFF).clamp_min(16) - 142
    else:
        exponent = ((bits >> 10) & 0x1F).clamp_min(1) - 33
    return ((exponent + 127) << 23).view(torch.float32)


def _lean_inv_unit(w: torch.Tensor) -> torch.Tensor:
    """1 / unit(w), a power of two in fp32's normal range."""
    bits = w.view(torch.int16).int() & 0xFFFF
    if w.dtype == torch.bfloat16:
        exponent = 142 - ((bits >> 7) & 0xFF).clamp_min(16)
    else:
        exponent = 33 - ((bits >> 10) & 0x1F).clamp_min(1)
    return ((exponent + 127) << 23).view(torch.float32)


_U32 = 0xFFFFFFFF


def lean_random_bits(idx: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """32 random bits per entry (int64 holding a uint32) from a hash of (flat index, step).

    The low 32 bits of the index and the integer step are mixed, then finalised with
    MurmurHash3's fmix32; all arithmetic is modulo 2^32, as uint32 in the kernels.
    """
    x = ((idx.long() & _U32) * 0x9E3779B1 + (step.long() & _U32) * 0x632BE5AB) & _U32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _U32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _U32
    return x ^ (x >> 16)


def lean_round_bf16(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 `x` -> bf16 by stochastic rounding with 16 random bits per entry (int64 in [0, 65536))."""
    bits = x.view(torch.int32).long() & _U32
    out = ((bits + random16) & _U32) >> 16
    out = torch.where(torch.isnan(x), 0x7FC0, out)
    return (((out ^ 0x8000) - 0x8000).to(torch.int16)).view(torch.bfloat16)


@takes_step_lists(LeanState)
def sparse_adamw_lean_ref(state: LeanState, hyper: AdamWHyper, *, table_cache: dict | None = None) -> None:
    """Plain-torch reference of one SparseAdamW step on the lean state (see the contract above).

    Takes `(state, hyper)` through `.structured`, or the eight lists of `LeanState` and the
    keywords of `AdamWHyper` plus `compact_grads`. `table_cache` is accepted and unused.
    """
    check_step(state, hyper)
    beta1, beta2 = hyper.beta1, hyper.beta2
    for i, p in enumerate(state.params):
        flat = p.view(-1)
        idx = decode_lean_indices(state.indices_low[i], state.window_offsets[i])
        g = _step_grad(state, hyper, i, idx)
        # Separate roundings, no fused multiply-add (torch's add_ with alpha fuses), as the
        # kernels round each product before adding it (`triton_kernels._rounding.mul_rn`).
        m = state.exp_avgs[i].float() * beta1 + g * (1 - beta1)
        v = state.exp_avg_sqs[i].float() * beta2 + g * (1 - beta2) * g
        bc1, bc2 = _bias_corrections(hyper, state.steps[i])
        # lr is taken in fp32 (as a device tensor lr is), then lr / bc1 in fp64.
        lr32 = hyper.lr.float() if hyper.lr_on_device else torch.tensor(float(hyper.lr), dtype=torch.float32)
        step_size = (lr32.double() / bc1).float().to(p.device)
        inv_bc2_sqrt = (1 / bc2.sqrt()).float().to(p.device)
        lr32 = lr32.to(p.device)
        stored = flat[idx]
        w = stored.float()
        residual = state.residuals[i] if state.residuals else None
        if residual is not None:
            w = w + residual.float() * lean_unit(stored)
        # torch's fp32 sqrt on CPU is not always correctly rounded; through fp64 it is.
        sqrt_v = v.double().sqrt().float()
        upd = -lr32 * hyper.weight_decay * w - step_size * m / (sqrt_v * inv_bc2_sqrt + hyper.eps)
        new = w + upd
        rounded = new.to(p.dtype)
        flat[idx] = rounded
        if residual is not None:
            r = torch.round((new - rounded.float()) * _lean_inv_unit(rounded)).clamp_(-128, 127)
            residual.copy_(torch.where(torch.isfinite(rounded), r, 0.0).to(torch.int8))
        bits = lean_random_bits(idx, state.steps[i])
        state.exp_avgs[i].copy_(lean_round_bf16(m, bits & 0xFFFF))
        state.exp_avg_sqs[i].copy_(lean_round_bf16(v, bits >> 16))


_define_step("sparse_adamw_lean_", sparse_adamw_lean_ref,
             "Tensor(a!)[] params, Tensor[] grads, Tensor[] indices_low, Tensor[] window_offsets, "
             "Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] residuals, Tensor[] steps", LeanState)
