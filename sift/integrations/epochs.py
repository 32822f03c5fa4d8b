"""An epoch-keyed order for TRL's `RepeatSampler` (GRPO's), so a Trainer resumed past the first epoch continues
with the prompts the uninterrupted run would have drawn.

`RepeatSampler` draws one permutation from its own generator per pass and has no `set_epoch`; the Trainer, resuming
at epoch e, starts a fresh pass without replaying the e passes before it, so it replays the first epoch's order.
`with_epochs` gives such a sampler a `set_epoch(e)` that leaves its generator where e passes would have (seeded
again, then e permutations drawn). The Trainer calls it before every epoch: the uninterrupted order is unchanged,
and a resume anywhere continues it."""

from __future__ import annotations

from typing import Any

import torch

_CLASSES: dict[type, type] = {}


def _set_epoch(self: Any, epoch: int) -> None:
    self.generator.manual_seed(self.seed)
    for _ in range(epoch):
        torch.randperm(self.num_samples, generator=self.generator)


def with_epochs(sampler: Any) -> Any:
    """`sampler`, given `set_epoch` if it is a shuffling, seeded TRL `RepeatSampler` without one; else unchanged.

    Example:
        >>> with_epochs(None) is None
        True
    """
    cls = type(sampler)
    if (cls.__name__ != "RepeatSampler" or not cls.__module__.startswith("trl.") or hasattr(sampler, "set_epoch")
            or not getattr(sampler, "shuffle", False) or getattr(sampler, "seed", None) is None
            or not isinstance(getattr(sampler, "generator", None), torch.Generator)):
        return sampler
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"set_epoch": _set_epoch, "__module__": __name__})
    sampler.__class__ = _CLASSES[cls]
    return sampler
