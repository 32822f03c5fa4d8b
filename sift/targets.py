"""Which weights of a model to fine-tune: `SparseAdamW.for_model` and `trainable_summary`.

`for_model` is the one-call entry point. It trains the attention projections' weights
sparsely (SIFT's default targets: Q, K, V and the output projection of every layer),
the task head densely, and freezes everything else:

    model family        sparse targets (their `.weight`)                 dense head
    BERT / RoBERTa      query, key, value, attention.output.dense        classifier, qa_outputs
    GPT-2               c_attn (fused QKV, a Conv1D), attn.c_proj        score
    Llama family        q_proj, k_proj, v_proj, o_proj (GQA too)         score (lm_head: only if named)

Module names are matched as peft matches `target_modules`: a plain dotted name matches a
module whose full name equals it or ends with "." + name; a pattern with other regex
characters (or a single string, peft's rule) must `re.fullmatch` the full name.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sift._index import entries_for
from sift.quantized import (attach_deltas, bind_deltas, check_not_sharded, detach_deltas, is_linear4bit,
                            is_linear8bit, is_quantized_linear)
from sift.sparse_backward import check_routable, enable_sparse_backward, exclude_from_ddp, routable_layers
from sift._params import SparseOptimizer
from sift._params import is_selected as _selected
from sift._params import local_tensor as _local
from sift._params import num_entries as _num_entries
from sift._params import quantized_routes as _quantized_routes

# SIFT trains the attention projections; per family, the names of those modules.
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "bert": ("query", "key", "value", "attention.output.dense"),
    "gpt2": ("c_attn", "attn.c_proj"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
# model_type -> family; models not listed are recognised by their module names.
_FAMILY_OF_TYPE = {
    "bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "camembert": "bert", "electra": "bert",
    "gpt2": "gpt2",
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "llama", "qwen3": "llama",
    "gemma": "llama", "gemma2": "llama", "olmo": "llama", "olmo2": "llama", "smollm3": "llama",
}
# The heads transformers adds on top of a pretrained body (randomly initialised for a new task). A
# causal LM's lm_head is pretrained: trained only when named in dense_modules (peft's habit).
DEFAULT_HEADS: tuple[str, ...] = ("classifier", "score", "qa_outputs")
# The entry points' rule and rate, chosen by the chat board (bench/results/llm-cpu.md, 3 seeds per task): a random
# 1% of the attention projections at 1e-2 learned more than top-|grad| at its own best rate (1e-3 to 3e-3) on both
# tasks and drifted a tenth as far from the base on general chat, whose top-|grad| entries crowd into the few
# massive-activation input columns. SparseAdamW itself keeps SIFT's "magnitude".
DEFAULT_SELECTION = "random"
DEFAULT_LR = 1e-2


def rate_advice(optimizer: torch.optim.Optimizer) -> str | None:
    """A warning when every sparse group's learning rate is a dense fine-tune's (below 1e-4: Trainer's default
    5e-5, TRL's 2e-5), at which sparse entries barely move; None otherwise."""
    rates = [float(g["lr"]) for g in optimizer.param_groups if g.get("density", 1.0) < 1.0]
    if not rates or max(rates) >= 1e-4:
        return None
    return (f"sift: learning_rate {max(rates):g} is a dense fine-tune's rate; sparse entries learn little at it "
            "(the chat board's best at 1%: about 1e-2 for selection='random', 1e-3 to 3e-3 for 'magnitude'; "
            "docs/modes.md)")
_PLAIN_NAME = re.compile(r"[\w.]+")


def _matches(pattern: str, name: str, as_regex: bool) -> bool:
    if as_regex or not _PLAIN_NAME.fullmatch(pattern):
        return re.fullmatch(pattern, name) is not None
    return name == pattern or name.endswith("." + pattern)


def _normalise(modules: str | Iterable[str], what: str) -> tuple[list[str], bool]:
    """The patterns of `modules` and whether they are one regex (peft's rule for a single str)."""
    if isinstance(modules, str):
        return [modules], True
    patterns = list(modules)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{what} must be a string or a list of strings, got an element {bad[0]!r}")
    return patterns, False


def _nearest(pattern: str, names: list[str]) -> list[str]:
    # A typo is usually in the short name ("qurey"), so the trailing parts of every name compete too.
    candidates = {".".join(parts[i:]) for parts in (name.split(".") for name in names)
                  for i in range(len(parts)) if not parts[i].isdigit()}
    return difflib.get_close_matches(pattern, sorted(candidates), n=5, cutoff=0.5)


def _resolve(model: nn.Module, modules: str | Iterable[str], what: str) -> list[str]:
    """Names of the modules `modules` selects; every pattern must select at least one."""
    patterns, as_regex = _normalise(modules, what)
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, None] = {}
    for pattern in patterns:
        hits = [name for name in names if _matches(pattern, name, as_regex)]
        if not hits:
            near = _nearest(pattern, names)
            hint = f"; nearest module names: {near}" if near else ""
            raise ValueError(f"{what} entry {pattern!r} matches no module of {type(model).__name__}{hint}")
        chosen.update(dict.fromkeys(hits))
    return list(chosen)


def model_family(model: nn.Module) -> str | None:
    """"bert", "gpt2", "llama", or None: from `model.config.model_type`, else from module names.

    Example:
        >>> model_family(transformers.GPT2Model(transformers.GPT2Config(n_layer=1)))  # doctest: +SKIP
        'gpt2'
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _FAMILY_OF_TYPE:
        return _FAMILY_OF_TYPE[model_type]
    suffixes = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    names = [name for name, _ in model.named_modules()]
    if {"q_proj", "k_proj", "v_proj", "o_proj"} <= suffixes:
        return "llama"
    if "c_attn" in suffixes and any(name.endswith("attn.c_proj") for name in names):
        return "gpt2"
    if {"query", "key", "value"} <= suffixes and any(name.endswith("attention.output.dense") for name in names):
        return "bert"
    return None


def _is_linear(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2) is a linear layer with an [in, out] weight.
    conv1d = type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) or conv1d) and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _default_heads(model: nn.Module) -> list[str]:
    """The default dense modules present in `model`: its new task head (never a causal LM's lm_head)."""
    present = dict(model.named_modules())
    return [name for name in DEFAULT_HEADS if name in present]


def head_fate(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """One line per head module of `model`: how `optimizer` trains it (or why not)."""
    trained = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    lines = []
    for name, module in model.named_modules():
        if name not in (*DEFAULT_HEADS, "lm_head"):
            continue
        params = list(module.parameters())
        groups = {trained[id(p)].get("name") or ("dense" if trained[id(p)].get("density", 1.0) >= 1.0 else "sparse")
                  for p in params if id(p) in trained and p.requires_grad}
        if groups:
            lines.append(f"{name}: trained ({', '.join(sorted(groups))})")
        elif name == "lm_head" and _lm_head_is_tied(model):
            lines.append(f"{name}: frozen (tied to the input embeddings; it trains with them if they are targets)")
        elif name == "lm_head":
            lines.append(f"{name}: frozen (pretrained; name it in dense_modules to train it)")
        else:
            lines.append(f"{name}: frozen")
    return lines


def _lm_head_is_tied(model: nn.Module) -> bool:
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    if get_out is None or get_in is None:
        return False
    out, inp = get_out(), get_in()
    if out is None or inp is None:
        return False
    return out.weight.data_ptr() == inp.weight.data_ptr()


@dataclass
class TargetPlan:
    """What `for_model` will do to a model, decided before anything is changed.

    Attributes:
        sparse: {param name: weight} trained sparsely (the target modules' `.weight`).
        dense: {param name: param} trained with dense AdamW (every param of the dense modules).
        frozen: names of all other params (`requires_grad_(False)`).
        target_modules: the module names whose weight is sparse.
        dense_modules: the module names trained densely.
    """

    sparse: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: list[str] = field(default_factory=list)
    target_modules: list[str] = field(default_factory=list)
    dense_modules: list[str] = field(default_factory=list)

    def apply_requires_grad(self, model: nn.Module) -> None:
        """Unfreeze the sparse and dense params and freeze all others."""
        trained = {id(p) for p in (*self.sparse.values(), *self.dense.values())}
        for p in model.parameters():
            p.requires_grad_(id(p) in trained)


def plan_targets(
    model: nn.Module,
    *,
    target_modules: str | Sequence[str] | None = None,
    dense_modules: str | Sequence[str] | None = None,
) -> TargetPlan:
    """Decide which params `for_model` trains sparsely, densely, or not at all; changes nothing.

    Args:
        model: any `nn.Module`; the defaults need a BERT/RoBERTa, GPT-2 or Llama-family model.
        target_modules: modules whose `.weight` is trained sparsely (names or regexes, see the
            module docstring). Default: the attention Q, K, V and output projections.
        dense_modules: modules trained densely (all their params). Default: the new task head
            (`classifier`, `score`, `qa_outputs`) when there is one; a causal LM's `lm_head`
            only when named here.

    Returns:
        The `TargetPlan`.

    Raises:
        ValueError: a pattern matching no module (with the nearest names), an unknown model
            family without `target_modules`, a target that is not a linear layer with a 2-D
            weight, or a param both sparse and dense.

    Example:
        >>> plan = plan_targets(model)  # doctest: +SKIP
        >>> sorted(plan.dense)  # doctest: +SKIP
        ['classifier.bias', 'classifier.weight']
    """
    if target_modules is None:
        family = model_family(model)
        if family is None:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise ValueError(
                f"cannot tell the attention projections of {type(model).__name__} (model_type {model_type!r}); "
                "pass target_modules=[...] with the names of the linear layers to train sparsely"
            )
        target_modules = DEFAULT_TARGETS[family]
    targets = _resolve(model, target_modules, "target_modules")
    dense_names = _default_heads(model) if dense_modules is None else _resolve(model, dense_modules, "dense_modules")
    modules = dict(model.named_modules())
    not_linear = [name for name in targets if not _is_linear(modules[name])]
    if not_linear:
        kinds = ", ".join(f"{name} ({type(modules[name]).__name__})" for name in not_linear[:5])
        raise ValueError(f"target_modules must select linear layers with a 2-D weight (nn.Linear or transformers "
                         f"Conv1D); these are not: {kinds}")
    name_of = {id(p): name for name, p in model.named_parameters()}
    sparse = {name_of[id(modules[name].weight)]: modules[name].weight for name in targets}
    dense: dict[str, torch.Tensor] = {}
    for module_name in dense_names:
        for p in modules[module_name].parameters():
            dense.setdefault(name_of[id(p)], p)
    both = sorted(set(sparse) & set(dense))
    if both:
        raise ValueError(f"params both sparse (target_modules) and dense (dense_modules): {both[:5]}; "
                         "a module can be only one of them")
    frozen = [name for name in name_of.values() if name not in sparse and name not in dense]
    return TargetPlan(sparse, dense, frozen, targets, dense_names)


def for_model(
    model: nn.Module,
    density: float = 0.01,
    lr: float = DEFAULT_LR,
    *,
    target_modules: str | Sequence[str] | None = None,
    dense_modules: str | Sequence[str] | None = None,
    selection: str = DEFAULT_SELECTION,
    optimizer_cls: type[torch.optim.Optimizer],
    sparse_backward: bool = False,
    **optimizer_kwargs: Any,
) -> torch.optim.Optimizer:
    """Freeze `model` but for its target weights (sparse) and task head (dense); their optimizer.

    The target modules' biases are frozen too: SIFT trains weight entries only. Everything
    is decided and the optimizer built before any `requires_grad` changes, so on error the
    model is left as it was. Param groups carry torch's `param_names` and a `"name"`
    ("sparse" or "dense"), which `trainable_summary` reads.

    Args:
        model: the model to fine-tune.
        density: fraction of each target weight's entries to train, in (0, 1].
        lr: learning rate of both groups (default 1e-2, the chat board's best for a random 1% mask; top-|grad|
            entries want 1e-3 to 3e-3).
        target_modules: see `plan_targets`.
        dense_modules: see `plan_targets`.
        selection: `SparseAdamW(selection=...)`: "random" by default (the chat board's choice, see
            `DEFAULT_SELECTION`), "magnitude" for SIFT's top-|grad|, or "saliency".
        optimizer_cls: the optimizer class to build, `SparseAdamW` or a subclass (`SparseAdamW.for_model`
            passes its own).
        sparse_backward: route the sparse linear weights through `sift.enable_sparse_backward` (needs
            `compact_grads=True`); its handle becomes `optimizer.sparse_backward_handle`.
        **optimizer_kwargs: the other `SparseAdamW` arguments (`weight_decay`,
            `compact_grads`, `max_grad_norm`, `select_steps`, ...).

    Returns:
        The optimizer, with a "sparse" group (if any target) and a "dense" group (if any head).

    Raises:
        ValueError: density outside (0, 1], or any error of `plan_targets` or `SparseAdamW`.

    Example:
        >>> model = transformers.BertForSequenceClassification(config)  # doctest: +SKIP
        >>> opt = sift.SparseAdamW.for_model(model, density=0.01, lr=2e-3)  # doctest: +SKIP
        >>> print(sift.trainable_summary(model, opt))  # doctest: +SKIP
    """
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    compact = optimizer_kwargs.get("compact_grads") or optimizer_kwargs.get("update_in_backward")
    if compact and isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("model is wrapped in DistributedDataParallel, which averages .grad, but compact_grads mode "
                         "(hook mode, the sparse backward, update_in_backward) frees or never forms .grad, so the "
                         "replicas would drift apart: call for_model on the unwrapped model and wrap it in DDP "
                         "afterwards (for_model leaves the sparse weights to the optimizer, which averages them), "
                         "or train in plain mode under DDP")
    check_not_sharded(model)
    plan = plan_targets(model, target_modules=target_modules, dense_modules=dense_modules)
    modules = dict(model.named_modules())
    # 4-bit targets train a sparse delta over their frozen packed weight (sift.quantized).
    quantized = [name for name in plan.target_modules if is_quantized_linear(modules[name])]
    packed = {id(modules[name].weight) for name in quantized}
    plan.sparse = {key: p for key, p in plan.sparse.items() if id(p) not in packed}
    if sparse_backward:  # every refusal before the first change to the model
        check_routable(routable_layers(model, {id(p) for p in plan.sparse.values()}))
    groups = []
    if plan.sparse:
        groups.append({"params": list(plan.sparse.values()), "param_names": list(plan.sparse),
                       "density": float(density), "name": "sparse"})
    if plan.dense:
        groups.append({"params": list(plan.dense.values()), "param_names": list(plan.dense),
                       "density": 1.0, "name": "dense"})
    deltas = attach_deltas(model, quantized, float(density)) if quantized else {}
    if deltas:
        groups.append({"params": list(deltas.values()), "param_names": list(deltas), "density": 1.0,
                       "name": "quantized"})
    try:
        optimizer = optimizer_cls(groups, lr=lr, density=float(density), selection=selection, **optimizer_kwargs)
    except BaseException:
        detach_deltas(model, quantized)
        raise
    plan.apply_requires_grad(model)
    for values in deltas.values():
        values.requires_grad_(True)
    if optimizer.compact_grads:
        exclude_from_ddp(model, list(plan.sparse))
    if quantized:
        optimizer.grads.route_quantized(bind_deltas(model, quantized, optimizer))
    if sparse_backward:
        optimizer.grads.hold_sparse_backward(enable_sparse_backward(model, optimizer))
    return optimizer


# ------------------------------------------------------------------ summary


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): name for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p, name in zip(group["params"], group.get("param_names", ())):
            names.setdefault(id(p), name)
    return names


def _kind(name: str) -> str:
    """`encoder.layer.3.attention.self.query.weight` -> `encoder.layer.*.attention.self.query.weight`."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def _state_tensor_bytes(state: dict[str, Any]) -> int:
    # "score" is the dense |grad| buffer of a pending multi-step selection, not kept state.
    return sum(v.numel() * v.element_size() for k, v in state.items() if isinstance(v, torch.Tensor) and k != "score")


def trainable_summary(model: nn.Module, optimizer: torch.optim.Optimizer, *, by: str = "kind") -> str:
    """A markdown table of what `optimizer` trains in `model`, and how much state it keeps.

    Columns: name, shape, mode (sparse / dense / 4-bit delta / frozen), trainable entries, optimizer-state
    bytes; after the table, the rule that picks a `SparseAdamW`'s sparse entries. A sparse weight not selected yet (before the first `step()`) shows the planned
    `ceil(density * numel)` entries, marked "pending"; its state bytes count once it exists.
    A last line gives the totals and the trainable share of all params; a 4-bit weight counts as its
    [out, in] elements (not its packed bytes) and its delta's values as entries of it. Works with any torch
    optimizer (params of groups without a `density` count as dense).

    Args:
        model: the model.
        optimizer: its optimizer, e.g. from `SparseAdamW.for_model`.
        by: "kind" merges params whose names differ only in layer numbers (`layer.*.`) and
            that share shape and mode; "param" lists every param.

    Returns:
        The table (markdown, one row per kind or param, then the total).

    Example:
        >>> opt = sift.SparseAdamW.for_model(model, density=0.01)  # doctest: +SKIP
        >>> print(sift.trainable_summary(model, opt))  # doctest: +SKIP
        | name | shape | mode | trainable entries | optimizer state (bytes) |
        ...
    """
    if by not in ("kind", "param"):
        raise ValueError(f"by must be 'kind' or 'param', got {by!r}")
    names = _param_names(model, optimizer)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    # (name, shape, mode) -> [params, entries, state bytes, params still pending]
    rows: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
    seen: set[int] = set()
    total_params = total_entries = total_bytes = 0
    # A 4-bit weight is stored as packed bytes ([out * in / 2, 1]): it counts as its [out, in] elements.
    logical = {id(m.weight): (m.out_features, m.in_features) for m in model.modules() if is_linear4bit(m)}
    # Params the optimizer holds outside the model (rare) still count.
    params = [p for _, p in model.named_parameters()] + [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        shape = logical.get(id(p), tuple(p.shape))
        numel = shape[0] * shape[1] if id(p) in logical else _local(p).numel()
        group = group_of.get(id(p))
        # A delta's values are entries of its layer's weight, whose elements count already.
        total_params += 0 if group is not None and group.get("name") == "quantized" else numel
        state = optimizer.state.get(p, {})
        pending = 0
        if group is None or not p.requires_grad:
            mode, entries = "frozen", 0
        elif group.get("name") == "quantized":  # the [k] values of a 4-bit or 8-bit layer's sparse delta
            route = _quantized_routes(optimizer).get(p)
            mode = "8-bit delta" if route is not None and is_linear8bit(route.module) else "4-bit delta"
            entries = numel
            pending = int("delta_indices" not in state and "delta_indices_low" not in state)
        elif group.get("density", 1.0) >= 1.0:
            mode, entries = "dense", numel
        else:
            mode = "sparse"
            if _selected(state):  # either layout: exact `indices` or lean `indices_low`
                entries = _num_entries(state)
            else:
                entries = max(1, entries_for(group["density"], numel)) if numel else 0
                pending = 1
        state_bytes = _state_tensor_bytes(state)
        total_entries += entries
        total_bytes += state_bytes
        name = names.get(id(p), "?")
        key = (_kind(name) if by == "kind" else name, shape, mode)
        row = rows.setdefault(key, [0, 0, 0, 0])
        row[0] += 1
        row[1] += entries
        row[2] += state_bytes
        row[3] += pending
    if isinstance(optimizer, SparseOptimizer):  # a SparseAdamW, which defines state_bytes()
        total_bytes = int(optimizer.state_bytes()["state_bytes"])
    lines = ["| name | shape | mode | trainable entries | optimizer state (bytes) |", "|---|---|---|---|---|"]
    for (name, shape, mode), (count, entries, state_bytes, pending) in rows.items():
        label = f"{name} (x{count})" if count > 1 else name
        entry_text = f"{entries:,}" + (" (pending)" if pending else "")
        lines.append(f"| {label} | {list(shape)} | {mode} | {entry_text} | {state_bytes:,} |")
    share = 100.0 * total_entries / total_params if total_params else 0.0
    lines.append(f"| **total** ({len(seen)} params, {total_params:,} elements) | | | "
                 f"**{total_entries:,}** ({share:.3g}% of all) | **{total_bytes:,}** |")
    if isinstance(optimizer, SparseOptimizer) and any(mode == "sparse" for _, _, mode in rows):
        rule = _SELECTION_TEXT[optimizer.selection].format(seed=optimizer.seed, steps=optimizer.select_steps)
        lines += ["", f"Sparse entries (those not given by set_indices): {rule}."]
    fates = head_fate(model, optimizer)
    if fates:
        lines += ["", "Heads: " + "; ".join(fates) + "."]
    return "\n".join(lines)


_SELECTION_TEXT = {"random": 'a random mask (selection="random", seed {seed}), drawn per weight from its name',
                   "magnitude": 'the top-|grad| of each weight over {steps} step(s) (selection="magnitude", SIFT)',
                   "saliency": 'the top first-order saliency |w * grad| over {steps} step(s) (selection="saliency")'}


def planned_entries(optimizer: SparseOptimizer) -> int:
    """Trainable entries of `optimizer` once every sparse weight is selected.

    Example:
        >>> planned_entries(sift.SparseAdamW.for_model(model, density=0.01))  # doctest: +SKIP
        35424
    """
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            numel = _local(p).numel()
            state = optimizer.state.get(p, {})
            if group["density"] >= 1.0:
                total += numel
            elif _selected(state):
                total += _num_entries(state)
            elif numel:
                total += max(1, entries_for(group["density"], numel))
    return total
