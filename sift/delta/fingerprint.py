"""`BaseFingerprint`: what a delta knows of the base model it was made for (a hash of the names,
shapes and dtypes of its floating-point tensors, and its values at a few fixed positions per
tensor), and the reading of a model's state that fingerprints and deltas share."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from sift.delta.entry import _dtype_name


# Fixed positions per tensor whose base values go into the fingerprint (first, last, two inner).
SAMPLES_PER_TENSOR = 4


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


def _find(sorted_positions: torch.Tensor, pos: int) -> int | None:
    """Where `pos` sits in a sorted 1-D tensor, or None."""
    j = int(torch.searchsorted(sorted_positions, torch.tensor([pos], dtype=sorted_positions.dtype)))
    return j if j < sorted_positions.numel() and int(sorted_positions[j]) == pos else None
