"""The selection rules, one engine for every weight source: a 16-bit weight's dense gradient
(`sift.optim.selection`) and a 4-bit or 8-bit layer's score formed in its backward (`sift.quantized`).

A rule turns each selection step's gradient into a score; the scores of `select_steps` steps add up
unscaled (GradScaler's scale may change between them); the entries are the top k of the total, equal
scores to the lower flat index on every device. A total that ranks nothing (zero everywhere, or not
finite) chooses nothing: the weight stays pending, said once. "random" draws each weight's scores from
a stream keyed by its name. Below both callers, so neither imports the other.
"""

from __future__ import annotations

import warnings

import torch

from sift._index import index_dtype, random_generator, top_k_positions

RULES = ("magnitude", "saliency", "random")


def step_score(rule: str, grad: torch.Tensor, weight: torch.Tensor | None, inv_scale: torch.Tensor | None = None, *,
               reuse: bool = False, signed: bool = True) -> torch.Tensor | None:
    """One step's score of a weight's entries (fp32, `grad`'s shape); None for "random", which scores nothing.

    The one scoring path: the selection of 16-bit weights and of 4-bit layers, and the re-selection of both
    (which ranks by magnitude, `signed=False`).

    Args:
        rule: "magnitude" (|grad|, SIFT) or "saliency" (-weight * grad; NAS-PEFT).
        grad: the weight's gradient (any float dtype), of `weight`'s shape.
        weight: the weight's values (saliency only).
        inv_scale: 1 / GradScaler's scale when `grad` is still loss-scaled; the score is unscaled by it.
        reuse: `grad` is an fp32 temporary of the caller's that the score may overwrite (no second
            weight-sized buffer).
        signed: saliency keeps its sign (the selection sums it over steps, then takes the magnitude); False:
            |weight * grad| (the re-selection ranks each step's magnitude).

    Example:
        >>> step_score("saliency", torch.tensor([1.0, -2.0]), torch.tensor([3.0, 1.0]), signed=False)
        tensor([3., 2.])
    """
    if rule == "random":
        return None
    if rule == "magnitude":
        score = grad.abs_() if reuse else grad.abs().float()
    elif rule == "saliency":
        # First-order saliency: the loss change predicted for zeroing the entry.
        score = grad.mul_(weight.float()) if reuse else weight.float() * grad.float()
        score = score.neg_() if signed else score.abs_()
    else:
        raise ValueError(f"selection must be one of {RULES}, got {rule!r}")
    if inv_scale is not None:
        score.mul_(inv_scale.to(score.device))
    return score


def total_score(rule: str, score: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """The score the entries are chosen by on the last selection step: this step's (overwritten) plus the
    earlier steps' `previous`; for saliency the magnitude of the signed sum (the average's order)."""
    if previous is not None:
        score = score.add_(previous)
    return score.abs_() if rule == "saliency" else score


def score_flags(score: torch.Tensor) -> torch.Tensor:
    """[2] fp32 on the score's device: whether any entry is inf/NaN, and whether any is nonzero."""
    return torch.stack([(~torch.isfinite(score)).any(), (score != 0).any()]).float()


def ranks_nothing(score: torch.Tensor | None) -> bool:
    """Whether `score` cannot rank the entries: zero everywhere (a zero-initialised layer, a batch whose
    labels are all ignored) or not finite anywhere. None (the random rule) always ranks. A host read."""
    if score is None:
        return False
    bad, nonzero = score_flags(score).tolist()
    return bool(bad) or not nonzero


def top_k(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k entries of largest score, sorted, ties to the lower flat index, in the index dtype of its size."""
    return top_k_positions(score.reshape(-1), k).to(index_dtype(score.numel()))


def random_entries(seed: int, name: str | None, position: int, numel: int, k: int,
                   device: torch.device) -> torch.Tensor:
    """The "random" rule's k entries of a weight of `numel` elements, drawn from the stream keyed by its
    `name` (by its `position` among the trained weights when it has none)."""
    gen = random_generator(seed, name, position, device)
    return top_k(torch.rand(numel, generator=gen, device=device), k)


def warn_unscored(label: str, stacklevel: int = 3) -> None:
    """Say, once per weight (the caller keeps the record), that its score ranked nothing."""
    warnings.warn(f"SparseAdamW: the selection score of {label} is zero everywhere or not finite (a zero-"
                  "initialised layer, a batch whose labels are all ignored, a NaN gradient): its entries are not "
                  "chosen, and it stays pending until a step whose gradient ranks them", stacklevel=stacklevel + 1)
