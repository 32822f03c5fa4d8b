"""A fine-tune as a Hugging Face-style directory, and merged checkpoints.

`save_pretrained(delta, directory, model)` writes the fine-tune directory (`delta.safetensors`,
`sift_config.json`, a model card; the layout is `sift.delta.directory`'s).
`from_pretrained(directory)` reads it back and refuses a directory it cannot trust (a missing or
extra file, a config that disagrees with the tensors, a newer format). `merge_and_save` applies a
delta to its base model and writes a plain `save_pretrained` checkpoint that `transformers`
loads without this package.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from sift.delta import SparseDelta
from sift.delta.directory import CARD_NAME, CONFIG_FORMAT, CONFIG_NAME, CONFIG_VERSION, WEIGHTS_NAME  # noqa: F401
from sift.delta.directory import read_directory, write_directory


def save_pretrained(delta: SparseDelta, directory: str | os.PathLike, model: nn.Module | None = None, *,
                    base_model: str | os.PathLike | None = None) -> None:
    """Write `delta` as a fine-tune directory (see the module docstring).

    The config records the base model by the name `model`'s config gives (`name_or_path`: a Hub name, or
    the local folder it was loaded from, which `sift.from_pretrained(directory)` can only find on this
    machine: saving then warns), or by `base_model`.

    Args:
        delta: the fine-tune (`SparseDelta.from_optimizer(opt, model)`).
        directory: created if missing; the three files are replaced.
        model: the base (or tuned) model, whose config names the base checkpoint.
        base_model: the base's name on the Hub (or a folder), recorded instead of what `model` says.

    Raises:
        DeltaError: the delta is invalid (nothing is written).

    Example:
        >>> delta.save_pretrained("my-fine-tune", model)  # doctest: +SKIP
    """
    write_directory(delta, directory, model, base_model)


def from_pretrained(directory: str | os.PathLike) -> SparseDelta:
    """Read a fine-tune directory written by `save_pretrained`, checking the config against the tensors.

    Raises:
        FileNotFoundError: `directory` or one of its files is missing.
        DeltaError: a config of another format or a newer version, or one that disagrees with the
            tensors (names, shapes, dtypes, entry counts, checksum); every problem listed.

    Example:
        >>> delta = SparseDelta.from_pretrained("my-fine-tune")  # doctest: +SKIP
    """
    return read_directory(SparseDelta, directory)


def merge_and_save(model: nn.Module, delta: SparseDelta, directory: str | os.PathLike, **save_kwargs: Any) -> None:
    """Apply `delta` to `model` and write `model.save_pretrained(directory)`: a plain checkpoint.

    The model stays merged (call `delta.remove_(model)` to undo). For a fine-tune over a 4-bit
    base, pass the 16-bit model the 4-bit one was loaded from: the delta's entries are of its weights.

    Args:
        model: the base model (a transformers `PreTrainedModel`).
        delta: the fine-tune.
        directory: where `save_pretrained` writes.
        **save_kwargs: passed to `model.save_pretrained`.

    Raises:
        TypeError: the model has no `save_pretrained`.
        DeltaError: the delta does not apply (the model is unchanged).

    Example:
        >>> sift.merge_and_save(base_model, delta, "merged")  # doctest: +SKIP
        >>> transformers.AutoModelForSequenceClassification.from_pretrained("merged")  # doctest: +SKIP
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel (with save_pretrained), got "
                        f"{type(model).__name__}")
    delta.apply_(model)
    with torch.no_grad():
        model.save_pretrained(os.fspath(directory), **save_kwargs)
