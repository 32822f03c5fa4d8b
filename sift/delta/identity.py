"""Which model a fine-tune belongs to, in words: the base model's name on the Hub (or its local folder),
its class and type, as a fine-tune's config records them and as errors name them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn


def model_identity(model: nn.Module | None, base_model: str | None = None) -> dict[str, Any]:
    """What a fine-tune records of its base: `name_or_path` (a Hub name or a local folder), whether that is a
    local folder (`local`), the Hub commit, the `model_type` and the class (`model_class`).

    Args:
        model: the base (or tuned) model; a transformers model's config names its checkpoint.
        base_model: the base's name on the Hub (or a folder), overriding what the model's config says.

    Example:
        >>> model_identity(nn.Linear(2, 2))["model_class"]
        'Linear'
    """
    config = getattr(model, "config", None)
    name = base_model
    if name is None and config is not None:
        name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None) or None
    name = os.fspath(name) if name is not None else None
    return {"name_or_path": name,
            "local": bool(name) and os.path.isdir(name),
            "commit_hash": getattr(config, "_commit_hash", None) if base_model is None else None,
            "model_type": getattr(config, "model_type", None),
            "model_class": type(model).__name__ if model is not None else None}


def describe(identity: Mapping[str, Any] | None, fallback: str) -> str:
    """A model in a few words: `'org/name' (LlamaForCausalLM)`, or `fallback` when nothing is known.

    Example:
        >>> describe({"name_or_path": "org/tiny", "model_class": "LlamaForCausalLM"}, "a model")
        "'org/tiny' (LlamaForCausalLM)"
    """
    identity = identity or {}
    name, cls = identity.get("name_or_path"), identity.get("model_class")
    if name and cls:
        return f"{name!r} ({cls})"
    if name:
        return repr(name)
    if cls:
        return f"a {cls}"
    return fallback
