"""The fine-tune directory: a delta in the layout Hugging Face users keep.

`write_directory(delta, directory, model)` (behind `SparseDelta.save_pretrained` and
`sift.pretrained.save_pretrained`) writes

    delta.safetensors   the sparse entries, the dense parts (a trained head) and the base
                        fingerprint, checksummed (`SparseDelta.save`'s file)
    sift_config.json    what the fine-tune is: the base model's `name_or_path` (a Hub name, or a
                        local folder: then `local` is true and saving warns), commit, class and
                        type (when known), the sparse weights and dense params with their shapes, dtypes and
                        entry counts, the density and selection rule, the package version
    README.md           a short model card: base model, method, what was trained, size, how to load

`read_directory(delta_cls, directory)` (behind both `from_pretrained`s) reads it back and
refuses a directory it cannot trust (a missing or extra file, a config that disagrees with the
tensors, a newer format).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from torch import nn

from sift._version import __version__
from sift.delta import storage
from sift.delta.contents import DeltaContents, DeltaT
from sift.delta.entry import DeltaError, _dtype_name
from sift.delta.identity import model_identity


CONFIG_NAME = "sift_config.json"
WEIGHTS_NAME = "delta.safetensors"
CARD_NAME = "README.md"
CONFIG_FORMAT = "sift.fine_tune"
CONFIG_VERSION = 1


def _base_of(delta: DeltaContents, model: nn.Module | None, base_model: str | os.PathLike | None) -> dict[str, Any]:
    """The base a fine-tune's config records: `base_model` if given, else what `model` says, else what the
    delta knows (the model it was made from, or the config it was read from)."""
    if model is not None or base_model is not None:
        return model_identity(model, base_model)
    known = delta.info.get("base_model")
    return dict(known) if isinstance(known, dict) else model_identity(None)


def _config(delta: DeltaContents, base: dict[str, Any]) -> dict[str, Any]:
    sparse = {name: {"shape": list(e.shape), "dtype": _dtype_name(e.dtype), "entries": e.nnz}
              for name, e in delta.entries.items()}
    dense = {name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "entries": t.numel()}
             for name, t in delta.dense.items()}
    groups = delta.info.get("groups", [])
    densities = sorted({g["density"] for g in groups if g.get("density", 1.0) < 1.0})
    return {
        "format": CONFIG_FORMAT,
        "format_version": CONFIG_VERSION,
        "sift_version": __version__,
        "base_model": base,
        "method": "SIFT sparse fine-tuning" + (" over a 4-bit base" if delta.info.get("quantized") else ""),
        "density": densities[0] if len(densities) == 1 else densities or None,
        "selection": delta.info.get("selection"),
        "select_steps": delta.info.get("select_steps"),
        "optimizer_state": delta.info.get("state"),
        "target_modules": sorted({name.rsplit(".", 1)[0] for name in delta.entries}),
        "dense_modules": sorted({name.rsplit(".", 1)[0] for name in delta.dense}),
        "sparse": sparse,
        "dense": dense,
        "entries": delta.nnz,
        "dense_entries": sum(t.numel() for t in delta.dense.values()),
        "has_base_fingerprint": delta.base is not None,
        "checksum": delta.checksum(),
    }


def _card(config: dict[str, Any], size: int) -> str:
    base = config["base_model"]["name_or_path"] or "(not recorded)"
    density = config["density"]
    rows = "\n".join(f"| `{name}` | {info['shape']} | {info['entries']:,} |" for name, info in
                     list(config["sparse"].items())[:8])
    more = len(config["sparse"]) - 8
    return f"""---
library_name: sift-kernels
base_model: {base}
tags: [sift, sparse-fine-tuning]
---

# Sparse fine-tune of {base}

{config['method']}: {config['entries']:,} entries of {len(config['sparse'])} weights trained
(density {density}, selection {config['selection']!r}), plus {config['dense_entries']:,} values of
densely trained params ({', '.join(config['dense_modules']) or 'none'}). The base model itself is not
in this directory: {size / 1024:.1f} KiB in all.

| sparse weight | shape | entries |
|---|---|---|
{rows}
{f'| ... {more} more | | |' if more > 0 else ''}

Load it with the `sift-kernels` package: the base model with the fine-tune applied, in one call.

```python
import sift

model = sift.from_pretrained("path/to/this/directory")  # loads {base}
# or onto a base already loaded (16-bit, or bitsandbytes 4-bit or 8-bit):
model = sift.from_pretrained(base_model, "path/to/this/directory")
with sift.disabled(model):  # the base model's outputs, exactly
    ...
```
"""


def write_directory(delta: DeltaContents, directory: str | os.PathLike, model: nn.Module | None = None,
                    base_model: str | os.PathLike | None = None) -> None:
    """Write `delta` as a fine-tune directory (`sift.pretrained.save_pretrained` documents it)."""
    problems = delta.problems()
    if problems:
        raise DeltaError("refusing to save an invalid delta", problems)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    storage.save(delta, os.path.join(directory, WEIGHTS_NAME))
    config = _config(delta, _base_of(delta, model, base_model))
    base = config["base_model"]
    if base.get("local"):
        warnings.warn(f"the fine-tune in {directory!r} points at its base model in the local folder "
                      f"{base['name_or_path']!r}, which loads it nowhere else: pass the base's name on the Hub, "
                      "save_pretrained(directory, model, base_model='org/name')", stacklevel=3)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(directory, name)) for name in (WEIGHTS_NAME, CONFIG_NAME))
    with open(os.path.join(directory, CARD_NAME), "w") as f:
        f.write(_card(config, size))


def read_directory(delta_cls: type[DeltaT], directory: str | os.PathLike) -> DeltaT:
    """Read a fine-tune directory as a `delta_cls` (`sift.pretrained.from_pretrained` documents it)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no fine-tune directory at {directory!r}")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not os.path.exists(os.path.join(directory, name)):
            raise FileNotFoundError(f"{directory!r} has no {name}: not a sift fine-tune directory")
    what = f"cannot load the fine-tune in {directory!r}"
    try:
        with open(os.path.join(directory, CONFIG_NAME)) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise DeltaError(what, [f"{CONFIG_NAME} is not readable JSON: {exc}"]) from exc
    if not isinstance(config, dict) or config.get("format") != CONFIG_FORMAT:
        raise DeltaError(what, [f"{CONFIG_NAME} is not a sift fine-tune config"])
    if not isinstance(config.get("format_version"), int) or config["format_version"] > CONFIG_VERSION:
        raise DeltaError(what, [f"config format version {config.get('format_version')!r} is newer than this "
                                f"sift reads ({CONFIG_VERSION})"])
    delta = storage.load(delta_cls, os.path.join(directory, WEIGHTS_NAME))
    saved = _config(delta, {})
    problems = []
    for key in ("sparse", "dense", "checksum"):
        if config.get(key) != saved[key]:
            problems.append(f"{CONFIG_NAME} and {WEIGHTS_NAME} disagree on {key} (edited or mixed up files?)")
    if problems:
        raise DeltaError(what, problems)
    delta.info = {"selection": config.get("selection"), "state": config.get("optimizer_state"),
                  "select_steps": config.get("select_steps"), "base_model": config.get("base_model"),
                  "groups": [{"density": config["density"]}] if isinstance(config.get("density"), float) else []}
    return delta
