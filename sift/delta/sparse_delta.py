"""`SparseDelta`: a fine-tune as per-weight sorted indices and fp32 increments, plus dense parts.

The data class: its entries, base fingerprint, dense parts and the record of how it was made, what
it holds (`problems`, `checksum`, `to_dense`) and its arithmetic (`scaled`, `*`, `/`, `+`, `-`).
What it does with a model or a file are plain functions of the modules below it, which its methods
call: `construction` (`from_optimizer`, `from_diff`), `application` (`apply_`, `remove_`), `storage`
(`save`, `load`), `directory` (`save_pretrained`, `from_pretrained`) and `merging` (`merge_deltas`).
They never import this module: they read a delta as `sift.delta.contents.DeltaContents` and are given
the class to make."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sift.delta import application, construction, merging, storage
from sift.delta.directory import read_directory, write_directory
from sift.delta.entry import DeltaEntry
from sift.delta.fingerprint import BaseFingerprint
from sift.delta.storage import _checksum


@dataclass(eq=False, repr=False)
class SparseDelta:
    """A fine-tune: per sparse weight, sorted unique flat indices and fp32 increments; per densely
    trained param (a task head), the whole trained tensor.

    Args:
        entries: name -> `DeltaEntry` (tensors on the CPU; they are validated when the delta
            is applied, merged or saved).
        base: fingerprint of the base model, or None to skip the base checks. It never covers
            the dense parts, which replace whatever the base holds there.
        dense: name -> the trained tensor that replaces the param whole (a head trained densely).
        info: what the fine-tune was (density, selection, targets, base model; `from_optimizer` records
            it), for its config file.

    Example:
        >>> base = torch.nn.Linear(4, 3)
        >>> tuned = torch.nn.Linear(4, 3)
        >>> delta = SparseDelta.from_diff(base, tuned, density=0.5)
        >>> delta.apply_(base)
        >>> delta.remove_(base)
    """

    entries: dict[str, DeltaEntry] = field(default_factory=dict)
    base: BaseFingerprint | None = None
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Own dicts (any mapping, or None, is accepted): the caller's may change after.
        self.entries = dict(self.entries or {})
        self.dense = dict(self.dense or {})
        self.info = dict(self.info or {})

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
        return SparseDelta(entries, self.base, {n: t.clone() for n, t in self.dense.items()}, self.info)

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

        For a bf16/fp16 weight whose base is known, each increment is the 16-bit value nearest
        tuned minus base that gives the same tuned value (`apply_` rounds the sum to the weight's
        dtype), where one exists: the file then stores it in 2 bytes. The tuned model is the same.

        The deltas of 4-bit layers (`for_model` on a bitsandbytes 4-bit model) become entries of
        `<layer>.weight` in the dtype the weight had before quantization: `apply_` merges them
        into the 16-bit model, `sift.quantized.attach_delta_` puts them back on the 4-bit one. Its
        base fingerprint fits both: the quantized weights are sampled dequantized, and a 16-bit
        weight matches within the quantization step there (`sift.delta.fingerprint`).

        Args:
            optimizer: a `sift.SparseAdamW` (any optimizer with that state layout).
            model: the trained model; names come from `model.named_parameters()`.
            base: the model's state before training (optional): fingerprints the base from it
                instead of from the untouched entries of `model`.

        Returns:
            The delta, fingerprinted with the base values it can know: untouched entries of
            `model`'s parameters (not its buffers), the `base` state of weights that keep one
            (every weight's chosen entries, in the exact state), and
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
        return construction.from_optimizer(cls, optimizer, model, base)

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
            tensors only), values `fp32(tuned) - fp32(base)` (for bf16/fp16 tensors the
            16-bit value nearest it that gives the same tuned value, where one exists),
            fingerprinted with `base`. Tensors without a kept entry are left out. Applied to
            `base`, a kept entry gives `tuned` back exactly for bf16/fp16 weights, within one
            rounding for fp32 ones.

        Example:
            >>> base = {"w": torch.zeros(2, 3)}
            >>> tuned = {"w": torch.tensor([[0.0, 2.0, 0.0], [-5.0, 0.0, 0.1]])}
            >>> d = SparseDelta.from_diff(base, tuned, density=0.3)
            >>> d["w"].indices, d["w"].values
            (tensor([1, 3], dtype=torch.int32), tensor([ 2., -5.]))
        """
        return construction.from_diff(cls, base, tuned, density=density, threshold=threshold)

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
        application.apply_(self, model, scale, check_base=check_base, stack=stack)

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
        application.remove_(self, model)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the delta to a safetensors file, atomically: written under a temporary name in the same
        directory and renamed over `path`, so a crash never leaves a partial file there. Format 5
        (`sift.delta.storage.save` spells the layout out): about 5.1 bytes an entry for an fp32 weight and
        3.1 for a 16-bit one, the dense parts in their dtypes, the base fingerprint and a checksum.
        Bit-exact on reload.

        Args:
            path: destination file.

        Raises:
            DeltaError: the delta is invalid (nothing is written); every problem listed.

        Example:
            >>> import tempfile
            >>> d = SparseDelta.from_diff({"w": torch.zeros(4)}, {"w": torch.ones(4)}, density=0.5)
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     d.save(f"{tmp}/d.safetensors")
            ...     SparseDelta.load(f"{tmp}/d.safetensors").nnz
            2
        """
        storage.save(self, path)

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
        return storage.load(cls, path)

    def save_pretrained(self, directory: str | os.PathLike, model: nn.Module | None = None, *,
                        base_model: str | os.PathLike | None = None) -> None:
        """Write the fine-tune as a directory: tensors, `sift_config.json`, a model card
        (`sift.pretrained.save_pretrained`). The config names the base `model` came from; `base_model`
        (its name on the Hub) overrides that, as for a base loaded from a local folder.

        Example:
            >>> delta.save_pretrained("my-fine-tune", model)  # doctest: +SKIP
            >>> delta.save_pretrained("my-fine-tune", model, base_model="org/name")  # doctest: +SKIP
        """
        write_directory(self, directory, model, base_model)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> SparseDelta:
        """Read a directory written by `save_pretrained`, refusing one it cannot trust
        (`sift.pretrained.from_pretrained`).

        Example:
            >>> delta = SparseDelta.from_pretrained("my-fine-tune")  # doctest: +SKIP
        """
        return read_directory(cls, directory)


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
    return merging.merge(SparseDelta, deltas, weights, method)
