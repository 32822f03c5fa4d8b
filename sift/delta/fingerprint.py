"""`BaseFingerprint`: what a delta knows of the base model it was made for (a hash of the names,
shapes and dtypes of its floating-point tensors, and its values at a few fixed positions per
tensor), and the reading of a model's state that fingerprints and deltas share.

A bitsandbytes 4-bit or int8 layer is read as the 16-bit weight it was quantized from (`logical_state`):
[out, in] in that dtype, its packed bytes and quantization statistics left out. So one fingerprint
describes a quantized base and the 16-bit model it came from; the quantized weights' samples are their
dequantized values, each with a tolerance (the quantization step there) within which a 16-bit weight
matches it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sift._params import is_dtensor, local_tensor, shard_group, shard_offset
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


def _quantized_layers(model: nn.Module) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """The bitsandbytes 4-bit and int8 linear layers of `model` (matched by their weights' class names, as
    `sift.quantized` does): name -> the [out, in] shape and dtype of the weight they were quantized from
    (the 4-bit quant state records the dtype; an int8 weight does not: its bias's, else fp32)."""
    layers = {}
    for name, m in model.named_modules():
        weight = getattr(m, "weight", None)
        kind = type(weight).__name__
        if not isinstance(m, nn.Linear) or kind not in ("Params4bit", "Int8Params"):
            continue
        if kind == "Int8Params" and weight.dtype != torch.int8:
            continue  # 16-bit weights in an 8-bit layer class: an ordinary weight
        recorded = getattr(getattr(weight, "quant_state", None), "dtype", None) if kind == "Params4bit" else None
        dtype = recorded or (m.bias.dtype if m.bias is not None else torch.float32)
        layers[name] = ((m.out_features, m.in_features), dtype)
    return layers


def logical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict(keep_vars=True)` with each quantized layer's weight as a meta tensor of the shape and
    dtype it was quantized from, and everything else of that layer but its bias (packed statistics, a sift
    delta) left out: the state the fingerprint of a quantized base describes.

    Example:
        >>> sorted(logical_state(torch.nn.Linear(3, 2)))  # nothing quantized: the state dict itself
        ['bias', 'weight']
    """
    state = model.state_dict(keep_vars=True)
    for name, (shape, dtype) in _quantized_layers(model).items():
        prefix = f"{name}." if name else ""
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix):] not in ("weight", "bias")]:
            del state[key]
        state[f"{prefix}weight"] = torch.empty(shape, dtype=dtype, device="meta")
    return state


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
        tolerances: name -> {flat position: `float.hex` of the largest difference that still matches}, for
            the samples of a quantized base's weights (dequantized values); other samples match exactly.
    """

    structure: str
    n_tensors: int
    samples: dict[str, dict[int, str]] = field(default_factory=dict)
    tolerances: dict[str, dict[int, str]] = field(default_factory=dict)

    def matches(self, name: str, pos: int, value: float) -> bool:
        """Whether a model's `value` at `name[pos]` is this base's there (exactly, or within its tolerance)."""
        tol = self.tolerances.get(name, {}).get(pos)
        if tol is None:
            return float(value).hex() == self.samples[name][pos]
        return abs(float(value) - float.fromhex(self.samples[name][pos])) <= float.fromhex(tol)

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
            if pos and t.device.type != "meta":  # a quantized layer's weight: from_optimizer samples it
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
            if pos in other.samples.get(name, {}) and not (
                self.matches(name, pos, float.fromhex(other.samples[name][pos]))
                or other.matches(name, pos, float.fromhex(value)))
        ]
        if differing:
            return [f"{len(differing)} sampled base values differ (first: {', '.join(differing[:3])})"]
        return []

    def union(self, other: BaseFingerprint) -> BaseFingerprint:
        """The fingerprint knowing the samples of both (they must not conflict)."""
        samples: dict[str, dict[int, str]] = {}
        tolerances: dict[str, dict[int, str]] = {}
        # An exact sample (a 16-bit base) wins over a dequantized one with its tolerance.
        for fingerprint in sorted((self, other), key=lambda f: bool(f.tolerances), reverse=True):
            for name, vals in fingerprint.samples.items():
                for pos, value in vals.items():
                    tol = fingerprint.tolerances.get(name, {}).get(pos)
                    if tol is None or pos not in samples.get(name, {}):
                        samples.setdefault(name, {})[pos] = value
                        if tol is None:
                            tolerances.get(name, {}).pop(pos, None)
                        else:
                            tolerances.setdefault(name, {})[pos] = tol
        return BaseFingerprint(self.structure, self.n_tensors, samples, {n: t for n, t in tolerances.items() if t})

    def to_json(self) -> str:
        d = {"structure": self.structure, "n_tensors": self.n_tensors,
             "samples": {n: {str(p): v for p, v in s.items()} for n, s in self.samples.items()}}
        if self.tolerances:
            d["tolerances"] = {n: {str(p): v for p, v in s.items()} for n, s in self.tolerances.items()}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BaseFingerprint:
        d = json.loads(text)
        samples = {n: {int(p): str(v) for p, v in s.items()} for n, s in d["samples"].items()}
        tolerances = {n: {int(p): str(v) for p, v in s.items()} for n, s in d.get("tolerances", {}).items()}
        return cls(str(d["structure"]), int(d["n_tensors"]), samples, tolerances)


def _find(sorted_positions: torch.Tensor, pos: int) -> int | None:
    """Where `pos` sits in a sorted 1-D tensor, or None."""
    j = int(torch.searchsorted(sorted_positions, torch.tensor([pos], dtype=sorted_positions.dtype)))
    return j if j < sorted_positions.numel() and int(sorted_positions[j]) == pos else None


def sharded_fingerprint(state: Mapping[str, torch.Tensor]) -> BaseFingerprint:
    """`BaseFingerprint.of(state)` for a state dict holding DTensors: each sampled base value is read on the
    rank whose shard holds it and gathered (a few floats a tensor, never a whole weight). Collective."""
    import torch.distributed as dist

    plain = BaseFingerprint.of({n: t for n, t in state.items() if not is_dtensor(t)})
    tensors = {n: t for n, t in state.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    samples = {name: dict(values) for name, values in plain.samples.items()}
    mine: dict[str, dict[int, str]] = {}
    sharded = sorted(n for n, t in tensors.items() if is_dtensor(t))
    group = None
    for name in sharded:
        t = tensors[name]
        group = shard_group(t)
        local = local_tensor(t).detach().reshape(-1)
        start = shard_offset(t)
        here = [pos for pos in _sample_positions(t.numel()) if start <= pos < start + local.numel()]
        if here:
            values = local[torch.tensor([pos - start for pos in here], device=local.device)].tolist()
            mine[name] = {pos: float(v).hex() for pos, v in zip(here, values)}
    if group is not None:
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
        for part in parts:
            for name, values in part.items():
                samples.setdefault(name, {}).update(values)
    return BaseFingerprint(_structure_hash(tensors), len(tensors), samples)
