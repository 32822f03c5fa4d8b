"""What a delta is made of: `DeltaEntry` (one weight's sorted flat indices and fp32 increments)
and `DeltaError`, the error that lists every problem found."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Problems listed in one error before the rest are summarised.
MAX_LISTED_PROBLEMS = 20


class DeltaError(ValueError):
    """A delta does not fit a model, a file, or other deltas; the message lists every problem.

    Attributes:
        problems: one line per problem found.
    """

    def __init__(self, what: str, problems: Sequence[str]):
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED_PROBLEMS]
        more = len(self.problems) - len(shown)
        lines = [f"{what} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in shown]
        if more:
            lines.append(f"  - ... and {more} more")
        super().__init__("\n".join(lines))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class DeltaEntry:
    """The delta of one weight.

    Attributes:
        shape: the weight's shape.
        dtype: the weight's dtype (float32, bfloat16 or float16).
        indices: [k] int32 (int64 for >= 2**31 elements) flat positions, sorted, unique.
        values: [k] fp32 increments.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        # A list or torch.Size shape must compare equal to the model's `tuple(p.shape)`.
        self.shape = tuple(int(s) for s in self.shape)

    @property
    def numel(self) -> int:
        """Elements of the weight (not of the delta)."""
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """Entries of the delta."""
        return int(self.indices.numel())

    def problems(self, name: str) -> list[str]:
        """Everything wrong with this entry, one line each ([] when valid)."""
        out = []
        if self.dtype not in SUPPORTED_DTYPES:
            out.append(f"{name}: weight dtype {self.dtype} is not supported (float32, bfloat16, float16)")
        idx, val = self.indices, self.values
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
            what = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            return out + [f"{name}: indices must be a 1-D int32/int64 tensor, got {what}"]
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or val.dim() != 1:
            what = f"{val.dtype} {tuple(val.shape)}" if isinstance(val, torch.Tensor) else type(val).__name__
            return out + [f"{name}: values must be a 1-D float32 tensor, got {what}"]
        if val.numel() != idx.numel():
            return out + [f"{name}: {idx.numel()} indices but {val.numel()} values"]
        if idx.dtype == torch.int32 and self.numel > 2**31:
            out.append(f"{name}: int32 indices cannot address a weight of {self.numel} elements")
        if idx.numel():
            if idx.numel() > 1:
                bad = (idx[1:] <= idx[:-1]).nonzero()
                if bad.numel():
                    j = int(bad[0])
                    out.append(f"{name}: indices are not sorted and unique (position {j + 1}: {int(idx[j + 1])} "
                               f"after {int(idx[j])})")
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.numel:
                out.append(f"{name}: indices out of range: span [{lo}, {hi}] for a weight of {self.numel} elements")
            finite = torch.isfinite(val)
            if not bool(finite.all()):
                n_nan = int(torch.isnan(val).sum())
                out.append(f"{name}: {n_nan} NaN and {int((~finite).sum()) - n_nan} infinite values")
        return out
