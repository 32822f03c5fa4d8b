"""`SparseAdamW` on FSDP2 (`torch.distributed.fsdp.fully_shard`) params: where each rank's shard
sits in its weight, the update-in-backward hook of sharded params, the modes that are refused,
gathering a delta's entries across ranks, and a DCP-checkpointable optimizer state.

FSDP2 keeps each param as a DTensor sharded on dim 0 (`torch.chunk` rows) over a 1-D mesh. The
optimizer works on each rank's local shard: by default it selects the whole weight's top
`ceil(density * numel)` of the reduce-scattered gradient, as one process would (a threshold search
across the ranks, `sift.optim.selection.sharded_top_k`), each rank keeping its shard's part, of any
size (0 included); with `sharded_selection="per_shard"` the top `ceil(density * shard numel)` of
each shard (no communication; one process selecting per block of rows). The state holds positions
within the shard. FSDP2 reduce-scatters the gradient and then runs the sharded
param's post-accumulate-grad hooks (`foreach_reduce` in torch's `_fsdp_collectives.py`), so the
compact mode's gather, and the update in backward, run there on the averaged shard gradient.

The sparse backward runs on the unsharded weight FSDP2 all-gathers for the forward: each rank computes
the gradient at every rank's chosen entries from its own data, and one reduce-scatter of those [K]
values (K = the ranks' k summed) gives each rank its own k, averaged; FSDP2 sees no gradient for the
weight and reduce-scatters nothing dense for it (`ShardedSparseGrad`).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from sift._index import index_dtype as _index_dtype
from sift._params import (full_tensor, gather_entries, is_dtensor, is_selected, local_shard_of,  # noqa: F401
                          is_row_sharded, local_tensor, quantized_routes, shard_group, shard_offset)
from sift.sparse_backward import check_sparse_backward  # noqa: F401  (its former home)


if TYPE_CHECKING:
    from sift.optim.core import SparseAdamW


def check_sharded_param(optimizer: SparseAdamW, p: torch.Tensor, label: str, sparse: bool) -> None:
    """Refuse a DTensor param this optimizer cannot train (called while adding its group, before any change)."""
    if optimizer.grads.process_group is not None:
        raise ValueError(f"process_group averages whole gradients across ranks, and {label} is an FSDP2 shard whose "
                         "gradient FSDP2 already reduce-scatters (each rank's shard differs): leave process_group unset")
    if not sparse:
        return
    if optimizer.settings.sharded_selection == "global" and not is_row_sharded(p):
        raise ValueError(f"{label} is a DTensor with placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D "
                         "mesh: the global selection supports FSDP2's default sharding, Shard(0) over a 1-D mesh; "
                         "pass sharded_selection='per_shard' to select within each shard")
    if optimizer.settings.compact_grads and not is_row_sharded(p):
        raise ValueError(f"{label} is a DTensor with placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D "
                         "mesh: compact_grads mode supports FSDP2's default sharding, Shard(0) over a 1-D mesh")
    if optimizer.memory.update_in_backward and optimizer.settings.max_grad_norm is not None:
        raise ValueError("max_grad_norm with update_in_backward=True clips each tensor by its own norm, and an FSDP2 "
                         f"shard ({label}) holds part of a tensor: clip with update_in_backward=False (which takes "
                         "the global norm across shards), or leave max_grad_norm unset")


@torch.no_grad()
def sharded_update_hook(optimizer: SparseAdamW, p: torch.Tensor) -> None:
    """update_in_backward on an FSDP2 param: its shard gradient was just reduce-scattered (every use of the
    weight in this backward is in it); step the shard's chosen entries and free the gradient.

    FSDP2's sharded params are not in the autograd graph (the forward uses the unsharded ones), so the
    AccumulateGrad pre-hook of unsharded training never runs for them; FSDP2 runs this hook instead.
    Before selection the shard gradient stays, and `step()` selects from it and applies the first update.
    """
    grad = p.grad
    if grad is None:
        return
    selected = optimizer.grads.gathers_entries(p)  # not while its next step re-selects it
    optimizer.grads.mark_backward(p, selected)
    if not selected or not p.requires_grad:
        return
    optimizer.grads.update_now(p, optimizer.grads.gather_scratch(p, grad))
    p.grad = None


class ShardedSparseGrad:
    """The sparse backward of one FSDP2-sharded linear weight: every rank's chosen entries, as positions of
    the unsharded weight the layer's forward used, and the reduction of their gradients to their owners.

    In backward each rank computes the gradient of all ranks' entries ([K] = sum of the ranks' k) from its
    own data; one reduce-scatter (padded to the largest k) sums them across ranks and hands each rank its
    own k values, averaged over the ranks as FSDP2 averages dense gradients, into the optimizer's compact
    buffer. FSDP2 sees no gradient for the weight and reduce-scatters nothing for it.

    The plan (everyone's entries) is built collectively: after a `step()` in which any rank's entries
    changed (the selection) and after `load_state_dict`; until then the layer returns the dense gradient
    on every rank, so the ranks never disagree on which path a weight takes.
    """

    def __init__(self, optimizer: SparseAdamW, weight: torch.Tensor):
        self.optimizer = optimizer
        self.weight = weight
        self.group = shard_group(weight)
        self.offset = shard_offset(weight)
        self.plan: dict[str, Any] | None = None

    def _local_indices(self) -> torch.Tensor | None:
        """The tensor holding this rank's chosen entries (the plan's source), or None before selection."""
        state = self.optimizer.state.get(self.weight, {})
        return state.get("indices", state.get("indices_low"))

    def stale(self) -> bool:
        source = self._local_indices()
        return source is not None and (self.plan is None or self.plan["source"] is not source)

    def refresh(self) -> None:
        """Gather every rank's entries (collective over the weight's mesh)."""
        import torch.distributed as dist

        source = self._local_indices()
        mine = (self.optimizer.indices_of(self.weight).long().cpu() + self.offset) if source is not None else \
            torch.zeros(0, dtype=torch.long)
        parts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, (source is not None, mine), group=self.group)
        if not any(chosen for chosen, _ in parts):
            # No rank has chosen yet (a resume before selection): no plan, so the backward forms the dense gradient
            # the selection reads. An empty plan would gather nothing, and the weight would stay pending for good.
            self.plan = None
            return
        parts = [part for _, part in parts]
        counts = [part.numel() for part in parts]
        width = max(counts)
        device = local_tensor(self.weight).device
        padded = torch.cat([r * width + torch.arange(c) for r, c in enumerate(counts)])
        self.plan = {"source": source, "indices": torch.cat(parts).to(device, _index_dtype(self.weight.numel())),
                     "padded": padded.to(device), "width": width,
                     "count": counts[dist.get_rank(self.group)]}

    def target(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([K] positions of the unsharded weight, a zeroed [K] fp32 buffer) for this backward, or None
        while there is no plan (the layer returns the dense gradient)."""
        if self.plan is None:
            return None
        if self.stale():
            raise RuntimeError("this rank's chosen entries of an FSDP2 weight changed since the sparse backward's "
                               "plan was built (set_indices?): call sift.optim.sharded.refresh_sparse_backward("
                               "optimizer) on every rank after changing entries")
        indices = self.plan["indices"]
        return indices, torch.zeros(indices.numel(), dtype=torch.float32, device=indices.device)

    def reduce(self, gradient: torch.Tensor) -> None:
        """Sum `gradient` [K] (all ranks' entries, this rank's data) across ranks; add this rank's part,
        averaged, to its compact buffer."""
        import torch.distributed as dist

        plan = self.plan
        world = dist.get_world_size(self.group)
        if plan["width"] == 0:
            return
        send = gradient.new_zeros(world * plan["width"]).index_copy_(0, plan["padded"], gradient)
        received = gradient.new_empty(plan["width"])
        # reduce_scatter_single replaces reduce_scatter_tensor (deprecated) from torch 2.13.
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(received, send, group=self.group)
        if plan["count"]:
            _, compact = self.optimizer.compact_grad_target(self.weight)
            compact.add_(received[:plan["count"]], alpha=1.0 / world)


def attach_sparse_backward(optimizer: SparseAdamW, routes: Iterable[Any]) -> list[ShardedSparseGrad]:
    """Give each route of a sharded weight its `ShardedSparseGrad` (`route.sharded`), returned for the optimizer to
    keep; `step()` and `load_state_dict` rebuild the plans (`refresh_if_stale`, `refresh_sparse_backward`)."""
    plans = []
    for route in routes:
        if is_dtensor(route.weight):
            route.sharded = ShardedSparseGrad(optimizer, route.weight)
            plans.append(route.sharded)
    return plans


def refresh_if_stale(optimizer: SparseAdamW) -> bool:
    """At the end of every step, run or skipped: rebuild the plans if any rank's entries changed. One all-reduce of two flags (and its
    host read) per step, until every rank has chosen every weight's entries and the plans hold them: from
    then on `step()` changes no entries, so the check stops (the reduced flags make every rank stop at once).
    Returns whether it may stop: every plan is final."""
    import torch.distributed as dist

    plans = optimizer.grads.sharded_plans
    flags = torch.tensor([float(any(plan.stale() for plan in plans)),
                          # A rank's empty shard (FSDP2 pads dim 0) never chooses entries: nothing pends there.
                          float(any(plan._local_indices() is None and local_tensor(plan.weight).numel() > 0
                                    for plan in plans))],
                         device=local_tensor(plans[0].weight).device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=plans[0].group)
    stale, pending = flags.tolist()
    if stale:
        refresh_sparse_backward(optimizer)
    return not pending


def refresh_sparse_backward(optimizer: SparseAdamW) -> None:
    """Rebuild the sparse backward's cross-rank plans of FSDP2 weights from every rank's chosen entries.

    Collective: call it on every rank after changing entries outside `step()` (`set_indices`); `step()`
    and `load_state_dict` call it themselves.

    Example:
        On every rank:

        >>> optimizer.set_indices(weight, indices)  # doctest: +SKIP
        >>> refresh_sparse_backward(optimizer)  # doctest: +SKIP
    """
    for plan in optimizer.grads.sharded_plans:
        plan.refresh()
    optimizer.grads.recheck_plans()  # entries changed outside step(): the next step checks again


# ----------------------------------------------------------------------------- delta export


# ----------------------------------------------------------------------------- checkpoints


class ShardedOptimizerState:
    """`SparseAdamW`'s state for `torch.distributed.checkpoint` (DCP) under FSDP2: each rank's own state.

    Each rank's state holds its shard's chosen entries (k differs from rank to rank), which DCP would
    save once for all ranks if given as plain tensors (it deduplicates unsharded values by key);
    torch's `get_optimizer_state_dict` would also initialise an empty optimizer by a zero-gradient
    `step()`, which for SparseAdamW is a selection. This object is DCP-`Stateful`: it saves every
    rank's `optimizer.state_dict()` under a key naming the rank and the world size, and loads it back
    with `optimizer.load_state_dict` (every tensor validated). A resume needs the same number of
    ranks and the same sharding.

    Example:
        >>> import torch.distributed.checkpoint as dcp  # doctest: +SKIP
        >>> state = {"model": model.state_dict(), "optim": ShardedOptimizerState(opt)}  # doctest: +SKIP
        >>> dcp.save(state, checkpoint_id=path)  # doctest: +SKIP
        >>> dcp.load(state, checkpoint_id=path)  # doctest: +SKIP
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any = None):
        self.optimizer = optimizer
        self.group = group

    def _key(self) -> str:
        import torch.distributed as dist

        return f"rank{dist.get_rank(self.group)}_of_{dist.get_world_size(self.group)}"

    def state_dict(self) -> dict[str, io.BytesIO]:
        # One opaque object per rank: DCP writes it as bytes and gives the same bytes back to that rank.
        buffer = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buffer)
        buffer.seek(0)
        return {self._key(): buffer}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        key = self._key()
        if key not in state_dict:
            raise ValueError(f"the checkpoint holds no optimizer state for {key} (saved: {sorted(state_dict)}): "
                             "resume on as many ranks as saved it")
        saved = state_dict[key]
        if isinstance(saved, io.BytesIO):
            saved.seek(0)
            # The state holds tensors and plain values only: nothing else is unpickled from a checkpoint.
            saved = torch.load(saved, weights_only=True)
        self.optimizer.load_state_dict(saved)


def replicated_quantized_deltas(optimizer: SparseAdamW, process_group: Any = None) -> set[torch.nn.Parameter]:
    """The 4-bit layers' [k] delta values for `fully_shard(..., ignored_params=...)`, each layer set to
    average its gradient across the ranks.

    A 4-bit base goes under FSDP2 *after* `for_model`: FSDP2 shards each packed `Params4bit` by rows (its
    bytes; the per-weight `quant_state` stays whole on every rank, kept by the layer's route) and replaces
    the module's params with its own, so the small delta values must stay out of it, the same tensors the
    optimizer holds, replicated. Each layer then averages its [k] gradient over `process_group` inside
    backward (one all-reduce of k floats per use; on the selecting step also its dense [out, in] score), so
    every rank chooses and steps the same entries, as one process on the global batch.

    Args:
        optimizer: from `SparseAdamW.for_model` on the 4-bit model, before any `fully_shard`; it must train
            nothing but 4-bit deltas (a 16-bit param it held would be replaced by FSDP2's).
        process_group: the ranks the batch is split over; the default process group if None.

    Returns:
        The values params, one per 4-bit layer: pass the set to every `fully_shard` call.

    Raises:
        ValueError: the optimizer holds other params, an 8-bit layer, or no 4-bit layer; or a layer is
            already sharded.

    Example:
        >>> opt = sift.SparseAdamW.for_model(model4bit, density=0.05, lr=2e-4)  # doctest: +SKIP
        >>> deltas = replicated_quantized_deltas(opt)  # doctest: +SKIP
        >>> for layer in model4bit.model.layers:  # doctest: +SKIP
        ...     fully_shard(layer, ignored_params=deltas)
        >>> fully_shard(model4bit, ignored_params=deltas)  # doctest: +SKIP
    """
    import torch.distributed as dist

    routes = quantized_routes(optimizer)
    if not routes:
        raise ValueError("the optimizer trains no 4-bit layer's delta: build it with SparseAdamW.for_model on a "
                         "bitsandbytes 4-bit model")
    others = [p for group in optimizer.param_groups for p in group["params"] if p not in routes]
    if others:
        raise ValueError(f"the optimizer trains {len(others)} params besides the 4-bit deltas; built before "
                         "fully_shard, it would keep params FSDP2 replaces with its own: train only the 4-bit "
                         "layers (target_modules naming them, no dense_modules) on a sharded 4-bit base")
    for route in routes.values():
        # By class name, as sift.quantized matches them (importing it here would close an import cycle).
        if type(route.module.weight).__name__ == "Int8Params":
            raise ValueError(f"{route.name!r} is an 8-bit layer: its row scales (SCB) live on the Int8Params that "
                             "FSDP2 replaces; only 4-bit (Params4bit) layers train over a sharded base")
        if any(cls.__name__ == "FSDPModule" for cls in type(route.module).__mro__) or is_dtensor(route.module.weight):
            raise ValueError(f"{route.name!r} is already sharded: call replicated_quantized_deltas before fully_shard")
        if route.quant_state is None:
            raise ValueError(f"{route.name!r} has no quant_state: move the model to its device first "
                             "(bitsandbytes quantizes on the move)")
    group = process_group if process_group is not None else dist.group.WORLD
    for route in routes.values():
        route.process_group = group
    return set(routes)
