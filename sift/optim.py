"""`SparseAdamW`: AdamW restricted to a fixed sparse set of entries per weight (SIFT).

SIFT (Song et al., "Sparse is Enough in Fine-tuning Pre-trained Large Language Models",
Sec. 4) updates only the top-x% gradient components of each weight, chosen on the first
batch(es) and then kept fixed, so Adam moments exist for those entries only. Per sparse
weight with k chosen entries the optimizer keeps

    indices     [k] int32 (int64 for >= 2**31 elements), sorted flat positions
    exp_avg     [k] fp32
    exp_avg_sq  [k] fp32
    delta       [k] fp32, the exact total increment since selection
    base        [k] in the weight dtype: values at selection time; bf16/fp16 weights always,
                fp32 weights with `keep_base=True`
    step        0-d fp32 tensor on the weight's device

i.e. 16 bytes per trainable entry for fp32 weights (20 with `keep_base=True`) and 18 for
bf16/fp16 ones. Weights with a base are written as round(base + delta) and never read by the
step, so no bf16/fp16 update is lost to rounding however small it is against the weight's ulp.

`set_indices` can change the set mid-training. Entries it drops with a nonzero `delta` keep
their increment in a retired record, disjoint from `indices` and absent while empty:

    retired_indices  [r] sorted flat positions, same dtype as `indices`
    retired_delta    [r] fp32, the increment each one had when dropped
    retired_base     [r] weights with a base only: their `base`

An entry re-added later takes its `delta` (and `base`) back from the record and leaves it, so
`delta` stays the total increment since the first selection (what `SparseDelta.from_optimizer`
exports). The fused step never reads the record: it costs memory (with int32 indices, 8 bytes
per retired entry, 10 for bf16/fp16), not time.

`SparseAdamW(state="lean")` keeps at most 8 bytes per entry instead (6 for fp32 weights, 7
for bf16/fp16, plus the tables below):

    indices_low     [k] int16, the low 16 bits of the sorted flat positions
    window_offsets  [ceil(numel / 65536) + 1] int32: entries of each 65536-element window (CSR)
    exp_avg         [k] bf16, stored by stochastic rounding (random bits hashed from index and step)
    exp_avg_sq      [k] bf16, likewise
    residual        [k] int8, bf16/fp16 weights only: the exact weight is
                    w + residual * ulp(w) / 256, so updates down to about ulp / 256 accumulate
    step            0-d fp32 tensor

The positions are exact. The moments are bf16: unbiased (stochastic rounding; rounding to
nearest stalls the second moment), about 0.4% noise each. The weight is its own master: fp32
weights are exact up to the bf16 moments; bf16/fp16 weights lose what lies below ulp / 256.
There is no `delta` (so `SparseDelta.from_optimizer` refuses a lean optimizer: use
`SparseDelta.from_diff`) and no retired record: entries `set_indices` drops simply leave.

Groups with `density=1.0` are plain dense AdamW (torch's math), for a classifier head or
LayerNorms. The fused step runs through `sift._ops` (Triton on CUDA, C++ on CPU, the torch
reference anywhere).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from sift import _ops
from sift._index import check_indices as _check_indices
from sift._index import entries_for as _entries_for
from sift._index import index_dtype as _index_dtype
from sift._index import lookup as _lookup
from sift._index import merge_disjoint as _merge_disjoint
from sift._index import top_k_positions

_SPARSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SPARSE_KEYS = ("indices", "exp_avg", "exp_avg_sq", "delta", "step")
_RETIRED_KEYS = ("retired_indices", "retired_delta", "retired_base")


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any, density: Any) -> None:
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


def _is_dtensor(t: torch.Tensor) -> bool:
    # FSDP2 shards params as DTensors; sparse state lives on each rank's local shard.
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (a view of its storage), else `t` itself."""
    return t.to_local() if _is_dtensor(t) else t


def _steps(p: torch.Tensor) -> bool:
    """Whether the step uses p's gradient this time: frozen params are skipped even with a grad."""
    return p.requires_grad and p.grad is not None


def _selected(state: dict[str, Any]) -> bool:
    """Whether a param state holds chosen entries (exact or lean layout)."""
    return "indices" in state or "indices_low" in state


def _num_entries(state: dict[str, Any]) -> int:
    """k of a selected param state, in either layout."""
    return (state["indices"] if "indices" in state else state["indices_low"]).numel()


def _needs_base(p: torch.Tensor, keep_base: bool) -> bool:
    """Whether p's sparse state keeps `base` (bf16/fp16 always, fp32 with keep_base)."""
    return p.dtype != torch.float32 or keep_base


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
        compact_grads: memory-efficient mode (SIFT Fig. 4). A post-accumulate-grad hook on
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
        keep_base: fp32 weights also keep their chosen entries' values at selection (`base`,
            4 more bytes per entry, 20 in all). The step then writes each weight as
            base + delta and never reads it: one random read fewer per entry, which may pay
            on a GPU and does not on a CPU, where writing a line reads it
            anyway. Values written into the chosen entries by anything but the optimizer are
            overwritten at the next step (as for bf16/fp16 weights, which always keep a base).
            `load_state_dict` adopts the saved setting, like `select_steps`.
        state: "exact" (the default: int32 indices, fp32 moments, the exact increment `delta`
            and, for bf16/fp16 weights, `base`; 16 bytes per entry for fp32 weights, 18 for
            bf16/fp16) or "lean" (at most 8 bytes per entry: 16-bit index halves under a window
            table, bf16 moments by stochastic rounding, an int8 sub-ulp residual for bf16/fp16
            weights; no `delta`, see the module docstring for what is exact). Not with
            `keep_base`. `load_state_dict` adopts the saved setting.
        update_in_backward: with `compact_grads=True`, step each selected sparse weight as soon
            as its gradient is complete: inside its gradient hook (after the gather), or, with
            the sparse backward, right after the layer wrote its compact gradient. Its [k]
            gradient lives in one scratch buffer per device, sized to the largest k and reused
            by every weight, so no per-weight compact gradient buffer outlives its layer's
            backward (`state_bytes()["compact_grad_bytes"]` counts the scratch). The selection
            step(s) still run in `step()` on dense gradients (and apply the first update there);
            afterwards `step()` only steps dense groups and keeps the books. One backward per
            `step()`: a second backward reaching a weight before `step()` raises RuntimeError
            (no micro-batch accumulation). `max_grad_norm` clips per tensor: each weight's
            compact gradient (and each dense group's gradient) is scaled to norm at most
            `max_grad_norm` on its own, since no global norm exists while layers are still
            being stepped; `sift.clip_grad_norm_` raises in this mode. Not with a
            `process_group` (the ranks' gradients would have to be averaged inside backward)
            nor with fp16 GradScaler (it reads `.grad`, which these weights no longer have).

    Example:
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = SparseAdamW(model.parameters(), lr=1e-3, density=0.05)
        >>> model(torch.randn(8, 64)).square().mean().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["indices"].shape
        torch.Size([103])
    """

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
        compact_grads: bool = False,
        max_grad_norm: float | None = None,
        process_group: Any = None,
        backend: str | None = None,
        keep_base: bool = False,
        state: str = "exact",
        update_in_backward: bool = False,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay, density)
        if not isinstance(update_in_backward, bool):
            raise TypeError(f"update_in_backward must be a bool, got {update_in_backward!r}")
        if update_in_backward and not compact_grads:
            raise ValueError("update_in_backward=True needs compact_grads=True (the update runs in the gradient "
                             "hooks of compact_grads mode)")
        if update_in_backward and process_group is not None:
            raise ValueError("update_in_backward=True does not support a process_group: each weight is stepped "
                             "inside backward, before its gradient could be averaged across ranks")
        if state not in ("exact", "lean"):
            raise ValueError(f"state must be 'exact' or 'lean', got {state!r}")
        if state == "lean" and keep_base is True:
            raise ValueError("keep_base=True keeps a base next to the exact increment; the lean state has "
                             "neither (use state='exact')")
        if not isinstance(keep_base, bool):
            raise TypeError(f"keep_base must be a bool, got {keep_base!r}")
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
        self.select_steps = select_steps
        self.selection = selection
        self.seed = seed
        self.compact_grads = compact_grads
        self.keep_base = keep_base
        self.state_layout = state
        self.backend = backend
        self.max_grad_norm = max_grad_norm
        self.process_group = process_group
        self.update_in_backward = update_in_backward
        self._compact: dict[torch.Tensor, torch.Tensor] = {}  # param -> [k] fp32 gathered grad
        # update_in_backward: device -> [max k] fp32 scratch gradient shared by every weight, and
        # the sparse params a backward reached since the last step() (a second backward raises).
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._backward_seen: set[torch.Tensor] = set()
        # The kernels' launch tables: a CUDA graph captured over step() reads them, so they live
        # as long as this optimizer (never in state_dict, pickles or copies).
        self._kernel_cache: dict = {}
        self._grad_ready: set[torch.Tensor] = set()  # params whose compact grad holds this step's grad
        self._init_step_caches()
        # Sparse params still waiting for their selection (None: scan all of them). Frozen
        # and gradless params stay on it, so a layer unfrozen later is still selected.
        self._pending: list[tuple[dict[str, Any], torch.Tensor]] | None = None
        self._hook_handles: dict[torch.Tensor, Any] = {}  # compact_grads: param -> its grad hook
        self._unhooked: list[torch.Tensor] = []  # compact_grads: frozen sparse params (no hook possible yet)
        super().__init__(params, defaults)
        self._hooks_ready = compact_grads
        if compact_grads:
            self._sync_hooks()

    def _init_step_caches(self) -> None:
        """What lives for one step only: the entries a selecting step will choose (computed by
        `clip_grad_norm_` or the step, committed only by the step), the clipped [k] gradients
        `clip_grad_norm_` gathered for the step, and which pending dense grads were averaged
        across ranks. Keyed by the gradient they came from, so a stale entry is never used."""
        self._tentative: dict[torch.Tensor, tuple[tuple, torch.Tensor]] = {}
        self._clipped: dict[torch.Tensor, tuple[tuple, torch.Tensor]] = {}
        self._averaged: set[torch.Tensor] = set()

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        density: float = 0.01,
        lr: float | torch.Tensor = 1e-3,
        *,
        target_modules: str | list[str] | None = None,
        dense_modules: str | list[str] | None = None,
        selection: str = "magnitude",
        sparse_backward: bool = False,
        **optimizer_kwargs: Any,
    ) -> SparseAdamW:
        """Train `model`'s attention projections sparsely and its task head densely; freeze the rest.

        See `sift.targets.for_model` for the defaults per model family, the matching rules and errors.
        With `sparse_backward=True` (which implies `compact_grads=True`) each sparse linear weight's
        gradient is computed only at its chosen entries after selection (`sift.sparse_backward`);
        the handle that undoes it is `optimizer.sparse_backward_handle`.

        Example:
            >>> opt = SparseAdamW.for_model(model, density=0.01, lr=2e-3)  # doctest: +SKIP
        """
        from sift.targets import for_model  # sift.targets imports this module

        if sparse_backward:
            if optimizer_kwargs.get("compact_grads") is False:
                raise ValueError("sparse_backward=True needs compact_grads=True (its gradients go to the compact "
                                 "buffers); leave compact_grads unset or True")
            optimizer_kwargs["compact_grads"] = True
        opt = for_model(model, density, lr, target_modules=target_modules, dense_modules=dense_modules,
                        selection=selection, optimizer_cls=cls, **optimizer_kwargs)
        if sparse_backward:
            from sift.sparse_backward import enable_sparse_backward

            opt.sparse_backward_handle = enable_sparse_backward(model, opt)
        return opt

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating all of it (nothing is added on error)."""
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("params must be an ordered collection (list or tuple), not a set: a set's order "
                            "changes between runs, and state_dict() identifies params by position")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        merged = {**self.defaults, **param_group} if hasattr(self, "defaults") else param_group
        _check_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], merged["density"])
        seen: dict[int, int] = {}
        for j, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must be tensors, got {type(p).__name__} at position {j}")
            if id(p) in seen:
                # torch steps such a param twice (and warns); the fused kernels would race on it.
                raise ValueError(f"params lists the same tensor twice (positions {seen[id(p)]} and {j}); "
                                 "list tied weights once")
            seen[id(p)] = j
            if not p.is_floating_point():
                raise ValueError(f"params must be floating point; param {j} of the new group has dtype {p.dtype}")
            if merged["density"] < 1.0 and p.dtype not in _SPARSE_DTYPES:
                raise ValueError(
                    f"sparse groups support float32, bfloat16 and float16 params; param {j} has dtype {p.dtype}"
                )
            if merged["density"] < 1.0 and not _local(p).is_contiguous():
                raise ValueError(f"sparse groups need contiguous params; param {j} is not contiguous")
            if getattr(self, "compact_grads", False) and _is_dtensor(p):
                raise ValueError(
                    "compact_grads mode does not support FSDP2 (DTensor) params, whose gradients bypass the "
                    "hooks; use plain mode with FSDP2"
                )
        self._pending = None
        group = dict(param_group)
        group["params"] = params
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        if "density" in group:
            group["density"] = float(group["density"])
        super().add_param_group(group)
        if getattr(self, "_hooks_ready", False):  # a group added after construction
            self._sync_hooks()

    def _sparse_params(self) -> Iterable[tuple[dict[str, Any], torch.Tensor]]:
        for group in self.param_groups:
            if group["density"] < 1.0:
                for p in group["params"]:
                    yield group, p

    def _group_of(self, param: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(param is p for p in group["params"]):
                return group
        raise ValueError("param is not managed by this optimizer")

    # --------------------------------------------------------------- selection

    def _num_selected(self, group: dict[str, Any], p: torch.Tensor) -> int:
        return max(1, _entries_for(group["density"], _local(p).numel()))

    def _choose(self, group: dict[str, Any], p: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        k = self._num_selected(group, p)
        if self.selection == "random":
            position = next(i for i, q in enumerate(q for _, q in self._sparse_params()) if q is p)
            gen = torch.Generator(device=p.device).manual_seed(self.seed * 1_000_003 + position)
            score = torch.rand(_local(p).numel(), generator=gen, device=p.device)
        assert score is not None
        return top_k_positions(score, k).to(_index_dtype(_local(p).numel()))

    def _init_sparse_state(self, p: torch.Tensor, indices: torch.Tensor) -> None:
        state = self.state[p]
        k = indices.numel()
        zeros = dict(dtype=torch.float32, device=p.device)
        state.clear()
        if self.state_layout == "lean":
            low, offsets = _ops.encode_lean_indices(indices.to(p.device), _local(p).numel())
            state["indices_low"], state["window_offsets"] = low, offsets
            state["exp_avg"] = torch.zeros(k, dtype=torch.bfloat16, device=p.device)
            state["exp_avg_sq"] = torch.zeros(k, dtype=torch.bfloat16, device=p.device)
            if p.dtype != torch.float32:
                state["residual"] = torch.zeros(k, dtype=torch.int8, device=p.device)
            state["step"] = torch.zeros((), **zeros)
            if self.compact_grads and not self.update_in_backward:
                self._compact[p] = torch.zeros(k, **zeros)
            return
        state["indices"] = indices.to(p.device)
        state["exp_avg"] = torch.zeros(k, **zeros)
        state["exp_avg_sq"] = torch.zeros(k, **zeros)
        state["delta"] = torch.zeros(k, **zeros)
        if _needs_base(p, self.keep_base):
            state["base"] = _local(p.detach()).view(-1)[state["indices"].long()].clone()
        state["step"] = torch.zeros((), **zeros)
        if self.compact_grads and not self.update_in_backward:
            self._compact[p] = torch.zeros(k, **zeros)

    def _score_now(self, p: torch.Tensor) -> torch.Tensor | None:
        """This step's contribution to p's selection score (fp32, p's local shape); None for "random"."""
        grad = _local(p.grad.detach())
        if self.selection == "magnitude":
            return grad.abs().float()
        if self.selection == "saliency":
            # First-order saliency: the loss change predicted for zeroing the entry. Summed
            # signed over the selection steps; the magnitude of the sum ranks (the average's order).
            return -(_local(p.detach()).float() * grad.float())
        return None

    @staticmethod
    def _grad_key(p: torch.Tensor) -> tuple:
        """Identifies the gradient a cached result came from (a new or modified grad misses)."""
        g = p.grad
        return (id(g), g._version, g.data_ptr()) if g is not None else ()

    def _is_final_selection(self, p: torch.Tensor) -> bool:
        return self.state[p].get("selection_calls", 0) + 1 >= self.select_steps

    def _pending_with_grad(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """Sparse params whose entries are not chosen yet, that this step would select for."""
        if self._pending == []:
            return []
        candidates = self._pending if self._pending is not None else list(self._sparse_params())
        return [(group, p) for group, p in candidates
                if not _selected(self.state.get(p, {})) and _local(p).numel() > 0 and _steps(p)]

    def _average_pending(self) -> None:
        """With a process group: average the pending params' dense grads across ranks (once a
        step) before anything selects from them, so every rank chooses the same entries."""
        if self.process_group is None:
            return
        for _, p in self._pending_with_grad():
            if p not in self._averaged:
                self._average_across_ranks(p.grad)
                self._averaged.add(p)

    def _tentative_indices(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """The entries this step would choose for pending p (its final selection step); not committed."""
        key = self._grad_key(p)
        hit = self._tentative.get(p)
        if hit is not None and hit[0] == key:
            return hit[1]
        score = self._score_now(p)
        previous = self.state[p].get("score")
        if score is not None and previous is not None:
            score = score.add_(previous)
        if score is not None and self.selection == "saliency":
            score = score.abs_()
        indices = self._choose(group, p, score)
        self._tentative[p] = (key, indices)
        return indices

    def _select(self) -> None:
        """Commit this step's selection: called by `step()` alone, after it knows it updates."""
        self._average_pending()
        for group, p in self._pending_with_grad():
            state = self.state[p]
            calls = state.get("selection_calls", 0) + 1
            if calls >= self.select_steps:
                indices = self._tentative_indices(group, p)
                self._init_sparse_state(p, indices)
                if self.update_in_backward:
                    # The first update, here since the gradient was dense in backward.
                    self._update_now(p, self._gather_scratch(p, p.grad))
                elif self.compact_grads:
                    self._gather_compact(p, self._clipped_grad(p))
            else:
                score = self._score_now(p)
                if score is not None:
                    state["score"] = score if "score" not in state else state["score"].add_(score)
            state["selection_calls"] = calls
            if self.compact_grads:
                p.grad = None  # as the hook does once the entries are known
        # Only params still pending are scanned next time: after selection the per-step cost is nil.
        candidates = self._pending if self._pending is not None else list(self._sparse_params())
        self._pending = [(g, p) for g, p in candidates if not _selected(self.state.get(p, {}))
                         and _local(p).numel() > 0]

    def _clipped_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The [k] gradient `clip_grad_norm_` gathered and scaled for this step, if still current."""
        hit = self._clipped.get(p)
        return hit[1] if hit is not None and hit[0] == self._grad_key(p) else None

    def _gather_compact(self, p: torch.Tensor, clipped: torch.Tensor | None) -> None:
        """compact_grads, at selection: fill p's compact buffer from its dense grad (or the clipped gather)."""
        compact = self._compact[p]
        if clipped is not None:
            compact.copy_(clipped)
        else:
            compact.copy_(torch.index_select(_local(p.grad).reshape(-1), 0, self.indices_of(p)))
        self._grad_ready.add(p)

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
            >>> w = torch.nn.Parameter(torch.randn(4, 4))
            >>> opt = SparseAdamW([w], density=0.5)
            >>> opt.set_indices(w, torch.tensor([0, 5, 10, 15]))
        """
        group = self._group_of(param)
        if group["density"] >= 1.0:
            raise ValueError("set_indices needs a param of a sparse group (density < 1); this one is dense")
        local = _local(param)
        if isinstance(indices, torch.Tensor) and indices.dtype == torch.bool:
            if indices.shape != local.shape:
                raise ValueError(f"mask must have the param's shape {tuple(local.shape)}, got {tuple(indices.shape)}")
            indices = indices.reshape(-1).nonzero().reshape(-1)
        _check_indices(indices, local.numel(), "indices")
        indices = indices.to(device=param.device, dtype=_index_dtype(local.numel()))
        old = dict(self.state.get(param, {}))
        old_compact = self._compact.get(param) if param in self._grad_ready else None
        if self.state_layout == "lean":
            self._set_lean_indices(param, indices, old, old_compact)
            return
        self._init_sparse_state(param, indices)
        state = self.state[param]
        state["selection_calls"] = max(old.get("selection_calls", 0), self.select_steps)
        if "indices" not in old:
            return
        state["step"].copy_(old["step"])
        kept, pos = _lookup(old["indices"], indices)
        for key in ("exp_avg", "exp_avg_sq", "delta"):
            state[key][kept] = old[key][pos[kept]]
        if "base" in old:
            state["base"][kept] = old["base"][pos[kept]]
        if old_compact is not None:
            self._compact[param][kept] = old_compact[pos[kept]]
        has_base = "base" in state
        retired_idx = old.get("retired_indices", old["indices"][:0])
        retired_delta = old.get("retired_delta", old["delta"][:0])
        retired_base = old.get("retired_base", old["base"][:0]) if has_base else None
        back, rpos = _lookup(retired_idx, indices)
        state["delta"][back] = retired_delta[rpos[back]]
        if has_base:
            state["base"][back] = retired_base[rpos[back]]
        # The new record: dropped entries that carry an increment, and the retired ones not re-added.
        still_active, _ = _lookup(indices, old["indices"])
        leaving = ~still_active & (old["delta"] != 0)
        still_retired = ~_lookup(indices, retired_idx)[0]
        pairs = [(old["delta"][leaving], retired_delta[still_retired])]
        if has_base:
            pairs.append((old["base"][leaving], retired_base[still_retired]))
        record_idx, values = _merge_disjoint(old["indices"][leaving], retired_idx[still_retired], *pairs)
        if record_idx.numel() == 0:
            return
        state["retired_indices"] = record_idx
        state["retired_delta"] = values[0]
        if has_base:
            state["retired_base"] = values[1]

    def _set_lean_indices(self, param: torch.Tensor, indices: torch.Tensor, old: dict[str, Any],
                          old_compact: torch.Tensor | None) -> None:
        """set_indices on the lean state: kept entries keep their moments and residual; there is
        no increment to retire, so dropped entries simply leave (the weight keeps its value)."""
        self._init_sparse_state(param, indices)
        state = self.state[param]
        state["selection_calls"] = max(old.get("selection_calls", 0), self.select_steps)
        if "indices_low" not in old:
            return
        state["step"].copy_(old["step"])
        kept, pos = _lookup(_ops.decode_lean_indices(old["indices_low"], old["window_offsets"]), indices)
        for key in ("exp_avg", "exp_avg_sq", "residual"):
            if key in state:
                state[key][kept] = old[key][pos[kept]]
        if old_compact is not None:
            self._compact[param][kept] = old_compact[pos[kept]]

    def indices_of(self, param: torch.Tensor) -> torch.Tensor:
        """The chosen entries of `param`: [k] sorted flat positions (int32, int64 past 2**31 elements).

        The stored tensor for the exact state; decoded (a new [k] tensor) for the lean one.

        Raises:
            ValueError: `param`'s entries are not chosen yet.

        Example:
            >>> w = torch.nn.Parameter(torch.randn(4, 4))
            >>> opt = SparseAdamW([w], density=0.5, state="lean")
            >>> opt.set_indices(w, torch.tensor([0, 5, 10, 15]))
            >>> opt.indices_of(w).tolist()
            [0, 5, 10, 15]
        """
        state = self.state.get(param, {})
        if "indices" in state:
            return state["indices"]
        if "indices_low" in state:
            return _ops.decode_lean_indices(state["indices_low"], state["window_offsets"],
                                            _index_dtype(_local(param).numel()))
        raise ValueError("param has no chosen entries yet (not selected, or not managed by this optimizer)")

    # ---------------------------------------------------------- gradient hooks

    def _sync_hooks(self) -> None:
        """Give every sparse param one grad hook, and dense ones none (groups may change)."""
        sparse = [p for _, p in self._sparse_params()]
        sparse_ids = {id(p) for p in sparse}
        for p in [q for q in self._hook_handles if id(q) not in sparse_ids]:
            self._hook_handles.pop(p).remove()
        # torch refuses hooks on tensors that do not require grad: those get theirs when unfrozen.
        self._unhooked = []
        for p in sparse:
            if p in self._hook_handles:
                continue
            if p.requires_grad:
                self._hook_handles[p] = p.register_post_accumulate_grad_hook(self._grad_hook)
            else:
                self._unhooked.append(p)

    def _hook_unfrozen(self) -> None:
        """compact_grads: hook the sparse params unfrozen since the last step."""
        for p in [q for q in self._unhooked if q.requires_grad]:
            self._unhooked.remove(p)
            self._hook_handles[p] = p.register_post_accumulate_grad_hook(self._grad_hook)
            # This step's gradient arrived before the hook existed: gather (and free) it now.
            self._grad_hook(p)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks of `compact_grads` mode (groups added later get none)."""
        for handle in self._hook_handles.values():
            handle.remove()
        self._hook_handles.clear()
        self._unhooked = []
        self._hooks_ready = False

    @torch.no_grad()
    def _grad_hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise ValueError("sparse-layout gradients are not supported; use dense gradients")
        if self.update_in_backward:
            self._mark_backward(p)
        state = self.state[p]
        if not _selected(state):
            # Not selected yet: the dense gradient accumulates as in plain mode and `step()`
            # selects from it, so micro-batches and skipped steps count exactly as there.
            return
        if self.update_in_backward:
            compact = self._gather_scratch(p, grad)
            p.grad = None  # freed before the step, so at most one dense weight gradient exists
            self._update_now(p, compact)
            return
        compact = self._compact[p]
        flat = grad.reshape(-1)
        indices = self.indices_of(p)
        if p in self._grad_ready:
            compact.add_(torch.index_select(flat, 0, indices))
        elif flat.dtype == torch.float32:
            torch.index_select(flat, 0, indices, out=compact)
            self._grad_ready.add(p)
        else:
            compact.copy_(torch.index_select(flat, 0, indices))
            self._grad_ready.add(p)
        p.grad = None

    def _average_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        world = dist.get_world_size(self.process_group)
        if world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
            tensor.div_(world)
        return tensor

    def _sync_grads(self) -> None:
        """compact_grads + process_group: average what this step uses across ranks, once a step.

        Every rank must have run backward over the same params (as with DDP).
        """
        if self.process_group is None:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._averaged:
                    continue
                if group["density"] >= 1.0:
                    if _steps(p):
                        self._average_across_ranks(p.grad)
                        self._averaged.add(p)
                elif p in self._grad_ready:
                    self._average_across_ranks(self._compact[p])
                    self._averaged.add(p)

    def _hook_new_params(self) -> None:
        """compact_grads: hook sparse params unfrozen since the last step."""
        if self._unhooked:
            self._hook_unfrozen()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero dense grads as torch does, and drop gathered compact grads (and what a clip or a
        skipped step left for the next step)."""
        super().zero_grad(set_to_none)
        self._grad_ready.clear()
        self._init_step_caches()

    def compact_grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a sparse backward adds this step's gradient of `param`: ([k] indices, [k] fp32
        buffer), or None while its entries are not chosen (the dense gradient is needed then).

        The first call of a step zeroes the buffer; later ones (micro-batches) add to it.
        """
        state = self.state.get(param, {})
        if not self.compact_grads or not _selected(state):
            return None
        if self.update_in_backward:
            self._mark_backward(param)
            indices = self.indices_of(param)
            return indices, self._scratch_for(param, indices.numel()).zero_()
        buffer = self._compact[param]
        if param not in self._grad_ready:
            buffer.zero_()
            self._grad_ready.add(param)
        return self.indices_of(param), buffer

    def _gradient_ready(self, param: torch.Tensor) -> None:
        """A sparse backward finished writing `param`'s compact gradient (into `compact_grad_target`'s
        buffer); with update_in_backward, step `param` now."""
        if self.update_in_backward and _selected(self.state.get(param, {})):
            self._update_now(param, self._scratch_for(param, _num_entries(self.state[param])))

    # ----------------------------------------------------- update in backward

    def _mark_backward(self, p: torch.Tensor) -> None:
        """update_in_backward: record that a backward reached `p`; a second one before step() raises."""
        if p in self._backward_seen:
            raise RuntimeError("update_in_backward=True takes one backward per step(): a second backward reached a "
                               "weight before step() (gradient accumulation is not supported in this mode; use "
                               "update_in_backward=False to accumulate micro-batches)")
        self._backward_seen.add(p)

    def _scratch_for(self, p: torch.Tensor, k: int) -> torch.Tensor:
        """A [k] fp32 view of p's device's scratch gradient, grown to the largest k selected there."""
        buffer = self._scratch.get(p.device)
        if buffer is None or buffer.numel() < k:
            largest = max((_num_entries(s) for q, s in self.state.items() if q.device == p.device and _selected(s)),
                          default=k)
            buffer = torch.empty(max(k, largest), dtype=torch.float32, device=p.device)
            self._scratch[p.device] = buffer
        return buffer[:k]

    def _gather_scratch(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """grad[indices] of selected p, in fp32, into the scratch buffer."""
        indices = self.indices_of(p)
        compact = self._scratch_for(p, indices.numel())
        flat = _local(grad).reshape(-1)
        if flat.dtype == torch.float32:
            torch.index_select(flat, 0, indices, out=compact)
        else:
            compact.copy_(torch.index_select(flat, 0, indices))
        return compact

    def _update_now(self, p: torch.Tensor, compact: torch.Tensor) -> None:
        """Clip p's [k] compact gradient on its own (max_grad_norm) and run p's fused step at once."""
        if not p.requires_grad:
            return
        if self.max_grad_norm is not None:
            norm = torch.linalg.vector_norm(compact)
            compact.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0))
        layout = "lean" if "indices_low" in self.state[p] else self.state[p]["indices"].dtype
        self._fused_step(self._group_of(p), p.device, p.dtype, layout, True, [(p, compact)])

    def _clip_dense_per_tensor(self) -> None:
        """update_in_backward with max_grad_norm: each dense group's gradient clipped on its own."""
        grads = [_local(p.grad) for group in self.param_groups if group["density"] >= 1.0
                 for p in group["params"] if _steps(p)]
        for g in grads:
            norm = torch.linalg.vector_norm(g, dtype=torch.float32)
            g.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0).to(g.dtype))

    def compact_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient this step will use for a selected sparse param, as [k] values.

        In `compact_grads` mode, the gathered buffer (None before any backward); otherwise
        `param.grad.view(-1)[indices]` (a new tensor).
        """
        state = self.state.get(param, {})
        if not _selected(state):
            return None
        if self.compact_grads:
            return self._compact[param] if param in self._grad_ready else None
        if param.grad is None:
            return None
        clipped = self._clipped_grad(param)
        if clipped is not None:
            return clipped
        # index_select takes the int32 indices as they are: no int64 copy on every clip.
        return torch.index_select(_local(param.grad).reshape(-1), 0, self.indices_of(param))

    # -------------------------------------------------------------------- step

    def _validate_grads(self) -> None:
        """Check what this step will read, before anything (selection included) changes."""
        devices = set()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if not _steps(p):
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
            _ops.resolve("sparse_adamw_lean_" if self.state_layout == "lean" else "sparse_adamw_", device,
                         self.backend)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (selection first, on the steps that select).

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate_grads()
        self._hook_new_params()
        self._sync_grads()
        # The only place entries are chosen: a step GradScaler skips never gets here.
        self._select()
        if self.max_grad_norm is not None and self.update_in_backward:
            self._clip_dense_per_tensor()
        elif self.max_grad_norm is not None:
            clip_grad_norm_(self, self.max_grad_norm)
        try:
            for group in self.param_groups:
                if group["density"] >= 1.0:
                    self._dense_step(group)
                else:
                    self._sparse_step(group)
        finally:
            self._init_step_caches()
            self._grad_ready.clear()
            self._backward_seen.clear()
        return loss

    def _sparse_step(self, group: dict[str, Any]) -> None:
        buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for p in group["params"]:
            state = self.state.get(p)
            if not state or not _selected(state):
                continue
            if self.compact_grads:
                # The hook gathered a gradient this step (and freed .grad).
                if not (p.requires_grad and p in self._grad_ready):
                    continue
                grad, compact = self._compact[p], True
            else:
                if not _steps(p):
                    continue
                # clip_grad_norm_ gathered and scaled the chosen entries: the dense grad stays as it was.
                grad = self._clipped_grad(p)
                compact = grad is not None
                if grad is None:
                    grad = _local(p.grad).contiguous()
            layout = state["indices"].dtype if "indices" in state else "lean"
            buckets[(p.device, p.dtype, layout, compact)].append((p, grad))
        for (device, dtype, layout, compact), members in buckets.items():
            self._fused_step(group, device, dtype, layout, compact, members)

    def _fused_step(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, layout: Any,
                    compact: bool, members: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One fused sparse step over `members` [(param, grad)], all on `device` in `dtype`, one layout."""
        beta1, beta2 = group["betas"]
        params = [p for p, _ in members]
        grads = [g for _, g in members]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        lean = layout == "lean"
        _, fn = _ops.resolve("sparse_adamw_lean_" if lean else "sparse_adamw_", device, self.backend)
        if lean:
            state_args = ([s["indices_low"] for s in states], [s["window_offsets"] for s in states],
                          [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                          [s["residual"] for s in states] if dtype != torch.float32 else [])
        else:
            state_args = ([s["indices"] for s in states], [s["exp_avg"] for s in states],
                          [s["exp_avg_sq"] for s in states], [s["delta"] for s in states],
                          [s["base"] for s in states] if "base" in states[0] else [])
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device != device:
            lr = lr.to(device)
        # The kernels read the incremented count; it is taken back if a kernel raises.
        torch._foreach_add_(steps, 1.0)
        try:
            fn(
                [_local(p.detach()) for p in params],
                grads,
                *state_args,
                steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                maximize=group["maximize"],
                compact_grads=compact,
                table_cache=self._kernel_cache,
            )
        except BaseException:
            torch._foreach_sub_(steps, 1.0)
            raise

    def _dense_step(self, group: dict[str, Any]) -> None:
        """torch's own functional AdamW. With a tensor lr on CUDA it runs capturable (step
        counts on the device, no host read), so a CUDA graph can capture the whole step."""
        from torch.optim.adamw import adamw

        params = [p for p in group["params"] if _steps(p)]
        if not params:
            return
        lr = group["lr"]
        capturable = isinstance(lr, torch.Tensor) and any(p.is_cuda for p in params)
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif capturable and state["step"].device != p.device:
                state["step"] = state["step"].to(p.device)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw([p for p in params], [p.grad for p in params], [s["exp_avg"] for s in states],
              [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=None,
              capturable=capturable, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])

    # ------------------------------------------------------------- state dict

    _PICKLED = ("select_steps", "selection", "seed", "compact_grads", "keep_base", "state_layout", "backend", "max_grad_norm",
                "_compact", "_grad_ready", "update_in_backward")

    def __getstate__(self) -> dict[str, Any]:
        """torch's pickled state plus this optimizer's settings (copy.deepcopy and pickle use it).

        Not carried: the process group (a handle to this process's communicator, which cannot
        be pickled; the copy has none and warns), the grad hooks (the copy hooks its own params)
        and the kernels' launch tables (built again for the copy's tensors).
        """
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._PICKLED})
        state["had_process_group"] = self.process_group is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        had_process_group = state.pop("had_process_group", False)
        state.pop("process_group", None)  # pickled by earlier versions (always None there)
        super().__setstate__(state)
        self.__dict__.setdefault("keep_base", False)  # pickled before the option existed
        self.__dict__.setdefault("state_layout", "exact")
        self.__dict__.setdefault("update_in_backward", False)
        self._scratch = {}
        self._backward_seen = set()
        self.process_group = None
        if had_process_group:
            warnings.warn("SparseAdamW: the copy has no process_group (a process group cannot be copied or "
                          "pickled); set `optimizer.process_group` to average gradients across ranks again",
                          stacklevel=2)
        self._kernel_cache = {}
        self._init_step_caches()
        self._pending = None
        self._hook_handles = {}
        self._unhooked = []
        # Hooks are not copied with the params: the copy hooks its own.
        self._hooks_ready = self.compact_grads
        if self.compact_grads:
            self._sync_hooks()


    def state_dict(self) -> dict[str, Any]:
        """torch's layout, plus this optimizer's selection settings under "sift"."""
        sd = super().state_dict()
        sd["sift"] = {"select_steps": self.select_steps, "selection": self.selection, "seed": self.seed,
                      "keep_base": self.keep_base, "state": self.state_layout, "format": 1}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict()`; validates everything before changing anything.

        Raises:
            ValueError: groups, param counts, or any sparse state do not fit the params.
        """
        state_dict = state_dict.copy()  # torch's order: a shallow copy, then the pre-hooks
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        # A deep copy, as torch takes: a saved lr tensor must not be shared with the source
        # optimizer, whose scheduler would otherwise drive this one too.
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, the optimizer {len(self.param_groups)}"
            )
        id_map: dict[int, tuple[torch.Tensor, float]] = {}  # saved id -> (param, its density once loaded)
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {gi}: state_dict has {len(saved['params'])} params, the optimizer "
                    f"{len(group['params'])}"
                )
            # The saved hyper-parameters replace the group's (as in torch), so they are checked
            # and the state is validated against the saved density, not the constructed one.
            merged = {**group, **saved}
            try:
                _check_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], merged["density"])
            except ValueError as exc:
                raise ValueError(f"param group {gi} of the state_dict: {exc}") from None
            id_map.update((pid, (p, float(merged["density"]))) for pid, p in zip(saved["params"], group["params"]))
        meta = state_dict.get("sift", {})
        keep_base = meta.get("keep_base", False)  # states saved before the option kept no fp32 base
        if not isinstance(keep_base, bool):
            raise ValueError(f"state_dict['sift']['keep_base'] must be a bool, got {keep_base!r}")
        layout = meta.get("state", "exact")  # states saved before the option are exact
        if layout not in ("exact", "lean"):
            raise ValueError(f"state_dict['sift']['state'] must be 'exact' or 'lean', got {layout!r}")
        if layout == "lean" and keep_base:
            raise ValueError("state_dict['sift'] has keep_base=True with state='lean', which keeps no base")
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for pid, saved_state in state_dict["state"].items():
            if pid not in id_map:
                raise ValueError(f"state_dict has state for param id {pid}, which no group lists")
            p, density = id_map[pid]
            new_state[p] = self._load_param_state(p, saved_state, density, _needs_base(p, keep_base),
                                                  f"state of param {pid}", lean=layout == "lean")
        # Everything validated: install.
        self.state = defaultdict(dict, new_state)
        self._pending = None
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = value
            group["betas"] = tuple(group["betas"])
            group["density"] = float(group["density"])
        self.keep_base = keep_base
        self.state_layout = layout
        self.select_steps = meta.get("select_steps", self.select_steps)
        self.selection = meta.get("selection", self.selection)
        self.seed = meta.get("seed", self.seed)
        self._compact.clear()
        self._grad_ready.clear()
        self._backward_seen.clear()
        if self.compact_grads and not self.update_in_backward:
            for p, state in self.state.items():
                if _selected(state):
                    self._compact[p] = torch.zeros(_num_entries(state), dtype=torch.float32, device=p.device)
        if self._hooks_ready:  # a group may have turned sparse or dense
            self._sync_hooks()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_param_state(self, p: torch.Tensor, saved: dict[str, Any], density: float, has_base: bool,
                          what: str, lean: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if density < 1.0 and (lean or "indices_low" in saved) and _selected(saved):
            return self._load_lean_state(p, saved, lean, what)
        stray = [k for k in _RETIRED_KEYS if k in saved and "indices" not in saved]
        if stray:
            raise ValueError(f"{what}: {', '.join(stray)} without indices (a retired record needs a selection)")
        if density >= 1.0 or "indices" not in saved:
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    if key in ("exp_avg", "exp_avg_sq") and value.shape != p.shape:
                        raise ValueError(f"{what}: {key} has shape {tuple(value.shape)}, param {tuple(p.shape)}")
                    if key == "score" and value.numel() != _local(p).numel():
                        raise ValueError(f"{what}: score has {value.numel()} entries, param {_local(p).numel()}")
                    if key == "step":
                        value = value.detach().clone().float().cpu() if density >= 1.0 else \
                            value.detach().clone().float().to(p.device)
                    elif key == "score":
                        value = value.detach().to(device=p.device, dtype=torch.float32).clone()
                    else:
                        value = value.detach().to(device=p.device, dtype=p.dtype).clone()
                out[key] = value
            return out
        missing = [k for k in _SPARSE_KEYS if k not in saved]
        if has_base and "base" not in saved:
            missing.append("base")
        stray_base = [k for k in ("base", "retired_base") if k in saved and not has_base]
        if stray_base:
            # Installing it would be harmless, dropping it silent: the state and its settings disagree.
            raise ValueError(f"{what}: has {' and '.join(stray_base)} for an fp32 weight, but the state_dict's "
                             "keep_base is False (or absent)")
        if missing:
            raise ValueError(f"{what}: missing {', '.join(missing)}")
        indices = saved["indices"]
        _check_indices(indices, _local(p).numel(), f"{what}: indices")
        k = indices.numel()
        for key in ("exp_avg", "exp_avg_sq", "delta") + (("base",) if has_base else ()):
            value = saved[key]
            if not isinstance(value, torch.Tensor) or value.shape != (k,):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{what}: {key} must have shape ({k},) to match indices, got {shape}")
        out["indices"] = indices.detach().to(device=p.device, dtype=_index_dtype(_local(p).numel())).clone()
        for key in ("exp_avg", "exp_avg_sq", "delta"):
            out[key] = saved[key].detach().to(device=p.device, dtype=torch.float32).clone()
        if has_base:
            out["base"] = saved["base"].detach().to(device=p.device, dtype=p.dtype).clone()
        out["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().to(p.device)
        if "selection_calls" in saved:
            out["selection_calls"] = int(saved["selection_calls"])
        out.update(self._load_retired(p, saved, out["indices"], has_base, what))
        return out

    def _load_lean_state(self, p: torch.Tensor, saved: dict[str, Any], lean: bool, what: str) -> dict[str, Any]:
        """The validated lean state of a selected sparse param."""
        if not lean:
            raise ValueError(f"{what}: a lean state (indices_low), but the state_dict's state is 'exact' (or absent)")
        low_precision = p.dtype != torch.float32
        stray = [key for key in ("indices", "delta", "base", *_RETIRED_KEYS) + (() if low_precision else ("residual",))
                 if key in saved]
        if stray:
            raise ValueError(f"{what}: {', '.join(stray)} in a lean state (state='lean' keeps "
                             f"{'a residual' if low_precision else 'no residual'} and no exact-state keys)")
        keys = ("indices_low", "window_offsets", "exp_avg", "exp_avg_sq", "step") + (("residual",) if low_precision else ())
        missing = [key for key in keys if key not in saved]
        if missing:
            raise ValueError(f"{what}: missing {', '.join(missing)}")
        low, offsets = saved["indices_low"], saved["window_offsets"]
        numel = _local(p).numel()
        windows = _ops.lean_num_windows(numel)
        if not isinstance(low, torch.Tensor) or low.dtype != torch.int16 or low.dim() != 1:
            raise ValueError(f"{what}: indices_low must be a 1-D int16 tensor")
        if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.shape != (windows + 1,):
            raise ValueError(f"{what}: window_offsets must be int32 of shape ({windows + 1},) for a param of "
                             f"{numel} elements")
        k = low.numel()
        if int(offsets[0]) != 0 or int(offsets[-1]) != k or bool((offsets.diff() < 0).any()):
            raise ValueError(f"{what}: window_offsets must rise from 0 to k = {k}")
        _check_indices(_ops.decode_lean_indices(low.cpu(), offsets.cpu()), numel, f"{what}: decoded indices")
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
        return out

    def _load_retired(self, p: torch.Tensor, saved: dict[str, Any], indices: torch.Tensor, has_base: bool,
                      what: str) -> dict[str, torch.Tensor]:
        """The validated retired record of a saved sparse state ({} when it has none)."""
        keys = _RETIRED_KEYS if has_base else _RETIRED_KEYS[:2]
        if not any(k in saved for k in keys):
            return {}
        missing = [k for k in keys if k not in saved]
        if missing:
            raise ValueError(f"{what}: missing {', '.join(missing)} (the retired record is incomplete)")
        retired = saved["retired_indices"]
        _check_indices(retired, _local(p).numel(), f"{what}: retired_indices", allow_empty=True)
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
        if has_base:
            out["retired_base"] = saved["retired_base"].detach().to(device=p.device, dtype=p.dtype).clone()
        return out

    # ------------------------------------------------------------- reporting

    def state_bytes(self) -> dict[str, float]:
        """Optimizer-state memory: total bytes, trainable entries, and bytes per entry.

        Counts the sparse state (indices, moments, delta, base, step, and the retired record
        that `set_indices` may leave; for the lean state its index halves, window table,
        moments, residual and step) and the dense state of dense groups; compact gradient
        buffers (with `update_in_backward`, the shared scratch) are reported separately.
        `trainable_entries` counts active entries only.
        """
        total = entries = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                tensors = [v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "score"]
                total += sum(t.numel() * t.element_size() for t in tensors)
                if _selected(state):
                    entries += _num_entries(state)
                elif "exp_avg" in state:
                    entries += _local(p).numel()
        grad_bytes = sum(t.numel() * t.element_size() for t in [*self._compact.values(), *self._scratch.values()])
        return {
            "state_bytes": float(total),
            "trainable_entries": float(entries),
            "bytes_per_entry": total / entries if entries else 0.0,
            "compact_grad_bytes": float(grad_bytes),
        }


@torch.no_grad()
def clip_grad_norm_(optimizer: SparseAdamW, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients `optimizer` will apply, by their global norm.

    The norm is taken over what the next `step()` uses: the chosen entries of each sparse
    weight (its compact buffer in `compact_grads` mode, `grad[indices]` otherwise) and the
    full gradients of dense groups, so both modes clip identically. Call it between
    `backward()` and `step()`. On a selecting step it works out the entries the step will
    choose without committing them (GradScaler may still skip that step). In plain mode the
    chosen entries are gathered once into [k] fp32 buffers that are scaled and that the step
    then reads: the dense gradient is neither written nor read again.

    Args:
        optimizer: the SparseAdamW whose gradients to clip.
        max_norm: the largest allowed global norm (> 0).
        norm_type: p of the p-norm (`inf` allowed).

    Returns:
        The global norm before clipping (0-d fp32 tensor).

    Example:
        >>> model = torch.nn.Linear(8, 8)
        >>> opt = SparseAdamW(model.parameters(), density=0.25)
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> norm = clip_grad_norm_(opt, max_norm=1.0)
    """
    if not isinstance(optimizer, SparseAdamW):
        raise TypeError(f"optimizer must be a sift.SparseAdamW, got {type(optimizer).__name__}")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")
    if optimizer.update_in_backward:
        raise RuntimeError("clip_grad_norm_ cannot clip an optimizer with update_in_backward=True: its sparse "
                           "gradients were applied and freed during backward; pass max_grad_norm to the optimizer "
                           "(it clips each tensor on its own)")
    # Nothing here commits a selection: GradScaler may still skip the step this clip precedes.
    optimizer._hook_new_params()
    optimizer._sync_grads()
    optimizer._average_pending()
    mesh_group = None
    used: list[torch.Tensor] = []  # what the step reads, scaled in place below
    for group in optimizer.param_groups:
        for p in group["params"]:
            if _is_dtensor(p):
                mesh_group = p.device_mesh.get_group()
            if not p.requires_grad:  # the step skips it
                continue
            if group["density"] >= 1.0:
                if _steps(p):
                    used.append(_local(p.grad))
                continue
            state = optimizer.state.get(p, {})
            if optimizer.compact_grads and _selected(state):
                if p in optimizer._grad_ready:
                    used.append(optimizer._compact[p])
                continue
            if not _steps(p):
                continue
            if _selected(state):
                indices = optimizer.indices_of(p)
            elif _local(p).numel() > 0 and optimizer._is_final_selection(p):
                # This step will choose its entries: clip what it will read from them.
                indices = optimizer._tentative_indices(group, p)
            else:
                continue  # an earlier selection step: the step updates nothing
            # The entries the step uses, gathered once in fp32: the step then reads these
            # instead of the dense gradient, which is neither read again nor written.
            gathered = torch.index_select(_local(p.grad).reshape(-1), 0, indices).float()
            optimizer._clipped[p] = (optimizer._grad_key(p), gathered)
            used.append(gathered)
    if not used and mesh_group is None:
        return torch.zeros(())
    device = used[0].device if used else torch.device("cpu")
    # One multi-tensor norm per (device, dtype) instead of a kernel per tensor: clipping runs
    # every step over every weight. Accumulated and returned in fp32 whatever the grad dtype.
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in used:
        by_kind[(g.device, g.dtype)].append(g)
    norms = [torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32)).to(device)
             for gs in by_kind.values()]
    stacked = torch.cat(norms) if norms else torch.zeros(1, device=device)
    if mesh_group is None:
        total = torch.linalg.vector_norm(stacked, norm_type)
    else:
        # FSDP2: each rank holds a shard; combine the shard norms into the global norm.
        import torch.distributed as dist

        if math.isinf(norm_type):
            total = stacked.max()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mesh_group)
        else:
            total = stacked.pow(norm_type).sum()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh_group)
            total = total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # The coefficient stays a device tensor (no host sync): one multi-tensor multiply per (device, dtype).
    to_scale: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in used:
        to_scale[(g.device, g.dtype)].append(g)
    for (dev, dtype), gs in to_scale.items():
        torch._foreach_mul_(gs, coef.to(device=dev, dtype=dtype))
    return total
