"""How deltas are made: `from_optimizer` (a trained SparseAdamW's exact increments, FSDP2 shards
gathered) and `from_diff` (the largest differences of two state dicts), behind the classmethods of
`SparseDelta` of the same names. Each is given the class to make (`SparseDelta`, which sits above)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sift import _ops
from sift._index import entries_for as _entries_for
from sift._index import index_dtype as _index_dtype
from sift._index import top_k_positions
from sift.delta.contents import DeltaT
from sift.delta.entry import SUPPORTED_DTYPES, DeltaEntry, DeltaError
from sift.delta.fingerprint import (BaseFingerprint, _find, _float_tensors, _sample_positions, _state_of, logical_state,
                                    sharded_fingerprint)
from sift.delta.identity import model_identity
from sift.delta.packing import HALF_DTYPES, shortest_increments
from sift._params import (full_tensor, gather_entries, increments, is_dense_stepped, is_dtensor, local_shard_of,
                          quantized_routes)


def from_optimizer(cls: type[DeltaT], optimizer: torch.optim.Optimizer, model: nn.Module,
                   base: nn.Module | Mapping[str, torch.Tensor] | None = None) -> DeltaT:
    """`cls.from_optimizer(optimizer, model, base)` (`SparseDelta.from_optimizer` documents it): the
    trained optimizer's exact increments, dense groups' params whole, and the base values it can know.

    Example:
        >>> from sift import SparseAdamW, SparseDelta
        >>> model = torch.nn.Linear(16, 8)
        >>> opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
        >>> model(torch.randn(4, 16)).square().mean().backward()
        >>> opt.step()
        >>> from_optimizer(SparseDelta, opt, model).nnz
        14
    """
    lean = getattr(optimizer, "state_layout", "exact") == "lean"
    if lean and base is None:
        raise ValueError("SparseDelta.from_optimizer of a lean optimizer (state='lean', which keeps no increments) "
                         "needs base= (the model's state before training); or use SparseDelta.from_diff")
    def fingerprint_of(tensors: Mapping[str, torch.Tensor]) -> BaseFingerprint:
        if any(is_dtensor(t) for t in tensors.values() if isinstance(t, torch.Tensor)):
            return sharded_fingerprint(tensors)
        return BaseFingerprint.of(tensors)

    names = {p: n for n, p in model.named_parameters()}
    tied: dict[str, tuple[str, ...]] = {}  # a param's name -> every name it has in the model
    for name, p in model.named_parameters(remove_duplicate=False):
        tied[names[p]] = (*tied.get(names[p], ()), name)
    state = model.state_dict(keep_vars=True)
    base_state = _state_of(base, "base") if base is not None else None
    entries, problems = {}, []
    dense: dict[str, torch.Tensor] = {}
    # 4-bit layers' deltas (sift.quantized): entries of the weight the packed one was quantized from.
    quantized = quantized_routes(optimizer)
    for values, route in quantized.items():
        indices = route.indices
        if indices is not None:
            entries[f"{route.name}.weight"] = DeltaEntry((route.module.out_features, route.module.in_features),
                                                         route.base_dtype, indices.cpu().clone(),
                                                         values.detach().float().cpu().clone())
    known: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (positions, base values)
    unknown: dict[str, torch.Tensor | None] = {}  # name -> positions of unknown base (None: all)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in quantized:
                continue
            name = names.get(p)
            if name is None:
                problems.append(f"an optimizer param of shape {tuple(p.shape)} is not a parameter of the model")
                continue
            st = optimizer.state.get(p, {})
            numel = p.numel()
            if is_dtensor(p):
                # FSDP2: this rank's state holds positions in its own shard; every rank's k entries are
                # gathered (collective: every rank walks the same params), never the weight itself.
                local = p.to_local()
                exact = gather_entries(p, _short(local, increments(st, local.numel()) if not lean else
                                                         _lean_increments(local, st, local_shard_of(
                                                             p, base_state.get(name)))))
            else:
                exact = _short(p, increments(st, numel) if not lean else
                               _lean_increments(p, st, base_state.get(name)))
            if exact is not None:
                idx, values, base_values = exact
                entries[name] = DeltaEntry(tuple(p.shape), p.dtype, idx, values)
                if base_values is not None:
                    known[name] = (idx, base_values)
                else:
                    unknown[name] = idx
            elif is_dense_stepped(st) and group.get("density", 1.0) >= 1.0:
                dense[name] = full_tensor(p)
                unknown[name] = None
            # else: never stepped, or sparse selection still accumulating: nothing changed.
    if problems:
        raise DeltaError("cannot build a delta from this optimizer and model", problems)
    if quantized and any(is_dtensor(t) for t in state.values() if isinstance(t, torch.Tensor)):
        # FSDP2 shards the packed bytes (read only inside a forward, gathered): no base sampled.
        fingerprint = None
    elif base_state is not None and not quantized:
        fingerprint = fingerprint_of(base_state)
        for name in dense:  # replaced whole: the base may hold anything there (a new head)
            for alias in tied.get(name, (name,)):
                fingerprint.samples.pop(alias, None)
    else:
        # A quantized base is read as the 16-bit model it was quantized from (its packed weights never
        # change in training): the fingerprint then fits both.
        fingerprint = fingerprint_of(logical_state(model) if quantized else state)
        for route in quantized.values():
            samples, tolerances = _dequantized_samples(route)
            fingerprint.samples[f"{route.name}.weight"] = samples
            fingerprint.tolerances[f"{route.name}.weight"] = tolerances
        # Buffers (BatchNorm's running statistics) change in training outside the optimizer,
        # so the trained model does not know their base values.
        param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for name in [n for n in fingerprint.samples if n not in param_names]:
            del fingerprint.samples[name]
        # A tied param (a head tied to the embedding) trained under one name changed under all of its names.
        for name, positions in unknown.items():
            for alias in tied.get(name, (name,)):
                if positions is None:
                    fingerprint.samples.pop(alias, None)
                    continue
                for pos in list(fingerprint.samples.get(alias, {})):
                    if _find(positions, pos) is not None:
                        del fingerprint.samples[alias][pos]
        for name, (positions, values) in known.items():
            for alias in tied.get(name, (name,)):
                for pos in fingerprint.samples.get(alias, {}):
                    j = _find(positions, pos)
                    if j is not None:
                        fingerprint.samples[alias][pos] = float(values[j]).hex()
    info = _optimizer_info(optimizer)
    info["base_model"] = model_identity(model)
    return cls(entries, fingerprint, dense, info)

def from_diff(cls: type[DeltaT], base: nn.Module | Mapping[str, torch.Tensor],
              tuned: nn.Module | Mapping[str, torch.Tensor], *, density: float | None = None,
              threshold: float | None = None) -> DeltaT:
    """`cls.from_diff(base, tuned, ...)` (`SparseDelta.from_diff` documents it): the largest differences
    of two state dicts, per tensor.

    Example:
        >>> from sift import SparseDelta
        >>> d = from_diff(SparseDelta, {"w": torch.zeros(3)}, {"w": torch.tensor([0.0, 2.0, -5.0])}, density=0.5)
        >>> d["w"].indices, d["w"].values
        (tensor([1, 2], dtype=torch.int32), tensor([ 2., -5.]))
    """
    if (density is None) == (threshold is None):
        raise ValueError("pass exactly one of density= or threshold=")
    if density is not None and not (isinstance(density, (int, float)) and 0 < density <= 1):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if threshold is not None and not (isinstance(threshold, (int, float)) and threshold >= 0):
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    base_state, tuned_state = _state_of(base, "base"), _state_of(tuned, "tuned")
    problems, entries, seen = [], {}, set()
    for name, t in _float_tensors(tuned_state).items():
        b = base_state.get(name)
        if b is None:
            problems.append(f"{name}: in tuned but missing from base")
            continue
        if b.shape != t.shape or b.dtype != t.dtype:
            problems.append(f"{name}: base is {b.dtype} {tuple(b.shape)}, tuned is {t.dtype} {tuple(t.shape)}")
            continue
        if t.dtype not in SUPPORTED_DTYPES:
            problems.append(f"{name}: dtype {t.dtype} is not supported (float32, bfloat16, float16)")
            continue
        # Tied weights appear under several names; one entry applies them once.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.device)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        diff = t.detach().float().cpu().reshape(-1) - b.detach().float().cpu().reshape(-1)
        if density is not None:
            k = min(_entries_for(density, diff.numel()), int(diff.count_nonzero()))
            idx = top_k_positions(diff.abs(), k)  # ties: the lower flat index, as the optimizer
        else:
            idx = (diff.abs() > threshold).nonzero().view(-1)
        if idx.numel():
            values = diff[idx]
            if t.dtype in HALF_DTYPES:
                flat_t, flat_b = t.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
                values = shortest_increments(flat_b[idx], flat_t[idx], values)
            entries[name] = DeltaEntry(tuple(t.shape), t.dtype, idx.to(_index_dtype(t.numel())), values)
    if problems:
        raise DeltaError("cannot diff these state dicts", problems)
    info = {"base_model": model_identity(base)} if isinstance(base, nn.Module) else {}
    return cls(entries, BaseFingerprint.of(base_state), {}, info)


def _dequantized_samples(route: Any) -> tuple[dict[int, str], dict[int, str]]:
    """A quantized layer's base samples: its dequantized weight (in the dtype it was quantized from) at the
    fingerprint's positions, and per position how far the 16-bit weight it came from may lie from it.

    Rounding to nearest moves an entry by at most half the gap between the codes around it, times its
    scale: an int8 row's absmax / 127; a 4-bit block's absmax (of `blocksize` flat entries) times at most
    0.139 (NF4) or 0.167 (FP4), bounded here by 0.25 (double quantization rounds the absmax too).
    """
    dense = route.weight(route.base_dtype, route.values, None).detach().float().cpu().reshape(-1)
    quant_state = getattr(route.module.weight, "quant_state", None) or getattr(route, "quant_state", None)
    if quant_state is not None:
        span, factor = int(quant_state.blocksize), 0.25
    else:  # int8: one scale per row
        span, factor = int(route.module.in_features), 0.6 / 127
    samples, tolerances = {}, {}
    for pos in _sample_positions(dense.numel()):
        start = pos // span * span
        scale = float(dense[start:start + span].abs().max())
        value = float(dense[pos])
        samples[pos] = value.hex()
        # and the rounding of the 16-bit value itself
        tolerances[pos] = (factor * scale + abs(value) * torch.finfo(route.base_dtype).eps).hex()
    return samples, tolerances


def _lean_increments(p: torch.Tensor, state: Mapping[str, Any], base: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A lean state's chosen entries, tuned minus base values there, and the base values (on the CPU)."""
    if "indices_low" not in state:
        return None
    if base is None or base.shape != p.shape:
        raise DeltaError("cannot build a delta from this optimizer and model",
                         [f"a lean sparse param of shape {tuple(p.shape)} is missing from base or of another shape"])
    numel = p.numel()
    idx = _ops.decode_lean_indices(state["indices_low"].cpu(), state["window_offsets"].cpu(), _index_dtype(numel))
    if "retired_indices" in state:  # entries a re-selection (or set_indices) dropped keep their increment
        idx = torch.cat([idx, state["retired_indices"].cpu().to(idx.dtype)]).sort().values
    base_values = base.detach().reshape(-1)[idx.long()].cpu()
    return idx, _tuned(p, idx).float() - base_values.float(), base_values


def _short(p: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """For a 16-bit weight whose base is known, each increment as the 16-bit value that gives the
    tuned weight where one exists (2 bytes in the file), else tuned minus base in fp32."""
    if exact is None or exact[2] is None or p.dtype not in HALF_DTYPES:
        return exact
    idx, _, base_values = exact
    tuned = _tuned(p, idx)
    return idx, shortest_increments(base_values, tuned, tuned.float() - base_values.float()), base_values


def _tuned(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """p's current values at flat positions `idx`, on the CPU."""
    return p.detach().reshape(-1)[idx.long().to(p.device)].cpu()


def _optimizer_info(optimizer: torch.optim.Optimizer) -> dict:
    """What a fine-tune's config records of its optimizer: rule, state layout, and per group its density."""
    groups = []
    for group in optimizer.param_groups:
        groups.append({"name": group.get("name"), "density": float(group.get("density", 1.0)),
                       "params": len(group["params"])})
    return {"selection": getattr(optimizer, "selection", None), "state": getattr(optimizer, "state_layout", None),
            "select_steps": getattr(optimizer, "select_steps", None), "groups": groups,
            "quantized": bool(quantized_routes(optimizer))}
