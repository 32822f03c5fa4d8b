"""The sparse delta ops: `merge_sorted_deltas` (k-way merge), `sparse_delta_apply_` (scatter-add
that keeps the overwritten values) and `sparse_delta_restore_` (writes them back)."""

from __future__ import annotations

import functools

import torch

from sift._ops.registry import _no_output, call, define, define_schema, register
from sift.triton_kernels._checks import check_lengths


# ---------------------------------------------------------------------------------------
# merge_sorted_deltas: k-way merge of index-sorted sparse lists, grouped per output tensor.
#   Inputs are flattened over groups: group g owns the next group_sizes[g] entries of
#   `indices` ([k_i] int32/int64, strictly increasing, one dtype per group), `values`
#   ([k_i] fp32) and `weights` (python floats). Output g is the sorted union U_g of its inputs'
#   indices (dtype of the inputs) and fp32 values, reduced in float64 from the contributions
#   c_i = weights[i] * values[i][j] of the inputs holding each index:
#     ties=False:  sum_i c_i
#     ties=True:   s = sign(sum_i c_i); mean of the c_i with sign s (0 where the sum is 0)
#
# sparse_delta_apply_: for each tensor i with flat view w = params[i].view(-1),
#   indices[i] [k_i] sorted unique, values[i] [k_i] fp32:
#     old = w[indices[i]];  originals[i] = old             (when originals is not empty)
#     w[indices[i]] = dtype(fp32(old) + fp32(scale) * values[i])
#   `originals` is [] or one [k_i] tensor per param in its dtype (`originals_like`), written:
#   an out list rather than a returned one, so torch.compile can functionalize the op.
#
# sparse_delta_restore_: w[indices[i]] = originals[i] (originals in the param dtype): the
#   bit-exact inverse of an apply that saved them.
# ---------------------------------------------------------------------------------------


def merge_sorted_deltas_ref(
    indices: list[torch.Tensor],
    values: list[torch.Tensor],
    weights: list[float],
    group_sizes: list[int],
    ties: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain-torch reference of the grouped k-way merge (sort-based; any device)."""
    if len(values) != len(indices) or len(weights) != len(indices):
        raise ValueError("values and weights must have one entry per indices tensor")
    if any(g < 1 for g in group_sizes) or sum(group_sizes) != len(indices):
        raise ValueError("group_sizes must be >= 1 and add up to the number of indices tensors")
    out_idx, out_val = [], []
    start = 0
    for size in group_sizes:
        idx_in = indices[start : start + size]
        val_in = values[start : start + size]
        w_in = weights[start : start + size]
        start += size
        flat_idx = torch.cat([i.long() for i in idx_in])
        contrib = torch.cat([w * v.double() for v, w in zip(val_in, w_in)])
        # Stable sort keeps equal indices in input order, the C++ reduction order.
        sorted_idx, perm = torch.sort(flat_idx, stable=True)
        contrib = contrib[perm]
        union, inverse = torch.unique_consecutive(sorted_idx, return_inverse=True)
        total = torch.zeros(union.numel(), dtype=torch.float64, device=contrib.device).index_add_(0, inverse, contrib)
        if ties:
            elected = torch.sign(total)[inverse]
            agree = (torch.sign(contrib) == elected) & (elected != 0)
            agree_sum = torch.zeros_like(total).index_add_(0, inverse, torch.where(agree, contrib, 0.0))
            count = torch.zeros_like(total).index_add_(0, inverse, agree.double())
            total = torch.where(count > 0, agree_sum / count.clamp_min(1), 0.0)
        # unique_consecutive's output keeps a storage sized for its input: copy to the union's size.
        out_idx.append(union.to(idx_in[0].dtype, copy=True))
        out_val.append(total.float())
    return out_idx, out_val


def sparse_delta_apply_ref(
    params: list[torch.Tensor],
    indices: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
    originals: list[torch.Tensor],
) -> None:
    """Plain-torch reference of the scatter-add apply with the fused gather of originals."""
    check_lengths(len(params), indices=indices, values=values)
    if originals:
        check_lengths(len(params), originals=originals)
    for i, (p, idx, val) in enumerate(zip(params, indices, values)):
        flat = p.view(-1)
        idx = idx.long()
        old = flat[idx]
        if originals:
            originals[i].copy_(old)
        flat[idx] = (old.float() + scale * val.float()).to(p.dtype)


def originals_like(params: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """The `originals` out list of `sparse_delta_apply_`: an empty [k_i] tensor per param, in its dtype."""
    return [torch.empty(idx.shape, dtype=p.dtype, device=p.device) for p, idx in zip(params, indices)]


def sparse_delta_restore_ref(params: list[torch.Tensor], indices: list[torch.Tensor],
                             originals: list[torch.Tensor]) -> None:
    """Plain-torch reference of the restore: writes the saved originals back."""
    check_lengths(len(params), indices=indices, originals=originals)
    for p, idx, old in zip(params, indices, originals):
        p.view(-1)[idx.long()] = old


def _merge_sorted_deltas_fake(indices, values, weights, group_sizes, ties):
    # The merged length depends on how many indices coincide: a data-dependent size.
    ctx = torch.library.get_ctx()
    out_idx, out_val, start = [], [], 0
    for size in group_sizes:
        n = ctx.new_dynamic_size()
        out_idx.append(indices[start].new_empty((n,)))
        out_val.append(values[start].new_empty((n,)))
        start += size
    return out_idx, out_val


define("merge_sorted_deltas", merge_sorted_deltas_ref)
define("sparse_delta_apply_", sparse_delta_apply_ref)
define("sparse_delta_restore_", sparse_delta_restore_ref)


@register("merge_sorted_deltas", "cpp")
def _merge_sorted_deltas_cpp(indices, values, weights, group_sizes, ties):
    # The C++ merge wants one index dtype per group and contiguous fp32 values; widen here so
    # the kernel stays one template instance per dtype.
    indices, values = list(indices), list(values)
    start = 0
    for size in group_sizes:
        group = range(start, start + size)
        wide = any(indices[i].dtype == torch.int64 for i in group)
        for i in group:
            indices[i] = indices[i].to(torch.int64 if wide else torch.int32).contiguous()
            values[i] = values[i].to(torch.float32).contiguous()
        start += size
    out_idx, out_val = torch.ops.sift.merge_sorted_deltas(indices, values, [float(w) for w in weights],
                                                          list(group_sizes), bool(ties))
    return list(out_idx), list(out_val)


@register("sparse_delta_apply_", "cpp")
def _sparse_delta_apply_cpp(params, indices, values, scale, originals):
    torch.ops.sift.sparse_delta_apply_(params, indices, values, float(scale), originals)


@register("sparse_delta_restore_", "cpp")
def _sparse_delta_restore_cpp(params, indices, originals):
    torch.ops.sift.sparse_delta_restore_(params, indices, originals)


@register("sparse_delta_apply_", "triton")
def _sparse_delta_apply_triton(params, indices, values, scale, originals):
    from sift.triton_kernels.delta import sparse_delta_apply_

    sparse_delta_apply_(params, indices, values, scale, originals)


@register("sparse_delta_restore_", "triton")
def _sparse_delta_restore_triton(params, indices, originals):
    from sift.triton_kernels.delta import sparse_delta_restore_

    sparse_delta_restore_(params, indices, originals)


define_schema("merge_sorted_deltas", "merge_sorted_deltas(Tensor[] indices, Tensor[] values, float[] weights, "
              "int[] group_sizes, bool ties) -> (Tensor[], Tensor[])",
              _merge_sorted_deltas_fake, functools.partial(call, "merge_sorted_deltas"))
define_schema("sparse_delta_apply_", "sparse_delta_apply_(Tensor(a!)[] params, Tensor[] indices, Tensor[] values, "
              "float scale, Tensor(b!)[] originals) -> ()", _no_output, functools.partial(call, "sparse_delta_apply_"),
              traced=_sparse_delta_apply_triton)
define_schema("sparse_delta_restore_", "sparse_delta_restore_(Tensor(a!)[] params, Tensor[] indices, "
              "Tensor[] originals) -> ()", _no_output, functools.partial(call, "sparse_delta_restore_"),
              traced=_sparse_delta_restore_triton)
