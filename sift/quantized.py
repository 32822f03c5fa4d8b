"""Sparse fine-tuning over a frozen quantized base: bitsandbytes `Linear4bit` (NF4 or FP4) and
`Linear8bitLt` (LLM.int8() weights, row-wise absmax; `has_fp16_weights=False`, as `load_in_8bit` loads).

Each targeted quantized linear layer trains a sparse delta S at k chosen entries of its weight:

    y = x (dequant(Wq) + S)^T + b        Wq: packed 4-bit or int8 [out, in], S: k entries (indices, values)

An 8-bit layer's product is the dequantized weight's, in the compute dtype: not bitsandbytes' own
int8 matmul with its outlier decomposition (sift's route replaces the layer's forward), so a tuned
8-bit model computes what the merged 16-bit model computes, up to the int8 rounding of the weight.

The packed weights never change. The trained parameter is the [k] fp32 vector of S's values
(`module.sift_delta`, a dense param of the optimizer); its [k] sorted flat indices into the
[out, in] weight are chosen on the first step(s) as for a 16-bit weight and kept in the
optimizer's state, so `state_dict` round-trips them. Per entry: the exact state keeps int32
indices and fp32 moments (16 bytes with the value); `state="lean"` keeps 16-bit index halves
under a window table and bf16 moments by stochastic rounding (10 bytes with the value).

Memory: nothing weight-sized outlives one layer's forward or backward. The forward dequantizes
Wq into a transient [out, in] tensor, adds S into it (a scatter of k entries) and multiplies;
it saves x and the [k] values, never the dequantized weight. The backward dequantizes again
for dX = dY (dequant(Wq) + S), and after selection the gradient of the values is the sampled
product g[j] = sum_t dY[t, row_j] X[t, col_j] (`sparse_weight_grad`): no dense dW. During the
selection step the backward forms one layer's dense fp32 dW at a time, scores it and keeps only
the k entries it would choose and their gradient; `step()` commits that choice (a step that
GradScaler skips discards it). With `select_steps > 1` each layer keeps two fp32 score buffers
of its weight's size (8 bytes per weight element, 16x the 4-bit weight) until it is selected: this
step's, checked for inf/NaN (under GradScaler an overflow skips the step and backs the scale off) and
unscaled as `step()` commits it, and the committed steps' sum, optimizer state (`state[values]["score"]`)
that `state_dict` carries. In a job of several processes the dense score is averaged over the ranks
that average the values (the layer's `process_group`, DDP's, or the optimizer's), and nowhere else.
With gradient accumulation on the selecting step, the entries are chosen on the step's first
backward and later micro-batches add their gradient at those entries.

Weight decay acts on the delta's values (as on a LoRA adapter), not on the base entries.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from sift import _ops
from sift._index import entries_for, index_dtype
from sift._rules import random_entries, ranks_nothing, step_score, top_k, total_score, warn_unscored
from sift.sparse_backward import weight_gradient_wanted

DELTA = "sift_delta"  # the trained [k] values, registered on each 4-bit module


def is_linear4bit(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes 4-bit linear layer (matched by name: bitsandbytes stays optional)."""
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) and type(weight).__name__ == "Params4bit"


def is_linear8bit(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes 8-bit linear layer holding int8 weights (`Linear8bitLt` with
    `has_fp16_weights=False`; one with 16-bit weights is an ordinary weight to sift)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and type(weight).__name__ == "Int8Params"
            and weight.dtype == torch.int8)


def is_quantized_linear(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes 4-bit or int8 linear layer, which `for_model` trains as a sparse delta."""
    return is_linear4bit(module) or is_linear8bit(module)


def check_not_sharded(model: nn.Module) -> None:
    """Refuse a model whose bitsandbytes layers FSDP2 already sharded: their weights are then DTensors of the
    packed bytes, without the `quant_state` (4-bit) or row scales (8-bit) needed to read them, and a
    bf16 `quant_storage` would even pass for a 16-bit weight and train the packed bytes as numbers.

    Raises:
        ValueError: a `Linear4bit` or `Linear8bitLt` whose weight is a DTensor.

    Example:
        >>> check_not_sharded(nn.Sequential(nn.Linear(4, 3)))  # nothing quantized, nothing sharded: no error
    """
    for name, module in model.named_modules():
        kinds = {cls.__name__ for cls in type(module).__mro__}
        if kinds & {"Linear4bit", "Linear8bitLt"} and type(getattr(module, "weight", None)).__name__ == "DTensor":
            raise ValueError(
                f"the bitsandbytes layer {name!r} is already sharded by fully_shard (FSDP2): for_model on a "
                "quantized model must come before fully_shard; then pass ignored_params="
                "sift.optim.sharded.replicated_quantized_deltas(optimizer) to every fully_shard call")


def _dequantize(module: nn.Module, dtype: torch.dtype, quant_state: Any = None) -> torch.Tensor:
    """The [out, in] weight of a 4-bit or int8 layer in `dtype`: a new tensor, never kept.

    `quant_state`: the 4-bit weight's, when the weight itself no longer carries it (FSDP2 all-gathers the
    packed bytes into a plain tensor, without bitsandbytes' `Params4bit` attributes).
    """
    weight = module.weight
    if is_linear8bit(module):
        from bitsandbytes.functional import int8_vectorwise_dequant

        # bitsandbytes moves the row scales (and the int8 rows) into the layer's state on its first forward.
        scales = getattr(weight, "SCB", None)
        scales = scales if scales is not None else getattr(module.state, "SCB", None)
        if scales is None:
            raise RuntimeError("the 8-bit layer's weight has no row scales (SCB): move the model to its device "
                               "first (bitsandbytes quantizes on the move)")
        return int8_vectorwise_dequant(weight.data, scales.float()).to(dtype)
    from bitsandbytes.functional import dequantize_4bit

    quant_state = weight.quant_state if getattr(weight, "quant_state", None) is not None else quant_state
    if quant_state is None:
        raise RuntimeError("the 4-bit layer's weight has no quant_state: move the model to its device first "
                           "(bitsandbytes quantizes on the move)")
    dense = dequantize_4bit(weight.data, quant_state)
    return dense.to(dtype).reshape(module.out_features, module.in_features)


class QuantizedRoute:
    """One 4-bit layer's sparse delta: its values param, its selection, and the optimizer that owns them."""

    def __init__(self, module: nn.Module, name: str, optimizer: Any, position: int, k: int):
        self.module = module
        self.name = name
        self.optimizer = optimizer
        self.position = position  # among the model's 4-bit targets ("random" draws by the name)
        self.k = k
        self.numel = module.out_features * module.in_features
        self.values: nn.Parameter = getattr(module, DELTA)
        # Kept here because FSDP2 swaps the packed Params4bit for DTensor / plain-tensor params that lack it;
        # it describes the whole weight, so every rank dequantizes the all-gathered bytes with it.
        self.quant_state = getattr(module.weight, "quant_state", None)
        # Set by `sift.optim.sharded.replicated_quantized_deltas`: the ranks over which this layer's [k]
        # gradient (and the selecting step's dense score) is averaged inside backward.
        self.process_group: Any = None
        # The process group of the DDP whose forward ran this layer (recorded at forward time; kept, since a
        # reentrant checkpoint recomputes the forward outside DDP's): DDP averages the [k] gradient over it,
        # so the selecting step's dense score is averaged over it too.
        self.ddp_group: Any = None
        # Selection in progress: this step's entries, its score (still loss-scaled) and that score's
        # inf/NaN flag (committed or dropped by step()). The committed steps' sum of unscaled scores is
        # optimizer state, `state[values]["score"]`, so that state_dict carries it.
        self.tentative: torch.Tensor | None = None
        self.step_score: torch.Tensor | None = None
        self.step_found_inf: torch.Tensor | None = None
        self.reached = False  # a backward reached this layer since the last step
        # This step's total score ranked nothing (zero everywhere or not finite): the layer stays pending if the
        # step runs; said once per layer.
        self.unscored = False
        self.warned_unscored = False

    fixed_indices: torch.Tensor | None = None  # a delta attached without an optimizer (`attach_delta_`)

    @property
    def selected(self) -> bool:
        """Whether the entries are chosen (without decoding the lean state's indices)."""
        if self.optimizer is None:
            return self.fixed_indices is not None
        state = self.optimizer.state.get(self.values, {})
        return "delta_indices" in state or "delta_indices_low" in state

    @property
    def indices(self) -> torch.Tensor | None:
        """The [k] chosen flat indices (sorted), or None before selection; the lean state decodes them
        on each read, so a forward or backward reads them once."""
        if self.optimizer is None:
            return self.fixed_indices
        state = self.optimizer.state.get(self.values, {})
        if "delta_indices_low" in state:  # the lean state keeps them as 16-bit halves (2 bytes an entry)
            return _ops.decode_lean_indices(state["delta_indices_low"], state["delta_window_offsets"],
                                            index_dtype(self.numel))
        return state.get("delta_indices")

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype the weight had before it was quantized (what a 16-bit copy of the model holds): the 4-bit
        quant state records it; an int8 weight does not, so its bias's dtype, or fp32 without a bias."""
        state = getattr(self.module.weight, "quant_state", None)
        recorded = getattr(state if state is not None else self.quant_state, "dtype", None)
        if recorded is not None:
            return recorded
        bias = self.module.bias
        return bias.dtype if bias is not None else torch.float32

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return getattr(self.module, "compute_dtype", None) or x.dtype

    def weight(self, dtype: torch.dtype, values: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
        """dequant(Wq) + S in `dtype` (transient, [out, in]); S's `indices` None before selection."""
        dense = _dequantize(self.module, dtype, self.quant_state)
        if indices is not None:
            dense.view(-1).index_add_(0, indices, values.to(dtype))
        return dense

    # ------------------------------------------------------------ selection

    def selection_grad(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Backward before selection: the values' gradient at this step's tentative entries ([k] fp32),
        or None on a selection step that only scores (select_steps > 1, not the last)."""
        optimizer = self.optimizer
        self.reached = True
        if self.tentative is not None:  # a later backward of the selecting step: the chosen entries' gradient
            return _ops.call("sparse_weight_grad", dy, x, self.tentative)
        if self.unscored:  # a later backward of a selecting step whose score ranked nothing
            return None
        settings = optimizer.settings
        rule = settings.selection
        state = optimizer.state[self.values]
        final = state.get("selection_calls", 0) + 1 >= settings.select_steps
        if rule == "random":
            if not final:
                return None
            self.tentative = random_entries(settings.seed, f"{self.name}.weight", self.position, self.numel, self.k,
                                            dy.device)
            return _ops.call("sparse_weight_grad", dy, x, self.tentative)
        dense = dy.t().float() @ x.float()  # [out, in] fp32: this layer's alone, freed on return
        # Several ranks choose one set of entries: from the gradient of the batch their values train on.
        self.average(dense, selecting=True)
        # The 16-bit weights' rule, computed in place (one weight-sized buffer); unscaled at commit, once the
        # step knows its scale.
        score = step_score(rule, dense, weight, reuse=True).reshape(-1)
        self._check_finite(score)
        self.step_score = score if self.step_score is None else self.step_score.add_(score)
        if not final:
            return None
        total, previous = self.step_score, state.get("score")
        self.step_score = None  # this step's score was only needed for the choice
        if previous is not None:
            # The earlier steps' scores were unscaled as they were committed: this one is too, by the scale
            # of the loss this backward came from.
            inv_scale = self._loss_inverse_scale()
            if inv_scale is not None:
                total = total * inv_scale.to(total.device)
        total = total_score(rule, total, previous)
        if ranks_nothing(total):  # step() leaves the layer pending (or GradScaler skips the step)
            self.unscored = True
            return None
        self.tentative = top_k(total, self.k)
        return _ops.call("sparse_weight_grad", dy, x, self.tentative)

    def reselecting(self) -> bool:
        """Whether this step re-selects the layer's entries (`sift.optim.reselection`)."""
        return self.optimizer is not None and self.optimizer.reselector.is_due(self.values)

    def reselection_grad(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Backward of a re-selecting step: the values' gradient at the entries the re-selection leaves ([k] fp32),
        chosen on the step's first backward from this layer's dense weight gradient (formed, averaged as the
        selecting step's, checked for inf/NaN and freed here); later micro-batches add at the same entries."""
        self.reached = True
        reselector = self.optimizer.reselector
        if self.tentative is None:
            dense = dy.t().float() @ x.float()  # [out, in] fp32: this layer's alone, consumed by the score
            self.average(dense, selecting=True)
            self._check_finite(dense)  # an overflow skips the step: nothing is re-selected or scored
            if not reselector.fires(self.values):  # a scoring step: its score joins the sum at step(), unscaled
                score = reselector.quantized_score(self, dense, weight)
                self.step_score = score if self.step_score is None else self.step_score.add_(score)
                return _ops.call("sparse_weight_grad", dy, x, self.indices)
            self.tentative = reselector.plan_quantized(self, dense, weight, self._loss_inverse_scale())
        return _ops.call("sparse_weight_grad", dy, x, self.tentative)

    def _check_finite(self, score: torch.Tensor) -> None:
        """Flag inf/NaN in this backward's score into `step_found_inf` (no host read, no weight-sized temporary):
        no `.grad` holds it, so GradScaler's own check cannot see it."""
        if self.step_found_inf is None:
            self.step_found_inf = torch.zeros((), dtype=torch.float32, device=score.device)
        one = torch.ones((), dtype=torch.float32, device=score.device)
        torch._amp_foreach_non_finite_check_and_unscale_([score], self.step_found_inf, one)

    def found_inf(self) -> torch.Tensor | None:
        """This step's inf/NaN flag of the selection score ([] fp32, nonzero on overflow), or None when no
        backward scored this layer since the last step. `step()` adds it to the scaler's found-inf, so that
        an overflow skips the step (nothing is committed) and backs the scale off."""
        return self.step_found_inf

    def _loss_inverse_scale(self) -> torch.Tensor | None:
        """1 / the scale of the loss being backpropagated, computed as GradScaler does: from the optimizer's
        scaler (`step()` links the one that calls it on a scoring step), else None (an unscaled loss)."""
        scaler = self.optimizer.grad_scaler
        if scaler is None or not scaler.is_enabled() or scaler._scale is None:
            return None
        return scaler._scale.double().reciprocal().float()

    def commit_inverse_scale(self) -> torch.Tensor | None:
        """1 / the scale of this step's losses, as `step()` knows it (`grad_scale`, or the scale `scaler.unscale_`
        divided `.grad` by); None without a scaler."""
        inv_scale = self.optimizer.amp.grad_inv_scale
        return inv_scale if inv_scale is not None else self.optimizer.amp.scaler_inverse_scale()

    def record_group(self) -> None:
        """At forward: remember the process group of the DDP running this forward, if any."""
        ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is not None:
            self.ddp_group = ddp.process_group

    def average(self, tensor: torch.Tensor, selecting: bool = False) -> torch.Tensor:
        """Average `tensor` (this rank's share of a gradient) in place over `process_group`; with `selecting`
        (the selecting step's dense score) over whichever group averages this layer's values: `process_group`,
        the DDP that ran the forward, or the optimizer's `process_group`; else unchanged.

        Under DDP, which averages the [k] values' gradient but not the dense score, each rank would otherwise
        choose its own entries and DDP would average values taken at different positions. Ranks that train
        apart (no DDP, no process group) choose apart, and a rank training alone never waits for another."""
        group = self.process_group
        if group is None and selecting:
            group = self.ddp_group if self.ddp_group is not None else getattr(self.optimizer, "process_group", None)
        if group is None:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor.div_(dist.get_world_size(group))

    def check_values(self, values: torch.Tensor) -> None:
        """Refuse, at the forward, a layer whose delta FSDP2 took over or whose ranks nothing averages: either
        would train each rank's replica apart (or not at all) without an error."""
        if self.optimizer is None:
            return
        if values is not self.values:
            raise ValueError(
                f"the 4-bit layer {self.name!r} computes with a {DELTA} that is not the one SparseAdamW trains: "
                "fully_shard (FSDP2) replaced it with its own param. Pass the deltas to fully_shard as "
                "ignored_params=sift.optim.sharded.replicated_quantized_deltas(optimizer) on every call")
        if self.process_group is None and _is_fsdp_module(self.module) and _world_size() > 1:
            raise ValueError(
                f"the 4-bit layer {self.name!r} is sharded by fully_shard (FSDP2) in a job of {_world_size()} "
                f"processes, and nothing averages its {DELTA} gradient across ranks: take the ignored_params of "
                "fully_shard from sift.optim.sharded.replicated_quantized_deltas(optimizer)")

    def commit(self) -> None:
        """step() updates: commit this step's tentative entries, or add its score (select_steps > 1)."""
        state, entries = self.optimizer.state[self.values], self.optimizer.entries
        if not self.selected and self.reached:
            score = self.step_score
            if score is not None:
                # GradScaler's scale may change between selection steps: scores add unscaled.
                inv_scale = self.commit_inverse_scale()
                if inv_scale is not None:
                    score.mul_(inv_scale.to(score.device))
            unranked = self.unscored or (self.tentative is None and ranks_nothing(score))
            if unranked:
                self._leave_pending()  # not counted, as a step that did not reach the layer
            else:
                entries.count_selection_step(self.values, state.get("selection_calls", 0) + 1)
            if self.tentative is not None:
                entries.choose_delta_entries(self.values, self.tentative, self.numel)
            elif score is not None and not unranked:
                entries.add_selection_score(self.values, score)
        self.discard()

    def _leave_pending(self) -> None:
        """This step's score ranked nothing: the layer's selection state stays as it was, said once."""
        if not self.warned_unscored:
            self.warned_unscored = True
            warn_unscored(repr(f"{self.name}.weight"), stacklevel=4)

    def discard(self) -> None:
        """A step that does not update (skipped, or gradients zeroed): forget this step's selection work."""
        self.tentative = None
        self.step_score = None
        self.step_found_inf = None
        self.reached = False
        self.unscored = False


class _QuantizedSparseLinear(torch.autograd.Function):
    """y = x (dequant(Wq) + S)^T + b, saving x and S's values only."""

    @staticmethod
    def forward(ctx, x, values, bias, route: QuantizedRoute):
        dtype = route.compute_dtype(x)
        xc = x.to(dtype)
        weight = route.weight(dtype, values, route.indices)
        with torch.autocast(x.device.type, enabled=False):
            out = nn.functional.linear(xc, weight, bias.to(dtype) if bias is not None else None)
        del weight  # the transient dequantized weight is not saved for backward
        ctx.route = route
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(xc, values)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xc, values = ctx.saved_tensors
        route: QuantizedRoute = ctx.route
        dy = grad_out.to(xc.dtype).reshape(-1, grad_out.shape[-1])
        x2 = xc.reshape(-1, xc.shape[-1])
        grad_x = grad_values = grad_b = None
        indices = route.indices
        weight = route.weight(xc.dtype, values, indices) if ctx.needs_input_grad[0] or indices is None else None
        if ctx.needs_input_grad[0]:
            grad_x = (dy @ weight).reshape(*grad_out.shape[:-1], weight.shape[1]).to(ctx.x_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.sum(0).to(route.module.bias.dtype)
        if ctx.needs_input_grad[1] and weight_gradient_wanted():
            if indices is not None and route.reselecting():
                grad_values = route.reselection_grad(dy, x2, weight)
            elif indices is not None:
                grad_values = _ops.call("sparse_weight_grad", dy, x2, indices, check_values=False)
            else:
                grad_values = route.selection_grad(dy, x2, weight)
            if grad_values is not None:
                route.average(grad_values)
        return grad_x, grad_values, grad_b, None


def _is_fsdp_module(module: nn.Module) -> bool:
    return any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    route, values = self._sift_quantized, getattr(self, DELTA)
    route.check_values(values)
    route.record_group()
    return _QuantizedSparseLinear.apply(x, values, self.bias, route)


def attach_deltas(model: nn.Module, names: list[str], density: float) -> dict[str, nn.Parameter]:
    """Give each named 4-bit layer a [k] fp32 values param (zeros) and return {param name: values}.

    Nothing else changes until `bind_deltas`; `detach_deltas` undoes this.
    """
    modules = dict(model.named_modules())
    deltas = {}
    for name in names:
        module = modules[name]
        numel = module.out_features * module.in_features
        k = max(1, entries_for(density, numel))
        device = module.weight.device
        module.register_parameter(DELTA, nn.Parameter(torch.zeros(k, dtype=torch.float32, device=device)))
        deltas[f"{name}.{DELTA}"] = getattr(module, DELTA)
    return deltas


def detach_deltas(model: nn.Module, names: list[str]) -> None:
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        module._parameters.pop(DELTA, None)
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_sift_quantized", None)


def bind_deltas(model: nn.Module, names: list[str], optimizer: Any) -> list[QuantizedRoute]:
    """Route each named 4-bit layer's forward through its sparse delta, owned by `optimizer`."""
    modules = dict(model.named_modules())
    routes = []
    for position, name in enumerate(names):
        module = modules[name]
        values = getattr(module, DELTA)
        route = QuantizedRoute(module, name, optimizer, position, values.numel())
        module._sift_quantized = route
        module.forward = types.MethodType(_forward, module)
        routes.append(route)
    return routes


def attach_delta_(model: nn.Module, delta: Any) -> None:
    """Put a `SparseDelta` from a 4-bit or 8-bit fine-tune back on a freshly loaded quantized model, for
    inference: `delta.apply_(model)`, which hands each quantized layer's entries to `attach_frozen_delta_`
    (its values frozen, its indices fixed: the packed weights stay as they are) and applies the entries
    of 16-bit weights (a head trained with the base given) in place. Everything is checked first; on
    error nothing changes, and `delta.remove_(model)` takes it all off again.

    Args:
        model: the quantized model, loaded as the fine-tune's base was.
        delta: the `SparseDelta` (`SparseDelta.from_optimizer` of the quantized fine-tune).

    Raises:
        DeltaError: a quantized layer's entry of another shape, a layer that already has a delta, or
            invalid indices or values.

    Example:
        >>> delta = sift.SparseDelta.from_optimizer(opt, model4bit)  # doctest: +SKIP
        >>> sift.quantized.attach_delta_(fresh_model4bit, delta)  # same as delta.apply_(fresh_model4bit)  # doctest: +SKIP
    """
    delta.apply_(model)


def frozen_delta_problems(module: nn.Module, name: str, shape: tuple[int, ...]) -> list[str]:
    """Why `module` cannot take a frozen delta of a weight of `shape` ([] when it can)."""
    problems = []
    if not is_quantized_linear(module):
        problems.append(f"{name}: not a bitsandbytes 4-bit or 8-bit linear layer")
        return problems
    expected = (module.out_features, module.in_features)
    if tuple(shape) != expected:
        problems.append(f"{name}: shape mismatch: delta {tuple(shape)}, quantized layer {expected}")
    if hasattr(module, "_sift_quantized"):
        problems.append(f"{name}: the quantized layer already has a sparse delta")
    return problems


def attach_frozen_delta_(module: nn.Module, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Route a quantized layer's forward through a fixed sparse delta: `indices` [k] sorted flat positions
    into its [out, in] weight, `values` [k] fp32 increments (frozen). `frozen_delta_problems` first."""
    device = module.weight.device
    module.register_parameter(DELTA, nn.Parameter(values.to(device=device, dtype=torch.float32).clone(),
                                                  requires_grad=False))
    route = QuantizedRoute(module, name, None, 0, values.numel())
    route.fixed_indices = indices.to(device=device, dtype=index_dtype(route.numel)).clone()
    module._sift_quantized = route
    set_delta_enabled(module, True)


def set_delta_enabled(module: nn.Module, enabled: bool) -> None:
    """Compute a quantized layer that has a sparse delta with it (`enabled`) or as its bare base layer, whose
    own forward is then the one that runs: its outputs are the base's, bit for bit."""
    if enabled:
        module.forward = types.MethodType(_forward, module)
    else:
        module.__dict__.pop("forward", None)


def detach_frozen_delta_(module: nn.Module) -> None:
    """Take a delta `attach_frozen_delta_` put on a quantized layer off again: the layer is as it was loaded."""
    module._parameters.pop(DELTA, None)
    module.__dict__.pop("forward", None)
    module.__dict__.pop("_sift_quantized", None)
