"""`SparseAdamW`: the optimizer class, its param groups, and `step()`, composed of named parts
(`_build_parts`), each owned by one sibling module: `entries` (state.py), `grads` (hooks.py),
`selector` (selection.py), `amp` (amp.py), `steps` (steps.py), `memory` (memory.py); checkpoints
and copies are checkpoint.py's functions. A part reads the settings it was built with (`self.settings`,
`sift.optim.settings`) and its sibling parts' public members, never another module's private attribute,
and changes a sibling's data (a param's state: the entries') only through the sibling's methods."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from sift import _ops
from sift.optim import checkpoint
from sift.optim.amp import ScalerLink
from sift.optim.checkpoint import check_hyper
from sift.optim.clip import clip_each_, clip_grad_norm_
from sift.optim.hooks import GradRoutes
from sift.optim.memory import MemoryPolicy, resolve_memory
from sift.optim.plan import WeightPlan, plans_of
from sift.optim.reselection import (Reselector, check_reselect_modes, check_reselect_param, reselect_memory,
                                    reselect_settings)
from sift.optim.selection import Selector
from sift.optim.settings import Settings, setting_view
from sift.optim.sharded import check_sharded_param, check_sparse_backward
from sift.optim.state import SPARSE_DTYPES, EntryState, is_dtensor, local_tensor, uses_grad
from sift.optim.steps import Steps
from sift.optim.trainer_check import check_trainer



class SparseAdamW(torch.optim.Optimizer):
    """AdamW over a fixed sparse subset of each weight's entries (SIFT).

    Args:
        params: tensors or param-group dicts, as for any torch optimizer. Groups may set
            their own `lr`, `betas`, `eps`, `weight_decay` and `density`.
        lr: learning rate (a float, or a 1-element tensor for CUDA-graph capture).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator.
        weight_decay: decoupled weight decay, applied to the chosen entries only.
        density: fraction of each weight's entries to train, in (0, 1]; the top
            `ceil(density * numel)` (at least 1) are kept. `1.0` makes the group dense AdamW.
        select_steps: how many `step()` calls accumulate the selection score before the
            entries are chosen. The last of them also applies the first update; earlier ones
            update nothing. Only a `step()` that runs counts: a step GradScaler skips (inf/NaN
            gradients) leaves the selection pending and the state unchanged.
        selection: "magnitude" (SIFT's top-|grad|, summed over the selection steps),
            "saliency" (first-order saliency `-theta * grad` averaged over the selection
            steps, the entries of largest magnitude kept; NAS-PEFT), or "random" (seeded
            baseline). Equal scores go to the lower flat index on every device.
        seed: seed of `selection="random"`.
        maximize: maximise the objective instead.
        compact_grads: memory-efficient mode (SIFT Fig. 4); default (None): on when
            `update_in_backward` is, else off. A post-accumulate-grad hook on
            each sparse weight gathers `grad[indices]` into a compact fp32 buffer and frees
            the dense gradient at once, so at most one dense weight gradient exists at a
            time. Micro-batch accumulation adds into the compact buffers. Until a weight's
            entries are chosen its dense gradient is kept as in plain mode (the selection
            steps hold every sparse weight's dense gradient), so the entries equal plain
            mode's in every case: accumulation over micro-batches, several selection steps,
            every rule.
        max_grad_norm: if set, `step()` first clips the gradients it uses to this global
            norm with `sift.clip_grad_norm_` (for loops that cannot call it themselves).
        process_group: data parallelism without DDP, for `compact_grads` mode (whose hooks
            free the dense gradients DDP would reduce). With a process group, the dense
            gradient is averaged across ranks before selection (so every rank chooses the
            same entries), and `step()` averages the compact buffers and the dense groups'
            gradients. Plain mode needs none of this: wrap the model in DDP as usual.
        backend: force a kernel backend ("torch", "cpp", "triton"); default: automatic
            (see `python -m sift.env`).
        state: "exact" (the default: int32 indices, fp32 moments, the exact increment `delta`
            and the entries' values at selection `base`; 20 bytes per entry for fp32 weights, 18
            for bf16/fp16. The step writes each weight as round(base + delta), so base + delta is
            the tuned weight bit for bit; values written into the chosen entries by anything but
            the optimizer are overwritten at the next step) or "lean" (at most 8 bytes per entry:
            16-bit index halves under a window table, bf16 moments by stochastic rounding, an int8
            sub-ulp residual for bf16/fp16 weights; no `delta`, see the module docstring for what
            is exact). `load_state_dict` adopts the saved setting.
        update_in_backward: step each selected sparse weight as soon as its gradient is
            complete (implies `compact_grads=True`): once per backward, after every use of the
            weight in the forward has contributed (a layer applied twice, a head tied to an
            embedding, shared layers), from a pre-hook on its gradient accumulator or, with the
            sparse backward, from the [k] gradient its layers wrote. That [k] gradient lives in one
            scratch buffer per device, sized to the largest k and reused by every weight (a weight
            whose uses interleave with another's gets its own buffer until its last use), so no
            per-weight compact gradient buffer outlives its layer's backward
            (`state_bytes()["compact_grad_bytes"]` counts the scratch). The selection step(s)
            still run in `step()` on dense gradients (and apply the first update there);
            afterwards `step()` only steps dense groups and keeps the books. One backward per
            `step()`: a second backward reaching a weight before `step()` raises RuntimeError
            (no micro-batch accumulation; nor reentrant checkpointing of segments that share a
            weight, whose nested backwards each see part of its gradient). `max_grad_norm` clips
            per tensor: each weight's compact gradient (and each dense group's gradient) is
            scaled to norm at most `max_grad_norm` on its own, since no global norm exists while
            layers are still being stepped; `sift.clip_grad_norm_` raises in this mode. Not with a
            `process_group` (the ranks' gradients would have to be averaged inside backward)
            nor with GradScaler (a weight stepped in backward cannot be unstepped when the
            scaler finds inf/NaN afterwards).
        grad_scaler: the `torch.amp.GradScaler` that scales this optimizer's loss, needed only
            when `scaler.unscale_(optimizer)` is called in `compact_grads` mode (or with the sparse
            backward): the unscale reaches `.grad` alone, and `clip_grad_norm_` or `step()`
            unscale the compact buffers with this scaler's scale. `scaler.step(optimizer)` needs
            no link: it hands `step()` the scale and the inf flag itself (see `sift.optim.amp`).
            May be set later as `optimizer.grad_scaler`; not pickled or copied.
        sharded_selection: which entries FSDP2 (`fully_shard`) params train. "global" (the
            default): the top `ceil(density * numel)` of the whole weight's gradient score, as one
            process on the same global batch chooses (ties to the lower flat index), found by a
            threshold search of a few dozen small all-reduces at selection; each rank keeps the
            entries in its shard, however many (0 included); `selection="random"` draws the whole
            weight's seeded scores on every rank (no communication). "per_shard": each rank the top
            `ceil(density * shard numel)` of its own shard, no communication (equal to one process
            selecting per block of rows). No effect on unsharded params.
        reselect_every, reselect_fraction, reselect_schedule, reselect_total_steps, reselect_rule,
            reselect_drop, reselect_steps: periodic drop-and-grow re-selection, off by default
            (`sift.optim.reselection`, docs/reselection.md).

    Example:
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = SparseAdamW(model.parameters(), lr=1e-3, density=0.05)
        >>> model(torch.randn(8, 64)).square().mean().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["indices"].shape
        torch.Size([103])
    """

    # GradScaler hands `step()` its scale and inf flag (`sift.optim.amp`) instead of unscaling `.grad` itself.
    _step_supports_amp_scaling = True
    # The parts every optimizer is composed of, by name (see `_build_parts`), each a `sift.optim.part.Part`; a
    # subclass may swap one for its own subclass (another selection rule, say). The only list: the per-step reset,
    # state_dict, load_state_dict and copies iterate it.
    PARTS = (("entries", EntryState), ("grads", GradRoutes), ("selector", Selector), ("amp", ScalerLink),
             ("steps", Steps), ("memory", MemoryPolicy), ("reselector", Reselector))

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        density: float = 0.01,
        *,
        select_steps: int = 1,
        selection: str = "magnitude",
        seed: int = 0,
        maximize: bool = False,
        compact_grads: bool | None = None,
        max_grad_norm: float | None = None,
        process_group: Any = None,
        backend: str | None = None,
        state: str = "exact",
        update_in_backward: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        sharded_selection: str = "global",
        reselect_every: int | None = None, reselect_fraction: float = 0.2, reselect_schedule: str = "constant",
        reselect_total_steps: int | None = None, reselect_rule: str = "spiel", reselect_drop: str = "merge",
        reselect_steps: int = 1,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay, density)
        reselect = reselect_settings(reselect_every, reselect_fraction, reselect_schedule, reselect_total_steps,
                                     reselect_rule, reselect_drop, reselect_steps)
        if not isinstance(update_in_backward, bool):
            raise TypeError(f"update_in_backward must be a bool, got {update_in_backward!r}")
        if compact_grads is not None and not isinstance(compact_grads, bool):
            raise TypeError(f"compact_grads must be a bool or None, got {compact_grads!r}")
        if update_in_backward and compact_grads is False:
            raise ValueError("update_in_backward=True runs in the gradient hooks of compact_grads mode: leave "
                             "compact_grads unset (it is implied) or True")
        compact_grads = bool(compact_grads) or update_in_backward
        if update_in_backward and process_group is not None:
            raise ValueError("update_in_backward=True does not support a process_group: each weight is stepped "
                             "inside backward, before its gradient could be averaged across ranks")
        if state not in ("exact", "lean"):
            raise ValueError(f"state must be 'exact' or 'lean', got {state!r}")
        if sharded_selection not in ("global", "per_shard"):
            raise ValueError(f"sharded_selection must be 'global' or 'per_shard', got {sharded_selection!r}")
        if isinstance(select_steps, bool) or not isinstance(select_steps, int) or select_steps < 1:
            raise ValueError(f"select_steps must be a positive integer, got {select_steps!r}")
        if selection not in ("magnitude", "saliency", "random"):
            raise ValueError(f"selection must be 'magnitude', 'saliency' or 'random', got {selection!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        if process_group is not None and not compact_grads:
            raise ValueError("process_group is for compact_grads mode; in plain mode wrap the model in DDP")
        if backend is not None and backend not in _ops.BACKENDS:
            raise ValueError(f"backend must be one of {_ops.BACKENDS} or None, got {backend!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, density=float(density),
                        maximize=maximize)
        if reselect is not None:
            check_reselect_modes(state=state, rule=reselect_rule, drop=reselect_drop)
            defaults["reselect"] = reselect
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
        if grad_scaler is not None and update_in_backward:
            raise ValueError("update_in_backward=True cannot be used with a GradScaler: weights stepped inside "
                             "backward cannot be unstepped when the scaler finds inf/NaN")
        self.settings = Settings(select_steps=select_steps, selection=selection, seed=seed, compact_grads=compact_grads,
                                 state_layout=state, backend=backend, max_grad_norm=max_grad_norm,
                                 sharded_selection=sharded_selection)
        self._build_parts()
        self.memory.start(update_in_backward)
        self.grads.average_over(process_group)
        self.amp.link(grad_scaler)
        super().__init__(params, defaults)
        if compact_grads:
            self.grads.install_hooks()

    # The constructor's settings (`self.settings`, handed to every part), read-only under their public names.
    select_steps, selection, seed, compact_grads, state_layout, backend, max_grad_norm, sharded_selection = map(
        setting_view, ("select_steps", "selection", "seed", "compact_grads", "state_layout", "backend",
                       "max_grad_norm", "sharded_selection"))
    # The data a part owns, read and set here under their public names.
    update_in_backward = property(lambda self: self.memory.update_in_backward,
                                  doc="Whether weights are stepped inside backward (`sift.optim.memory`).")
    loss_scaled = property(lambda self: self.amp.loss_scaled, doc="Whether a GradScaler has driven a step.")

    def _sparse_backward_handle(self) -> Any:
        handle = self.grads.sparse_backward_handle
        if handle is None:  # as before: absent until a sparse backward is enabled
            raise AttributeError("no sparse backward was enabled for this optimizer")
        return handle

    sparse_backward_handle = property(_sparse_backward_handle, lambda self, handle: self.grads.hold_sparse_backward(
        handle), doc="What undoes the sparse backward `for_model` enabled (absent when none was).")
    grad_scaler = property(lambda self: self.amp.scaler, lambda self, scaler: self.amp.link(scaler),
                           doc="The GradScaler linked to this optimizer (`sift.optim.amp`).")
    process_group = property(lambda self: self.grads.process_group,
                             lambda self, group: self.grads.average_over(group),
                             doc="The ranks whose gradients `step()` averages (`sift.optim.hooks`).")

    def _build_parts(self) -> None:
        """The parts a mode is composed of (`PARTS`), each owned by one module and given `self.settings`, and what
        lives with this process alone. The constructor and every copy (`__setstate__`) build them here, so a copy
        never lacks one.

        `entries` (sift.optim.state): the sparse params, their state layout, `set_indices`, `indices_of`.
        `grads` (sift.optim.hooks): where each weight's gradient comes from and waits: hooks, compact buffers,
            the update in backward, 4-bit deltas, averaging over a process group.
        `selector` (sift.optim.selection): scores and the entries they choose.
        `amp` (sift.optim.amp): GradScaler's scale and inf flag, and the step's one agreement across ranks.
        `steps` (sift.optim.steps): the fused sparse kernels and torch's AdamW for dense groups.
        `memory` (sift.optim.memory): `memory="lowest"`'s first-step decision.
        `reselector` (sift.optim.reselection): the periodic drop and grow, and which weights re-select next.
        """
        # Whether the last step() was skipped for GradScaler's inf/NaN: `scaler.step` calls a
        # step that takes the scale itself even when it skips, so wrappers that count skipped
        # steps by "step() was not called" (accelerate) read this instead.
        self.last_step_skipped = False
        for name, part in self.PARTS:
            setattr(self, name, part(self, self.settings))

    def _forget_step_caches(self) -> None:
        """What lived for one step only, in each part (see their `new_step`)."""
        for name, _ in self.PARTS:
            getattr(self, name).new_step()

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        density: float = 0.01,
        lr: float | torch.Tensor = 1e-2,
        *,
        target_modules: str | list[str] | None = None,
        dense_modules: str | list[str] | None = None,
        selection: str = "random",
        memory: str = "low",
        sparse_backward: bool | None = None,
        **optimizer_kwargs: Any,
    ) -> SparseAdamW:
        """Train `model`'s attention projections sparsely and its task head densely; freeze the rest.

        See `sift.targets.for_model` for the defaults per model family, the matching rules and errors. The rule and
        rate (a random mask at 1e-2; `sift.targets.DEFAULT_SELECTION`, `DEFAULT_LR`) are the chat board's choice;
        `selection="magnitude"` trains SIFT's top-|grad| entries, best at 1e-3 to 3e-3.

        `memory` picks the memory mode (`sift.optim.memory`): "low" (the default: hook mode and the
        sparse backward, plain mode's result with no dense weight gradient after selection; 16-bit
        weights sum micro-batches in fp32, see that module), "lowest" (also the lean state and the
        update in backward) or "plain" (dense gradients). A mode that cannot apply to this model or
        these arguments is dropped with one log line. The explicit flags override the preset: `compact_grads`, `state`,
        `update_in_backward`, and `sparse_backward` (each sparse linear weight's gradient computed
        only at its chosen entries after selection, `sift.sparse_backward`; implies
        `compact_grads=True`; the handle that undoes it is `optimizer.sparse_backward_handle`).

        Example:
            >>> opt = SparseAdamW.for_model(model, density=0.01, lr=2e-3)  # doctest: +SKIP
            >>> opt = SparseAdamW.for_model(model, density=0.01, lr=2e-3, memory="lowest")  # doctest: +SKIP
        """
        # Imported here: sift.targets imports sift.optim.state (through sift.sparse_backward too), and so this
        # package, whose __init__ imports this module.
        from sift.targets import for_model

        if sparse_backward and optimizer_kwargs.get("compact_grads") is False:
            raise ValueError("sparse_backward=True needs compact_grads=True (its gradients go to the compact "
                             "buffers); leave compact_grads unset or True")
        memory = reselect_memory(memory, model, optimizer_kwargs)
        flags, auto = resolve_memory(memory, model, {**optimizer_kwargs, "sparse_backward": sparse_backward})
        sparse_backward = flags.pop("sparse_backward")
        optimizer_kwargs.update(flags)
        if sparse_backward:
            check_sparse_backward(model.named_parameters(), optimizer_kwargs.get("update_in_backward", False))
            if optimizer_kwargs.get("compact_grads") is False:
                raise ValueError("sparse_backward=True needs compact_grads=True (its gradients go to the compact "
                                 "buffers); leave compact_grads unset or True")
            optimizer_kwargs["compact_grads"] = True
        opt = for_model(model, density, lr, target_modules=target_modules, dense_modules=dense_modules,
                        selection=selection, optimizer_cls=cls, sparse_backward=bool(sparse_backward),
                        **optimizer_kwargs)
        opt.memory.chosen_by_preset(auto)
        return opt

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating all of it (nothing is added on error)."""
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("params must be an ordered collection (list or tuple), not a set: a set's order "
                            "changes between runs, and state_dict() identifies params by position")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if params and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params):
            # torch's named form, `named_parameters()`: the names become the group's param_names.
            param_group = {**param_group, "param_names": [name for name, _ in params]}
            params = [p for _, p in params]
        merged = {**self.defaults, **param_group} if hasattr(self, "defaults") else param_group
        check_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], merged["density"])
        seen: dict[int, int] = {}
        names = param_group.get("param_names")
        for j, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must be tensors, got {type(p).__name__} at position {j}")
            label = f"param {names[j]!r}" if names is not None and j < len(names) else f"param {j} of the new group"
            if id(p) in seen:
                # torch steps such a param twice (and warns); the fused kernels would race on it.
                raise ValueError(f"params lists the same tensor twice (positions {seen[id(p)]} and {j}); "
                                 "list tied weights once")
            seen[id(p)] = j
            if p.device.type == "meta":
                raise ValueError(f"{label} is on the meta device, which holds no values to train: materialise the "
                                 "model first (load its weights, or `to_empty(device=...)` and initialise it)")
            if not p.is_floating_point():
                raise ValueError(f"params must be floating point; {label} has dtype {p.dtype} (a quantized weight "
                                 "cannot be trained in place)")
            if merged["density"] < 1.0 and p.dtype not in SPARSE_DTYPES:
                raise ValueError(
                    f"sparse groups support float32, bfloat16 and float16 params; {label} has dtype {p.dtype}"
                )
            if merged["density"] < 1.0 and not local_tensor(p).is_contiguous():
                raise ValueError(f"sparse groups need contiguous params; {label} is not contiguous")
            if is_dtensor(p):
                check_sharded_param(self, p, label, sparse=merged["density"] < 1.0)
            if merged.get("reselect") and merged["density"] < 1.0:
                check_reselect_param(p, label, merged["reselect"], self.settings.state_layout == "lean")
        self.selector.rescan()
        group = dict(param_group)
        group["params"] = params
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        if "density" in group:
            group["density"] = float(group["density"])
        super().add_param_group(group)
        self.entries.index_groups()
        if self.grads.hooks_ready:  # a group added after construction
            self.grads.sync_hooks()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero dense grads as torch does, and drop gathered compact grads (and what a clip or a
        skipped step left for the next step)."""
        super().zero_grad(set_to_none)
        self.grads.drop_gathered()
        self._forget_step_caches()

    # ------------------------------------------------------ entries and gradients

    def set_indices(self, param: torch.Tensor, indices: torch.Tensor) -> None:
        """Choose the trainable entries of `param` yourself.

        Entries kept from an earlier selection keep their moments, increment and base;
        new entries start from zero moments. No increment is lost: an entry dropped with a
        nonzero `delta` moves to the param's retired record (`retired_indices`,
        `retired_delta`, and `retired_base` for weights with a base), and if a later call re-adds it,
        it takes its `delta` and `base` back from there (its moments still start at zero).
        The step count is kept. In `compact_grads` mode, a gradient already gathered this
        step is kept for the kept entries; the new ones get zero (their dense gradient is gone).

        Args:
            param: a param of a sparse group (density < 1) of this optimizer.
            indices: [k] sorted unique flat positions (int32 or int64), or a bool mask of
                `param`'s shape.

        Example:
            >>> from sift import SparseAdamW
            >>> w = torch.nn.Parameter(torch.randn(4, 4))
            >>> opt = SparseAdamW([w], density=0.5)
            >>> opt.set_indices(w, torch.tensor([0, 5, 10, 15]))
        """
        self.entries.set_indices(param, indices)
        self.reselector.refresh()  # k changed: so may the next re-selection

    def indices_of(self, param: torch.Tensor) -> torch.Tensor:
        """The chosen entries of `param`: [k] sorted flat positions (int32, int64 past 2**31 elements).

        The stored tensor for the exact state; decoded (a new [k] tensor) for the lean one.

        Raises:
            ValueError: `param`'s entries are not chosen yet.

        Example:
            >>> from sift import SparseAdamW
            >>> w = torch.nn.Parameter(torch.randn(4, 4))
            >>> opt = SparseAdamW([w], density=0.5, state="lean")
            >>> opt.set_indices(w, torch.tensor([0, 5, 10, 15]))
            >>> opt.indices_of(w).tolist()
            [0, 5, 10, 15]
        """
        return self.entries.indices_of(param)

    def state_bytes(self) -> dict[str, float]:
        """Optimizer-state memory: total bytes, trainable entries, and bytes per entry.

        Counts the sparse state (indices, moments, delta, base, step, and the retired record
        that `set_indices` may leave; for the lean state its index halves, window table,
        moments, residual and step) and the dense state of dense groups; compact gradient
        buffers (with `update_in_backward`, the shared scratch) are reported separately.
        `trainable_entries` counts active entries only.
        """
        return self.entries.state_bytes()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks of `compact_grads` mode (groups added later get none)."""
        self.grads.remove_hooks()

    def compact_grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a sparse backward adds this step's gradient of `param`: ([k] indices, [k] fp32
        buffer), or None while its entries are not chosen (the dense gradient is needed then).

        The first call of a step zeroes the buffer; later ones (micro-batches) add to it.
        """
        return self.grads.compact_grad_target(param)

    def compact_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient this step will use for a selected sparse param, as [k] values.

        In `compact_grads` mode, the gathered buffer (None before any backward); otherwise
        `param.grad.view(-1)[indices]` (a new tensor).
        """
        return self.grads.compact_grad(param)

    def plans(self) -> dict[str, WeightPlan]:
        """Each trained weight's `sift.optim.plan.WeightPlan` (what trains, where its gradient comes from, which
        state keeps it, when it steps, its entries once chosen), by param name (else "group {i}, param {j}").

        Example:
            >>> opt = SparseAdamW([("weight", torch.nn.Linear(8, 4).weight)], density=0.25, compact_grads=True)
            >>> opt.plans()["weight"]
            WeightPlan(trains='entries', gradient='hook', state='exact', steps='step()', entries=None)
        """
        return plans_of(self)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, plus this optimizer's selection settings under "sift"."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict()`; validates everything before changing anything.

        Raises:
            ValueError: groups, param counts, or any sparse state do not fit the params, or the state comes
                from another model (`sift.optim.checkpoint`).
        """
        checkpoint.load_state_dict(self, state_dict)
        self.entries.index_groups()
        self.reselector.refresh(reread=True)

    def __getstate__(self) -> dict[str, Any]:
        return checkpoint.getstate(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.settings = checkpoint.pickled_settings(state)
        self._build_parts()  # every part from the constructor's own list, then what each part carried over them
        checkpoint.setstate(self, state)
        self.entries.index_groups()
        self.reselector.refresh()

    # -------------------------------------------------------------------- step

    def _validate_grads(self) -> None:
        """Every refusal of `step()`, before anything (the memory mode's settling, selection included) changes,
        in the mode the step will run in (`memory="lowest"` may still drop the update in backward at it)."""
        update_in_backward = self.memory.update_in_backward and self.memory.drop_reason() is None
        self.grads.check_one_backward()
        if self.settings.compact_grads and not self.state:
            self._check_params_not_replaced()
        self.amp.check(update_in_backward)
        devices = set()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if not uses_grad(p):
                    continue
                g = p.grad
                if group["density"] < 1.0:
                    devices.add(p.device)
                if g.is_sparse:
                    raise ValueError(f"sparse-layout gradients are not supported (group {gi}, param {pi})")
                if g.shape != p.shape or g.dtype != p.dtype:
                    raise ValueError(
                        f"grad of group {gi}, param {pi} has shape {tuple(g.shape)} and dtype {g.dtype}; "
                        f"expected {tuple(p.shape)} and {p.dtype}"
                    )
        for device in devices:  # a forced backend that cannot run raises here, not mid-step
            lean = self.settings.state_layout == "lean"
            _ops.resolve("sparse_adamw_lean_" if lean else "sparse_adamw_", device, self.settings.backend)
        # Last: where it does not refuse, it may adopt the default process group.
        self.grads.check_data_parallel(update_in_backward)

    def train(self) -> None:
        """Called by transformers' Trainer before each training step: refuses one whose clipping cannot see
        the gradients this optimizer frees (`sift.optim.trainer_check`). Nothing else changes."""
        check_trainer(self)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (selection first, on the steps that select).

        Under `scaler.step(optimizer)` it reads GradScaler's `grad_scale` and `found_inf`: the
        scale is divided out of what the step reads (never by a pass over a sparse weight's
        `.grad`), and inf/NaN there or in a compact gradient skips the step, changing nothing.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate_grads()
        self.memory.settle()
        self.grads.hook_new_params()
        # Every rank agrees, once, before anything changes: averaged, unscaled, selected or skipped.
        scaled = self.amp.prepare()
        self.last_step_skipped = self.amp.agree(scaled.found_inf)
        self.amp.begin(scaled)
        if self.last_step_skipped:
            # GradScaler's inf/NaN: nothing changes (a pending selection stays pending); this
            # step's gradients are used up as by a step that ran.
            self._end_step()
            self.grads.after_step()
            return loss
        self.grads.sync_grads()
        self.grads.average_pending()  # the dense gradients both the selection and the re-selection read
        # The only place entries are chosen: a step GradScaler skips never gets here.
        self.reselector.reselect()
        self.selector.select()
        for route in self.grads.quantized.values():
            route.commit()
        self.amp.unscale_after_selection()
        if self.settings.max_grad_norm is not None and self.memory.update_in_backward:
            # No global norm exists once layers were stepped in backward: each dense grad on its own.
            clip_each_([local_tensor(p.grad) for group in self.param_groups if group["density"] >= 1.0
                        for p in group["params"] if uses_grad(p)], self.settings.max_grad_norm)
        elif self.settings.max_grad_norm is not None:
            clip_grad_norm_(self, self.settings.max_grad_norm)
        self.reselector.seed()  # from the gradient the update applies: unscaled and clipped by now
        try:
            for group in self.param_groups:
                if group["density"] >= 1.0:
                    self.steps.dense_step(group)
                else:
                    self.steps.sparse_step(group)
        finally:
            self._end_step()
        self.reselector.refresh()  # which weights re-select at the next step: their backward keeps the dense gradient
        self.grads.after_step()  # FSDP2's sparse backward: whether any rank's entries changed (a collective)
        return loss

    def _check_params_not_replaced(self) -> None:
        """Refuse params swapped into the groups after construction (accelerate's FSDP2 `prepare` does so): the
        compact modes' hooks and sparse backward hold the old ones, and the new ones would train wrongly."""
        for _, p in self.entries.sparse_params():
            if p.requires_grad and p not in self.grads.hook_handles and not any(p is q for q in self.grads.unhooked):
                raise RuntimeError("a param of this SparseAdamW was replaced after it was built (accelerate's FSDP2 "
                                   "prepare swaps an optimizer's params for the sharded ones): compact_grads and the "
                                   "sparse backward hooked the old params. Build the optimizer after fully_shard, or "
                                   "use plain mode (memory='plain') with accelerate")

    def _end_step(self) -> None:
        """Drop what lived for this step: caches, gathered compact gradients, the backward marks."""
        self._forget_step_caches()
        self.grads.end_step()
