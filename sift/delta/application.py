"""Putting a delta on a model and taking it off again: `apply_` (every check first, then the
scatter-add that keeps the overwritten values; a bitsandbytes 4-bit or 8-bit layer's entries become
its frozen sparse delta, `sift.quantized.attach_frozen_delta_`) and `remove_` (writes them back, bit
for bit), behind `SparseDelta.apply_` and `SparseDelta.remove_`; `disabled(model)` switches every
delta applied to a model off for the length of a `with` block."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sift import _ops
from sift.delta.contents import DeltaContents
from sift.delta.entry import DeltaError
from sift.delta.fingerprint import (BaseFingerprint, _find, _float_tensors, _quantized_layers, _state_of,
                                    _structure_hash, logical_state)
from sift.delta.identity import describe, model_identity
from sift.quantized import attach_frozen_delta_, detach_frozen_delta_, frozen_delta_problems, set_delta_enabled


# Applications currently on each model, in order: remove_ undoes the last one only.
_APPLIED: weakref.WeakKeyDictionary[nn.Module, list[_Application]] = weakref.WeakKeyDictionary()
# Models inside `disabled`: how many blocks deep (an inner block finds the deltas already off).
_SWITCHED_OFF: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
# Lines of one kind (weights missing from the model, shapes that differ) listed before the rest are counted.
LISTED_PER_KIND = 3


@dataclass
class _Application:
    delta: DeltaContents
    scale: float
    names: list[str]
    params: list[torch.Tensor]
    indices: list[torch.Tensor]  # on the params' devices
    originals: list[torch.Tensor]  # the overwritten values, in the params' dtypes
    dense_names: list[str] = field(default_factory=list)
    dense_params: list[torch.Tensor] = field(default_factory=list)
    dense_originals: list[torch.Tensor] = field(default_factory=list)  # whole copies of the replaced params
    checksum: str = ""  # of the delta's tensors: the same delta loaded twice is the same delta
    quantized_modules: list[nn.Module] = field(default_factory=list)  # layers holding a frozen delta


def apply_(delta: DeltaContents, model: nn.Module, scale: float = 1.0, *, check_base: bool = True,
           stack: bool = False) -> None:
    """`delta.apply_(model, ...)` (`SparseDelta.apply_` documents it): every check first, then the
    scatter-add that keeps the overwritten values, and the dense parts put in place.

    Example:
        >>> from sift import SparseDelta
        >>> base, tuned = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        >>> apply_(SparseDelta.from_diff(base, tuned, density=1.0), base)
        >>> torch.equal(base.weight, tuned.weight)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    state = _state_of(model, "model")
    problems = delta.problems()
    if model in _SWITCHED_OFF:
        problems.append("the model's deltas are switched off (inside `disabled`): apply after the block")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)):
        problems.append(f"scale must be a finite number, got {scale!r}")
    checksum = delta.checksum() if not problems else None  # a hash of every tensor: once per apply
    if not stack and any(a.delta is delta or a.checksum == checksum for a in _APPLIED.get(model, [])):
        problems.append("this delta is already applied to the model (pass stack=True to add it again)")
    for name, t in delta.dense.items():
        p = state.get(name)
        if p is None:
            problems.append(f"{name}: no such param in the model (a dense part)")
        elif tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
            problems.append(f"{name}: the dense part is {t.dtype} {tuple(t.shape)}, the model's param "
                            f"{p.dtype} {tuple(p.shape)}")
    # A quantized layer's weight is packed bytes: its entries become the layer's frozen sparse delta.
    quantized = {f"{n}.weight": n for n in _quantized_layers(model)}
    modules = dict(model.named_modules()) if quantized else {}
    missing, mismatched, retyped = [], [], []
    owners: dict[tuple, str] = {}
    for name, e in delta.entries.items():
        if name in quantized:
            problems += frozen_delta_problems(modules[quantized[name]], name, e.shape)
            continue
        p = state.get(name)
        if p is None:
            missing.append((name, "no such weight in the model"))
            continue
        if tuple(p.shape) != e.shape:
            mismatched.append((name, f"shape mismatch: delta {e.shape}, model {tuple(p.shape)}"))
        if p.dtype != e.dtype:
            retyped.append((name, f"dtype mismatch: delta {e.dtype}, model {p.dtype}"))
        if not p.is_contiguous():
            problems.append(f"{name}: the model's weight is not contiguous")
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), p.device)
        if e.nnz and key in owners:
            problems.append(f"{name}: the same tensor as {owners[key]} (tied weights); keep one entry")
        owners[key] = name
    foreign = _counted(f"of the delta's {len(delta.entries)} weights are not in the model", missing)
    foreign += _counted("weights have another shape", mismatched)
    foreign += _counted("weights have another dtype", retyped)
    if check_base and delta.base is not None:
        foreign += _base_problems(delta.base, logical_state(model), _APPLIED.get(model, []))
    if foreign:
        given = describe(model_identity(model), "an unnamed model")
        made_for = describe(delta.info.get("base_model"), "another base model")
        raise DeltaError(f"cannot apply the sparse delta: it was made for {made_for}, and the given model is "
                         f"{given}; the model is unchanged", foreign + problems)
    if problems:
        raise DeltaError("cannot apply the sparse delta; the model is unchanged", problems)
    names = [n for n, e in delta.entries.items() if e.nnz and n not in quantized]
    params = [state[n].detach() for n in names]
    # The kernels read flat buffers; a user-built entry may hold strided views.
    indices = [delta.entries[n].indices.to(p.device).contiguous() for n, p in zip(names, params)]
    values = [delta.entries[n].values.to(p.device).contiguous() for n, p in zip(names, params)]
    originals = _ops.originals_like(params, indices)
    dense_names = list(delta.dense)
    dense_params = [state[n].detach() for n in dense_names]
    with torch.no_grad():
        for device, members in _by_device(params).items():
            _ops.call("sparse_delta_apply_", [params[i] for i in members], [indices[i] for i in members],
                      [values[i] for i in members], float(scale), [originals[i] for i in members], device=device)
        dense_originals = [p.clone() for p in dense_params]
        for p, name in zip(dense_params, dense_names):
            p.copy_(delta.dense[name])
    quantized_modules = []
    for name in [n for n in delta.entries if n in quantized]:
        e, module = delta.entries[name], modules[quantized[name]]
        attach_frozen_delta_(module, quantized[name], e.indices, e.values * float(scale))
        quantized_modules.append(module)
    _APPLIED.setdefault(model, []).append(_Application(delta, float(scale), names, params, indices, originals,
                                                       dense_names, dense_params, dense_originals,
                                                       checksum, quantized_modules))


def remove_(delta: DeltaContents, model: nn.Module) -> None:
    """`delta.remove_(model)` (`SparseDelta.remove_` documents it): writes back the values `apply_(delta,
    model)` overwrote, once nothing applied after it is left on the model.

    Example:
        >>> from sift import SparseDelta
        >>> base, tuned = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        >>> before, delta = base.weight.clone(), SparseDelta.from_diff(base, tuned, density=1.0)
        >>> apply_(delta, base); remove_(delta, base)
        >>> torch.equal(base.weight, before)
        True
    """
    stack = _APPLIED.get(model, []) if isinstance(model, nn.Module) else []
    mine = [a for a in stack if a.delta is delta]
    if not mine:
        raise DeltaError("cannot remove the sparse delta; the model is unchanged",
                         ["this delta is not applied to this model (never applied, or already removed)"])
    if stack[-1].delta is not delta:
        raise DeltaError("cannot remove the sparse delta; the model is unchanged",
                         [f"{len(stack) - 1 - stack.index(mine[-1])} delta(s) applied after it must be removed "
                          f"first (deltas come off in reverse order of application)"])
    app = stack[-1]
    state = _state_of(model, "model")
    problems = ["the model's deltas are switched off (inside `disabled`): remove after the block"] if (
        model in _SWITCHED_OFF) else []
    for name, p in zip(app.names + app.dense_names, app.params + app.dense_params):
        now = state.get(name)
        if now is None or now.data_ptr() != p.data_ptr() or now.shape != p.shape or now.dtype != p.dtype:
            problems.append(f"{name}: the weight was replaced since the delta was applied")
    if problems:
        raise DeltaError("cannot remove the sparse delta; the model is unchanged", problems)
    with torch.no_grad():
        _write(app.params, app.indices, app.originals)
        for p, original in zip(app.dense_params, app.dense_originals):
            p.copy_(original)
    for module in app.quantized_modules:
        detach_frozen_delta_(module)
    stack.pop()


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Switch every delta applied to `model` off for a `with` block: inside, the model computes its base's
    outputs bit for bit; after the block (an exception included), its tuned outputs bit for bit.

    Off writes back the values each `apply_` overwrote (latest application first) after keeping the tuned
    values at the same entries and the tuned dense parts; on writes those kept values back. Nothing is
    subtracted, so both directions are exact in every dtype. A quantized layer's frozen delta is switched
    off by running the layer's own forward. Inside the block, `apply_` and `remove_` on `model` are refused.

    Args:
        model: a model with deltas applied (`SparseDelta.apply_`, `sift.from_pretrained`); none is fine.

    Yields:
        `model`.

    Example:
        >>> from sift import SparseDelta
        >>> base, tuned = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        >>> before = base.weight.clone()
        >>> SparseDelta.from_diff(base, tuned, density=1.0).apply_(base)
        >>> with disabled(base):
        ...     torch.equal(base.weight, before)
        True
        >>> torch.equal(base.weight, tuned.weight)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if model in _SWITCHED_OFF:  # an inner block: the deltas are off already, and the outer block turns them on
        _SWITCHED_OFF[model] += 1
        try:
            yield model
        finally:
            _SWITCHED_OFF[model] -= 1
        return
    applications = list(_APPLIED.get(model, []))
    with torch.no_grad():
        tuned = [[p.view(-1).index_select(0, idx) for p, idx in zip(app.params, app.indices)] for app in applications]
        tuned_dense = [[p.clone() for p in app.dense_params] for app in applications]
        for app in reversed(applications):
            _write(app.params, app.indices, app.originals)
            for p, original in zip(app.dense_params, app.dense_originals):
                p.copy_(original)
            for module in app.quantized_modules:
                set_delta_enabled(module, False)
    _SWITCHED_OFF[model] = 1
    try:
        yield model
    finally:
        del _SWITCHED_OFF[model]
        with torch.no_grad():
            for app, values, dense in zip(applications, tuned, tuned_dense):
                _write(app.params, app.indices, values)
                for p, value in zip(app.dense_params, dense):
                    p.copy_(value)
                for module in app.quantized_modules:
                    set_delta_enabled(module, True)


def _write(params: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """params[i].view(-1)[indices[i]] = values[i], per device through the restore op."""
    for device, members in _by_device(params).items():
        _ops.call("sparse_delta_restore_", [params[i] for i in members], [indices[i] for i in members],
                  [values[i] for i in members], device=device)


def _counted(what: str, problems: Sequence[tuple[str, str]]) -> list[str]:
    """(name, problem) pairs of one kind: a line each when few, else one line with their count and the first
    `LISTED_PER_KIND` (a delta for another architecture would otherwise list every weight)."""
    if len(problems) <= LISTED_PER_KIND:
        return [f"{name}: {problem}" for name, problem in problems]
    listed = "; ".join(name if problem.startswith("no such") else f"{name} ({problem.split(': ', 1)[-1]})"
                       for name, problem in problems[:LISTED_PER_KIND])
    return [f"{len(problems)} {what}: {listed}; and {len(problems) - LISTED_PER_KIND} more"]


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
