"""`SparseDelta`: a fine-tune as per-weight sorted indices and fp32 increments, plus dense parts.
Here the container, its arithmetic (`scaled`, `+`, `-`, `*`, `/`) and `merge_deltas`; making
deltas, their files and applying them are the mixins of `construction`, `storage` and
`application`."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from sift import _ops
from sift._index import index_dtype as _index_dtype
from sift.delta.application import DeltaApplicationMixin
from sift.delta.construction import DeltaConstructionMixin
from sift.delta.entry import DeltaEntry, DeltaError
from sift.delta.fingerprint import BaseFingerprint
from sift.delta.storage import DeltaFileMixin, _checksum


MERGE_METHODS = ("sum", "mean", "ties")


class SparseDelta(DeltaConstructionMixin, DeltaFileMixin, DeltaApplicationMixin):
    """A fine-tune: per sparse weight, sorted unique flat indices and fp32 increments; per densely
    trained param (a task head), the whole trained tensor.

    Args:
        entries: name -> `DeltaEntry` (tensors on the CPU; they are validated when the delta
            is applied, merged or saved).
        base: fingerprint of the base model, or None to skip the base checks. It never covers
            the dense parts, which replace whatever the base holds there.
        dense: name -> the trained tensor that replaces the param whole (a head trained densely).

    Example:
        >>> base = torch.nn.Linear(4, 3)
        >>> tuned = torch.nn.Linear(4, 3)
        >>> delta = SparseDelta.from_diff(base, tuned, density=0.5)
        >>> delta.apply_(base)
        >>> delta.remove_(base)
    """

    def __init__(self, entries: Mapping[str, DeltaEntry] | None = None, base: BaseFingerprint | None = None,
                 dense: Mapping[str, torch.Tensor] | None = None):
        self.entries: dict[str, DeltaEntry] = dict(entries or {})
        self.base = base
        self.dense: dict[str, torch.Tensor] = dict(dense or {})
        # What the fine-tune was (density, selection, targets; set by from_optimizer), for its config file.
        self.info: dict = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> DeltaEntry:
        return self.entries[name]

    @property
    def nnz(self) -> int:
        """Entries over all weights."""
        return sum(e.nnz for e in self.entries.values())

    def __repr__(self) -> str:
        dense = f", {len(self.dense)} dense" if self.dense else ""
        return (f"SparseDelta({len(self)} tensors, {self.nnz} entries{dense}, "
                f"base={'known' if self.base else 'unknown'})")

    def problems(self) -> list[str]:
        """Everything wrong inside this delta (dtypes, sortedness, range, finiteness)."""
        out = [p for name, e in self.entries.items() for p in e.problems(name)]
        for name, t in self.dense.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                out.append(f"{name}: a dense part must be a floating-point tensor")
            elif not bool(torch.isfinite(t).all()):
                out.append(f"{name}: the dense part holds NaN or infinite values")
            if name in self.entries:
                out.append(f"{name}: both a sparse entry and a dense part")
        return out

    def checksum(self) -> str:
        """A blake2b digest of the delta's tensors (names, indices, values, dense parts)."""
        tensors = {f"{n}.indices": e.indices for n, e in self.entries.items()}
        tensors.update({f"{n}.values": e.values for n, e in self.entries.items()})
        tensors.update({f"{n}.dense": t for n, t in self.dense.items()})
        return _checksum({k: t.detach().cpu().contiguous() for k, t in tensors.items()})

    def to_dense(self, name: str) -> torch.Tensor:
        """The delta of weight `name` as a dense fp32 tensor of the weight's shape.

        Example:
            >>> d = SparseDelta({"w": DeltaEntry((2, 2), torch.float32, torch.tensor([3], dtype=torch.int32),
            ...                                  torch.tensor([1.5]))})
            >>> d.to_dense("w")
            tensor([[0.0000, 0.0000],
                    [0.0000, 1.5000]])
        """
        e = self.entries[name]
        dense = torch.zeros(e.numel, dtype=torch.float32)
        dense[e.indices.long()] = e.values
        return dense.view(e.shape)

    def scaled(self, factor: float) -> SparseDelta:
        """A copy with every value multiplied by `factor` (in fp32); dense parts are kept as they are
        (a trained head is a replacement, not an increment).

        Example:
            >>> d = SparseDelta.from_diff({"w": torch.zeros(2)}, {"w": torch.ones(2)}, density=1.0)
            >>> (0.5 * d)["w"].values
            tensor([0.5000, 0.5000])
        """
        factor = float(factor)
        entries = {n: DeltaEntry(e.shape, e.dtype, e.indices.clone(), e.values * factor)
                   for n, e in self.entries.items()}
        scaled = SparseDelta(entries, self.base, {n: t.clone() for n, t in self.dense.items()})
        scaled.info = dict(self.info)
        return scaled

    def __mul__(self, factor: object) -> SparseDelta:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            return NotImplemented
        return self.scaled(factor)

    __rmul__ = __mul__

    def __truediv__(self, divisor: object) -> SparseDelta:
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)):
            return NotImplemented
        return self.scaled(1.0 / divisor)

    def __neg__(self) -> SparseDelta:
        return self.scaled(-1.0)

    def __add__(self, other: object) -> SparseDelta:
        if not isinstance(other, SparseDelta):
            return NotImplemented
        return merge_deltas([self, other])

    def __radd__(self, other: object) -> SparseDelta:
        # sum(deltas) starts from 0.
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self
        return NotImplemented

    def __sub__(self, other: object) -> SparseDelta:
        if not isinstance(other, SparseDelta):
            return NotImplemented
        return merge_deltas([self, other], weights=[1.0, -1.0])


def merge_deltas(deltas: Sequence[SparseDelta], weights: Sequence[float] | None = None,
                 method: str = "sum") -> SparseDelta:
    """Merges deltas of one base model into one: per weight, the sorted union of their indices.

    With contributions `c_i = weights[i] * values_i` at an index (absent deltas contribute 0):

        "sum":   sum_i c_i                          (task arithmetic)
        "mean":  sum_i c_i / sum_i weights[i]       (the mean of the dense deltas)
        "ties":  s = sign(sum_i c_i); the mean of the c_i of sign s, over the deltas holding
                 the index (TIES-merging's elect + disjoint mean, Yadav et al. 2023; the
                 trim step is the deltas' own sparsity)

    Reductions run in float64 and round to fp32 once. The k-way merge runs in C++ on the CPU
    (torch's sort elsewhere). Dense parts (trained heads) are replacements, not increments: the
    merge carries each through unchanged, and refuses a param that two deltas replace with
    different tensors.

    Args:
        deltas: one or more deltas; weights shared by several must agree in shape and dtype,
            and their base fingerprints must be compatible.
        weights: one float per delta (default: all 1).
        method: "sum", "mean" or "ties".

    Returns:
        A new delta with the union of the fingerprints.

    Raises:
        DeltaError: the deltas do not fit together; every problem listed.

    Example:
        >>> a = SparseDelta.from_diff({"w": torch.zeros(3)}, {"w": torch.tensor([1.0, 0, 2])}, density=1.0)
        >>> b = SparseDelta.from_diff({"w": torch.zeros(3)}, {"w": torch.tensor([0.0, 3, 2])}, density=1.0)
        >>> merge_deltas([a, b], method="mean")["w"].values
        tensor([0.5000, 1.5000, 2.0000])
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"method must be one of {MERGE_METHODS}, got {method!r}")
    deltas = list(deltas)
    if not deltas or not all(isinstance(d, SparseDelta) for d in deltas):
        raise TypeError("deltas must be a non-empty sequence of SparseDelta")
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
    return SparseDelta(entries, base, dense)
