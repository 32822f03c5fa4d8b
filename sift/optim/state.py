"""The sparse state of `SparseAdamW`: its layout (exact and lean, see the `sift.optim` docstring),
creating it at selection, `set_indices`, `indices_of`, and reading a weight's increments.

The public functions here read a param's state dict, whatever optimizer holds it, so
`sift.delta` and `sift.targets` need no knowledge of its keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from sift import _ops
from sift._params import (SparseOptimizer, first_shard, increments, is_dense_stepped, is_dtensor,  # noqa: F401
                          is_selected, local_tensor, num_entries, quantized_routes, uses_grad)
from sift._index import check_indices as _check_indices
from sift._index import index_dtype as _index_dtype
from sift._index import lookup as _lookup
from sift._index import merge_disjoint as _merge_disjoint
from sift.optim.part import Part

SPARSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPARSE_KEYS = ("indices", "exp_avg", "exp_avg_sq", "delta", "step")
RETIRED_KEYS = ("retired_indices", "retired_delta", "retired_base")


class EntryState(Part):
    """`SparseAdamW`'s sparse state: the groups' sparse params, allocation at selection, `set_indices`,
    `indices_of`, `state_bytes`."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        # id(param) -> (param, its group), for `group_of`; the param is held so that its id is not reused.
        self.groups_by_param: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

    def sparse_params(self) -> Iterable[tuple[dict[str, Any], torch.Tensor]]:
        for group in self.opt.param_groups:
            if group["density"] < 1.0:
                for p in group["params"]:
                    yield group, p

    def index_groups(self) -> None:
        """Build `group_of`'s table from the param groups (after a group is added, a load, a copy)."""
        self.groups_by_param = {id(p): (p, group) for group in self.opt.param_groups for p in group["params"]}

    def group_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The param group holding `param`: one look-up (the table is built again, once, for a param it does not
        know, such as one put into a group's list by hand)."""
        found = self.groups_by_param.get(id(param))
        if found is None:
            self.index_groups()
            found = self.groups_by_param.get(id(param))
            if found is None:
                raise ValueError("param is not managed by this optimizer")
        return found[1]

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
            self.opt.grads.new_compact(p, k)
            return
        state["indices"] = indices.to(p.device)
        state["exp_avg"] = torch.zeros(k, **zeros)
        state["exp_avg_sq"] = torch.zeros(k, **zeros)
        state["delta"] = torch.zeros(k, **zeros)
        # Every dtype keeps its base: the step writes round(base + delta), so the delta is exact.
        state["base"] = local_tensor(p.detach()).view(-1)[state["indices"].long()].clone()
        state["step"] = torch.zeros((), **zeros)
        self.opt.grads.new_compact(p, k)

    def set_indices(self, param: torch.Tensor, indices: torch.Tensor, keep_gathered: bool = False) -> None:
        """Choose the trainable entries of `param` yourself. (`SparseAdamW.set_indices`; `keep_gathered`: a
        re-selection, whose clipped gradient was gathered at the new entries.)"""
        group = self.group_of(param)
        if group["density"] >= 1.0:
            raise ValueError("set_indices needs a param of a sparse group (density < 1); this one is dense")
        local = local_tensor(param)
        if isinstance(indices, torch.Tensor) and indices.dtype == torch.bool:
            if indices.shape != local.shape:
                raise ValueError(f"mask must have the param's shape {tuple(local.shape)}, got {tuple(indices.shape)}")
            indices = indices.reshape(-1).nonzero().reshape(-1)
        # An FSDP2 shard may hold none of the whole weight's entries (its global selection or re-selection).
        _check_indices(indices, local.numel(), "indices", allow_empty=is_dtensor(param))
        indices = indices.to(device=param.device, dtype=_index_dtype(local.numel()))
        self.opt.selector.forget_gathered(param, keep_clipped=keep_gathered)
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
        """set_indices on the lean state: kept entries keep their moments and residual. Dropped entries leave
        (the weight keeps its value); their positions join `retired_indices`, so that
        `SparseDelta.from_optimizer` still finds their increments against the base."""
        old_indices = (_ops.decode_lean_indices(old["indices_low"], old["window_offsets"])
                       if "indices_low" in old else None)
        state = self.carry_over(param, indices, old, old_compact, old_indices, ("exp_avg", "exp_avg_sq", "residual"))
        if state is None:
            return
        retired = old.get("retired_indices", indices[:0])
        leaving = old_indices[~_lookup(indices, old_indices)[0]]
        record = torch.cat([retired[~_lookup(indices, retired)[0]].to(indices.dtype), leaving.to(indices.dtype)])
        if record.numel():
            state["retired_indices"] = record.sort().values

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
            self.opt.grads.keep_compact(param, kept, old_compact[pos[kept]])
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
                tensors = [v for k, v in state.items()
                           if isinstance(v, torch.Tensor) and k not in ("score", "reselect_score")]
                total += sum(t.numel() * t.element_size() for t in tensors)
                if is_selected(state):
                    entries += num_entries(state)
                elif "exp_avg" in state:
                    entries += local_tensor(p).numel()
        grads = self.opt.grads
        grad_bytes = sum(t.numel() * t.element_size() for t in [*grads.compact.values(), *grads.scratch.values()])
        return {
            "state_bytes": float(total),
            "trainable_entries": float(entries),
            "bytes_per_entry": total / entries if entries else 0.0,
            "compact_grad_bytes": float(grad_bytes),
        }


