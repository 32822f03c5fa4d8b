"""Merging deltas of one base model: per weight, the sorted union of their indices, summed, averaged or
TIES-merged (`merge`, behind `sift.delta.merge_deltas` and `SparseDelta`'s `+` and `-`). The k-way
merge is the op `merge_sorted_deltas` of `sift._ops`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sift import _ops
from sift._index import index_dtype as _index_dtype
from sift.delta.contents import DeltaT
from sift.delta.entry import DeltaEntry, DeltaError


MERGE_METHODS = ("sum", "mean", "ties")


def merge(cls: type[DeltaT], deltas: Sequence[DeltaT], weights: Sequence[float] | None = None,
          method: str = "sum") -> DeltaT:
    """`merge_deltas(deltas, weights, method)` (documented there) for deltas of class `cls`: every problem
    found first, then one k-way merge over all weights.

    Example:
        >>> from sift import SparseDelta
        >>> a = SparseDelta.from_diff({"w": torch.zeros(3)}, {"w": torch.tensor([1.0, 0, 2])}, density=1.0)
        >>> b = SparseDelta.from_diff({"w": torch.zeros(3)}, {"w": torch.tensor([0.0, 3, 2])}, density=1.0)
        >>> merge(SparseDelta, [a, b], method="ties")["w"].values
        tensor([1., 3., 2.])
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"method must be one of {MERGE_METHODS}, got {method!r}")
    deltas = list(deltas)
    if not deltas or not all(isinstance(d, cls) for d in deltas):
        raise TypeError(f"deltas must be a non-empty sequence of {cls.__name__}")
    weights = [1.0] * len(deltas) if weights is None else [float(w) for w in weights]
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(weights)} weights for {len(deltas)} deltas")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be finite, got {weights}")
    if method == "mean":
        total = sum(weights)
        if total == 0:
            raise ValueError("method='mean' needs weights that do not sum to 0")
        weights = [w / total for w in weights]
    problems = [f"delta {i}: {p}" for i, d in enumerate(deltas) for p in d.problems()]
    base = None
    for i, d in enumerate(deltas):
        if d.base is None:
            continue
        if base is None:
            base, first = d.base, i
            continue
        problems += [f"delta {i} and delta {first} are for different base models: {c}" for c in base.conflicts(d.base)]
        base = base.union(d.base)
    layout: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
    for i, d in enumerate(deltas):
        for name, e in d.entries.items():
            shape, dtype, j = layout.setdefault(name, (e.shape, e.dtype, i))
            if (shape, dtype) != (e.shape, e.dtype):
                problems.append(f"{name}: delta {i} has {e.dtype} {e.shape}, delta {j} has {dtype} {shape}")
    dense: dict[str, torch.Tensor] = {}
    dense_from: dict[str, int] = {}
    for i, d in enumerate(deltas):
        for name, t in d.dense.items():
            if name in layout:
                problems.append(f"{name}: a dense part in delta {i} and a sparse entry in another")
            elif name in dense and not torch.equal(dense[name], t):
                problems.append(f"{name}: deltas {dense_from[name]} and {i} replace it with different tensors "
                                "(merge the heads by hand)")
            else:
                dense.setdefault(name, t.clone())
                dense_from.setdefault(name, i)
    if problems:
        raise DeltaError("cannot merge these deltas", problems)
    names = list(layout)
    flat_idx, flat_val, flat_w, sizes = [], [], [], []
    for name in names:
        members = [(d.entries[name], w) for d, w in zip(deltas, weights) if name in d.entries]
        sizes.append(len(members))
        for e, w in members:
            flat_idx.append(e.indices)
            flat_val.append(e.values)
            flat_w.append(w)
    entries = {}
    if names:
        out_idx, out_val = _ops.call("merge_sorted_deltas", flat_idx, flat_val, flat_w, sizes, method == "ties")
        for name, idx, val in zip(names, out_idx, out_val):
            shape, dtype, _ = layout[name]
            entries[name] = DeltaEntry(shape, dtype, idx.to(_index_dtype(math.prod(shape))), val)
    return cls(entries, base, dense)
