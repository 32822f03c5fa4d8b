"""A fine-tune in one call, as peft users load adapters: `from_pretrained(base_model, directory)` (as
`PeftModel.from_pretrained`) applies the fine-tune directory onto a model already loaded, in 16 bits or
in bitsandbytes 4 or 8 bits; `from_pretrained(directory)` (as `AutoPeftModelForCausalLM.from_pretrained`)
first loads the base model its config names, with transformers."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from sift.delta.sparse_delta import SparseDelta


def from_pretrained(model_or_directory: nn.Module | str | os.PathLike, directory: str | os.PathLike | None = None,
                    *, scale: float = 1.0, base_model: str | os.PathLike | None = None,
                    model_class: type | str | None = None, **from_pretrained_kwargs: Any) -> nn.Module:
    """The base model with a fine-tune directory (`SparseDelta.save_pretrained`) applied, in one call.

    `from_pretrained(model, directory)` applies it onto `model` in place: 16-bit weights take the entries
    in place, bitsandbytes 4-bit and 8-bit layers as their frozen sparse delta (`SparseDelta.apply_`).
    `from_pretrained(directory)` loads the base first: the model the fine-tune's config names (its Hub
    name or local folder, or `base_model`), with the class recorded there (or `model_class`; unknown:
    `AutoModelForCausalLM`), in the dtype of the delta's weights unless `dtype=` says otherwise.
    `sift.disabled(model)` switches the fine-tune off for a `with` block; `SparseDelta.from_pretrained`
    reads the delta alone.

    Args:
        model_or_directory: the base model, or the fine-tune directory.
        directory: the fine-tune directory, when the first argument is the model.
        scale: multiplier of the delta's values.
        base_model: where to load the base from (a Hub name or a folder) instead of the recorded one.
        model_class: the transformers class (or its name) that loads the base.
        **from_pretrained_kwargs: passed to the class's `from_pretrained` (`quantization_config=`,
            `device_map=`, `dtype=`, `local_files_only=`, ...).

    Returns:
        The model with the fine-tune applied (the given one, or the one loaded).

    Raises:
        FileNotFoundError: the directory is missing, or the base model cannot be loaded (the message
            names it and how to pass it).
        DeltaError: the directory cannot be trusted, or the fine-tune does not fit the model (nothing changed).

    Example:
        >>> model = sift.from_pretrained("my-fine-tune")  # doctest: +SKIP
        >>> model = sift.from_pretrained(base_model, "my-fine-tune")  # a base loaded in 4 bits, say  # doctest: +SKIP
    """
    if isinstance(model_or_directory, nn.Module):
        if directory is None:
            raise TypeError("from_pretrained(model, directory) needs the fine-tune directory")
        loading = {"base_model": base_model, "model_class": model_class, **from_pretrained_kwargs}
        given = sorted(k for k, v in loading.items() if v is not None)
        if given:
            raise TypeError(f"{', '.join(given)} load the base model, which was given: pass them without it, "
                            "as from_pretrained(directory, ...)")
        model = model_or_directory
        delta = SparseDelta.from_pretrained(directory)
    else:
        if directory is not None:
            raise TypeError("pass the base model first: from_pretrained(model, directory), or the directory alone")
        directory = model_or_directory
        delta = SparseDelta.from_pretrained(directory)
        model = _load_base(delta, os.fspath(directory), base_model, model_class, from_pretrained_kwargs)
    delta.apply_(model, scale)
    return model


def _load_base(delta: SparseDelta, directory: str, base_model: str | os.PathLike | None,
               model_class: type | str | None, kwargs: dict[str, Any]) -> nn.Module:
    """The base model the fine-tune in `directory` names, loaded with transformers."""
    import transformers

    recorded = delta.info.get("base_model") or {}
    name = os.fspath(base_model) if base_model is not None else recorded.get("name_or_path")
    how = (f"load the base yourself and pass it, sift.from_pretrained(base_model, {directory!r}), or say where "
           f"it is, sift.from_pretrained({directory!r}, base_model='org/name' or a folder)")
    if not name:
        raise FileNotFoundError(f"the fine-tune in {directory!r} does not name its base model: {how}")
    cls = model_class if model_class is not None else recorded.get("model_class")
    if isinstance(cls, str):
        cls = getattr(transformers, cls, None)
    if not (isinstance(cls, type) and hasattr(cls, "from_pretrained")):
        cls = transformers.AutoModelForCausalLM
    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        dtypes = {e.dtype for e in delta.entries.values()} | {t.dtype for t in delta.dense.values()}
        if len(dtypes) == 1:
            kwargs = {**kwargs, "dtype": dtypes.pop()}
    try:
        return cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:  # a missing repo or folder; an invalid repo id (a deleted local path)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(f"the fine-tune in {directory!r} was made on the base model {name!r}, which "
                                f"{cls.__name__}.from_pretrained cannot load ({first}): {how}") from exc

