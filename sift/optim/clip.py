"""Gradient clipping for `SparseAdamW`: `clip_grad_norm_` over what the next step reads, and the
per-tensor clip of `update_in_backward` (where no global norm exists)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sift.optim.state import SparseOptimizer, is_dtensor, is_selected, local_tensor, uses_grad

if TYPE_CHECKING:
    from sift.optim.core import SparseAdamW


def clip_each_(tensors: Sequence[torch.Tensor], max_norm: float) -> None:
    """Scale each tensor on its own to 2-norm at most `max_norm` (norms in fp32, no host sync).

    Args:
        tensors: gradients of any shapes and floating dtypes, scaled in place.
        max_norm: the largest norm each may keep (> 0).

    Example:
        >>> g = torch.full((4,), 2.0)
        >>> clip_each_([g], max_norm=1.0)
        >>> round(float(g.norm()), 4)
        1.0
    """
    for g in tensors:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(g.dtype))


@torch.no_grad()
def clip_grad_norm_(optimizer: SparseAdamW, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients `optimizer` will apply, by their global norm.

    The norm is taken over what the next `step()` uses: the chosen entries of each sparse
    weight (its compact buffer in `compact_grads` mode, `grad[indices]` otherwise) and the
    full gradients of dense groups, so both modes clip identically. Call it between
    `backward()` and `step()`. On a selecting step it works out the entries the step will
    choose without committing them (GradScaler may still skip that step). In plain mode the
    chosen entries are gathered once into [k] fp32 buffers that are scaled and that the step
    then reads: the dense gradient is neither written nor read again.

    Args:
        optimizer: the SparseAdamW whose gradients to clip.
        max_norm: the largest allowed global norm (> 0).
        norm_type: p of the p-norm (`inf` allowed).

    Returns:
        The global norm before clipping (0-d fp32 tensor).

    Example:
        >>> from sift import SparseAdamW
        >>> model = torch.nn.Linear(8, 8)
        >>> opt = SparseAdamW(model.parameters(), density=0.25)
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> norm = clip_grad_norm_(opt, max_norm=1.0)
    """
    # Checked by its protocol: core, which defines SparseAdamW, imports this module.
    if not isinstance(optimizer, SparseOptimizer):
        raise TypeError(f"optimizer must be a sift.SparseAdamW, got {type(optimizer).__name__}")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")
    # memory="lowest" before its first selection: nothing was stepped in backward yet, so the preset's update
    # in backward gives way to the global norm, as it does to accumulation and GradScaler.
    optimizer.memory.settle(global_clip=True)
    # Under DDP the first step adopts the default group for the sparse weights DDP leaves out: a clip before it
    # must average with it too, or each rank would clip by its own local norm.
    optimizer.grads.check_data_parallel()
    if optimizer.settings.compact_grads and optimizer.amp.loss_scaled and optimizer.amp.scaler is None and \
            optimizer.grads.ready:
        # The compact buffers hold the scaled loss's gradients, and only the scaler knows its scale: clipping them
        # as they are would clip by a norm `scale` times too large (a resumed optimizer has lost the link).
        raise RuntimeError("clip_grad_norm_: this optimizer's compact gradients are scaled by a GradScaler it is not "
                           "linked to (an optimizer loaded from a state_dict does not know it): set "
                           "`optimizer.grad_scaler = scaler` (or pass grad_scaler= to SparseAdamW.for_model)")
    if optimizer.memory.update_in_backward:
        raise RuntimeError("clip_grad_norm_ cannot clip an optimizer with update_in_backward=True: its sparse "
                           "gradients were applied and freed during backward; pass max_grad_norm to the optimizer "
                           "(it clips each tensor on its own)")
    # Nothing here commits a selection: GradScaler may still skip the step this clip precedes.
    optimizer.grads.hook_new_params()
    optimizer.grads.sync_grads()
    optimizer.selector.average_pending()
    optimizer.reselector.plan_all()  # FSDP2 weights re-selecting this step plan across the shards at once
    inv_scale = optimizer.amp.scaler_inverse_scale()
    if inv_scale is not None:
        # `scaler.unscale_` could not see the compact buffers: unscale them here, once.
        optimizer.amp.unscale_compact(inv_scale)
    mesh_group = None
    used: list[torch.Tensor] = []  # what the step reads, scaled in place below
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_dtensor(p):
                mesh_group = p.device_mesh.get_group()
            if not p.requires_grad:  # the step skips it
                continue
            if group["density"] >= 1.0:
                if uses_grad(p):
                    used.append(local_tensor(p.grad))
                continue
            state = optimizer.state.get(p, {})
            if optimizer.reselector.is_due(p):
                # This step re-selects p's entries from its dense gradient: clip what it will read from the new ones.
                if uses_grad(p):
                    used.append(optimizer.selector.gathered_grad(p, optimizer.reselector.plan(group, p)))
                continue
            if optimizer.settings.compact_grads and is_selected(state):
                if p in optimizer.grads.ready:
                    used.append(optimizer.grads.compact[p])
                continue
            if not uses_grad(p):
                continue
            if is_selected(state):
                indices = optimizer.indices_of(p)
            elif local_tensor(p).numel() > 0 and optimizer.selector.is_final_selection(p):
                # This step will choose its entries: clip what it will read from them.
                indices = optimizer.selector.tentative_indices(group, p)
                if indices is None:
                    continue  # its score ranks nothing: it stays pending, the step updates nothing
            else:
                continue  # an earlier selection step: the step updates nothing
            # The entries the step uses, gathered once in fp32: the step then reads these
            # instead of the dense gradient, which is neither read again nor written.
            used.append(optimizer.selector.gathered_grad(p, indices))
    if not used and mesh_group is None:
        return torch.zeros(())
    device = used[0].device if used else torch.device("cpu")
    # One multi-tensor norm per (device, dtype) instead of a kernel per tensor: clipping runs
    # every step over every weight. Accumulated and returned in fp32 whatever the grad dtype.
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in used:
        by_kind[(g.device, g.dtype)].append(g)
    norms = [torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32)).to(device)
             for gs in by_kind.values()]
    stacked = torch.cat(norms) if norms else torch.zeros(1, device=device)
    if mesh_group is None:
        total = torch.linalg.vector_norm(stacked, norm_type)
    else:
        # FSDP2: each rank holds a shard; combine the shard norms into the global norm.
        import torch.distributed as dist

        if math.isinf(norm_type):
            total = stacked.max()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mesh_group)
        else:
            total = stacked.pow(norm_type).sum()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh_group)
            total = total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # The coefficient stays a device tensor (no host sync): one multi-tensor multiply per (device, dtype).
    to_scale: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in used:
        to_scale[(g.device, g.dtype)].append(g)
    for (dev, dtype), gs in to_scale.items():
        torch._foreach_mul_(gs, coef.to(device=dev, dtype=dtype))
    return total
