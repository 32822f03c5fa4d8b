"""A delta's safetensors file: `save` / `load` (behind `SparseDelta.save` and `SparseDelta.load`):
every weight's positions in Elias-Fano form, its values as fp32 or 16-bit words, the dense parts,
metadata and a checksum. Files of earlier formats read as before. The fine-tune directory around
the file is `sift.delta.directory`'s."""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections.abc import Mapping

import torch

from sift import _ops
from sift._index import index_dtype as _index_dtype
from sift.delta.contents import DeltaContents, DeltaT
from sift.delta.entry import DeltaEntry, DeltaError, _dtype_name
from sift.delta.fingerprint import BaseFingerprint
from sift.delta.packing import (HALF_DTYPES, decode_positions, decode_words, encode_positions, encode_words,
                                high_bits_for, low_bytes_for)


FORMAT = "sift.sparse_delta"
# 2: dense parts (`<name>.dense`) and the "dense" metadata. 3: indices as 16-bit halves under a
# window table (`<name>.indices_low`, `<name>.window_offsets`). 4: 16-bit weights' values in their
# dtype with fp32 exceptions. 5: every weight in a few shared tensors (Elias-Fano positions, 16-bit
# words). Older files read as before.
FORMAT_VERSION = 5
# Format 5's shared tensors: name -> dtype.
_PACKED = {"positions.low": torch.uint8, "positions.high": torch.uint8, "values.float32": torch.float32,
           "values.words16": torch.int16, "values.mask": torch.uint8, "values.rest16": torch.int16}


_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save(delta: DeltaContents, path: str | os.PathLike) -> None:
    """Writes the delta to a safetensors file, atomically (`SparseDelta.save`).

    Layout (format 5): every weight's sorted positions in Elias-Fano form (`positions.low` and
    `positions.high`, uint8: about 1.1 bytes an entry at 1% density); the values of fp32 weights as
    fp32 (`values.float32`) and those of bf16/fp16 weights as one 16-bit word each (`values.words16`,
    int16), the weight's dtype where it holds the increment exactly, else the high half of its fp32
    bits with the low half in `values.rest16` under a bit mask (`values.mask`). So an entry costs
    about 5.1 bytes for an fp32 weight and 3.1 for a 16-bit one, plus 2 for each 16-bit increment
    that needs more (`SparseDelta.from_optimizer` and `from_diff` pick, for a 16-bit weight, the
    16-bit increment that gives the tuned value where one exists). Bit-exact on reload.
    `<name>.dense` for each dense part (in its dtype); metadata with the format version, each
    weight's shape, dtype and counts, the dense parts' names, the base fingerprint and a blake2b
    checksum of the tensors. The file is written under a temporary name in the same directory and
    renamed over `path`, so a crash never leaves a partial file under `path`.

    Args:
        delta: the delta to write.
        path: destination file.

    Example:
        >>> from sift import SparseDelta
        >>> import tempfile
        >>> d = SparseDelta.from_diff({"w": torch.zeros(4)}, {"w": torch.ones(4)}, density=0.5)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     save(d, f"{tmp}/d.safetensors")
        ...     load(SparseDelta, f"{tmp}/d.safetensors").nnz
        2
    """
    from safetensors.torch import save_file

    problems = delta.problems()
    if problems:
        raise DeltaError("refusing to save an invalid delta", problems)
    tensors, meta_entries = _encode_entries(delta.entries)
    for name, t in delta.dense.items():
        tensors[f"{name}.dense"] = t.detach().cpu().contiguous().clone()
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "entries": json.dumps(meta_entries, separators=(",", ":")),
        "dense": json.dumps(sorted(delta.dense), separators=(",", ":")),
        "checksum": _checksum(tensors),
    }
    if delta.base is not None:
        metadata["base"] = delta.base.to_json()
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


def load(cls: type[DeltaT], path: str | os.PathLike) -> DeltaT:
    """`cls.load(path)` (`SparseDelta.load` documents it): a delta written by `save`, everything in it
    checked: the format and its version, the checksum, the metadata against the tensors, the delta itself.

    Example:
        >>> from sift import SparseDelta
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     save(SparseDelta(), f"{tmp}/empty.safetensors")
        ...     len(load(SparseDelta, f"{tmp}/empty.safetensors"))
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
    if version >= 5:
        entries, expected = _decode_entries(meta_entries, tensors, problems), set(_PACKED)
    else:
        entries, expected = _decode_named_entries(meta_entries, tensors, version, problems)
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


def _encode_entries(entries: Mapping[str, DeltaEntry]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Format 5's shared tensors and per-weight metadata for `entries`."""
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in _PACKED}
    meta = {}
    for name, e in entries.items():
        low_bits, low, high = encode_positions(e.indices, e.numel)
        parts["positions.low"].append(low)
        parts["positions.high"].append(high)
        info = {"shape": list(e.shape), "dtype": _dtype_name(e.dtype), "nnz": e.nnz, "low_bits": low_bits}
        values = e.values.detach().float().cpu()
        words = encode_words(values, e.dtype) if e.dtype in HALF_DTYPES else None
        # Words cost 2 bytes, plus 2 and a bit for an increment the dtype cannot hold: fp32 when cheaper.
        if words is not None and 2 * words[0].numel() + words[1].numel() + 2 * words[2].numel() <= 4 * e.nnz:
            info["values"], info["rest"] = "words16", words[2].numel()
            for key, t in zip(("values.words16", "values.mask", "values.rest16"), words):
                parts[key].append(t)
        else:
            info["values"] = "float32"
            parts["values.float32"].append(values)
        meta[name] = info
    tensors = {key: (torch.cat(ts) if ts else torch.zeros(0, dtype=_PACKED[key])).contiguous()
               for key, ts in parts.items()}
    return tensors, meta


def _decode_entries(meta_entries: Mapping[str, object], tensors: Mapping[str, torch.Tensor],
                    problems: list[str]) -> dict[str, DeltaEntry]:
    """Format 5's entries from its shared tensors (`_PACKED`), every problem recorded."""
    entries: dict[str, DeltaEntry] = {}
    missing = [k for k, dt in _PACKED.items() if k not in tensors or tensors[k].dtype != dt or tensors[k].dim() != 1]
    if missing:
        problems.append(f"shared tensors missing or of the wrong dtype: {', '.join(missing)}")
        return entries
    at = dict.fromkeys(_PACKED, 0)

    def take(key: str, n: int) -> torch.Tensor:
        t = tensors[key][at[key]:at[key] + n]
        at[key] += n
        return t

    for name, info in meta_entries.items():
        fields = ("shape", "dtype", "nnz", "low_bits", "values")
        if not (isinstance(info, dict) and all(f in info for f in fields)):
            problems.append(f"{name}: unreadable metadata (needs {', '.join(fields)})")
            return entries
        shape, k, low_bits, dtype = info["shape"], info["nnz"], info["low_bits"], _DTYPE_NAMES.get(info["dtype"])
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)) or type(k) is not int \
                or type(low_bits) is not int or not 0 <= low_bits < 63 or not 0 <= k <= math.prod(shape) \
                or dtype is None:
            problems.append(f"{name}: unreadable metadata: shape {shape!r}, nnz {k!r}, low_bits {low_bits!r}, "
                            f"dtype {info['dtype']!r}")
            return entries
        numel = math.prod(shape)
        low = take("positions.low", low_bytes_for(k, low_bits))
        high = take("positions.high", -(-high_bits_for(k, numel, low_bits) // 8))
        rest = info.get("rest", 0)
        if info["values"] == "words16" and dtype in HALF_DTYPES and type(rest) is int and rest >= 0:
            words, mask = take("values.words16", k), take("values.mask", -(-k // 8) if rest else 0)
            parts = (words, mask, take("values.rest16", rest))
        elif info["values"] == "float32":
            parts = (take("values.float32", k),)
        else:
            problems.append(f"{name}: unreadable metadata: values {info['values']!r} (rest {rest!r}) for a "
                            f"{info['dtype']} weight")
            return entries
        try:
            indices = decode_positions(low_bits, low, high, k, numel).to(_index_dtype(numel))
            values = decode_words(*parts, dtype) if len(parts) == 3 else parts[0].clone()
            if values.numel() != k:
                raise ValueError(f"{values.numel()} values for {k} positions")
        except ValueError as exc:
            problems.append(f"{name}: {exc} (truncated or corrupted?)")
            continue
        entries[name] = DeltaEntry(tuple(shape), dtype, indices, values)
    left = [f"{key} ({tensors[key].numel() - n} more)" for key, n in at.items() if tensors[key].numel() != n]
    if left:
        problems.append(f"the shared tensors do not match the metadata: {', '.join(left)}")
    return entries


def _decode_named_entries(meta_entries: Mapping[str, object], tensors: Mapping[str, torch.Tensor], version: int,
                          problems: list[str]) -> tuple[dict[str, DeltaEntry], set[str]]:
    """The entries of a file before format 5 (tensors named per weight), every problem recorded; and the
    tensor names they use."""
    entries: dict[str, DeltaEntry] = {}
    expected: set[str] = set()
    for name, info in meta_entries.items():
        keys = ((f"{name}.indices_low", f"{name}.window_offsets") if version >= 3 else (f"{name}.indices",)) + (
            f"{name}.values",)
        dtype = _DTYPE_NAMES.get(info.get("dtype")) if isinstance(info, dict) else None
        stored = tensors.get(f"{name}.values")
        exact_keys = (f"{name}.exact_positions", f"{name}.exact_values") if (
            version >= 4 and dtype in HALF_DTYPES and stored is not None and stored.dtype == dtype) else ()
        expected.update(keys + exact_keys)
        # The checksum covers the tensors only: the metadata is checked field by field.
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            problems.append(f"{name}: unreadable metadata: shape {shape!r} is not a list of sizes")
            continue
        if dtype is None:
            problems.append(f"{name}: unsupported weight dtype {info.get('dtype')!r}")
            continue
        missing = [k for k in keys + exact_keys if k not in tensors]
        if missing:
            problems.append(f"{name}: tensors missing from the file: {', '.join(missing)}")
            continue
        if version >= 3:
            indices = _decode_indices(tensors[keys[0]], tensors[keys[1]], math.prod(shape), name, problems)
            if indices is None:
                continue
        else:
            indices = tensors[keys[0]]
        values = tensors[keys[-1]]
        if exact_keys:
            values = _exact_values(values, tensors[exact_keys[0]], tensors[exact_keys[1]], name, problems)
            if values is None:
                continue
        entries[name] = DeltaEntry(tuple(shape), dtype, indices, values)
    return entries, expected


def _exact_values(half: torch.Tensor, positions: torch.Tensor, exact: torch.Tensor, name: str,
                  problems: list[str]) -> torch.Tensor | None:
    """A 16-bit weight's fp32 increments from the file: its 16-bit values with the fp32 exceptions written
    back, or None with the problem recorded."""
    n = half.numel()
    if half.dtype not in HALF_DTYPES or positions.dtype != torch.int32 or exact.dtype != torch.float32 or \
            positions.dim() != 1 or exact.shape != positions.shape:
        problems.append(f"{name}: exact_positions (int32) and exact_values (fp32) must be [m] vectors next to 16-bit "
                        f"values, got {positions.dtype} {tuple(positions.shape)}, {exact.dtype} {tuple(exact.shape)}, "
                        f"values {half.dtype}")
        return None
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n):
        problems.append(f"{name}: exact_positions out of range for {n} values")
        return None
    values = half.float()
    values[positions.long()] = exact
    return values


def _decode_indices(low: torch.Tensor, offsets: torch.Tensor, numel: int, name: str,
                    problems: list[str]) -> torch.Tensor | None:
    """A file's (indices_low, window_offsets) as sorted positions, or None with the problem recorded."""
    try:
        return _ops.checked_lean_indices(low, offsets, numel, name, allow_empty=True).to(_index_dtype(numel))
    except ValueError as exc:
        problems.append(str(exc))
        return None


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(_dtype_name(t.dtype).encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()
