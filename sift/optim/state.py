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
from sift.optim.settings import Settings

SPARSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPARSE_KEYS = ("indices", "exp_avg", "exp_avg_sq", "delta", "step")
RETIRED_KEYS = ("retired_indices", "retired_delta", "retired_base")


class EntryState(Part):
    """`SparseAdamW`'s sparse state: the groups' sparse params, allocation at selection, `set_indices`,
    `indices_of`, `state_bytes`."""

    def __init__(self, opt: Any, settings: Settings) -> None:
        super().__init__(opt, settings)
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
        if self.settings.state_layout == "lean":
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
        if self.settings.state_layout == "lean":
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
        state["selection_calls"] = max(old.get("selection_calls", 0), self.settings.select_steps)
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

    # -------------------------------------------- what other parts change, through these methods

    def count_selection_step(self, p: torch.Tensor, calls: int) -> None:
        """p's selection has scored `calls` steps so far (a selecting step's count stays with the chosen entries)."""
        self.opt.state[p]["selection_calls"] = calls

    def add_selection_score(self, p: torch.Tensor, score: torch.Tensor) -> None:
        """A selection step that does not choose yet: its `score` ([numel] fp32, unscaled) joins p's summed score."""
        state = self.opt.state[p]
        state["score"] = score if "score" not in state else state["score"].add_(score)

    def add_reselect_score(self, p: torch.Tensor, score: torch.Tensor) -> None:
        """A re-selection's scoring step: its `score` ([numel] fp32, unscaled) joins p's summed re-selection score."""
        state = self.opt.state[p]
        state["reselect_score"] = score if "reselect_score" not in state else state["reselect_score"].add_(score)

    def drop_reselect_score(self, p: torch.Tensor) -> None:
        """p re-selected: the score summed for it is used up."""
        self.opt.state[p].pop("reselect_score", None)

    def revert(self, p: torch.Tensor, entries: torch.Tensor, leaving: torch.Tensor) -> None:
        """Put p's `entries` ([k] flat positions, its chosen ones) where `leaving` ([k] bool) holds back at their
        base (exact state): their increment goes to 0, so nothing of them is retired."""
        state = self.opt.state[p]
        local_tensor(p.detach()).view(-1)[entries[leaving].long()] = state["base"][leaving]
        state["delta"][leaving] = 0.0

    def seed_moments(self, p: torch.Tensor, fresh: torch.Tensor, grad: torch.Tensor, count: int,
                     betas: tuple[float, float]) -> None:
        """Grown entries (`fresh`, [k] bool) start their moments as if `grad` ([fresh.sum()] fp32, signed as the
        update applies it) had been the gradient of all `count` updates so far (bias-corrected Adam's moments)."""
        state = self.opt.state[p]
        beta1, beta2 = betas
        # The lean state's bf16 moments take the seeds rounded to nearest.
        state["exp_avg"][fresh] = ((1.0 - beta1 ** count) * grad).to(state["exp_avg"].dtype)
        state["exp_avg_sq"][fresh] = ((1.0 - beta2 ** count) * grad * grad).to(state["exp_avg_sq"].dtype)

    def choose_delta_entries(self, values: torch.Tensor, indices: torch.Tensor, numel: int) -> None:
        """A 4-bit or int8 layer's selection (`sift.quantized`): its [k] delta `values` train at `indices` ([k]
        sorted flat positions of its weight of `numel` elements); the summed score is used up."""
        state = self.opt.state[values]
        if self.settings.state_layout == "lean":
            state["delta_indices_low"], state["delta_window_offsets"] = _ops.encode_lean_indices(indices, numel)
        else:
            state["delta_indices"] = indices
        state.pop("score", None)

    def move_delta_entries(self, values: torch.Tensor, old: torch.Tensor, new: torch.Tensor, numel: int
                           ) -> torch.Tensor:
        """A 4-bit or int8 layer's re-selection: its delta `values` and their moments follow their entries from `old`
        to `new` ([k] sorted flat positions of its weight of `numel` elements); dropped ones leave (their increment
        gone), grown ones start at 0. Returns which of `new` were kept ([k] bool)."""
        state = self.opt.state[values]
        kept, pos = _lookup(old, new)
        for tensor in (values.data, state["exp_avg"], state["exp_avg_sq"]):
            moved = torch.zeros_like(tensor)
            moved[kept] = tensor[pos[kept]]
            tensor.copy_(moved)
        if "delta_indices_low" in state:
            state["delta_indices_low"], state["delta_window_offsets"] = _ops.encode_lean_indices(new, numel)
        else:
            state["delta_indices"] = new.to(old.dtype)
        state.pop("reselect_score", None)
        return kept

    def start_lean_moments(self, values: torch.Tensor) -> None:
        """The lean step's first update of a 4-bit layer's [k] delta `values`: zero bf16 moments, a device count."""
        state = self.opt.state[values]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros(values.numel(), dtype=torch.bfloat16, device=values.device)
            state["exp_avg_sq"] = torch.zeros(values.numel(), dtype=torch.bfloat16, device=values.device)
            state["step"] = torch.zeros((), dtype=torch.float32, device=values.device)

    def start_dense_moments(self, p: torch.Tensor, capturable: bool) -> None:
        """torch's AdamW state of a dense `p` before its update: zero moments of its shape and a step count, on the
        device when `capturable` (a CUDA graph may capture the step), else on the CPU."""
        state = self.opt.state[p]
        if "exp_avg" not in state:  # a 4-bit delta's state holds its indices before its moments
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif capturable and state["step"].device != p.device:
            state["step"] = state["step"].to(p.device)

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


