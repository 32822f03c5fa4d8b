"""The sparse state of `SparseAdamW`: its layout (exact and lean, see the `sift.optim` docstring),
creating it at selection, `set_indices`, `indices_of`, and reading a weight's increments.

The public functions here read a param's state dict, whatever optimizer holds it, so
`sift.delta` and `sift.targets` need no knowledge of its keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from sift import _ops
from sift._index import check_indices as _check_indices
from sift._index import index_dtype as _index_dtype
from sift._index import lookup as _lookup
from sift._index import merge_disjoint as _merge_disjoint

SPARSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPARSE_KEYS = ("indices", "exp_avg", "exp_avg_sq", "delta", "step")
RETIRED_KEYS = ("retired_indices", "retired_delta", "retired_base")


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


class EntryState:
    """`SparseAdamW`'s sparse state: the groups' sparse params, allocation at selection, `set_indices`,
    `indices_of`, `state_bytes`."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def sparse_params(self) -> Iterable[tuple[dict[str, Any], torch.Tensor]]:
        for group in self.opt.param_groups:
            if group["density"] < 1.0:
                for p in group["params"]:
                    yield group, p

    def group_of(self, param: torch.Tensor) -> dict[str, Any]:
        for group in self.opt.param_groups:
            if any(param is p for p in group["params"]):
                return group
        raise ValueError("param is not managed by this optimizer")

    def allocate(self, p: torch.Tensor, indices: torch.Tensor) -> None:
        state = self.opt.state[p]
        k = indices.numel()
        zeros = dict(dtype=torch.float32, device=p.device)
        state.clear()
        if self.opt.state_layout == "lean":
            low, offsets = _ops.encode_lean_indices(indices.to(p.device), local_tensor(p).numel())
            state["indices_low"], state["window_offsets"] = low, offsets
            state["exp_avg"] = torch.zeros(k, dtype=torch.bfloat16, device=p.device)
            state["exp_avg_sq"] = torch.zeros(k, dtype=torch.bfloat16, device=p.device)
            if p.dtype != torch.float32:
                state["residual"] = torch.zeros(k, dtype=torch.int8, device=p.device)
            state["step"] = torch.zeros((), **zeros)
            if self.opt.compact_grads and not self.opt.update_in_backward:
                self.opt.grads.compact[p] = torch.zeros(k, **zeros)
            return
        state["indices"] = indices.to(p.device)
        state["exp_avg"] = torch.zeros(k, **zeros)
        state["exp_avg_sq"] = torch.zeros(k, **zeros)
        state["delta"] = torch.zeros(k, **zeros)
        # Every dtype keeps its base: the step writes round(base + delta), so the delta is exact.
        state["base"] = local_tensor(p.detach()).view(-1)[state["indices"].long()].clone()
        state["step"] = torch.zeros((), **zeros)
        if self.opt.compact_grads and not self.opt.update_in_backward:
            self.opt.grads.compact[p] = torch.zeros(k, **zeros)

    def set_indices(self, param: torch.Tensor, indices: torch.Tensor) -> None:
        """Choose the trainable entries of `param` yourself. (`SparseAdamW.set_indices`)."""
        group = self.group_of(param)
        if group["density"] >= 1.0:
            raise ValueError("set_indices needs a param of a sparse group (density < 1); this one is dense")
        local = local_tensor(param)
        if isinstance(indices, torch.Tensor) and indices.dtype == torch.bool:
            if indices.shape != local.shape:
                raise ValueError(f"mask must have the param's shape {tuple(local.shape)}, got {tuple(indices.shape)}")
            indices = indices.reshape(-1).nonzero().reshape(-1)
        _check_indices(indices, local.numel(), "indices")
        indices = indices.to(device=param.device, dtype=_index_dtype(local.numel()))
        self.opt.selector.forget_gathered(param)
        old = dict(self.opt.state.get(param, {}))
        old_compact = self.opt.grads.compact.get(param) if param in self.opt.grads.ready else None
        if self.opt.state_layout == "lean":
            self.set_lean_indices(param, indices, old, old_compact)
            return
        state = self.carry_over(param, indices, old, old_compact, old.get("indices"),
                                 ("exp_avg", "exp_avg_sq", "delta", "base"))
        if state is None:
            return
        has_base = "base" in state
        retired_idx = old.get("retired_indices", old["indices"][:0])
        retired_delta = old.get("retired_delta", old["delta"][:0])
        retired_base = old.get("retired_base", old["base"][:0]) if has_base else None
        back, rpos = _lookup(retired_idx, indices)
        state["delta"][back] = retired_delta[rpos[back]]
        if has_base:
            state["base"][back] = retired_base[rpos[back]]
        # The new record: dropped entries that carry an increment, and the retired ones not re-added.
        still_active, _ = _lookup(indices, old["indices"])
        leaving = ~still_active & (old["delta"] != 0)
        still_retired = ~_lookup(indices, retired_idx)[0]
        pairs = [(old["delta"][leaving], retired_delta[still_retired])]
        if has_base:
            pairs.append((old["base"][leaving], retired_base[still_retired]))
        record_idx, values = _merge_disjoint(old["indices"][leaving], retired_idx[still_retired], *pairs)
        if record_idx.numel() == 0:
            return
        state["retired_indices"] = record_idx
        state["retired_delta"] = values[0]
        if has_base:
            state["retired_base"] = values[1]

    def set_lean_indices(self, param: torch.Tensor, indices: torch.Tensor, old: dict[str, Any],
                          old_compact: torch.Tensor | None) -> None:
        """set_indices on the lean state: kept entries keep their moments and residual; there is
        no increment to retire, so dropped entries simply leave (the weight keeps its value)."""
        old_indices = (_ops.decode_lean_indices(old["indices_low"], old["window_offsets"])
                       if "indices_low" in old else None)
        self.carry_over(param, indices, old, old_compact, old_indices, ("exp_avg", "exp_avg_sq", "residual"))

    def carry_over(self, param: torch.Tensor, indices: torch.Tensor, old: dict[str, Any],
                    old_compact: torch.Tensor | None, old_indices: torch.Tensor | None,
                    keys: tuple[str, ...]) -> dict[str, Any] | None:
        """Fresh state for `indices` that keeps, for the entries `old_indices` also held, the step
        count, the per-entry `keys` and the compact gradient. Returns the new state, or None when
        `old` had no entries (nothing carried over)."""
        self.allocate(param, indices)
        state = self.opt.state[param]
        state["selection_calls"] = max(old.get("selection_calls", 0), self.opt.select_steps)
        if old_indices is None:
            return None
        state["step"].copy_(old["step"])
        kept, pos = _lookup(old_indices, indices)
        for key in keys:
            if key in old and key in state:
                state[key][kept] = old[key][pos[kept]]
        if old_compact is not None:
            self.opt.grads.compact[param][kept] = old_compact[pos[kept]]
        return state

    def indices_of(self, param: torch.Tensor) -> torch.Tensor:
        """See `SparseAdamW.indices_of`."""
        state = self.opt.state.get(param, {})
        if "indices" in state:
            return state["indices"]
        if "indices_low" in state:
            return _ops.decode_lean_indices(state["indices_low"], state["window_offsets"],
                                            _index_dtype(local_tensor(param).numel()))
        raise ValueError("param has no chosen entries yet (not selected, or not managed by this optimizer)")

    # ------------------------------------------------------------- reporting

    def state_bytes(self) -> dict[str, float]:
        """Optimizer-state memory: total bytes, trainable entries, and bytes per entry. (`SparseAdamW.state_bytes`)."""
        total = entries = 0
        for group in self.opt.param_groups:
            for p in group["params"]:
                state = self.opt.state.get(p, {})
                tensors = [v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "score"]
                total += sum(t.numel() * t.element_size() for t in tensors)
                if is_selected(state):
                    entries += num_entries(state)
                elif "exp_avg" in state:
                    entries += local_tensor(p).numel()
        grad_bytes = sum(t.numel() * t.element_size() for t in [*self.opt.grads.compact.values(), *self.opt.grads.scratch.values()])
        return {
            "state_bytes": float(total),
            "trainable_entries": float(entries),
            "bytes_per_entry": total / entries if entries else 0.0,
            "compact_grad_bytes": float(grad_bytes),
        }


