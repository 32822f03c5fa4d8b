"""Sparse backward: after selection, a sparse weight's gradient is computed only at its chosen
entries, straight into the optimizer's compact buffer; the dense weight gradient never exists.

For a linear layer y = x W^T + b (W [out, in]) over T tokens, the backward needs

    dX = dY W                                   [T, in]   as usual
    g[j] = sum_t dY[t, row_j] * X[t, col_j]     [k]       row_j = idx_j // in, col_j = idx_j % in

instead of the dense dW = dY^T X [out, in] (a third of the layer's training FLOPs and a
weight-sized buffer). transformers' `Conv1D` stores W as [in, out] (y = x W + b): its flat
index splits into (in-row, out-col), so the same op runs with X and dY swapped.

During the selection steps the layer returns the dense gradient as before (selection needs it);
from the first step after selection it returns none for the weight and adds the sampled product
into the optimizer's compact buffer (gradient accumulation adds up). Biases and dense groups are
untouched. The optimizer must be in `compact_grads` mode, whose step, clipping and process-group
averaging already read those buffers.

Supported: gradient accumulation, `sift.clip_grad_norm_` and `max_grad_norm`, `torch.compile` (once the
entries are chosen the forward is one graph: the weight-gradient part is one opaque op,
`torch.ops.sift.sparse_weight_grad_routed_`, that keeps the optimizer's books when it runs), autocast (bf16/
fp16 compute; the op reads dY and X in the autocast dtype and accumulates in fp32), gradient
checkpointing, several processes through the optimizer's `process_group` (k entries on the wire
per weight), and the optimizer's `update_in_backward` (each weight is stepped once every use of
it in the forward has added its part: a layer applied twice, a head tied to an embedding, shared
layers), and fp16 weights with
`GradScaler` (the optimizer unscales and checks the compact gradients itself; after an explicit
`scaler.unscale_(optimizer)` it needs `optimizer.grad_scaler = scaler`, see `sift.optim.amp`).
Several processes under DDP: enable the sparse backward (or build the optimizer with `for_model`)
before wrapping the model: the patched weights are excluded from DDP's reduction and the optimizer
averages their compact gradients over the default process group itself (`wrap_ddp` wraps a model whose
only trained params are those weights, which DDP alone refuses).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable

import torch
from torch import nn

from sift import _ops
from sift._params import SparseOptimizer, is_dtensor


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D, matched by name so transformers stays optional here.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def weight_gradient_wanted() -> bool:
    """Inside a custom Function's backward: whether this backward delivers its second input's gradient.

    False under `torch.autograd.grad(..., inputs=...)` for other tensors (a gradient penalty, say):
    a compact buffer or a selection must not take a gradient that nobody asked for.
    """
    if torch.compiler.is_compiling():
        return True
    node = torch._C._current_autograd_node()
    if node is None:
        return True
    accumulator = node.next_functions[1][0]
    return accumulator is None or torch._C._will_engine_execute_node(accumulator)


class _SparseLinearFunction(torch.autograd.Function):
    """y = x W^T + b (or x W + b for Conv1D) whose backward feeds the compact gradient of W."""

    @staticmethod
    def forward(ctx, x, weight, bias, route: _Route):
        device_type = x.device.type
        cast = _autocast_dtype(device_type)
        # Autocast's casts, done here once so backward sees the dtypes forward used.
        xc = x.to(cast) if cast is not None and x.is_floating_point() else x
        wc = weight.to(cast) if cast is not None else weight
        bc = bias.to(cast) if cast is not None and bias is not None else bias
        # Autocast off around the product only where it is on: entering the context costs about
        # 10 us a layer, a tenth of the sparse backward's own overhead on a 576-wide layer.
        with torch.autocast(device_type, enabled=False) if cast is not None else contextlib.nullcontext():
            if route.transposed:
                out = torch.matmul(xc, wc)
                if bc is not None:
                    out = out + bc
            else:
                out = nn.functional.linear(xc, wc, bc)
        ctx.route = route
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(xc, wc)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xc, wc = ctx.saved_tensors
        route: _Route = ctx.route
        weight = route.weight
        grad_out = grad_out.to(wc.dtype) if grad_out.dtype != wc.dtype else grad_out
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (torch.matmul(grad_out, wc.t()) if route.transposed else torch.matmul(grad_out, wc)).to(ctx.x_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[1] and weight_gradient_wanted():
            dy = grad_out.reshape(-1, grad_out.shape[-1])
            x2 = xc.reshape(-1, xc.shape[-1])
            if route.selected():
                # One opaque op that finds the buffer and keeps the optimizer's books when it runs, so
                # under torch.compile that Python state stays out of the graph.
                torch.ops.sift.sparse_weight_grad_routed_(dy, x2, route.id)
            else:
                # Not selected yet: the dense gradient, which the selection step reads.
                dense = x2.t() @ dy if route.transposed else dy.t() @ x2
                grad_w = dense.to(weight.dtype)
        return grad_x, grad_w, grad_b, None


class _Route:
    """What one patched layer needs in backward: its weight, layout and optimizer."""

    def __init__(self, module: nn.Module, optimizer, transposed: bool):
        self.weight = module.weight
        self.optimizer = optimizer
        self.transposed = transposed
        self.sharded = None  # an FSDP2 weight's cross-rank plan (sift.optim.sharded.ShardedSparseGrad)
        self.removed = False  # the layer has its own forward back (`SparseBackwardHandle.remove`)
        self.id = _ops.register_weight_grad_route(self)

    def __setstate__(self, state: dict) -> None:
        # A copy (deepcopy of the patched model) routes to its own optimizer, not the original's.
        self.__dict__.update(state)
        self.id = _ops.register_weight_grad_route(self)

    def selected(self) -> bool:
        """Whether the backward computes the weight's gradient at its chosen entries only (else densely).

        Reads state only: under torch.compile it becomes a guard, so a selection recompiles.
        """
        if self.sharded is not None:
            return self.sharded.plan is not None and not self.optimizer.reselector.is_due(self.weight)
        # The condition under which `compact_grad_target` returns a target.
        return self.optimizer.compact_grads and self.optimizer.grads.gathers_entries(self.weight)

    def add_weight_grad(self, grad_output: torch.Tensor, input: torch.Tensor) -> None:
        """Add the gradient at the chosen entries, from dY [T, R] and X [T, C], to where this step
        keeps it (`torch.ops.sift.sparse_weight_grad_routed_` runs this)."""
        target = self.optimizer.compact_grad_target(self.weight) if self.sharded is None else self.sharded.target()
        if target is None:
            raise RuntimeError("the sparse backward ran for a weight whose entries are not chosen")
        indices, buffer = target
        # Linear: W[out, in], row = out. Conv1D: W[in, out], row = in: swap the operands.
        a, b = (input, grad_output) if self.transposed else (grad_output, input)
        # The optimizer's indices are validated already: no host sync per layer.
        # With update_in_backward the optimizer steps the weight once all its uses have added.
        _ops.call("sparse_weight_grad", a, b, indices, out=buffer, check_values=False)
        if self.sharded is not None:  # every rank's entries, from this rank's data: sum to their owners
            self.sharded.reduce(buffer)


def _is_routed(module: nn.Module) -> bool:
    """Whether `module`'s forward is the sparse backward's (set by an earlier `enable_sparse_backward`)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _sparse_forward


def _unroute(module: nn.Module) -> None:
    """Give `module` its own forward back."""
    module.__dict__.pop("forward", None)
    route = module.__dict__.pop("_sift_route", None)
    if route is not None:
        route.removed = True


def _sparse_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _SparseLinearFunction.apply(x, self.weight, self.bias, self._sift_route)


class SparseBackwardHandle:
    """The layers `enable_sparse_backward` patched; `remove()` restores their own forward."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules

    def remove(self) -> None:
        for module in self.modules.values():
            _unroute(module)
        self.modules = {}

    def __repr__(self) -> str:
        return f"SparseBackwardHandle({len(self.modules)} layers: {', '.join(list(self.modules)[:4])}...)"


def check_sparse_backward(params: Iterable[tuple[str, torch.Tensor]], update_in_backward: bool) -> None:
    """Raise before anything is patched if the sparse backward cannot route these weights.

    With FSDP2 each rank's [k] gradient is reduce-scattered inside the layer's backward, once per use of
    the weight; update_in_backward would have to step the weight after its last use's reduction, which
    nothing marks for a weight FSDP2 never gives a gradient.
    """
    sharded = [name for name, p in params if is_dtensor(p)]
    if sharded and update_in_backward:
        raise ValueError(f"the sparse backward of FSDP2 (fully_shard) params ({sharded[0]!r} is a sharded DTensor) "
                         "does not support update_in_backward=True: use update_in_backward=False (the step applies "
                         "the reduced [k] gradients), or update_in_backward without the sparse backward")


def enable_sparse_backward(model: nn.Module, optimizer, modules: Iterable[str] | None = None) -> SparseBackwardHandle:
    """Route each sparsely trained linear weight of `model` through the sparse backward.

    Args:
        model: the model whose `nn.Linear` / transformers `Conv1D` layers to patch.
        optimizer: a `sift.SparseAdamW` in `compact_grads` mode that trains those weights
            in a sparse group (density < 1).
        modules: dotted names of the layers to patch; default: every linear layer whose
            weight is a sparse param of `optimizer`.

    Returns:
        A handle whose `remove()` restores the layers.

    Raises:
        ValueError: the optimizer is not in compact_grads mode, a named module is not a
            linear layer, or its weight is not a sparse param of the optimizer.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        >>> opt = sift.SparseAdamW([model[0].weight], density=0.1, compact_grads=True)  # doctest: +SKIP
        >>> handle = enable_sparse_backward(model, opt)  # doctest: +SKIP
    """
    # Checked by its protocol: sift.optim, which defines SparseAdamW, imports this module.
    if not isinstance(optimizer, SparseOptimizer):
        raise TypeError(f"optimizer must be a sift.SparseAdamW, got {type(optimizer).__name__}")
    if not optimizer.compact_grads:
        raise ValueError("sparse backward writes the optimizer's compact gradient buffers: build the optimizer "
                         "with compact_grads=True")
    sparse = {id(p) for group in optimizer.param_groups if group["density"] < 1.0 for p in group["params"]}
    named = dict(model.named_modules())
    if modules is None:
        chosen = routable_layers(model, sparse)
    else:
        chosen = {}
        for name in modules:
            if name not in named:
                raise ValueError(f"modules names {name!r}, which is not a module of the model")
            m = named[name]
            if not (isinstance(m, nn.Linear) or _is_conv1d(m)):
                raise ValueError(f"module {name!r} is a {type(m).__name__}, not nn.Linear or transformers Conv1D")
            if id(m.weight) not in sparse:
                raise ValueError(f"the weight of module {name!r} is not in a sparse group of the optimizer")
            chosen[name] = m
    check_sparse_backward(((f"{name}.weight", m.weight) for name, m in chosen.items()), optimizer.update_in_backward)
    check_routable(chosen)
    # A model an earlier call routed (for_model run again) is taken over whole: no layer may keep feeding
    # the earlier optimizer's buffers.
    for m in named.values():
        if _is_routed(m):
            _unroute(m)
    for m in chosen.values():
        m._sift_route = _Route(m, optimizer, transposed=_is_conv1d(m))
        # A partial of a module-level function pickles (a bound method would be looked up by name on load).
        m.forward = functools.partial(_sparse_forward, m)
    optimizer.grads.attach_sparse_backward([m._sift_route for m in chosen.values()])
    name_of = {id(p): n for n, p in model.named_parameters()}
    exclude_from_ddp(model, [name_of[id(m.weight)] for m in chosen.values() if id(m.weight) in name_of])
    return SparseBackwardHandle(chosen)


def routable_layers(model: nn.Module, weights: set[int]) -> dict[str, nn.Module]:
    """The linear layers of `model` whose weight is one of `weights` (ids): what the sparse backward patches."""
    return {name: m for name, m in model.named_modules()
            if (isinstance(m, nn.Linear) or _is_conv1d(m)) and id(getattr(m, "weight", None)) in weights}


def check_routable(modules: dict[str, nn.Module]) -> None:
    """Raise if the sparse backward cannot take over these layers' forward (another wrapper replaced it)."""
    for name, m in modules.items():
        if "forward" in m.__dict__ and not _is_routed(m):
            raise ValueError(f"module {name!r} already has its forward replaced by something other than sift "
                             "(a monkeypatched module.forward): the sparse backward would drop it; restore the "
                             "layer's own forward or pass sparse_backward=False")


def exclude_from_ddp(model: nn.Module, names: Iterable[str]) -> None:
    """Leave these params to the optimizer when `model` is later wrapped in DDP: compact_grads mode frees
    or never forms their `.grad`, and the optimizer averages their compact gradients itself."""
    names = list(names)
    if not names or not torch.distributed.is_available():
        return
    ignored = sorted(set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(names))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)


def wrap_ddp(model: nn.Module, **ddp_kwargs) -> nn.Module:
    """Wrap `model` in `DistributedDataParallel` after `SparseAdamW.for_model`, also when DDP has nothing to reduce.

    In the compact modes `for_model` leaves the sparse weights to the optimizer, which averages their [k]
    gradients over the default process group itself. A causal LM whose only trained params are those weights
    then gives DDP no param to reduce, and torch refuses the wrap ("DistributedDataParallel is not needed when a
    module doesn't have any parameter that requires a gradient"). There this broadcasts the model's params and
    buffers from rank 0 once (as DDP's construction does) and returns the model itself; otherwise it returns
    `DistributedDataParallel(model, **ddp_kwargs)`.

    Args:
        model: the model `for_model` (or `enable_sparse_backward`) prepared, not wrapped yet.
        **ddp_kwargs: passed to `DistributedDataParallel` (`device_ids`, ...). Without a DDP wrap only the
            default process group is possible: the optimizer averages over it.

    Returns:
        The DDP-wrapped model, or `model` when every trained param is averaged by the optimizer.

    Raises:
        ValueError: nothing for DDP to reduce and a `process_group` other than the default one.

    Example:
        >>> opt = sift.SparseAdamW.for_model(causal_lm, density=0.01)  # doctest: +SKIP
        >>> causal_lm = sift.wrap_ddp(causal_lm)  # doctest: +SKIP
    """
    import torch.distributed as dist

    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    if any(p.requires_grad and name not in ignored for name, p in model.named_parameters()):
        return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    group = ddp_kwargs.get("process_group")
    if group is not None and group is not dist.group.WORLD:
        raise ValueError("process_group: every trained param of the model is averaged by the optimizer over the "
                         "default process group (DDP has none to reduce); pass no process_group, or build the "
                         "optimizer with process_group= and do not wrap the model")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    return model
