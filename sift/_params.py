"""How a trained param and its optimizer state are read, below every module that trains, routes or saves
them (`sift.optim`, `sift.targets`, `sift.sparse_backward`, `sift.quantized`, `sift.delta`): the FSDP2 shard
helpers, the sparse state's layout queries, and `SparseOptimizer`, the protocol `SparseAdamW` satisfies.
Nothing here imports from those modules, so none of them imports another in a circle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from sift._index import index_dtype as _index_dtype
from sift._index import merge_disjoint as _merge_disjoint



def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor: FSDP2 shards params so, and sparse state lives on each rank's local shard."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def first_shard(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The optimizer's first DTensor (FSDP2) param, or None when it holds none."""
    return next((p for group in optimizer.param_groups for p in group["params"] if is_dtensor(p)), None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (a view of its storage), else `t` itself."""
    return t.to_local() if is_dtensor(t) else t


def uses_grad(p: torch.Tensor) -> bool:
    """Whether the step uses p's gradient this time: frozen params are skipped even with a grad."""
    return p.requires_grad and p.grad is not None


@runtime_checkable
class SparseOptimizer(Protocol):
    """What the routes (the sparse backward, `clip_grad_norm_`, `trainable_summary`) need of `SparseAdamW`: an
    `isinstance` check against this tells one apart without importing the class."""

    def indices_of(self, param: torch.Tensor) -> torch.Tensor: ...

    def compact_grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def state_bytes(self) -> dict[str, float]: ...


def quantized_routes(optimizer: Any) -> dict[torch.Tensor, Any]:
    """A SparseAdamW's 4-bit and 8-bit layers (`sift.quantized`): delta values param -> route; {} for any other
    optimizer."""
    return getattr(getattr(optimizer, "grads", None), "quantized", None) or {}


def is_selected(state: Mapping[str, Any]) -> bool:
    """Whether a param state holds chosen entries (exact or lean layout)."""
    return "indices" in state or "indices_low" in state


def num_entries(state: Mapping[str, Any]) -> int:
    """k of a selected param state, in either layout."""
    return (state["indices"] if "indices" in state else state["indices_low"]).numel()


def is_dense_stepped(state: Mapping[str, Any]) -> bool:
    """Whether a param state is dense AdamW's (a `density=1.0` group's param that has been stepped)."""
    return "exp_avg" in state and not is_selected(state)


def increments(state: Mapping[str, torch.Tensor], numel: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The exact increments of a sparse param state on the CPU, active and retired entries merged.

    Args:
        state: the param's state in a `SparseAdamW(state="exact")` (`optimizer.state[param]`).
        numel: the param's element count (it fixes the index dtype).

    Returns:
        [n] sorted flat positions (int32, int64 past 2**31 elements), [n] fp32 increments since
        the first selection, and [n] base values (None for a hand-made state without them); None
        when the state has no exact chosen entries (not selected yet, a dense param, or the lean
        layout, which keeps no increments).

    Example:
        >>> from sift import SparseAdamW
        >>> w = torch.nn.Parameter(torch.randn(4, 4))
        >>> opt = SparseAdamW([w], density=0.25)
        >>> opt.set_indices(w, torch.tensor([1, 6, 11, 12]))
        >>> positions, values, base = increments(opt.state[w], w.numel())
        >>> positions.tolist(), values.tolist(), torch.equal(base, w.detach().view(-1)[positions.long()])
        ([1, 6, 11, 12], [0.0, 0.0, 0.0, 0.0], True)
    """
    if "indices" not in state:
        return None
    index_dtype = _index_dtype(numel)
    idx = state["indices"].detach().to("cpu", index_dtype, copy=True)
    values = state["delta"].detach().to("cpu", torch.float32, copy=True)
    base = state["base"].detach().to("cpu", copy=True) if "base" in state else None
    if "retired_indices" in state:
        pairs = [(values, state["retired_delta"].detach().to("cpu", torch.float32))]
        if base is not None:
            pairs.append((base, state["retired_base"].detach().cpu()))
        idx, merged = _merge_disjoint(idx, state["retired_indices"].detach().to("cpu", index_dtype), *pairs)
        values, base = merged[0], (merged[1] if base is not None else None)
    return idx, values, base


# ------------------------------------------------------------------ FSDP2 shards


def is_row_sharded(p: torch.Tensor) -> bool:
    placements = p.placements
    return p.device_mesh.ndim == 1 and len(placements) == 1 and placements[0].is_shard(0) and p.dim() > 0


def shard_group(p: torch.Tensor):
    """The process group `p`'s shards are spread over (its 1-D device mesh's)."""
    return p.device_mesh.get_group()


def shard_offset(p: torch.Tensor) -> int:
    """The flat position, in the full weight, of the first element of this rank's shard of `p`.

    FSDP2 shards dim 0 as `torch.chunk` does: rank r holds rows [r * c, min((r + 1) * c, rows)),
    c = ceil(rows / world); a row-major shard of rows is one contiguous run of flat positions.

    Raises:
        ValueError: `p` is not sharded by rows over a 1-D mesh (HSDP, `Shard(dim > 0)`).

    Example:
        On rank 1 of 2, for a [16, 12] weight (rank 1 holds rows 8 to 15):

        >>> shard_offset(model[0].weight)  # doctest: +SKIP
        96
    """
    if not is_row_sharded(p):
        raise ValueError(f"a DTensor param with placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh: "
                         "SparseAdamW supports FSDP2's default sharding, Shard(0) over a 1-D mesh")
    rows = p.shape[0]
    world = p.device_mesh.size()
    chunk = -(-rows // world)
    first = min(p.device_mesh.get_local_rank() * chunk, rows)
    local = local_tensor(p)
    if (local.shape[0] if local.dim() else 0) != max(0, min(chunk, rows - first)):
        raise ValueError(f"a DTensor param of shape {tuple(p.shape)} holds {tuple(local.shape)} on this rank, not the "
                         f"torch.chunk rows FSDP2 assigns ({max(0, min(chunk, rows - first))} from row {first})")
    return first * (p.numel() // rows if rows else 0)


def local_shard_of(p: torch.Tensor, full: torch.Tensor | None) -> torch.Tensor | None:
    """The part of `full` (a tensor of `p`'s full shape, or a DTensor sharded like it) that this rank's shard
    of `p` covers; None if `full` is None or of another shape."""
    if full is None or tuple(full.shape) != tuple(p.shape):
        return None
    if is_dtensor(full):
        return local_tensor(full)
    local = local_tensor(p)
    start = shard_offset(p)
    return full.detach().reshape(-1)[start:start + local.numel()].view(local.shape)


def gather_entries(p: torch.Tensor, local: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Every rank's entries of sharded `p` as entries of the full weight: ([n] sorted flat positions,
    [n] fp32 values, [n] base values or None), or None when no rank has any.

    `local` holds this rank's (positions within its shard, values, base values), or None. Collective:
    every rank of `p`'s mesh calls it for the same params in the same order. Only the entries travel,
    never the weight.
    """
    import torch.distributed as dist

    group = shard_group(p)
    offset = shard_offset(p)
    payload = None
    if local is not None:
        idx, values, base = local
        payload = (offset, idx.detach().cpu().long(), values.detach().cpu().float(),
                   base.detach().cpu() if base is not None else None)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, payload, group=group)
    parts = sorted((part for part in parts if part is not None), key=lambda part: part[0])
    if not parts:
        return None
    idx = torch.cat([start + positions for start, positions, _, _ in parts]).to(_index_dtype(p.numel()))
    values = torch.cat([v for _, _, v, _ in parts])
    bases = [b for _, _, _, b in parts]
    base = torch.cat(bases) if all(b is not None for b in bases) else None
    return idx, values, base


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """A dense param's full value (gathered from its shards for a DTensor; collective), on the CPU."""
    return (p.full_tensor() if is_dtensor(p) else p).detach().cpu().clone()
