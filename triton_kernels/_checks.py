"""Argument checks shared by the launchers here and the references in `sift._ops` (imports
only the standard library, so the references use it without triton)."""

from __future__ import annotations


def check_lengths(n_params: int, **lists: list) -> None:
    """Raise unless every list holds one tensor per param.

    Example:
        >>> check_lengths(2, indices=[0, 1], values=[0])
        Traceback (most recent call last):
        ...
        ValueError: values must have one tensor per param (got 1 for 2)
    """
    # zip() would silently skip the params past the shorter list.
    for name, tensors in lists.items():
        if len(tensors) != n_params:
            raise ValueError(f"{name} must have one tensor per param (got {len(tensors)} for {n_params})")
