"""What the functions of `sift.delta` read of a delta: `DeltaContents`, the shape of `SparseDelta`'s data.

`SparseDelta`'s methods delegate to those functions (`construction`, `application`, `storage`,
`directory`, `merging`), so the functions sit below it in the import graph and name the delta they take
by this protocol, never by importing the class. A function that makes a delta is given the class to make."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

import torch

from sift.delta.entry import DeltaEntry
from sift.delta.fingerprint import BaseFingerprint


class DeltaContents(Protocol):
    """A delta's data: entries per sparse weight, dense parts, base fingerprint, and how it was made.

    Attributes:
        entries: name -> `DeltaEntry`.
        base: the base model's fingerprint, or None.
        dense: name -> the trained tensor that replaces the param whole.
        info: what the fine-tune was (density, selection, base model), for its config file.
    """

    entries: dict[str, DeltaEntry]
    base: BaseFingerprint | None
    dense: dict[str, torch.Tensor]
    info: dict

    def __init__(self, entries: Mapping[str, DeltaEntry] | None = None, base: BaseFingerprint | None = None,
                 dense: Mapping[str, torch.Tensor] | None = None, info: Mapping | None = None) -> None: ...

    @property
    def nnz(self) -> int: ...

    def problems(self) -> list[str]: ...

    def checksum(self) -> str: ...


# The class a function that makes a delta is given, and returns an instance of.
DeltaT = TypeVar("DeltaT", bound=DeltaContents)
