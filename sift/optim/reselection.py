"""Periodic re-selection of `SparseAdamW`'s entries: drop the entries that moved least, grow new ones.

After SpIEL's drop-and-grow (Ansell et al.), with one step's dense gradient. A sparse weight whose
update count `s` (its state's `step`, the updates applied since its selection) is a positive multiple
of `reselect_every` is re-selected at the start of the `step()` that applies its update `s + 1`,
before that update, on that step's dense gradient `g`:

    n = floor(f(s) * k)                  (k: the weight's entries; at most numel - k)
    drop  the n kept entries of smallest |delta| ("spiel") or smallest |g| ("magnitude")
    grow  the n entries not selected before this step of largest |g|

Equal scores go to the lower flat index (dropped first, grown first). `f(s)` is `reselect_fraction`
times 1 ("constant"), `1 - t` ("linear") or `(1 + cos(pi t)) / 2` ("cosine"), `t = min(s / T, 1)`
with `T = reselect_total_steps`.

What each entry keeps (the exact state; indices stay sorted, every [k] tensor follows its index):
- a kept entry keeps its moments, `delta` and `base`;
- a dropped entry leaves its increment in the weight and in the retired record (`reselect_drop=
  "merge"`, the default: `SparseDelta.from_optimizer` still holds it), or is written back to its
  `base` and forgotten ("revert");
- a grown entry starts with `delta = 0` and `base` = the weight's current value; one that an earlier
  re-selection dropped takes its `delta` and `base` back from the retired record instead (the same
  weight value, its increment since the first selection kept whole).

Grown entries' moments. A fresh Adam entry taking its first step on `g` ends with
`exp_avg = (1 - b1) g`, `exp_avg_sq = (1 - b2) g^2` and bias corrections `1 - b^1`. The kernels
keep one step count per weight, so this update runs at the weight's count `s + 1`, corrected by
`1 - b^(s+1)`. Seeding the grown entries, before the update, with

    exp_avg = (1 - b1^s) g,   exp_avg_sq = (1 - b2^s) g^2

makes the update's moments `b (1 - b^s) x + (1 - b) x = (1 - b^(s+1)) x` (x = g, g^2): read through
the weight's correction, exactly a fresh entry's corrected moments `g` and `g^2`, so the grown
entries' first update is a fresh entry's first update. Their stored moments are then a fresh entry's
times `(1 - b^(s+1)) / (1 - b)`, which the shared correction reads as an entry whose past gradients
all equalled `g` (no inflated steps from a correction meant for an old count).

Not supported yet (refused at construction, or at the re-selection step for what only shows there):
the compact modes (`compact_grads`, the sparse backward, `update_in_backward`: the dense gradient
the growth ranks is gone), the lean state (it keeps no `delta`), 4-bit bases, FSDP2 shards,
`max_grad_norm` and a `clip_grad_norm_` before a re-selection step (the seeds would need the clip's
scale). Every setting lives in the param groups (`group["reselect"]`), so `state_dict` carries it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from sift._index import lookup as _lookup
from sift._index import top_k_positions
from sift.optim.state import is_dtensor, is_selected, local_tensor, uses_grad

logger = logging.getLogger("sift")

SCHEDULES = ("constant", "linear", "cosine")
RULES = ("spiel", "magnitude")
DROPS = ("merge", "revert")


def reselect_settings(every: int | None, fraction: float = 0.2, schedule: str = "constant",
                      total_steps: int | None = None, rule: str = "spiel", drop: str = "merge"
                      ) -> dict[str, Any] | None:
    """The validated re-selection settings a param group keeps, or None when `every` is None (off).

    Raises:
        ValueError: a setting out of range, naming its `reselect_*` argument.

    Example:
        >>> reselect_settings(100, 0.1)["fraction"]
        0.1
        >>> reselect_settings(None) is None
        True
    """
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"reselect_every must be a positive integer or None, got {every!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"reselect_fraction must be in (0, 1], got {fraction!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"reselect_schedule must be one of {SCHEDULES}, got {schedule!r}")
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise ValueError(f"reselect_total_steps must be a positive integer or None, got {total_steps!r}")
    if schedule != "constant" and total_steps is None:
        raise ValueError(f"reselect_schedule={schedule!r} decays over reselect_total_steps: pass it")
    if rule not in RULES:
        raise ValueError(f"reselect_rule must be one of {RULES}, got {rule!r}")
    if drop not in DROPS:
        raise ValueError(f"reselect_drop must be one of {DROPS}, got {drop!r}")
    return dict(every=every, fraction=float(fraction), schedule=schedule, total_steps=total_steps, rule=rule,
                drop=drop)


def check_reselect_modes(*, compact_grads: bool, update_in_backward: bool, state: str,
                         max_grad_norm: float | None) -> None:
    """Refuse, before anything is built, the modes re-selection does not support yet."""
    if compact_grads or update_in_backward:
        raise ValueError("reselect_every is not supported yet with compact_grads, the sparse backward or "
                         "update_in_backward: growing entries ranks the dense gradient these modes never keep; "
                         "use plain mode (memory='plain', compact_grads=False)")
    if state != "exact":
        raise ValueError("reselect_every is not supported yet with state='lean': dropping ranks each entry's "
                         "delta, which the lean state does not keep; use state='exact'")
    if max_grad_norm is not None:
        raise ValueError("reselect_every is not supported yet with max_grad_norm: the grown entries' moments are "
                         "seeded from the unclipped gradient")


def reselect_memory(memory: str, model: torch.nn.Module, kwargs: dict[str, Any]) -> str:
    """`for_model`'s memory preset with re-selection: "plain", the one mode it supports, with one log line.

    Raises:
        ValueError: re-selection asked for on a model with 4-bit or int8 (bitsandbytes) layers.
    """
    if kwargs.get("reselect_every") is None:
        return memory
    # By class name, as sift.quantized matches them (importing it here would close an import cycle).
    if any(type(getattr(m, "weight", None)).__name__ in ("Params4bit", "Int8Params") for m in model.modules()):
        raise ValueError("reselect_every is not supported yet on 4-bit or int8 bases: their sparse deltas are "
                         "trained through routes that keep no dense gradient")
    if memory != "plain":
        logger.warning("sift: memory=%r without its compact modes: reselect_every needs the dense gradients "
                       "(memory='plain')", memory)
    return "plain"


def fraction_at(settings: dict[str, Any], step: int) -> float:
    """The fraction of a weight's entries re-selected at its update count `step`.

    Example:
        >>> fraction_at(reselect_settings(10, 0.2, "linear", 100), 50)
        0.1
    """
    if settings["schedule"] == "constant":
        return settings["fraction"]
    t = min(step / settings["total_steps"], 1.0)
    decay = 1.0 - t if settings["schedule"] == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return settings["fraction"] * decay


def _refusal(opt: Any, p: torch.Tensor, state: dict[str, Any]) -> str | None:
    if opt.compact_grads or opt.update_in_backward:
        return "the compact modes keep no dense gradient to grow from (use plain mode)"
    if "indices" not in state:
        return "the lean state keeps no delta to drop by (use state='exact')"
    if p in opt.grads.quantized or is_dtensor(p):
        return "4-bit bases and FSDP2 shards are not supported yet"
    if opt.selector.clipped_grad(p) is not None:
        return ("clip_grad_norm_ gathered this step's gradient at the former entries; "
                "re-selection steps need an unclipped step() (max_grad_norm=None, no clip before it)")
    return None


def reselect_(opt: Any) -> None:
    """Re-select the entries of every sparse weight due this step (see the module docstring).

    Called by `step()` once it knows it updates, before the update. Everything is checked before
    anything changes.

    Raises:
        ValueError: a param group's `reselect` settings are invalid.
        RuntimeError: a weight due for re-selection is in a mode it does not support yet.
    """
    candidates = []
    for group in opt.param_groups:
        settings = group.get("reselect")
        if not settings or group["density"] >= 1.0:
            continue
        reselect_settings(**settings)
        for p in group["params"]:
            state = opt.state.get(p)
            if state and is_selected(state) and uses_grad(p):
                candidates.append((group, p, settings, state))
    # The update counts live on the weights' device: read them in one transfer per device, not one per weight.
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, _, _, state) in enumerate(candidates):
        by_device.setdefault(state["step"].device, []).append(i)
    counts = [0] * len(candidates)
    for positions in by_device.values():
        read = torch.stack([candidates[i][3]["step"] for i in positions]).tolist()
        for i, count in zip(positions, read):
            counts[i] = int(count)
    due = []
    for (group, p, settings, state), count in zip(candidates, counts):
        if count == 0 or count % settings["every"]:
            continue
        why = _refusal(opt, p, state)
        if why is not None:
            raise RuntimeError(f"re-selection (reselect_every={settings['every']}) at update {count}: {why}")
        due.append((group, p, settings, count))
    for group, p, settings, count in due:
        _reselect_param(opt, group, p, settings, count)


def _reselect_param(opt: Any, group: dict[str, Any], p: torch.Tensor, settings: dict[str, Any], count: int) -> None:
    state = opt.state[p]
    flat = local_tensor(p.detach()).view(-1)
    old = state["indices"]
    k = old.numel()
    n = min(int(fraction_at(settings, count) * k), flat.numel() - k)
    if n <= 0:
        return
    grad = local_tensor(p.grad).reshape(-1).float()
    inv_scale = opt.amp.grad_inv_scale
    if inv_scale is not None:  # scaler.step: .grad still holds the loss-scaled gradient
        grad = grad * inv_scale.to(grad.device)
    if group["maximize"]:
        grad = -grad
    old_long = old.long()
    moved = state["delta"].abs() if settings["rule"] == "spiel" else grad[old_long].abs()
    dropped = top_k_positions(-moved, n)  # positions in [k]; equal scores drop the lower index
    candidates = grad.abs().nan_to_num_(nan=-1.0)  # a NaN never outranks a finite gradient
    candidates[old_long] = float("-inf")  # only entries not selected before this step grow
    grown = top_k_positions(candidates, n)
    keep = torch.ones(k, dtype=torch.bool, device=old.device)
    keep[dropped] = False
    if settings["drop"] == "revert":
        flat[old_long[dropped]] = state["base"][dropped]
        state["delta"][dropped] = 0.0  # nothing to retire: the entry is back at its base
    indices = torch.cat([old[keep], grown.to(old.dtype)]).sort().values
    opt.set_indices(p, indices)
    state = opt.state[p]
    fresh = ~_lookup(old, indices)[0]
    g = grad[indices[fresh].long()]
    beta1, beta2 = (float(b) for b in group["betas"])
    state["exp_avg"][fresh] = (1.0 - beta1 ** count) * g
    state["exp_avg_sq"][fresh] = (1.0 - beta2 ** count) * g * g
