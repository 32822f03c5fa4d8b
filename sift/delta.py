"""Sparse deltas: a sparse fine-tune as index/value pairs per weight.

A `SparseDelta` maps parameter names to `DeltaEntry`s: the weight's shape and dtype, the flat
positions `indices` ([k] int32, or int64 for weights of >= 2**31 elements; sorted, unique)
and the fp32 increments `values` ([k]). Applying adds them in place,

    w.view(-1)[indices] = dtype(fp32(w.view(-1)[indices]) + fp32(scale) * values),

so a fine-tune costs nothing at inference time, and `remove_` writes back the values the
apply overwrote (kept by `apply_`), which restores the weights bit for bit in every dtype.
No arithmetic inverse could promise that: `w + d - d` rounds, in bf16 most of all.

Deltas come from a trained `sift.SparseAdamW` (`SparseDelta.from_optimizer`: the optimizer's
exact increments, no copy of the base model needed) or from two state dicts (`from_diff`,
top-|difference| per tensor). They save to safetensors (`save` / `load`, 6 bytes per entry,
bit-exact) or as a fine-tune directory (`save_pretrained`) and combine with `merge_deltas` (sum, mean, or TIES-style sign election), `+` and `*`.

Every delta remembers a fingerprint of the base model it was made for: a hash of the names,
shapes and dtypes of all its floating-point tensors, and the values of the base at a few fixed
positions per tensor. `apply_` refuses another base, `merge_deltas` refuses deltas of different
bases, and nothing is modified before every check has passed.

The kernels (k-way merge, scatter-add with the gather of the overwritten values, restore) are
the ops `merge_sorted_deltas`, `sparse_delta_apply_` and `sparse_delta_restore_` of `sift._ops`:
C++ on CPU, Triton (apply/restore) or torch (merge) on CUDA.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from dataclasses import dataclass, field

import torch
from torch import nn

from sift import _ops
from sift._index import entries_for as _entries_for
from sift._index import index_dtype as _index_dtype
from sift._index import top_k_positions
from sift.optim.state import increments, is_dense_stepped, is_dtensor

__all__ = ["BaseFingerprint", "DeltaEntry", "DeltaError", "SparseDelta", "merge_deltas"]

FORMAT = "sift.sparse_delta"
# 2: dense parts (`<name>.dense`) and the "dense" metadata. 3: indices as 16-bit halves under a
# window table (`<name>.indices_low`, `<name>.window_offsets`). Older files read as before.
FORMAT_VERSION = 3
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MERGE_METHODS = ("sum", "mean", "ties")
# Fixed positions per tensor whose base values go into the fingerprint (first, last, two inner).
SAMPLES_PER_TENSOR = 4
# Problems listed in one error before the rest are summarised.
MAX_LISTED_PROBLEMS = 20

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeltaError(ValueError):
    """A delta does not fit a model, a file, or other deltas; the message lists every problem.

    Attributes:
        problems: one line per problem found.
    """

    def __init__(self, what: str, problems: Sequence[str]):
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED_PROBLEMS]
        more = len(self.problems) - len(shown)
        lines = [f"{what} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in shown]
        if more:
            lines.append(f"  - ... and {more} more")
        super().__init__("\n".join(lines))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sample_positions(numel: int) -> list[int]:
    if numel <= 0:
        return []
    return sorted({j * (numel - 1) // (SAMPLES_PER_TENSOR - 1) for j in range(SAMPLES_PER_TENSOR)})


def _float_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in state.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}


def _state_of(obj: nn.Module | Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    if isinstance(obj, nn.Module):
        return obj.state_dict(keep_vars=True)
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"{what} must be an nn.Module or a state dict, got {type(obj).__name__}")


def _structure_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, list(t.shape), _dtype_name(t.dtype)]).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class BaseFingerprint:
    """What a delta knows of the base model it was made for.

    Attributes:
        structure: sha256 of the names, shapes and dtypes of the base's floating-point tensors.
        n_tensors: how many tensors `structure` covers (for error messages).
        samples: name -> {flat position: `float.hex` of the base value there}, at up to
            `SAMPLES_PER_TENSOR` fixed positions per tensor. The values themselves are kept,
            not one hash of them: a delta from `from_optimizer` cannot know the base value of
            an fp32 weight where training changed it, so deltas know different subsets and are
            compared where both know a value.
    """

    structure: str
    n_tensors: int
    samples: dict[str, dict[int, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> BaseFingerprint:
        """The fingerprint of a base model given as a (name -> tensor) state dict.

        Example:
            >>> fp = BaseFingerprint.of(torch.nn.Linear(3, 2).state_dict())
            >>> sorted(fp.samples)
            ['bias', 'weight']
        """
        tensors = _float_tensors(state)
        samples = {}
        for name, t in tensors.items():
            pos = _sample_positions(t.numel())
            if pos:
                vals = t.detach().reshape(-1)[torch.tensor(pos, device=t.device)].tolist()
                samples[name] = {p: float(v).hex() for p, v in zip(pos, vals)}
        return cls(_structure_hash(tensors), len(tensors), samples)

    def conflicts(self, other: BaseFingerprint) -> list[str]:
        """Reasons the two fingerprints cannot describe one base model ([] when compatible)."""
        if self.structure != other.structure:
            return [
                f"base structure differs (names, shapes and dtypes of {self.n_tensors} vs {other.n_tensors} "
                f"floating-point tensors)"
            ]
        differing = [
            f"{name}[{pos}]"
            for name, mine in self.samples.items()
            for pos, value in mine.items()
            if other.samples.get(name, {}).get(pos, value) != value
        ]
        if differing:
            return [f"{len(differing)} sampled base values differ (first: {', '.join(differing[:3])})"]
        return []

    def union(self, other: BaseFingerprint) -> BaseFingerprint:
        """The fingerprint knowing the samples of both (they must not conflict)."""
        samples = {name: dict(vals) for name, vals in self.samples.items()}
        for name, vals in other.samples.items():
            samples.setdefault(name, {}).update(vals)
        return BaseFingerprint(self.structure, self.n_tensors, samples)

    def to_json(self) -> str:
        return json.dumps({"structure": self.structure, "n_tensors": self.n_tensors,
                           "samples": {n: {str(p): v for p, v in s.items()} for n, s in self.samples.items()}},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BaseFingerprint:
        d = json.loads(text)
        samples = {n: {int(p): str(v) for p, v in s.items()} for n, s in d["samples"].items()}
        return cls(str(d["structure"]), int(d["n_tensors"]), samples)


@dataclass
class DeltaEntry:
    """The delta of one weight.

    Attributes:
        shape: the weight's shape.
        dtype: the weight's dtype (float32, bfloat16 or float16).
        indices: [k] int32 (int64 for >= 2**31 elements) flat positions, sorted, unique.
        values: [k] fp32 increments.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        # A list or torch.Size shape must compare equal to the model's `tuple(p.shape)`.
        self.shape = tuple(int(s) for s in self.shape)

    @property
    def numel(self) -> int:
        """Elements of the weight (not of the delta)."""
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """Entries of the delta."""
        return int(self.indices.numel())

    def problems(self, name: str) -> list[str]:
        """Everything wrong with this entry, one line each ([] when valid)."""
        out = []
        if self.dtype not in SUPPORTED_DTYPES:
            out.append(f"{name}: weight dtype {self.dtype} is not supported (float32, bfloat16, float16)")
        idx, val = self.indices, self.values
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
            what = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            return out + [f"{name}: indices must be a 1-D int32/int64 tensor, got {what}"]
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or val.dim() != 1:
            what = f"{val.dtype} {tuple(val.shape)}" if isinstance(val, torch.Tensor) else type(val).__name__
            return out + [f"{name}: values must be a 1-D float32 tensor, got {what}"]
        if val.numel() != idx.numel():
            return out + [f"{name}: {idx.numel()} indices but {val.numel()} values"]
        if idx.dtype == torch.int32 and self.numel > 2**31:
            out.append(f"{name}: int32 indices cannot address a weight of {self.numel} elements")
        if idx.numel():
            if idx.numel() > 1:
                bad = (idx[1:] <= idx[:-1]).nonzero()
                if bad.numel():
                    j = int(bad[0])
                    out.append(f"{name}: indices are not sorted and unique (position {j + 1}: {int(idx[j + 1])} "
                               f"after {int(idx[j])})")
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.numel:
                out.append(f"{name}: indices out of range: span [{lo}, {hi}] for a weight of {self.numel} elements")
            finite = torch.isfinite(val)
            if not bool(finite.all()):
                n_nan = int(torch.isnan(val).sum())
                out.append(f"{name}: {n_nan} NaN and {int((~finite).sum()) - n_nan} infinite values")
        return out


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


class SparseDelta:
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

    # ---------------------------------------------------------------- container

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

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, model: nn.Module,
                       base: nn.Module | Mapping[str, torch.Tensor] | None = None) -> SparseDelta:
        """The delta a trained `SparseAdamW` applied to `model`: its exact increments.

        Sparse weights give their chosen `indices` and `delta` state (the total increment
        since selection), merged with the entries `set_indices` retired (`retired_indices`,
        `retired_delta`), so a selection changed mid-training loses nothing. Params of dense
        groups (`density=1.0`, a task head) are stored whole as dense parts: `apply_` puts the
        trained tensor in place (whatever the base holds there, a freshly initialised head
        included) and `remove_` restores the replaced one.

        A lean optimizer (`SparseAdamW(state="lean")`) keeps no increments: give `base` (the
        state before training), and its chosen entries' increments are the tuned values minus
        the base values there (in fp32: exact for bf16/fp16 weights).

        The deltas of 4-bit layers (`for_model` on a bitsandbytes 4-bit model) become entries of
        `<layer>.weight` in the dtype the weight had before quantization: `apply_` merges them
        into the 16-bit model, `sift.quantized.attach_delta_` puts them back on the 4-bit one.
        Such a delta has no base fingerprint (no one fingerprint describes both models).

        Args:
            optimizer: a `sift.SparseAdamW` (any optimizer with that state layout).
            model: the trained model; names come from `model.named_parameters()`.
            base: the model's state before training (optional): fingerprints the base from it
                instead of from the untouched entries of `model`.

        Returns:
            The delta, fingerprinted with the base values it can know: untouched entries of
            `model`'s parameters (not its buffers), the `base` state of weights that keep one
            (bf16/fp16, and fp32 with `keep_base=True`), and
            `base` if given.

        Example:
            >>> from sift import SparseAdamW
            >>> model = torch.nn.Linear(16, 8)
            >>> opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
            >>> model(torch.randn(4, 16)).square().mean().backward()
            >>> opt.step()
            >>> SparseDelta.from_optimizer(opt, model).nnz
            14
        """
        lean = getattr(optimizer, "state_layout", "exact") == "lean"
        if lean and base is None:
            raise ValueError("SparseDelta.from_optimizer of a lean optimizer (state='lean', which keeps no increments) "
                             "needs base= (the model's state before training); or use SparseDelta.from_diff")
        from sift.optim import sharded

        def fingerprint_of(tensors: Mapping[str, torch.Tensor]) -> BaseFingerprint:
            if any(is_dtensor(t) for t in tensors.values() if isinstance(t, torch.Tensor)):
                return sharded.sharded_fingerprint(tensors, BaseFingerprint)
            return BaseFingerprint.of(tensors)

        names = {p: n for n, p in model.named_parameters()}
        state = model.state_dict(keep_vars=True)
        base_state = _state_of(base, "base") if base is not None else None
        entries, problems = {}, []
        dense: dict[str, torch.Tensor] = {}
        # 4-bit layers' deltas (sift.quantized): entries of the weight the packed one was quantized from.
        quantized = getattr(optimizer, "_quantized", {})
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
                    exact = sharded.gather_entries(p, increments(st, local.numel()) if not lean else _lean_increments(
                        local, st, sharded.local_shard_of(p, base_state.get(name))))
                else:
                    exact = increments(st, numel) if not lean else _lean_increments(p, st, base_state.get(name))
                if exact is not None:
                    idx, values, base_values = exact
                    entries[name] = DeltaEntry(tuple(p.shape), p.dtype, idx, values)
                    if base_values is not None:
                        known[name] = (idx, base_values)
                    else:
                        unknown[name] = idx
                elif is_dense_stepped(st) and group.get("density", 1.0) >= 1.0:
                    dense[name] = sharded.full_tensor(p)
                    unknown[name] = None
                # else: never stepped, or sparse selection still accumulating: nothing changed.
        if problems:
            raise DeltaError("cannot build a delta from this optimizer and model", problems)
        if quantized:
            # A 4-bit fine-tune's delta applies to the 4-bit model and to the 16-bit model it was quantized
            # from, whose tensors differ: no one fingerprint describes both.
            fingerprint = None
        elif base_state is not None:
            fingerprint = fingerprint_of(base_state)
            for name in dense:  # replaced whole: the base may hold anything there (a new head)
                fingerprint.samples.pop(name, None)
        else:
            fingerprint = fingerprint_of(state)
            # Buffers (BatchNorm's running statistics) change in training outside the optimizer,
            # so the trained model does not know their base values.
            param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
            for name in [n for n in fingerprint.samples if n not in param_names]:
                del fingerprint.samples[name]
            for name, positions in unknown.items():
                if positions is None:
                    fingerprint.samples.pop(name, None)
                    continue
                for pos in list(fingerprint.samples.get(name, {})):
                    if _find(positions, pos) is not None:
                        del fingerprint.samples[name][pos]
            for name, (positions, values) in known.items():
                for pos in fingerprint.samples.get(name, {}):
                    j = _find(positions, pos)
                    if j is not None:
                        fingerprint.samples[name][pos] = float(values[j]).hex()
        delta = cls(entries, fingerprint, dense)
        delta.info = _optimizer_info(optimizer)
        return delta

    @classmethod
    def from_diff(cls, base: nn.Module | Mapping[str, torch.Tensor], tuned: nn.Module | Mapping[str, torch.Tensor],
                  *, density: float | None = None, threshold: float | None = None) -> SparseDelta:
        """The largest differences between two state dicts, per tensor.

        Args:
            base: the base model or its state dict.
            tuned: the fine-tuned model or its state dict (same names, shapes and dtypes).
            density: keep the top `ceil(density * numel)` |tuned - base| entries per tensor
                (nonzero ones only), in (0, 1].
            threshold: or keep every entry with |tuned - base| > threshold (>= 0).

        Returns:
            The delta over the floating-point tensors of `tuned` (the first name of tied
            tensors only), values `fp32(tuned) - fp32(base)`, fingerprinted with `base`.
            Tensors without a kept entry are left out. Applied to `base`, a kept entry gives
            `tuned` back exactly for bf16/fp16 weights, within one rounding for fp32 ones.

        Example:
            >>> base = {"w": torch.zeros(2, 3)}
            >>> tuned = {"w": torch.tensor([[0.0, 2.0, 0.0], [-5.0, 0.0, 0.1]])}
            >>> d = SparseDelta.from_diff(base, tuned, density=0.3)
            >>> d["w"].indices, d["w"].values
            (tensor([1, 3], dtype=torch.int32), tensor([ 2., -5.]))
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
                entries[name] = DeltaEntry(tuple(t.shape), t.dtype, idx.to(_index_dtype(t.numel())), diff[idx])
        if problems:
            raise DeltaError("cannot diff these state dicts", problems)
        return cls(entries, BaseFingerprint.of(base_state))

    # ---------------------------------------------------------------- files

    def save(self, path: str | os.PathLike) -> None:
        """Writes the delta to a safetensors file, atomically.

        Layout: per sparse weight, its sorted indices as their low 16 bits (`<name>.indices_low`,
        int16) under a table of where each 65536-element window starts (`<name>.window_offsets`,
        int32), and `<name>.values` (fp32): 6 bytes per entry and 4 per 65536 weight elements,
        bit-exact on reload; `<name>.dense` for each dense part (in its dtype); metadata with the format version, each weight's shape and dtype,
        the dense parts' names, the base fingerprint and a blake2b checksum of the tensors. The file is written under a temporary name in the same directory and renamed
        over `path`, so a crash never leaves a partial file under `path`.

        Args:
            path: destination file.

        Example:
            >>> import tempfile
            >>> d = SparseDelta.from_diff({"w": torch.zeros(4)}, {"w": torch.ones(4)}, density=0.5)
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     d.save(f"{tmp}/d.safetensors")
            ...     SparseDelta.load(f"{tmp}/d.safetensors").nnz
            2
        """
        from safetensors.torch import save_file

        problems = self.problems()
        if problems:
            raise DeltaError("refusing to save an invalid delta", problems)
        tensors, meta_entries, storages = {}, {}, set()
        for name, e in self.entries.items():
            low, offsets = _ops.encode_lean_indices(e.indices.cpu(), e.numel)
            for key, t in ((f"{name}.indices_low", low), (f"{name}.window_offsets", offsets),
                           (f"{name}.values", e.values)):
                t = t.detach().cpu().contiguous()
                # safetensors refuses tensors that share memory (slices of one user tensor).
                ptr = t.untyped_storage().data_ptr()
                if t.numel() and ptr in storages:
                    t = t.clone()
                storages.add(t.untyped_storage().data_ptr())
                tensors[key] = t
            meta_entries[name] = {"shape": list(e.shape), "dtype": _dtype_name(e.dtype)}
        for name, t in self.dense.items():
            tensors[f"{name}.dense"] = t.detach().cpu().contiguous().clone()
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "entries": json.dumps(meta_entries, separators=(",", ":")),
            "dense": json.dumps(sorted(self.dense), separators=(",", ":")),
            "checksum": _checksum(tensors),
        }
        if self.base is not None:
            metadata["base"] = self.base.to_json()
        path = os.fspath(path)
        tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                           f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            save_file(tensors, tmp, metadata=metadata)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def save_pretrained(self, directory: str | os.PathLike, model: nn.Module | None = None) -> None:
        """Write the fine-tune as a directory: tensors, `sift_config.json`, a model card
        (`sift.pretrained.save_pretrained`).

        Example:
            >>> delta.save_pretrained("my-fine-tune", model)  # doctest: +SKIP
        """
        from sift.pretrained import save_pretrained

        save_pretrained(self, directory, model)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> SparseDelta:
        """Read a directory written by `save_pretrained`, refusing one it cannot trust
        (`sift.pretrained.from_pretrained`).

        Example:
            >>> delta = SparseDelta.from_pretrained("my-fine-tune")  # doctest: +SKIP
        """
        from sift.pretrained import from_pretrained

        return from_pretrained(directory)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SparseDelta:
        """Reads a delta written by `save`, checking everything in it.

        Args:
            path: a file written by `SparseDelta.save`.

        Returns:
            The delta (tensors on the CPU).

        Raises:
            FileNotFoundError: nothing exists at `path`.
            DeltaError: the file is unreadable, truncated, corrupted (checksum), of another
                format or a newer version, or holds an invalid delta; every problem listed.

        Example:
            >>> import tempfile
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     SparseDelta().save(f"{tmp}/empty.safetensors")
            ...     len(SparseDelta.load(f"{tmp}/empty.safetensors"))
            0
        """
        from safetensors import safe_open

        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no sparse delta file at {path!r}")
        what = f"cannot load sparse delta {path!r}"
        try:
            with safe_open(path, framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for bad headers and sizes
            raise DeltaError(what, [f"not a readable safetensors file (truncated or corrupted?): {exc}"]) from exc
        if metadata.get("format") != FORMAT:
            raise DeltaError(what, [f"not a sift sparse delta (format {metadata.get('format')!r})"])
        try:
            version = int(metadata.get("format_version", ""))
        except ValueError:
            raise DeltaError(what, [f"bad format_version {metadata.get('format_version')!r}"]) from None
        if version > FORMAT_VERSION:
            raise DeltaError(what, [f"format version {version} is newer than this sift reads ({FORMAT_VERSION})"])
        problems = []
        if metadata.get("checksum") != _checksum(tensors):
            problems.append("checksum mismatch: the tensor data is corrupted")
        try:
            meta_entries = json.loads(metadata["entries"])
            base = BaseFingerprint.from_json(metadata["base"]) if "base" in metadata else None
            if not isinstance(meta_entries, dict):
                raise TypeError(f"entries is a {type(meta_entries).__name__}, not a mapping")
            dense_names = json.loads(metadata.get("dense", "[]"))
            if not (isinstance(dense_names, list) and all(isinstance(n, str) for n in dense_names)):
                raise TypeError("dense is not a list of names")
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise DeltaError(what, problems + [f"unreadable metadata: {exc!r}"]) from exc
        entries, expected = {}, set()
        for name, info in meta_entries.items():
            keys = ((f"{name}.indices_low", f"{name}.window_offsets") if version >= 3 else (f"{name}.indices",)) + (
                f"{name}.values",)
            expected.update(keys)
            # The checksum covers the tensors only: the metadata is checked field by field.
            shape = info.get("shape") if isinstance(info, dict) else None
            if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
                problems.append(f"{name}: unreadable metadata: shape {shape!r} is not a list of sizes")
                continue
            dtype = _DTYPE_NAMES.get(info.get("dtype"))
            if dtype is None:
                problems.append(f"{name}: unsupported weight dtype {info.get('dtype')!r}")
                continue
            missing = [k for k in keys if k not in tensors]
            if missing:
                problems.append(f"{name}: tensors missing from the file: {', '.join(missing)}")
                continue
            if version >= 3:
                indices = _decode_indices(tensors[keys[0]], tensors[keys[1]], math.prod(shape), name, problems)
                if indices is None:
                    continue
            else:
                indices = tensors[keys[0]]
            entries[name] = DeltaEntry(tuple(shape), dtype, indices, tensors[keys[-1]])
        dense = {}
        for name in dense_names:
            key = f"{name}.dense"
            expected.add(key)
            if key not in tensors:
                problems.append(f"{name}: the dense part is missing from the file")
                continue
            dense[name] = tensors[key]
        extra = sorted(set(tensors) - expected)
        if extra:
            problems.append(f"tensors not described by the metadata: {', '.join(extra[:5])}")
        delta = cls(entries, base, dense)
        problems += delta.problems()
        if problems:
            raise DeltaError(what, problems)
        return delta

    # ---------------------------------------------------------------- apply / remove

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
            problems += _base_problems(self.base, state, _APPLIED.get(model, []))
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

    # ---------------------------------------------------------------- arithmetic

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


# -------------------------------------------------------------------- helpers


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
    base_values = base.detach().reshape(-1)[idx.long()].cpu()
    tuned = p.detach().reshape(-1)[idx.long().to(p.device)].cpu()
    return idx, tuned.float() - base_values.float(), base_values


def _decode_indices(low: torch.Tensor, offsets: torch.Tensor, numel: int, name: str,
                    problems: list[str]) -> torch.Tensor | None:
    """A file's (indices_low, window_offsets) as sorted positions, or None with the problem recorded."""
    try:
        return _ops.checked_lean_indices(low, offsets, numel, name, allow_empty=True).to(_index_dtype(numel))
    except ValueError as exc:
        problems.append(str(exc))
        return None


def _optimizer_info(optimizer: torch.optim.Optimizer) -> dict:
    """What a fine-tune's config records of its optimizer: rule, state layout, and per group its density."""
    groups = []
    for group in optimizer.param_groups:
        groups.append({"name": group.get("name"), "density": float(group.get("density", 1.0)),
                       "params": len(group["params"])})
    return {"selection": getattr(optimizer, "selection", None), "state": getattr(optimizer, "state_layout", None),
            "select_steps": getattr(optimizer, "select_steps", None), "groups": groups,
            "quantized": bool(getattr(optimizer, "_quantized", {}))}


def _find(sorted_positions: torch.Tensor, pos: int) -> int | None:
    """Where `pos` sits in a sorted 1-D tensor, or None."""
    j = int(torch.searchsorted(sorted_positions, torch.tensor([pos], dtype=sorted_positions.dtype)))
    return j if j < sorted_positions.numel() and int(sorted_positions[j]) == pos else None


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
        if t is None or not samples:
            continue
        positions = [p for p in samples if p < t.numel()
                     and not any(_find(ix, p) is not None for ix in touched.get(name, []))]
        if not positions:
            continue
        now = t.detach().reshape(-1)[torch.tensor(positions, device=t.device)].tolist()
        compared += len(positions)
        differing += [f"{name}[{p}]" for p, v in zip(positions, now) if float(v).hex() != samples[p]]
    if differing:
        return [f"the delta was made for another base model: {len(differing)} of {compared} sampled base values "
                f"differ (first: {', '.join(differing[:3])})"]
    return []


def _by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(_dtype_name(t.dtype).encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()
