"""Each trained weight's plan: what trains, where its gradient comes from, which state keeps it, and when it
steps, as the optimizer's parts will handle it (`SparseAdamW.plans()`; docs/modes.md, "How a mode is put
together"). A mode is the set of these plans; `trainable_summary`'s counts are by the same weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sift._params import is_selected, num_entries


@dataclass(frozen=True)
class WeightPlan:
    """How one trained weight trains.

    Attributes:
        trains: "entries" (sparse entries of a 16-bit weight), "dense" (a `density=1.0` group), "4-bit delta" or
            "int8 delta" (a [k] delta over a packed bitsandbytes weight, `sift.quantized`).
        gradient: where its gradient comes from: "dense .grad" (plain mode; also every weight before its
            entries are chosen), "hook" (`compact_grads`: a hook gathers `grad[indices]` into a [k] fp32 buffer),
            "sparse backward" (the layer's backward writes the [k] gradient, `sift.sparse_backward`) or
            "4-bit backward" (the packed layer's backward forms the [k] values' gradient).
        state: "exact" (indices, fp32 moments, `delta`, `base`), "lean" (16-bit index halves, bf16 moments) or
            "dense" (torch's AdamW state).
        steps: "step()" or "backward" (`update_in_backward`: stepped as soon as its gradient is complete).
        entries: k, the number of chosen entries; None while they are not chosen (the weight is pending).
    """

    trains: str
    gradient: str
    state: str
    steps: str
    entries: int | None


def plan_of(opt: Any, group: dict[str, Any], p: torch.Tensor) -> WeightPlan:
    """`p`'s plan in `opt` (a SparseAdamW), from its group and the parts that will handle it."""
    route = opt.grads.quantized.get(p)
    in_backward, layout = opt.memory.update_in_backward, opt.settings.state_layout
    if route is not None:
        from_packed = "4-bit" if route.quant_state is not None else "int8"  # an int8 weight has no quant state
        return WeightPlan(f"{from_packed} delta", "4-bit backward", layout,
                          "backward" if in_backward else "step()", route.k if route.selected else None)
    if group["density"] >= 1.0:
        return WeightPlan("dense", "dense .grad", "dense", "step()", p.numel())
    state = opt.state.get(p, {})
    selected = is_selected(state)
    if not opt.settings.compact_grads:
        gradient = "dense .grad"
    else:
        gradient = "sparse backward" if opt.grads.routed(p) else "hook"
    return WeightPlan("entries", gradient, layout, "backward" if in_backward else "step()",
                      num_entries(state) if selected else None)


def plans_of(opt: Any) -> dict[str, WeightPlan]:
    """Every trained weight's plan in `opt`, by param name (else "group {i}, param {j}")."""
    plans = {}
    for gi, group in enumerate(opt.param_groups):
        names = group.get("param_names") or ()
        for pi, p in enumerate(group["params"]):
            plans[names[pi] if pi < len(names) else f"group {gi}, param {pi}"] = plan_of(opt, group, p)
    return plans
