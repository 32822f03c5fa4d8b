"""Putting a delta on a model and taking it off again: `apply_` (every check first, then the
scatter-add that keeps the overwritten values) and `remove_` (writes them back, bit for bit).
`DeltaApplicationMixin` gives `SparseDelta` these methods."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from sift import _ops
from sift.delta.entry import DeltaError
from sift.delta.fingerprint import BaseFingerprint, _find, _float_tensors, _state_of, _structure_hash, logical_state

if TYPE_CHECKING:
    from sift.delta.sparse_delta import SparseDelta


# Applications currently on each model, in order: remove_ undoes the last one only.
_APPLIED: weakref.WeakKeyDictionary[nn.Module, list[_Application]] = weakref.WeakKeyDictionary()


@dataclass
class _Application:
    delta: SparseDelta
    scale: float
    names: list[str]
    params: list[torch.Tensor]
    indices: list[torch.Tensor]  # on the params' devices
    originals: list[torch.Tensor]  # the overwritten values, in the params' dtypes
    dense_names: list[str] = field(default_factory=list)
    dense_params: list[torch.Tensor] = field(default_factory=list)
    dense_originals: list[torch.Tensor] = field(default_factory=list)  # whole copies of the replaced params
    checksum: str = ""  # of the delta's tensors: the same delta loaded twice is the same delta


class DeltaApplicationMixin:
    """`SparseDelta` on a model: `apply_`, `remove_`."""

    def apply_(self, model: nn.Module, scale: float = 1.0, *, check_base: bool = True, stack: bool = False) -> None:
        """Adds `scale * values` to the model's weights in place, and puts the dense parts in place.

        Everything is validated first (names, shapes, dtypes, contiguity, index range and
        order, finite values and scale, the base fingerprint); on any problem a `DeltaError`
        lists all of them and no weight is touched. The overwritten values are kept so that
        `remove_` restores them exactly; they cost one element of the weight's dtype per entry
        until then.

        Args:
            model: the base model (its `state_dict(keep_vars=True)` names the weights).
            scale: multiplier of the values (computed in fp32).
            check_base: compare the model with the delta's base fingerprint. Positions changed
                by deltas already applied to `model` are not compared.
            stack: allow applying a delta that is already applied to `model` (its increments then
                count twice); without it that is refused.

        Example:
            >>> from sift import SparseDelta
            >>> base, tuned = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
            >>> d = SparseDelta.from_diff(base, tuned, density=1.0)
            >>> d.apply_(base)
            >>> torch.equal(base.weight, tuned.weight)
            True
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        state = _state_of(model, "model")
        problems = self.problems()
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)):
            problems.append(f"scale must be a finite number, got {scale!r}")
        checksum = self.checksum() if not problems else None  # a hash of every tensor: once per apply
        if not stack and any(a.delta is self or a.checksum == checksum for a in _APPLIED.get(model, [])):
            problems.append("this delta is already applied to the model (pass stack=True to add it again)")
        for name, t in self.dense.items():
            p = state.get(name)
            if p is None:
                problems.append(f"{name}: no such param in the model (a dense part)")
            elif tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
                problems.append(f"{name}: the dense part is {t.dtype} {tuple(t.shape)}, the model's param "
                                f"{p.dtype} {tuple(p.shape)}")
        owners: dict[tuple, str] = {}
        for name, e in self.entries.items():
            p = state.get(name)
            if p is None:
                problems.append(f"{name}: no such weight in the model")
                continue
            if tuple(p.shape) != e.shape:
                problems.append(f"{name}: shape mismatch: delta {e.shape}, model {tuple(p.shape)}")
            if p.dtype != e.dtype:
                problems.append(f"{name}: dtype mismatch: delta {e.dtype}, model {p.dtype}")
            if not p.is_contiguous():
                problems.append(f"{name}: the model's weight is not contiguous")
            key = (p.untyped_storage().data_ptr(), p.storage_offset(), p.device)
            if e.nnz and key in owners:
                problems.append(f"{name}: the same tensor as {owners[key]} (tied weights); keep one entry")
            owners[key] = name
        if check_base and self.base is not None:
            problems += _base_problems(self.base, logical_state(model), _APPLIED.get(model, []))
        if problems:
            raise DeltaError("cannot apply the sparse delta; the model is unchanged", problems)
        names = [n for n, e in self.entries.items() if e.nnz]
        params = [state[n].detach() for n in names]
        # The kernels read flat buffers; a user-built entry may hold strided views.
        indices = [self.entries[n].indices.to(p.device).contiguous() for n, p in zip(names, params)]
        values = [self.entries[n].values.to(p.device).contiguous() for n, p in zip(names, params)]
        originals = _ops.originals_like(params, indices)
        dense_names = list(self.dense)
        dense_params = [state[n].detach() for n in dense_names]
        with torch.no_grad():
            for device, members in _by_device(params).items():
                _ops.call("sparse_delta_apply_", [params[i] for i in members], [indices[i] for i in members],
                          [values[i] for i in members], float(scale), [originals[i] for i in members], device=device)
            dense_originals = [p.clone() for p in dense_params]
            for p, name in zip(dense_params, dense_names):
                p.copy_(self.dense[name])
        _APPLIED.setdefault(model, []).append(_Application(self, float(scale), names, params, indices, originals,
                                                           dense_names, dense_params, dense_originals,
                                                           checksum))

    def remove_(self, model: nn.Module) -> None:
        """Takes the delta off `model` again, restoring the exact values `apply_` overwrote.

        Exactness comes from writing back the values saved at apply time, not from subtracting,
        so it holds bit for bit in every dtype. Deltas on one model come off in reverse order of
        application; removing this one needs the same `SparseDelta` object that applied it (for
        an approximate inverse of a delta applied elsewhere, use `apply_(model, scale=-scale)`).

        Args:
            model: the model this delta was applied to.

        Example:
            >>> from sift import SparseDelta
            >>> base, tuned = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
            >>> before = base.weight.clone()
            >>> d = SparseDelta.from_diff(base, tuned, density=1.0)
            >>> d.apply_(base); d.remove_(base)
            >>> torch.equal(base.weight, before)
            True
        """
        stack = _APPLIED.get(model, []) if isinstance(model, nn.Module) else []
        mine = [a for a in stack if a.delta is self]
        if not mine:
            raise DeltaError("cannot remove the sparse delta; the model is unchanged",
                             ["this delta is not applied to this model (never applied, or already removed)"])
        if stack[-1].delta is not self:
            raise DeltaError("cannot remove the sparse delta; the model is unchanged",
                             [f"{len(stack) - 1 - stack.index(mine[-1])} delta(s) applied after it must be removed "
                              f"first (deltas come off in reverse order of application)"])
        app = stack[-1]
        state = _state_of(model, "model")
        problems = []
        for name, p in zip(app.names + app.dense_names, app.params + app.dense_params):
            now = state.get(name)
            if now is None or now.data_ptr() != p.data_ptr() or now.shape != p.shape or now.dtype != p.dtype:
                problems.append(f"{name}: the weight was replaced since the delta was applied")
        if problems:
            raise DeltaError("cannot remove the sparse delta; the model is unchanged", problems)
        with torch.no_grad():
            for device, members in _by_device(app.params).items():
                _ops.call("sparse_delta_restore_", [app.params[i] for i in members], [app.indices[i] for i in members],
                          [app.originals[i] for i in members], device=device)
            for p, original in zip(app.dense_params, app.dense_originals):
                p.copy_(original)
        stack.pop()


def _base_problems(base: BaseFingerprint, state: Mapping[str, torch.Tensor],
                   applied: Sequence[_Application]) -> list[str]:
    tensors = _float_tensors(state)
    if _structure_hash(tensors) != base.structure:
        return [
            f"the delta was made for another base model: names, shapes or dtypes differ "
            f"(base had {base.n_tensors} floating-point tensors, the model has {len(tensors)})"
        ]
    touched: dict[str, list[torch.Tensor]] = {}
    for app in applied:
        for name, idx in zip(app.names, app.indices):
            touched.setdefault(name, []).append(idx.cpu())
    differing, compared = [], 0
    for name, samples in base.samples.items():
        t = tensors.get(name)
        if t is None or not samples or t.device.type == "meta":  # meta: a quantized layer's weight, not read
            continue
        positions = [p for p in samples if p < t.numel()
                     and not any(_find(ix, p) is not None for ix in touched.get(name, []))]
        if not positions:
            continue
        now = t.detach().reshape(-1)[torch.tensor(positions, device=t.device)].tolist()
        compared += len(positions)
        differing += [f"{name}[{p}]" for p, v in zip(positions, now) if not base.matches(name, p, v)]
    if differing:
        return [f"the delta was made for another base model: {len(differing)} of {compared} sampled base values "
                f"differ (first: {', '.join(differing[:3])})"]
    return []


def _by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups
