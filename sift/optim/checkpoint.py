"""Checking and saving `SparseAdamW`: hyper-parameter checks, `state_dict` / `load_state_dict`
(every saved tensor validated before anything changes), pickling and copying."""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from typing import Any

import torch

from sift import _ops
from sift._index import check_indices as _check_indices
from sift._index import index_dtype as _index_dtype
from sift._index import lookup as _lookup
from sift.optim.settings import NAMES as SETTING_NAMES
from sift.optim.settings import Settings
from sift.optim.state import RETIRED_KEYS, SPARSE_KEYS, is_dtensor, is_selected, local_tensor


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any, density: Any) -> None:
    lr_value = lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"lr must be a float or a 1-element tensor, got shape {tuple(lr.shape)}")
    if not isinstance(lr_value, (int, float)) or not lr_value >= 0.0:
        raise ValueError(f"lr must be a non-negative number, got {lr!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta!r}")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be a non-negative number, got {weight_decay!r}")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")



# What a copy carries besides torch's own state and its parts': the settings, each under its own key.
PICKLED = SETTING_NAMES


def getstate(opt: Any) -> dict[str, Any]:
    """torch's pickled state plus the optimizer's settings (copy.deepcopy and pickle use it).

    Not carried: the process group (a handle to this process's communicator, which cannot
    be pickled; the copy has none and warns), the grad scaler (the copy has none), the grad
    hooks (the copy hooks its own params) and the kernels' launch tables (built again for the
    copy's tensors). Carried: what each part of `opt.PARTS` carries (`Part.carried`: the compact gradients
    gathered this step, the update in backward and `memory="lowest"`'s decision, whether a GradScaler drove a step).
    """
    state = torch.optim.Optimizer.__getstate__(opt)
    for name, _ in opt.PARTS:  # the copy builds its own
        state.pop(name, None)
    state.pop("last_step_skipped", None)
    state.update({name: getattr(opt.settings, name) for name in PICKLED})
    state["parts"] = {name: getattr(opt, name).carried() for name, _ in opt.PARTS}
    state["had_process_group"] = opt.grads.process_group is not None
    return state


def pickled_settings(state: dict[str, Any]) -> Settings:
    """The settings a pickled optimizer was built with (earlier versions pickled no state layout or sharded
    selection: theirs were the defaults)."""
    return Settings(**{name: state[name] for name in PICKLED if name in state})


def setstate(opt: Any, state: dict[str, Any]) -> None:
    """Rebuild a copy whose settings (`pickled_settings`) and parts were just built (`SparseAdamW._build_parts`):
    torch's state, and what each part carried, over them."""
    state = {key: value for key, value in state.items() if key not in PICKLED}
    had_process_group = state.pop("had_process_group", False)
    state.pop("process_group", None)  # pickled by earlier versions (always None there)
    # Pickled by earlier versions under their own keys (before them, the mixins' attribute names).
    legacy = {"grads": {"compact": state.pop("compact", state.pop("_compact", {})),
                        "ready": state.pop("grad_ready", state.pop("_grad_ready", set()))},
              "memory": {"auto": state.pop("update_in_backward_auto", state.pop("_update_in_backward_auto", False))}}
    carried = {name: dict(part) for name, part in state.pop("parts", legacy).items()}
    # Settings earlier versions pickled on the optimizer, which its parts own now.
    for part, key in (("memory", "update_in_backward"), ("amp", "loss_scaled")):
        if key in state:
            carried.setdefault(part, {}).setdefault(key, state.pop(key))
    torch.optim.Optimizer.__setstate__(opt, state)
    for name, _ in opt.PARTS:
        getattr(opt, name).carry(carried.get(name, {}))
    opt.__dict__.pop("keep_base", None)  # pickled by versions that had the option
    if had_process_group:
        warnings.warn("SparseAdamW: the copy has no process_group (a process group cannot be copied or "
                      "pickled); set `optimizer.process_group` to average gradients across ranks again",
                      stacklevel=3)
    # Hooks are not copied with the params: the copy hooks its own.
    if opt.settings.compact_grads:
        opt.grads.install_hooks()


def state_dict(opt: Any) -> dict[str, Any]:
    """torch's layout, plus the optimizer's selection settings under "sift"."""
    sd = torch.optim.Optimizer.state_dict(opt)
    # Each param's shape, so that a load can tell a state meant for another weight of equal size.
    shapes = {pid: list(local_tensor(p).shape) for saved, group in zip(sd["param_groups"], opt.param_groups)
              for pid, p in zip(saved["params"], group["params"])}
    settings = opt.settings
    sd["sift"] = {"select_steps": settings.select_steps, "selection": settings.selection, "seed": settings.seed,
                  "state": settings.state_layout, "format": 1, "param_shapes": shapes,
                  "sharded_selection": settings.sharded_selection,
                  "compact_grads": settings.compact_grads}
    for name, _ in opt.PARTS:
        sd["sift"].update(getattr(opt, name).saved())
    return sd


def load_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
    """Load a state saved by `state_dict()`; validates everything before changing anything.

    Raises:
        ValueError: groups, param counts, or any sparse state do not fit the params.
    """
    state_dict = state_dict.copy()  # torch's order: a shallow copy, then the pre-hooks
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    # A deep copy, as torch takes: a saved lr tensor must not be shared with the source
    # optimizer, whose scheduler would otherwise drive this one too.
    saved_groups = copy.deepcopy(state_dict["param_groups"])
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} param groups, the optimizer {len(opt.param_groups)}"
        )
    id_map: dict[int, tuple[torch.Tensor, float]] = {}  # saved id -> (param, its density once loaded)
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {gi}: state_dict has {len(saved['params'])} params, the optimizer "
                f"{len(group['params'])}"
            )
        # The saved hyper-parameters replace the group's (as in torch), so they are checked
        # and the state is validated against the saved density, not the constructed one.
        merged = {**group, **saved}
        try:
            check_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], merged["density"])
        except ValueError as exc:
            raise ValueError(f"param group {gi} of the state_dict: {exc}") from None
        id_map.update((pid, (p, float(merged["density"]))) for pid, p in _match_params(gi, saved, group))
    meta = state_dict.get("sift", {})
    _check_shapes(meta.get("param_shapes"), id_map, saved_groups, opt.param_groups)
    layout = meta.get("state", "exact")  # states saved before the option are exact
    if meta.get("sharded_selection", "global") not in ("global", "per_shard"):
        raise ValueError(f"state_dict['sift']['sharded_selection'] must be 'global' or 'per_shard', got "
                         f"{meta['sharded_selection']!r}")
    if layout not in ("exact", "lean"):
        raise ValueError(f"state_dict['sift']['state'] must be 'exact' or 'lean', got {layout!r}")
    if layout == "lean":
        for saved, group in zip(saved_groups, opt.param_groups):
            settings = saved.get("reselect", group.get("reselect"))
            sparse = float(saved.get("density", group["density"])) < 1.0  # a 4-bit delta's group is dense
            if settings and (settings["rule"] == "spiel" or (sparse and settings["drop"] == "revert")):
                raise ValueError("a lean state_dict (state='lean') cannot be loaded into groups that re-select by "
                                 f"reselect_rule={settings['rule']!r}, reselect_drop={settings['drop']!r}: the lean "
                                 "state keeps no delta to drop by and no base to revert to")
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    for pid, saved_state in state_dict["state"].items():
        if pid not in id_map:
            raise ValueError(f"state_dict has state for param id {pid}, which no group lists")
        p, density = id_map[pid]
        route = opt.grads.quantized.get(p)
        new_state[p] = _load_param_state(p, saved_state, density, f"state of param {pid}", lean=layout == "lean",
                                         delta_numel=route.numel if route is not None else None)
    _check_entry_values(new_state, id_map, saved_groups, opt.param_groups)
    # Everything validated: install.
    opt.state = defaultdict(dict, new_state)
    opt.selector.rescan()
    for saved, group in zip(saved_groups, opt.param_groups):
        for key, value in saved.items():
            if key not in ("params", "param_names"):
                group[key] = value
        group["betas"] = tuple(group["betas"])
        group["density"] = float(group["density"])
    opt.settings = opt.settings.adopting(meta)
    for name, _ in opt.PARTS:
        getattr(opt, name).adopt(opt.settings)
    for name, _ in opt.PARTS:
        getattr(opt, name).resume(meta)
    opt.grads.after_load()
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _match_params(gi: int, saved: dict[str, Any], group: dict[str, Any]) -> list[tuple[Any, torch.Tensor]]:
    """(saved id, param) pairs of group `gi`: by `param_names` when both sides carry them, else by position.

    Raises:
        ValueError: the names differ (naming the first saved and the first own name that disagree).
    """
    saved_names, names = saved.get("param_names"), group.get("param_names")
    if saved_names is None or names is None:
        return list(zip(saved["params"], group["params"]))
    if sorted(saved_names) != sorted(names):
        missing = [n for n in names if n not in saved_names]
        extra = [n for n in saved_names if n not in names]
        raise ValueError(f"param group {gi}: the state_dict holds state for {extra[0]!r}, this optimizer trains "
                         f"{missing[0]!r} there (the params must be the same, by name)")
    by_name = dict(zip(saved_names, saved["params"]))
    return [(by_name[name], p) for name, p in zip(names, group["params"])]


def _check_shapes(shapes: dict[Any, list[int]] | None, id_map: dict[Any, tuple[torch.Tensor, float]],
                  saved_groups: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Refuse a state saved for a param of another shape (two weights of equal size swapped by position)."""
    if shapes is None:  # saved before shapes were recorded
        return
    saved_name = {pid: name for saved in saved_groups for pid, name in zip(saved["params"], saved.get("param_names", ()))}
    own_name = {id(p): name for group in groups for p, name in zip(group["params"], group.get("param_names", ()))}
    for pid, (p, _) in id_map.items():
        shape = shapes.get(pid)
        if shape is not None and tuple(shape) != tuple(local_tensor(p).shape):
            theirs = f"{saved_name[pid]!r}" if pid in saved_name else f"param {pid}"
            ours = f"{own_name[id(p)]!r}" if id(p) in own_name else "the param at its position"
            raise ValueError(f"the state_dict's state of {theirs} was saved for shape {tuple(shape)}, but would load "
                             f"onto {ours} of shape {tuple(local_tensor(p).shape)}")


def _check_entry_values(new_state: dict[torch.Tensor, dict[str, Any]],
                        id_map: dict[Any, tuple[torch.Tensor, float]], saved_groups: list[dict[str, Any]],
                        groups: list[dict[str, Any]]) -> None:
    """Refuse an exact state whose weight is not this param: its step writes each chosen entry as
    round(base + delta), so the param the state was saved with holds exactly those values there (another model's
    weight of equal shape does not), and the next step would write them over this param's. States without a base
    (lean: its step adds to the weight's own values; 4-bit deltas; fp32 states saved without bases) carry nothing
    to compare and write nothing of another weight: their params are matched by name (and shape) alone."""
    saved_name = {pid: name for saved in saved_groups
                  for pid, name in zip(saved["params"], saved.get("param_names", ()))}
    own_name = {id(p): name for group in groups for p, name in zip(group["params"], group.get("param_names", ()))}
    own_position = {id(p): (gi, pi) for gi, group in enumerate(groups) for pi, p in enumerate(group["params"])}
    for pid, (p, _) in id_map.items():
        state = new_state.get(p, {})
        if "indices" not in state or "base" not in state:
            continue
        indices = state["indices"].long()
        written = (state["base"].float() + state["delta"]).to(p.dtype)
        held = local_tensor(p.detach()).reshape(-1)[indices]
        differs = ~(held.eq(written) | (held.isnan() & written.isnan()))
        if not bool(differs.any()):
            continue
        first = int(differs.nonzero()[0])
        theirs = f"{saved_name[pid]!r}" if pid in saved_name else f"param {pid}"
        ours = (f"{own_name[id(p)]!r}" if id(p) in own_name else
                "group {}, param {}".format(*own_position[id(p)]))
        raise ValueError(f"the state_dict's state of {theirs} does not belong to this optimizer's {ours}: "
                         f"{int(differs.sum())} of its {indices.numel()} chosen entries hold other values "
                         f"than the weight it was saved with (flat position {int(indices[first])} holds "
                         f"{float(held[first])!r}, that weight {float(written[first])!r}). It was saved with another "
                         "model; or load the model's weights saved with it before the optimizer state")


def _load_param_state(p: torch.Tensor, saved: dict[str, Any], density: float, what: str, lean: bool = False,
                      delta_numel: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta_numel is not None:
        return _load_delta_state(p, saved, delta_numel, what, lean)
    if density < 1.0 and (lean or "indices_low" in saved) and is_selected(saved):
        return _load_lean_state(p, saved, lean, what)
    stray = [k for k in RETIRED_KEYS if k in saved and "indices" not in saved]
    if stray:
        raise ValueError(f"{what}: {', '.join(stray)} without indices (a retired record needs a selection)")
    if density >= 1.0 or "indices" not in saved:
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                if key in ("exp_avg", "exp_avg_sq") and value.shape != p.shape:
                    raise ValueError(f"{what}: {key} has shape {tuple(value.shape)}, param {tuple(p.shape)}")
                if key == "score" and value.numel() != local_tensor(p).numel():
                    raise ValueError(f"{what}: score has {value.numel()} entries, param {local_tensor(p).numel()}")
                if key == "step":
                    value = value.detach().clone().float().cpu() if density >= 1.0 else \
                        value.detach().clone().float().to(p.device)
                elif key == "score":
                    value = value.detach().to(device=p.device, dtype=torch.float32).clone()
                else:
                    value = value.detach().to(device=p.device, dtype=p.dtype).clone()
            out[key] = value
        return out
    # fp32 states saved by versions that kept no fp32 base: the base is rebuilt from the weight.
    derive_base = p.dtype == torch.float32 and "base" not in saved
    missing = [k for k in SPARSE_KEYS if k not in saved] + ([] if "base" in saved or derive_base else ["base"])
    if missing:
        raise ValueError(f"{what}: missing {', '.join(missing)}")
    indices = saved["indices"]
    # An FSDP2 shard may hold 0 entries of the whole weight's top-k (the global selection).
    _check_indices(indices, local_tensor(p).numel(), f"{what}: indices", allow_empty=is_dtensor(p))
    k = indices.numel()
    for key in ("exp_avg", "exp_avg_sq", "delta") + (() if derive_base else ("base",)):
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != (k,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{what}: {key} must have shape ({k},) to match indices, got {shape}")
    out["indices"] = indices.detach().to(device=p.device, dtype=_index_dtype(local_tensor(p).numel())).clone()
    for key in ("exp_avg", "exp_avg_sq", "delta"):
        out[key] = saved[key].detach().to(device=p.device, dtype=torch.float32).clone()
    if derive_base:
        out["base"] = _weight_minus(p, out["indices"], out["delta"])
    else:
        out["base"] = saved["base"].detach().to(device=p.device, dtype=p.dtype).clone()
    out["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().to(p.device)
    if "selection_calls" in saved:
        out["selection_calls"] = int(saved["selection_calls"])
    out.update(_load_retired(p, saved, out["indices"], derive_base, what))
    out.update(_load_reselect_score(p, saved, local_tensor(p).numel(), what))
    return out


def _load_reselect_score(p: torch.Tensor, saved: dict[str, Any], numel: int, what: str) -> dict[str, torch.Tensor]:
    """A re-selection's summed score of the steps scored so far (`reselect_steps`), {} when none is in progress."""
    if "reselect_score" not in saved:
        return {}
    score = saved["reselect_score"]
    if not isinstance(score, torch.Tensor) or score.numel() != numel or not score.is_floating_point():
        raise ValueError(f"{what}: reselect_score must be a floating-point tensor of {numel} entries (the weight's)")
    return {"reselect_score": score.detach().reshape(-1).to(device=p.device, dtype=torch.float32).clone()}


def _weight_minus(p: torch.Tensor, indices: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """An fp32 weight's values at `indices` minus their increments: the base of a state saved without one
    (exact from here on; the trajectory so far was rounded once per step, so it may differ by an ulp)."""
    return local_tensor(p.detach()).reshape(-1)[indices.long()].float() - delta

def _load_delta_state(p: torch.Tensor, saved: dict[str, Any], numel: int, what: str, lean: bool) -> dict[str, Any]:
    """The validated state of a 4-bit layer's [k] delta values (`sift.quantized`): its chosen entries of
    the base weight (int32/int64 exact, 16-bit halves lean), moments (fp32 exact, bf16 lean), step."""
    k = p.numel()
    out: dict[str, Any] = {}
    index_keys = ("delta_indices_low", "delta_window_offsets") if lean else ("delta_indices",)
    stray = [key for key in ("delta_indices", "delta_indices_low", "delta_window_offsets")
             if key in saved and key not in index_keys]
    if stray:
        raise ValueError(f"{what}: {', '.join(stray)} do not belong to a {'lean' if lean else 'exact'} state")
    if "delta_indices" in saved:
        indices = saved["delta_indices"]
        if not isinstance(indices, torch.Tensor) or indices.shape != (k,):
            raise ValueError(f"{what}: delta_indices must have shape ({k},) to match the values")
        _check_indices(indices, numel, f"{what}: delta_indices")
        out["delta_indices"] = indices.detach().to(device=p.device, dtype=_index_dtype(numel)).clone()
    elif "delta_indices_low" in saved:
        low, offsets = saved["delta_indices_low"], saved.get("delta_window_offsets")
        _ops.checked_lean_indices(low, offsets, numel, what, ("delta_indices_low", "delta_window_offsets"))
        if low.numel() != k:
            raise ValueError(f"{what}: delta_indices_low must have shape ({k},) to match the values")
        out["delta_indices_low"] = low.detach().to(p.device).clone()
        out["delta_window_offsets"] = offsets.detach().to(p.device).clone()
    moment_dtype = torch.bfloat16 if lean else torch.float32
    for key in ("exp_avg", "exp_avg_sq"):
        if key in saved:
            value = saved[key]
            if not isinstance(value, torch.Tensor) or value.shape != (k,) or not value.is_floating_point():
                raise ValueError(f"{what}: {key} must be a floating-point tensor of shape ({k},)")
            out[key] = value.detach().to(device=p.device, dtype=moment_dtype).clone()
    if "step" in saved:
        # The lean kernel reads its count on the device; torch's AdamW on the CPU.
        out["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().to(
            p.device if lean else "cpu")
    if "selection_calls" in saved:
        out["selection_calls"] = int(saved["selection_calls"])
    if "score" in saved:  # a multi-step selection in progress: the committed steps' summed score
        score = saved["score"]
        if not isinstance(score, torch.Tensor) or score.numel() != numel or not score.is_floating_point():
            raise ValueError(f"{what}: score must be a floating-point tensor of {numel} entries (the weight's)")
        out["score"] = score.detach().reshape(-1).to(device=p.device, dtype=torch.float32).clone()
    out.update(_load_reselect_score(p, saved, numel, what))
    return out


def _load_lean_state(p: torch.Tensor, saved: dict[str, Any], lean: bool, what: str) -> dict[str, Any]:
    """The validated lean state of a selected sparse param."""
    if not lean:
        raise ValueError(f"{what}: a lean state (indices_low), but the state_dict's state is 'exact' (or absent)")
    low_precision = p.dtype != torch.float32
    stray = [key for key in ("indices", "delta", "base", *RETIRED_KEYS[1:]) + (() if low_precision else ("residual",))
             if key in saved]
    if stray:
        raise ValueError(f"{what}: {', '.join(stray)} in a lean state (state='lean' keeps "
                         f"{'a residual' if low_precision else 'no residual'} and no exact-state keys)")
    keys = ("indices_low", "window_offsets", "exp_avg", "exp_avg_sq", "step") + (("residual",) if low_precision else ())
    missing = [key for key in keys if key not in saved]
    if missing:
        raise ValueError(f"{what}: missing {', '.join(missing)}")
    low = saved["indices_low"]
    _ops.checked_lean_indices(low, saved["window_offsets"], local_tensor(p).numel(), what, allow_empty=is_dtensor(p))
    k = low.numel()
    dtypes = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "residual": torch.int8}
    for key in keys[2:4] + keys[5:]:
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != (k,) or value.dtype != dtypes[key]:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{what}: {key} must be {dtypes[key]} of shape ({k},), got {got}")
    out = {key: saved[key].detach().to(p.device).clone() for key in keys if key != "step"}
    out["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().to(p.device)
    if "selection_calls" in saved:
        out["selection_calls"] = int(saved["selection_calls"])
    out.update(_load_reselect_score(p, saved, local_tensor(p).numel(), what))
    if "retired_indices" in saved:  # positions dropped by set_indices or a re-selection: the weight keeps them
        retired = saved["retired_indices"]
        _check_indices(retired, local_tensor(p).numel(), f"{what}: retired_indices", allow_empty=True)
        out["retired_indices"] = retired.detach().to(device=p.device,
                                                     dtype=_index_dtype(local_tensor(p).numel())).clone()
    return out

def _load_retired(p: torch.Tensor, saved: dict[str, Any], indices: torch.Tensor, derive_base: bool,
                  what: str) -> dict[str, torch.Tensor]:
    """The validated retired record of a saved sparse state ({} when it has none); `derive_base`: an fp32
    state saved without bases, whose retired bases are rebuilt from the weight."""
    keys = RETIRED_KEYS[:2] if derive_base else RETIRED_KEYS
    if not any(k in saved for k in keys):
        return {}
    missing = [k for k in keys if k not in saved]
    if missing:
        raise ValueError(f"{what}: missing {', '.join(missing)} (the retired record is incomplete)")
    retired = saved["retired_indices"]
    _check_indices(retired, local_tensor(p).numel(), f"{what}: retired_indices", allow_empty=True)
    r = retired.numel()
    for key in keys[1:]:
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != (r,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{what}: {key} must have shape ({r},) to match retired_indices, got {shape}")
    retired = retired.detach().to(device=p.device, dtype=indices.dtype)
    overlap = _lookup(indices, retired)[0]
    if bool(overlap.any()):
        raise ValueError(f"{what}: retired_indices must be disjoint from indices; "
                         f"{int(overlap.sum())} are in both (first: {int(retired[overlap][0])})")
    if r == 0:  # the record is kept only while it holds something
        return {}
    out = {"retired_indices": retired.clone(),
           "retired_delta": saved["retired_delta"].detach().to(device=p.device, dtype=torch.float32).clone()}
    if derive_base:
        out["retired_base"] = _weight_minus(p, out["retired_indices"], out["retired_delta"])
    else:
        out["retired_base"] = saved["retired_base"].detach().to(device=p.device, dtype=p.dtype).clone()
    return out
