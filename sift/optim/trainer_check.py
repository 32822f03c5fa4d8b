"""A transformers `Trainer` that does not know `SparseAdamW`: refused when its clipping would be lost.

The Trainer clips with torch's `clip_grad_norm_` over `.grad`. In the memory modes (`compact_grads`, the
sparse backward, the update in backward; `for_model`'s default) the sparse weights' dense gradients are
freed in hooks, so that clip finds none: it logs grad_norm 0.0 and the step goes unclipped, silently.

Where to notice: nothing in the Trainer calls into sift before training except `optimizer.train()`, its
hook for schedule-free optimizers, made at the start of every training step (before forward and backward,
so a refusal changes nothing). `SparseAdamW.train` runs this check there, finding the Trainer among the
calling frames by what it has (`args.max_grad_norm`, `_clip_grad_norm`): transformers is neither imported
nor patched. `sift.integrations.sparse_trainer` marks its classes `sift_integrated`, and they clip with
`sift.clip_grad_norm_`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)
_CALLER_DEPTH = 6  # Trainer.training_step -> AcceleratedOptimizer.train -> SparseAdamW.train -> here


def calling_trainer() -> Any | None:
    """The transformers-style Trainer among the calling frames, or None."""
    frame = sys._getframe(1)
    for _ in range(_CALLER_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if callable(getattr(owner, "_clip_grad_norm", None)) and hasattr(getattr(owner, "args", None),
                                                                          "max_grad_norm"):
            return owner
    return None


def check_trainer(optimizer: Any) -> None:
    """Raise (clipping asked) or warn once (only the logged grad_norm is wrong) when a Trainer that does not
    integrate sift drives an optimizer that frees the dense gradients its clipping reads.

    Raises:
        ValueError: `max_grad_norm > 0` in the Trainer's arguments, which its clip would not apply.
    """
    frees_grads = optimizer.settings.compact_grads or optimizer.memory.update_in_backward
    if optimizer.__dict__.get("_trainer_checked") or not frees_grads:
        return
    trainer = calling_trainer()
    if trainer is None or getattr(trainer, "sift_integrated", False):
        optimizer._trainer_checked = True
        return
    if getattr(trainer.args, "world_size", 1) > 1:
        # Several processes need plain mode, whatever the trainer class: the memory modes are refused there by
        # their own checks (DDP's averaging of .grad, FSDP2's replaced params), with that fix in the message.
        optimizer._trainer_checked = True
        return
    name = type(trainer).__name__
    max_norm = trainer.args.max_grad_norm
    fix = (f"use sift.integrations.sparse_trainer({name}) instead of {name} (the same trainer, clipping with "
           "sift.clip_grad_norm_, logging the true norm and saving the fine-tune)")
    if max_norm and max_norm > 0:
        raise ValueError(
            f"{name} would clip with max_grad_norm={max_norm} over .grad, which this SparseAdamW frees in its "
            f"memory mode: the clip would see no gradient, log grad_norm 0.0 and never apply. {fix}; or set "
            "max_grad_norm=0 in the TrainingArguments and pass max_grad_norm= to the optimizer, or memory='plain'")
    optimizer._trainer_checked = True
    logger.warning("%s logs grad_norm from .grad, which this SparseAdamW frees in its memory mode: it will log "
                   "0.0. To log the true norm, %s", name, fix)
