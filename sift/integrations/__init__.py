"""Integrations with training frameworks.

- `sift.integrations.sparse_trainer(TrainerClass)`: any transformers `Trainer` class (TRL's `SFTTrainer`,
  `DPOTrainer`, ...) with sift's fine-tuning; `SparseTrainer` is `sparse_trainer(Trainer)`
  (`sift.integrations.hf`).
- Plain loops and DDP need nothing special: see the README.
"""

from __future__ import annotations

from typing import Any

_FROM_HF = ("SparseTrainer", "SparseTrainerMixin", "sparse_trainer")
__all__ = list(_FROM_HF)


def __getattr__(name: str) -> Any:
    # transformers is imported on first use, not by `import sift.integrations`.
    if name in _FROM_HF:
        from sift.integrations import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'sift.integrations' has no attribute {name!r}")
