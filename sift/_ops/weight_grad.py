"""The `sparse_weight_grad` op: a linear layer's weight gradient at its chosen entries only,
its argument checks, reference and the checked entry `sparse_weight_grad`; and
`sparse_weight_grad_routed_`, the sparse backward's call of it as one opaque node."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from sift._ops.registry import _no_output, call, define, define_ordered, define_schema, register


# ---------------------------------------------------------------------------------------
# sparse_weight_grad: the weight gradient of a linear layer at its chosen entries only (a
# sampled dense-dense product), so the sparse backward never forms the dense [R, C] gradient.
#
# For y = x W^T + b with W [R, C] (R = out_features, C = in_features) and the tokens flattened
# to T rows: grad_output dY [T, R], input X [T, C] (one dtype: fp32, bf16 or fp16; leading
# dims, equal in both, are flattened into T), indices [k] int32/int64 strictly increasing in
# [0, R * C):
#   g[j] = sum_t dY[t, idx[j] // C] * X[t, idx[j] % C]        fp32 accumulation, g [k] fp32
# i.e. (dY^T X).view(-1)[indices]. With `out` ([k] fp32, contiguous) g is added into it (the
# optimizer's compact gradient buffer) and `out` is returned.
# transformers' Conv1D stores W as [C, R] (y = x W + b): its flat index is (in-row, out-col),
# so callers swap the operands: sparse_weight_grad(X, dY, indices).
#   "torch"  chunks of entries: gather, fp32 product, sum over tokens (<= ~64 MB temporaries)
#   "cpp"    csrc/sparse_weight_grad.cpp: token-blocked fp32 transposes, SIMD dot products
#   "triton" triton_kernels/sparse_weight_grad.py: BLOCK_K entries per program, T in tiles
# Every backend starts with check_sparse_weight_grad_args, so bad arguments raise the same
# ValueError on each.
# ---------------------------------------------------------------------------------------

SPARSE_WEIGHT_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Temporaries of the reference per chunk of entries: three [T, chunk] tensors of <= 4 bytes.
_SPARSE_WEIGHT_GRAD_REF_BYTES = 64 << 20


def check_sparse_weight_grad_args(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate sparse_weight_grad's arguments; flatten the token dims.

    Returns:
        `(dY [T, R], X [T, C])`, 2-D views (or copies) of grad_output and input.

    Raises:
        ValueError: naming the bad argument (shape, dtype, device, unsorted, repeated or
            out-of-range indices, or an `out` that is not a contiguous fp32 [k] tensor).
    """
    for name, t in (("grad_output", grad_output), ("input", input), ("indices", indices)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if grad_output.dim() < 1 or input.dim() < 1:
        raise ValueError("grad_output and input must have at least one dim (features last)")
    if grad_output.shape[:-1] != input.shape[:-1]:
        raise ValueError(f"grad_output and input must have the same token dims, got grad_output "
                         f"{tuple(grad_output.shape)} and input {tuple(input.shape)}")
    if grad_output.dtype not in SPARSE_WEIGHT_GRAD_DTYPES:
        raise ValueError(f"grad_output must be float32, bfloat16 or float16, got {grad_output.dtype}")
    if input.dtype != grad_output.dtype:
        raise ValueError(f"input must have grad_output's dtype {grad_output.dtype}, got {input.dtype}")
    device = grad_output.device
    if input.device != device:
        raise ValueError(f"input must be on grad_output's device {device}, got {input.device}")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be a 1-D int32 or int64 tensor, got {indices.dtype} {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"indices must be on grad_output's device {device}, got {indices.device}")
    k, limit = indices.numel(), grad_output.shape[-1] * input.shape[-1]
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.shape != (k,)
                            or not out.is_contiguous() or out.device != device):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous float32 [{k}] tensor on {device} (k = indices.numel()), got {got}")
    if k and check_values:
        # One host sync for the three facts; the position is looked up only on failure. Callers
        # whose indices are already validated (the optimizer's) skip it: no sync per layer.
        descending = indices[1:] <= indices[:-1]
        flags = torch.stack([descending.any(), indices[0] < 0, indices[-1].long() >= limit]).tolist()
        if flags[0]:
            j = int(descending.nonzero()[0, 0]) + 1
            raise ValueError(f"indices must be strictly increasing: {int(indices[j])} at position {j} is not above "
                             f"{int(indices[j - 1])}")
        if flags[1] or flags[2]:
            j = 0 if flags[1] else k - 1
            raise ValueError(f"indices has {int(indices[j])} at position {j}, outside [0, {limit}) (R * C)")
    return grad_output.reshape(-1, grad_output.shape[-1]), input.reshape(-1, input.shape[-1])


def sparse_weight_grad_ref(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Plain-torch reference of the sampled product (see the contract above); fp32 math."""
    dy, x = check_sparse_weight_grad_args(grad_output, input, indices, out, check_values)
    (t, c), k = x.shape, indices.numel()
    if out is None:
        out = torch.zeros(k, dtype=torch.float32, device=dy.device)
    idx = indices.long()
    chunk = max(1, _SPARSE_WEIGHT_GRAD_REF_BYTES // (12 * max(t, 1)))
    for s in range(0, k, chunk):
        rows, cols = idx[s : s + chunk].div(c, rounding_mode="floor"), idx[s : s + chunk].remainder(c)
        prod = dy[:, rows].float().mul_(x[:, cols])
        out[s : s + chunk] += prod.sum(0)
    return out


define("sparse_weight_grad", sparse_weight_grad_ref)


@register("sparse_weight_grad", "cpp")
def _sparse_weight_grad_cpp(grad_output, input, indices, out=None, check_values=True):
    dy, x = check_sparse_weight_grad_args(grad_output, input, indices, out, check_values)
    # The kernel reads rows with unit stride; any row stride is fine.
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.zeros(indices.numel(), dtype=torch.float32, device=dy.device)
    torch.ops.sift.sparse_weight_grad_(dy, x, indices.contiguous(), out)
    return out


@register("sparse_weight_grad", "triton")
def _sparse_weight_grad_triton(grad_output, input, indices, out=None, check_values=True):
    from sift.triton_kernels.sparse_weight_grad import sparse_weight_grad as launch

    dy, x = check_sparse_weight_grad_args(grad_output, input, indices, out, check_values)
    return launch(dy, x, indices, out)


def _sparse_weight_grad_traced(dy, x, indices, out, isa="auto", token_block=0) -> None:
    # Index values are not read in a trace (a host sync in the graph); the eager op checks them.
    _sparse_weight_grad_triton(dy, x, indices, out, check_values=False)


# The raw kernel op: 2-D operands, `out` given (sparse_weight_grad below is the checked entry).
define_schema("sparse_weight_grad_", 'sparse_weight_grad_(Tensor grad_output, Tensor input, Tensor indices, '
              'Tensor(a!) out, str isa="auto", int token_block=0) -> ()', _no_output,
              lambda dy, x, indices, out, isa="auto", token_block=0: call("sparse_weight_grad", dy, x, indices, out),
              traced=_sparse_weight_grad_traced, registry="sparse_weight_grad")


def sparse_weight_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """The weight gradient dY^T X of a linear layer at its chosen flat entries only.

    `g[j] = sum_t grad_output[t, row_j] * input[t, col_j]` with `row_j = indices[j] // C`,
    `col_j = indices[j] % C`, summed in fp32 without forming the dense [R, C] product.

    Args:
        grad_output: dY `[..., R]` (R = out_features), fp32, bf16 or fp16.
        input: X `[..., C]` (C = in_features), grad_output's dtype, device and token dims.
        indices: `[k]` int32/int64 flat positions into W `[R, C]`, strictly increasing.
        out: optional `[k]` fp32 contiguous; the result is added into it and it is returned.
        backend: force "torch", "cpp" or "triton" (default: the automatic choice).

    Returns:
        `[k]` fp32: the gradient at `indices` (plus `out`'s previous values when given).

    Raises:
        ValueError: a bad argument, named (see `check_sparse_weight_grad_args`).

    Example:
        >>> layer = torch.nn.Linear(5, 3)
        >>> x, dy = torch.randn(4, 5), torch.randn(4, 3)
        >>> idx = torch.tensor([0, 7, 14])
        >>> torch.allclose(sparse_weight_grad(dy, x, idx), (dy.T @ x).view(-1)[idx], atol=1e-5)
        True

        transformers' Conv1D keeps W as `[in, out]` (y = x W + b), so its flat index is
        `in * out_features + out`: pass the operands swapped.

        >>> w_conv1d_grad = x.T @ dy  # [5, 3], the dense gradient of a Conv1D(3, 5) weight
        >>> torch.allclose(sparse_weight_grad(x, dy, idx), w_conv1d_grad.view(-1)[idx], atol=1e-5)
        True
    """
    return call("sparse_weight_grad", grad_output, input, indices, out, backend=backend)


# ---------------------------------------------------------------------------------------
# sparse_weight_grad_routed_(grad_output, input, route): the sparse backward's weight-gradient
# part, one opaque node with an ordered effect. Where the [k] values go (the optimizer's compact
# buffer, zeroed by a step's first call; an open buffer under update_in_backward; an FSDP2
# reduce-scatter) and the optimizer's bookkeeping are Python state the route object handles when
# the op runs: inside a torch.compile graph that state would break the graph or go stale in it.
# The route registers itself (`register_weight_grad_route`) and is held weakly: its layer owns it.
# ---------------------------------------------------------------------------------------

_ROUTES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_route_ids = itertools.count()


def register_weight_grad_route(route: Any) -> int:
    """Give `route` (with a method `add_weight_grad(grad_output [T, R], input [T, C])`) its id for
    `torch.ops.sift.sparse_weight_grad_routed_`."""
    route_id = next(_route_ids)
    _ROUTES[route_id] = route
    return route_id


def _sparse_weight_grad_routed(grad_output: torch.Tensor, input: torch.Tensor, route: int) -> None:
    target = _ROUTES.get(route)
    if target is None:
        raise RuntimeError(f"sparse_weight_grad_routed_: no live route {route} (its layer's sparse backward was removed)")
    target.add_weight_grad(grad_output, input)


define_ordered("sparse_weight_grad_routed_",
               "sparse_weight_grad_routed_(Tensor grad_output, Tensor input, int route) -> ()",
               _sparse_weight_grad_routed)
