"""The one contract between the API and the kernels.

Every op has: a name, a plain-torch fp32-upcast reference (the fallback on any device and
the oracle in tests), and zero or more faster implementations registered per backend:

    "torch"   the reference itself; always available.
    "cpp"     `torch.ops.sift.*` from the C++ extension (CPU tensors).
    "triton"  `sift.triton_kernels` (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1).

`resolve(op, device)` is the only place a backend is chosen. Order when nothing is forced:
CUDA -> triton, torch; CPU -> cpp, torch. `SIFT_BACKEND=torch|cpp|triton` (or the
`backend=` argument of `resolve`) forces one; a forced backend that cannot run raises, an
automatically chosen one that fails to load falls back with one log line.

Each op is also `torch.ops.sift.<name>`, defined here once (`define_schema`): its schema and
fake kernel (so calls trace under torch.compile), its CPU kernel registered by the C++
extension, its CUDA kernel the registry's entry. Where Triton serves an op, a torch.compile
graph holds the op's Triton launches rather than an opaque call (`traced`). The step ops take
their operands as one structure (`ExactState` / `LeanState`, `AdamWHyper` in
`sift.triton_kernels._step_args`) and validate them with one function (`check_step`),
whichever backend runs.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from typing import Any

import torch

from sift.triton_kernels._checks import check_lengths
from sift.triton_kernels._step_args import AdamWHyper, ExactState, LeanState, check_step, takes_step_lists

log = logging.getLogger("sift")

BACKENDS = ("torch", "cpp", "triton")


@dataclass
class Op:
    name: str
    reference: Callable
    impls: dict[str, Callable] = field(default_factory=dict)


_OPS: dict[str, Op] = {}
_warned: set[tuple[str, str]] = set()
_resolved: dict[tuple, tuple[str, Callable]] = {}


def define(name: str, reference: Callable) -> Op:
    """Declare op `name` with its plain-torch reference."""
    op = _OPS.setdefault(name, Op(name, reference))
    op.reference = reference
    op.impls["torch"] = reference
    return op


def register(name: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator registering `fn` as `backend`'s implementation of op `name`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def deco(fn: Callable) -> Callable:
        _OPS[name].impls[backend] = fn
        _resolved.clear()
        return fn

    return deco


def _triton_importable() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401

        from sift import triton_kernels  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return False, f"triton is not importable ({exc})"
    return True, ""


def backend_unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` now, or None when it can."""
    if backend == "torch":
        return None
    if backend == "cpp":
        if device.type != "cpu":
            return f"the C++ backend runs on CPU tensors, not {device.type}"
        from sift._ext import extension_status, load_extension

        if not load_extension():
            return f"C++ extension unavailable: {extension_status()['why']}"
        return None
    if backend == "triton":
        ok, why = _triton_importable()
        if not ok:
            return why
        if device.type == "cuda":
            return None
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
            return None
        return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for CPU tensors), got {device.type}"
    return f"unknown backend {backend!r}; choose one of {BACKENDS}"


def _auto_order(device: torch.device) -> tuple[str, ...]:
    return ("triton", "torch") if device.type == "cuda" else ("cpp", "torch")


def forced_backend() -> str | None:
    """The backend named by `SIFT_BACKEND`, or None."""
    value = os.environ.get("SIFT_BACKEND", "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in BACKENDS:
        raise ValueError(f"SIFT_BACKEND must be one of {BACKENDS} or 'auto', got {value!r}")
    return value


def resolve(name: str, device: torch.device | str, backend: str | None = None) -> tuple[str, Callable]:
    """Choose the implementation of op `name` for tensors on `device`.

    Args:
        name: a declared op.
        device: where the op's tensors live.
        backend: force one backend (else `SIFT_BACKEND`, else the automatic order).

    Returns:
        `(backend_name, fn)`.

    Raises:
        RuntimeError: a forced backend cannot run here or has no implementation of `name`.
    """
    device = torch.device(device)
    # Resolution runs in every optimizer step: cache it per op, device, request and environment.
    key = (name, device, backend, os.environ.get("SIFT_BACKEND"), os.environ.get("TRITON_INTERPRET"))
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    choice = _resolve_uncached(name, device, backend)
    _resolved[key] = choice
    return choice


def _resolve_uncached(name: str, device: torch.device, backend: str | None) -> tuple[str, Callable]:
    op = _OPS[name]
    wanted = backend if backend is not None else forced_backend()
    if wanted is not None:
        if wanted not in op.impls:
            raise RuntimeError(f"op {name!r} has no {wanted!r} implementation (has: {sorted(op.impls)})")
        why = backend_unavailable_reason(wanted, device)
        if why is not None:
            raise RuntimeError(f"backend {wanted!r} was requested for op {name!r} but cannot run: {why}")
        return wanted, op.impls[wanted]
    for cand in _auto_order(device):
        if cand not in op.impls:
            continue
        why = backend_unavailable_reason(cand, device)
        if why is None:
            return cand, op.impls[cand]
        if (name, cand) not in _warned and cand != "torch":
            _warned.add((name, cand))
            log.warning("sift: %s falls back from %s on %s: %s", name, cand, device.type, why)
    return "torch", op.reference


def call(name: str, *args, backend: str | None = None, device: torch.device | str | None = None, **kwargs):
    """Run op `name`, dispatching on `device` (default: the first tensor argument's)."""
    if device is None:
        device = _first_device(args) or torch.device("cpu")
    _, fn = resolve(name, device, backend)
    return fn(*args, **kwargs)


def _first_device(args: Sequence) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].device
    return None


def ops() -> dict[str, Op]:
    """All declared ops (for `python -m sift.env`)."""
    return dict(_OPS)


# `torch.ops.sift.*`: each op's schema and fake (shape-only) kernel are defined here, once, so
# code calling the ops traces under torch.compile. The C++ extension registers the CPU kernels
# of these schemas (TORCH_LIBRARY_IMPL); on CUDA tensors an op runs its registry entry
# (Triton, else the reference) through `resolve`.
_LIB = torch.library.Library("sift", "FRAGMENT")


def define_schema(name: str, schema: str, fake: Callable, cuda: Callable, *, traced: Callable | None = None,
                  registry: str | None = None) -> None:
    """Define `torch.ops.sift.<name>` with `schema`, its fake kernel and its CUDA kernel.

    Args:
        name: the op's name (the schema's).
        schema: the full schema, e.g. `"singular_values(Tensor x, str isa=\"auto\") -> Tensor"`.
        fake: the shape-only kernel (FakeTensor mode).
        cuda: the kernel for CUDA tensors, taking the schema's arguments.
        traced: what torch.compile records where the registry runs Triton: the schema's
            arguments to the op's result, its kernels launched through
            `triton_kernels._launch.launchable`; NotImplemented keeps the op whole. None: the
            op is one opaque node on every device.
        registry: the op's name in the backend registry (default: `name`).
    """
    _LIB.define(schema)
    torch.library.register_fake(f"sift::{name}", fake, lib=_LIB)
    _LIB.impl(name, cuda, "CUDA")
    if traced is not None:
        _record_on_triton(name, registry or name, traced)


def _record_on_triton(name: str, registry: str, traced: Callable) -> None:
    """Let torch.compile see the Triton kernels of `torch.ops.sift.<name>`.

    When torch.compile functionalizes a graph, a call whose tensors the registry gives to
    compiled Triton kernels (CUDA) becomes `traced(...)` with its launches recorded: the graph
    holds the kernels themselves, which Inductor compiles and schedules, instead of one opaque
    call. Elsewhere (C++ on CPU, the interpreter) the op stays one node.
    """
    if not hasattr(torch.library, "register_torch_dispatch"):  # torch < 2.5: the op stays opaque
        return
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from sift.triton_kernels import _launch

    def decompose(mode, op, types, args, kwargs):
        device = _first_device(args)
        if device is not None and _launch.can_record() and resolve(registry, device)[0] == "triton":
            with mode, _launch.recording():
                out = traced(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return mode.__torch_dispatch__(op, types, args, kwargs)

    torch.library.register_torch_dispatch(f"sift::{name}", FunctionalTensorMode, decompose, lib=_LIB)


def _step_schema(name: str, lists: str) -> str:
    return (f"{name}({lists}, float lr, float beta1, float beta2, float eps, float weight_decay, bool maximize, "
            f"bool compact_grads, str isa=\"auto\") -> ()")


def _step_on_device(name: str, state_type: type) -> Callable:
    """The CUDA kernel of a step op: its schema's flat arguments to the registry's entry."""
    n = len(state_type.LISTS)

    def run(*args, **_isa) -> None:
        # The tensor lists, seven scalars, then `isa` (absent when a trace leaves out the default).
        lr, beta1, beta2, eps, weight_decay, maximize, compact_grads = args[n:n + 7]
        call(name, *args[:n], lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
             compact_grads=compact_grads)

    return run


def _no_output(*args) -> None:
    return None


# ---------------------------------------------------------------------------------------
# sparse_adamw_: one fused SparseAdamW step over a list of tensors of one device and dtype.
#
# For tensor i with k_i chosen entries (flat positions indices[i], sorted ascending):
#   g      = grads[i]              if compact_grads  ([k_i] fp32, already gathered)
#          = grads[i].view(-1)[indices[i]]         otherwise (dense grad, param's shape)
#   g      = -g if maximize
#   m      = beta1 * m + (1 - beta1) * g           (exp_avgs[i], [k_i] fp32)
#   v      = beta2 * v + (1 - beta2) * g * g       (exp_avg_sqs[i], [k_i] fp32)
#   t      = steps[i]                               (0-d fp32, already incremented)
#   w      = params[i].view(-1)[indices[i]]  (no bases: fp32 params only)
#          = bases[i] + deltas[i]            (with bases: the exact fp32 weight)
#   upd    = -lr * weight_decay * w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
#   deltas[i] += upd                                ([k_i] fp32: total increment since selection)
#   params[i].view(-1)[indices[i]] = w + upd  (no bases) | round(bases[i] + deltas[i]) (bases)
# Entries not in indices[i] are never written. `bases` is empty or has one [k_i] tensor per
# param in the param dtype (the values at selection time): required for bf16/fp16 params,
# optional for fp32 ones (SparseAdamW(keep_base=True)).
# ---------------------------------------------------------------------------------------


@takes_step_lists(ExactState)
def sparse_adamw_ref(state: ExactState, hyper: AdamWHyper, *, table_cache: dict | None = None) -> None:
    """Plain-torch reference of one fused SparseAdamW step (see the contract above).

    Takes `(state, hyper)` through `.structured`, or the eight lists of `ExactState` and the
    keywords of `AdamWHyper` plus `compact_grads`, as every backend's entry does.
    `table_cache` (the caller's dict for a backend's launch tables) is accepted and unused.
    """
    check_step(state, hyper)
    for i, p in enumerate(state.params):
        flat = p.view(-1)
        idx = state.indices[i].long()
        g = _step_grad(state, hyper, i, idx)
        m, v, d = state.exp_avgs[i], state.exp_avg_sqs[i], state.deltas[i]
        m.mul_(hyper.beta1).add_(g, alpha=1 - hyper.beta1)
        v.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
        bc1, bc2 = _bias_corrections(hyper, state.steps[i])
        lr_f = hyper.lr.double() if hyper.lr_on_device else torch.tensor(float(hyper.lr), dtype=torch.float64)
        step_size = (lr_f / bc1).float().to(p.device)
        bc2_sqrt = bc2.sqrt().float().to(p.device)
        lr32 = lr_f.float().to(p.device)
        base = state.bases[i].float() if state.bases else None
        w = flat[idx].float() if base is None else base + d
        upd = -lr32 * hyper.weight_decay * w - step_size * m / (v.sqrt() / bc2_sqrt + hyper.eps)
        d.add_(upd)
        flat[idx] = w + upd if base is None else (base + d).to(p.dtype)


def _step_grad(state: ExactState | LeanState, hyper: AdamWHyper, i: int, idx: torch.Tensor) -> torch.Tensor:
    """Tensor i's gradient at its chosen entries, fp32, negated under `maximize`."""
    g = state.grads[i] if state.compact_grads else state.grads[i].reshape(-1)[idx]
    g = g.float()
    return -g if hyper.maximize else g


def _bias_corrections(hyper: AdamWHyper, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 - beta1^t, 1 - beta2^t) in fp64 for the one-element step `t`."""
    t = step.double()
    return 1 - hyper.beta1**t, 1 - hyper.beta2**t


def _cpp_step(op_name: str, state_type: type) -> Callable:
    """The C++ entry of a step op: `torch.ops.sift.<op_name>` on the flat lists.

    The kernel checks its operands before touching memory (it can be called directly), and an
    index out of order or range before stepping the chunk holding it: it never writes outside
    the params, though a step refused for a bad index may be partly applied. A refusal is then
    re-checked by `check_step`, so a bad operand is named as on every other backend. Checking first instead would cost a Python pass over
    every tensor in every step, more than a small C++ step takes.
    """

    @takes_step_lists(state_type)
    def run(state: ExactState | LeanState, hyper: AdamWHyper, *, table_cache: dict | None = None) -> None:
        lr = float(hyper.lr)  # CPU: a 0-d tensor lr is read here, no device sync involved
        try:
            getattr(torch.ops.sift, op_name)(*state.lists(), lr, hyper.beta1, hyper.beta2, hyper.eps,
                                             hyper.weight_decay, hyper.maximize, state.compact_grads)
        except RuntimeError:
            check_step(state, hyper)
            raise

    return run


def _triton_step(module: str, fn_name: str) -> Callable:
    """The Triton entry of a step op: imports the launcher on first use (triton may be missing)."""

    def run(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(f"sift.triton_kernels.{module}"), fn_name)(*args, **kwargs)

    return run


def _define_step(name: str, reference: Callable, lists: str, state_type: type) -> None:
    """One step op: its reference, schema (`lists`, the tensor-list arguments), fake kernel, C++
    entry and Triton launcher (`triton_kernels/<name without the trailing _>.py`)."""
    define(name, reference)
    # Eager or traced, a CUDA call runs the registry's entry (Triton records its launches when traced).
    on_device = _step_on_device(name, state_type)
    define_schema(name, _step_schema(name, lists), _no_output, on_device, traced=on_device)
    register(name, "cpp")(_cpp_step(name, state_type))
    register(name, "triton")(_triton_step(name.rstrip("_"), name))


_define_step("sparse_adamw_", sparse_adamw_ref,
             "Tensor(a!)[] params, Tensor[] grads, Tensor[] indices, Tensor(b!)[] exp_avgs, "
             "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] deltas, Tensor[] bases, Tensor[] steps", ExactState)


# ---------------------------------------------------------------------------------------
# Sparse delta ops are declared below this line.
# ---------------------------------------------------------------------------------------
#
# merge_sorted_deltas: k-way merge of index-sorted sparse lists, grouped per output tensor.
#   Inputs are flattened over groups: group g owns the next group_sizes[g] entries of
#   `indices` ([k_i] int32/int64, strictly increasing, one dtype per group), `values`
#   ([k_i] fp32) and `weights` (python floats). Output g is the sorted union U_g of its inputs'
#   indices (dtype of the inputs) and fp32 values, reduced in float64 from the contributions
#   c_i = weights[i] * values[i][j] of the inputs holding each index:
#     ties=False:  sum_i c_i
#     ties=True:   s = sign(sum_i c_i); mean of the c_i with sign s (0 where the sum is 0)
#
# sparse_delta_apply_: for each tensor i with flat view w = params[i].view(-1),
#   indices[i] [k_i] sorted unique, values[i] [k_i] fp32:
#     old = w[indices[i]];  originals[i] = old             (when originals is not empty)
#     w[indices[i]] = dtype(fp32(old) + fp32(scale) * values[i])
#   `originals` is [] or one [k_i] tensor per param in its dtype (`originals_like`), written:
#   an out list rather than a returned one, so torch.compile can functionalize the op.
#
# sparse_delta_restore_: w[indices[i]] = originals[i] (originals in the param dtype): the
#   bit-exact inverse of an apply that saved them.
# ---------------------------------------------------------------------------------------


def merge_sorted_deltas_ref(
    indices: list[torch.Tensor],
    values: list[torch.Tensor],
    weights: list[float],
    group_sizes: list[int],
    ties: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain-torch reference of the grouped k-way merge (sort-based; any device)."""
    if len(values) != len(indices) or len(weights) != len(indices):
        raise ValueError("values and weights must have one entry per indices tensor")
    if any(g < 1 for g in group_sizes) or sum(group_sizes) != len(indices):
        raise ValueError("group_sizes must be >= 1 and add up to the number of indices tensors")
    out_idx, out_val = [], []
    start = 0
    for size in group_sizes:
        idx_in = indices[start : start + size]
        val_in = values[start : start + size]
        w_in = weights[start : start + size]
        start += size
        flat_idx = torch.cat([i.long() for i in idx_in])
        contrib = torch.cat([w * v.double() for v, w in zip(val_in, w_in)])
        # Stable sort keeps equal indices in input order, the C++ reduction order.
        sorted_idx, perm = torch.sort(flat_idx, stable=True)
        contrib = contrib[perm]
        union, inverse = torch.unique_consecutive(sorted_idx, return_inverse=True)
        total = torch.zeros(union.numel(), dtype=torch.float64, device=contrib.device).index_add_(0, inverse, contrib)
        if ties:
            elected = torch.sign(total)[inverse]
            agree = (torch.sign(contrib) == elected) & (elected != 0)
            agree_sum = torch.zeros_like(total).index_add_(0, inverse, torch.where(agree, contrib, 0.0))
            count = torch.zeros_like(total).index_add_(0, inverse, agree.double())
            total = torch.where(count > 0, agree_sum / count.clamp_min(1), 0.0)
        # unique_consecutive's output keeps a storage sized for its input: copy to the union's size.
        out_idx.append(union.to(idx_in[0].dtype, copy=True))
        out_val.append(total.float())
    return out_idx, out_val


def sparse_delta_apply_ref(
    params: list[torch.Tensor],
    indices: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
    originals: list[torch.Tensor],
) -> None:
    """Plain-torch reference of the scatter-add apply with the fused gather of originals."""
    check_lengths(len(params), indices=indices, values=values)
    if originals:
        check_lengths(len(params), originals=originals)
    for i, (p, idx, val) in enumerate(zip(params, indices, values)):
        flat = p.view(-1)
        idx = idx.long()
        old = flat[idx]
        if originals:
            originals[i].copy_(old)
        flat[idx] = (old.float() + scale * val.float()).to(p.dtype)


def originals_like(params: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """The `originals` out list of `sparse_delta_apply_`: an empty [k_i] tensor per param, in its dtype."""
    return [torch.empty(idx.shape, dtype=p.dtype, device=p.device) for p, idx in zip(params, indices)]


def sparse_delta_restore_ref(params: list[torch.Tensor], indices: list[torch.Tensor],
                             originals: list[torch.Tensor]) -> None:
    """Plain-torch reference of the restore: writes the saved originals back."""
    check_lengths(len(params), indices=indices, originals=originals)
    for p, idx, old in zip(params, indices, originals):
        p.view(-1)[idx.long()] = old


def _merge_sorted_deltas_fake(indices, values, weights, group_sizes, ties):
    # The merged length depends on how many indices coincide: a data-dependent size.
    ctx = torch.library.get_ctx()
    out_idx, out_val, start = [], [], 0
    for size in group_sizes:
        n = ctx.new_dynamic_size()
        out_idx.append(indices[start].new_empty((n,)))
        out_val.append(values[start].new_empty((n,)))
        start += size
    return out_idx, out_val


define("merge_sorted_deltas", merge_sorted_deltas_ref)
define("sparse_delta_apply_", sparse_delta_apply_ref)
define("sparse_delta_restore_", sparse_delta_restore_ref)


@register("merge_sorted_deltas", "cpp")
def _merge_sorted_deltas_cpp(indices, values, weights, group_sizes, ties):
    # The C++ merge wants one index dtype per group and contiguous fp32 values; widen here so
    # the kernel stays one template instance per dtype.
    indices, values = list(indices), list(values)
    start = 0
    for size in group_sizes:
        group = range(start, start + size)
        wide = any(indices[i].dtype == torch.int64 for i in group)
        for i in group:
            indices[i] = indices[i].to(torch.int64 if wide else torch.int32).contiguous()
            values[i] = values[i].to(torch.float32).contiguous()
        start += size
    out_idx, out_val = torch.ops.sift.merge_sorted_deltas(indices, values, [float(w) for w in weights],
                                                          list(group_sizes), bool(ties))
    return list(out_idx), list(out_val)


@register("sparse_delta_apply_", "cpp")
def _sparse_delta_apply_cpp(params, indices, values, scale, originals):
    torch.ops.sift.sparse_delta_apply_(params, indices, values, float(scale), originals)


@register("sparse_delta_restore_", "cpp")
def _sparse_delta_restore_cpp(params, indices, originals):
    torch.ops.sift.sparse_delta_restore_(params, indices, originals)


@register("sparse_delta_apply_", "triton")
def _sparse_delta_apply_triton(params, indices, values, scale, originals):
    from sift.triton_kernels.delta import sparse_delta_apply_

    sparse_delta_apply_(params, indices, values, scale, originals)


@register("sparse_delta_restore_", "triton")
def _sparse_delta_restore_triton(params, indices, originals):
    from sift.triton_kernels.delta import sparse_delta_restore_

    sparse_delta_restore_(params, indices, originals)


define_schema("merge_sorted_deltas", "merge_sorted_deltas(Tensor[] indices, Tensor[] values, float[] weights, "
              "int[] group_sizes, bool ties) -> (Tensor[], Tensor[])",
              _merge_sorted_deltas_fake, functools.partial(call, "merge_sorted_deltas"))
define_schema("sparse_delta_apply_", "sparse_delta_apply_(Tensor(a!)[] params, Tensor[] indices, Tensor[] values, "
              "float scale, Tensor(b!)[] originals) -> ()", _no_output, functools.partial(call, "sparse_delta_apply_"),
              traced=_sparse_delta_apply_triton)
define_schema("sparse_delta_restore_", "sparse_delta_restore_(Tensor(a!)[] params, Tensor[] indices, "
              "Tensor[] originals) -> ()", _no_output, functools.partial(call, "sparse_delta_restore_"),
              traced=_sparse_delta_restore_triton)


# ---------------------------------------------------------------------------------------
# Head-importance ops are declared below this line.
# ---------------------------------------------------------------------------------------

# singular_values: batched singular values of x [..., S, D] -> [..., min(S, D)], descending;
# fp64 output for fp64 input, fp32 otherwise. The reference is fp64 `svdvals`. All faster
# backends square the matrix: fp64 Gram of the shorter side, then its eigenvalues. Squaring
# the condition number is harmless in fp64 for the accuracy the op promises (values above
# 1e-3 * sigma_max to 1e-4 relative).
#   "torch"  Gram + LAPACK `eigvalsh`, chunks spread over a thread pool.
#   "cpp"    csrc/singular_values.cpp: Gram, Householder tridiagonalisation and QL, 8 matrices
#            per SIMD instruction (min(S, D) <= 512; larger goes to "torch").
#   "triton" triton_kernels/singular_values.py: one program per matrix, Gram with tl.dot,
#            Householder tridiagonalisation in registers, Sturm bisection (min(S, D) <= 128).


def _singular_values_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def singular_values_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: `torch.linalg.svdvals` in fp64."""
    return torch.linalg.svdvals(x.to(torch.float64)).to(_singular_values_dtype(x))


def _singular_values_fake(x: torch.Tensor, isa: str = "auto") -> torch.Tensor:
    return x.new_empty((*x.shape[:-2], min(x.shape[-2:])), dtype=_singular_values_dtype(x))


define("singular_values", singular_values_ref)

_eigvalsh_pool = None


def _gram_eigvalsh(x3: torch.Tensor) -> torch.Tensor:
    # [B, S, D] -> [B, min(S, D)] descending, fp64.
    xd = x3.to(torch.float64)
    gram = xd.mT @ xd if x3.shape[-2] >= x3.shape[-1] else xd @ xd.mT
    # LAPACK raises on NaN/inf; give those matrices NaN values instead (as the other backends
    # do), without a host sync, and leave the refusal to the caller's one check.
    bad = ~torch.isfinite(gram).all(-1).all(-1)
    sigma = torch.linalg.eigvalsh(torch.where(bad[:, None, None], 0.0, gram)).clamp_min_(0).sqrt_().flip(-1)
    return sigma.masked_fill_(bad[:, None], float("nan"))


@register("singular_values", "torch")
def singular_values_gram_eigvalsh(x: torch.Tensor) -> torch.Tensor:
    """Fast plain-torch path: fp64 Gram of the shorter side, then batched `eigvalsh`."""
    global _eigvalsh_pool
    *batch, s, d = x.shape
    x3 = x.reshape(math.prod(batch), s, d)  # not -1: a batch may be empty
    n_threads = torch.get_num_threads()
    if x.device.type != "cpu" or n_threads < 2 or x3.shape[0] < 4 * n_threads:
        sigma = _gram_eigvalsh(x3)
    else:
        # LAPACK's syevd solves one matrix at a time on one thread (torch does not parallelise
        # over the batch), so each thread takes whole chunks: upcast, Gram and eigvalsh stay
        # cache-local, and the GIL is released inside every op.
        if _eigvalsh_pool is None or _eigvalsh_pool._max_workers != n_threads:
            from concurrent.futures import ThreadPoolExecutor

            _eigvalsh_pool = ThreadPoolExecutor(n_threads, thread_name_prefix="sift-eigvalsh")
        # Chunks of about 4 MB of fp64 input keep the upcast copy and Gram cache-resident
        # (256 matrices of 512x128 would be 134 MB and run at memory speed).
        per_matrix = max(1, s * d * 8)
        chunk = max(1, min(256, (4 << 20) // per_matrix, -(-x3.shape[0] // n_threads)))
        sigma = torch.cat(list(_eigvalsh_pool.map(_gram_eigvalsh, x3.split(chunk))))
    return sigma.reshape(*batch, min(s, d)).to(_singular_values_dtype(x))


CPP_SINGULAR_VALUES_MAX_K = 512


@register("singular_values", "cpp")
def _singular_values_cpp(x: torch.Tensor) -> torch.Tensor:
    *batch, s, d = x.shape
    if min(s, d) > CPP_SINGULAR_VALUES_MAX_K:
        return singular_values_gram_eigvalsh(x)
    sigma = torch.ops.sift.singular_values(x.reshape(math.prod(batch), s, d))
    return sigma.reshape(*batch, min(s, d))


@register("singular_values", "triton")
def _singular_values_triton(x: torch.Tensor) -> torch.Tensor:
    from sift.triton_kernels.singular_values import MAX_K, singular_values

    if min(x.shape[-2:]) > MAX_K:
        # Beyond the kernel's register budget; head outputs have min(S, D') <= 128 in practice.
        return singular_values_gram_eigvalsh(x)
    return singular_values(x)


def _singular_values_traced(x: torch.Tensor, isa: str = "auto") -> torch.Tensor:
    from sift.triton_kernels.singular_values import MAX_K, singular_values

    # The larger sizes' eigvalsh spreads over a thread pool, which a trace cannot follow.
    return NotImplemented if min(x.shape[-2:]) > MAX_K else singular_values(x)


define_schema("singular_values", 'singular_values(Tensor x, str isa="auto") -> Tensor', _singular_values_fake,
              lambda x, isa="auto": call("singular_values", x), traced=_singular_values_traced)


# ---------------------------------------------------------------------------------------
# sparse_adamw_lean_: the SparseAdamW step on the lean state (SparseAdamW(state="lean")),
# at most 8 bytes per trainable entry.
#
# Layout of tensor i (numel n_i, k_i chosen entries at sorted flat positions idx):
#   window_offsets[i]  [ceil(n_i / 65536) + 1] int32, CSR over 65536-element windows of the
#                      flat weight: window w holds entries off[w] .. off[w+1]-1; off[0] = 0,
#                      off[-1] = k_i
#   indices_low[i]     [k_i] int16, idx & 0xFFFF (read as uint16): idx = w * 65536 + uint16(low)
#   exp_avgs[i], exp_avg_sqs[i]  [k_i] bf16, read as fp32, stored by stochastic rounding
#   residuals[i]       [k_i] int8, bf16/fp16 weights only (empty list for fp32): the exact
#                      weight is fp32(w) + residual * unit(w), unit(w) = ulp(w) / 256
#   steps[i]           0-d fp32, already incremented
# The step (fp32 math, the order of sparse_adamw_ref):
#   g   = grads[i] (compact, [k_i] fp32) | grads[i].view(-1)[idx] (dense);  g = -g if maximize
#   m   = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g * g
#   w   = fp32(p[idx]) (+ residual * unit(p[idx]) for bf16/fp16)
#   upd = -lr * wd * w - lr / bc1 * m / (sqrt(v) * (1 / sqrt(bc2)) + eps)
#         (lr rounded to fp32; lr / bc1 and 1 / sqrt(bc2) in fp64, then fp32; each fp32 operation
#         rounded, no fused multiply-add)
#   new = w + upd;  p[idx] = round_to_nearest(new)
#   residual = clamp(rint((new - fp32(p[idx])) / unit(p[idx])), -128, 127), 0 where p[idx] is inf/NaN
#   m, v -> bf16 by stochastic rounding: fp32 bits + r >> 16, r 16 random bits (m the low half
#           of lean_random_bits(idx, t), v the high half); NaN stores the quiet NaN 0x7FC0
# unit(w): bf16 2^(max(E, 16) - 142), fp16 2^(max(E, 1) - 33), E the stored exponent field.
# For normal weights that is ulp / 256 (bf16 ulp 2^(e-7), fp16 2^(e-10)); fp16 subnormals
# and zero get the subnormal spacing's; bf16 weights below 2^-111 in magnitude get 2^-126
# (coarser than ulp / 256 there, so no fp32 subnormal is ever formed). new - fp32(p[idx]) and
# the products by powers of two are exact in fp32, so the residual is the same on every backend.
# Why stochastic rounding: bf16 moments rounded to nearest stall once an update is below half
# a bf16 ulp of the moment; with beta2 = 0.999 the second moment ends at 0.28x (constant
# gradients) or 1.33x (Gaussian) of fp32's (figures: bench/results/README.md). Random bits
# from a hash of (flat index, step) make the rounding unbiased and the same on every backend,
# so a reloaded state continues identically.
# ---------------------------------------------------------------------------------------

LEAN_WINDOW = 65536
LEAN_WINDOW_BITS = 16


def lean_num_windows(numel: int) -> int:
    """Windows of a weight of `numel` elements (the CSR table has one more entry)."""
    return -(-numel // LEAN_WINDOW)


def encode_lean_indices(indices: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat positions -> (indices_low [k] int16, window_offsets [windows + 1] int32).

    Example:
        >>> low, off = encode_lean_indices(torch.tensor([3, 65537]), 70000)
        >>> low.tolist(), off.tolist()
        ([3, 1], [0, 1, 2])
    """
    idx = indices.long()
    counts = torch.bincount(idx >> LEAN_WINDOW_BITS, minlength=lean_num_windows(numel))
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=idx.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    low = ((idx & 0xFFFF) ^ 0x8000) - 0x8000  # the low 16 bits as a signed int16 value
    return low.to(torch.int16), offsets


def checked_lean_indices(indices_low: Any, window_offsets: Any, numel: int, what: str,
                         names: tuple[str, str] = ("indices_low", "window_offsets"),
                         allow_empty: bool = False) -> torch.Tensor:
    """Validate a saved lean index pair for a weight of `numel` elements; its decoded positions.

    Raises:
        ValueError: naming `what` and the offending tensor (`names`): wrong dtype or shape, offsets
            that do not rise from 0 to k, or decoded positions unsorted or out of range.
    """
    from sift._index import check_indices

    low_name, offsets_name = names
    windows = lean_num_windows(numel)
    if not isinstance(indices_low, torch.Tensor) or indices_low.dtype != torch.int16 or indices_low.dim() != 1:
        raise ValueError(f"{what}: {low_name} must be a 1-D int16 tensor")
    if (not isinstance(window_offsets, torch.Tensor) or window_offsets.dtype != torch.int32
            or window_offsets.shape != (windows + 1,)):
        raise ValueError(f"{what}: {offsets_name} must be int32 of shape ({windows + 1},) for a param of "
                         f"{numel} elements")
    k = indices_low.numel()
    if int(window_offsets[0]) != 0 or int(window_offsets[-1]) != k or bool((window_offsets.diff() < 0).any()):
        raise ValueError(f"{what}: {offsets_name} must rise from 0 to k = {k}")
    decoded = decode_lean_indices(indices_low.cpu(), window_offsets.cpu())
    check_indices(decoded, numel, f"{what}: decoded {low_name}", allow_empty=allow_empty)
    return decoded


def decode_lean_indices(indices_low: torch.Tensor, window_offsets: torch.Tensor,
                        dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """(indices_low, window_offsets) -> [k] sorted flat positions in `dtype`.

    Example:
        >>> decode_lean_indices(torch.tensor([3, 1], dtype=torch.int16), torch.tensor([0, 1, 2], dtype=torch.int32))
        tensor([    3, 65537])
    """
    counts = window_offsets.diff().long()
    windows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                      output_size=indices_low.numel())
    return ((windows << LEAN_WINDOW_BITS) | (indices_low.long() & 0xFFFF)).to(dtype)


def lean_unit(w: torch.Tensor) -> torch.Tensor:
    """unit(w) of the contract above: the residual's step for bf16/fp16 weights `w` (fp32, exact)."""
    bits = w.view(torch.int16).int() & 0xFFFF
    if w.dtype == torch.bfloat16:
        exponent = ((bits >> 7) & 0xFF).clamp_min(16) - 142
    else:
        exponent = ((bits >> 10) & 0x1F).clamp_min(1) - 33
    return ((exponent + 127) << 23).view(torch.float32)


def _lean_inv_unit(w: torch.Tensor) -> torch.Tensor:
    """1 / unit(w), a power of two in fp32's normal range."""
    bits = w.view(torch.int16).int() & 0xFFFF
    if w.dtype == torch.bfloat16:
        exponent = 142 - ((bits >> 7) & 0xFF).clamp_min(16)
    else:
        exponent = 33 - ((bits >> 10) & 0x1F).clamp_min(1)
    return ((exponent + 127) << 23).view(torch.float32)


_U32 = 0xFFFFFFFF


def lean_random_bits(idx: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """32 random bits per entry (int64 holding a uint32) from a hash of (flat index, step).

    The low 32 bits of the index and the integer step are mixed, then finalised with
    MurmurHash3's fmix32; all arithmetic is modulo 2^32, as uint32 in the kernels.
    """
    x = ((idx.long() & _U32) * 0x9E3779B1 + (step.long() & _U32) * 0x632BE5AB) & _U32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _U32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _U32
    return x ^ (x >> 16)


def lean_round_bf16(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 `x` -> bf16 by stochastic rounding with 16 random bits per entry (int64 in [0, 65536))."""
    bits = x.view(torch.int32).long() & _U32
    out = ((bits + random16) & _U32) >> 16
    out = torch.where(torch.isnan(x), 0x7FC0, out)
    return (((out ^ 0x8000) - 0x8000).to(torch.int16)).view(torch.bfloat16)


@takes_step_lists(LeanState)
def sparse_adamw_lean_ref(state: LeanState, hyper: AdamWHyper, *, table_cache: dict | None = None) -> None:
    """Plain-torch reference of one SparseAdamW step on the lean state (see the contract above).

    Takes `(state, hyper)` through `.structured`, or the eight lists of `LeanState` and the
    keywords of `AdamWHyper` plus `compact_grads`. `table_cache` is accepted and unused.
    """
    check_step(state, hyper)
    beta1, beta2 = hyper.beta1, hyper.beta2
    for i, p in enumerate(state.params):
        flat = p.view(-1)
        idx = decode_lean_indices(state.indices_low[i], state.window_offsets[i])
        g = _step_grad(state, hyper, i, idx)
        # Separate roundings, no fused multiply-add (torch's add_ with alpha fuses), so the
        # kernels, compiled with fp-contract off, give the same bits.
        m = state.exp_avgs[i].float() * beta1 + g * (1 - beta1)
        v = state.exp_avg_sqs[i].float() * beta2 + g * (1 - beta2) * g
        bc1, bc2 = _bias_corrections(hyper, state.steps[i])
        # lr is taken in fp32 (as a device tensor lr is), then lr / bc1 in fp64.
        lr32 = hyper.lr.float() if hyper.lr_on_device else torch.tensor(float(hyper.lr), dtype=torch.float32)
        step_size = (lr32.double() / bc1).float().to(p.device)
        inv_bc2_sqrt = (1 / bc2.sqrt()).float().to(p.device)
        lr32 = lr32.to(p.device)
        stored = flat[idx]
        w = stored.float()
        residual = state.residuals[i] if state.residuals else None
        if residual is not None:
            w = w + residual.float() * lean_unit(stored)
        # torch's fp32 sqrt on CPU is not always correctly rounded; through fp64 it is.
        sqrt_v = v.double().sqrt().float()
        upd = -lr32 * hyper.weight_decay * w - step_size * m / (sqrt_v * inv_bc2_sqrt + hyper.eps)
        new = w + upd
        rounded = new.to(p.dtype)
        flat[idx] = rounded
        if residual is not None:
            r = torch.round((new - rounded.float()) * _lean_inv_unit(rounded)).clamp_(-128, 127)
            residual.copy_(torch.where(torch.isfinite(rounded), r, 0.0).to(torch.int8))
        bits = lean_random_bits(idx, state.steps[i])
        state.exp_avgs[i].copy_(lean_round_bf16(m, bits & 0xFFFF))
        state.exp_avg_sqs[i].copy_(lean_round_bf16(v, bits >> 16))


_define_step("sparse_adamw_lean_", sparse_adamw_lean_ref,
             "Tensor(a!)[] params, Tensor[] grads, Tensor[] indices_low, Tensor[] window_offsets, "
             "Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] residuals, Tensor[] steps", LeanState)


# ---------------------------------------------------------------------------------------
# sparse_weight_grad: the weight gradient of a linear layer at its chosen entries only (a
# sampled dense-dense product), so the sparse backward never forms the dense [R, C] gradient.
#
# For y = x W^T + b with W [R, C] (R = out_features, C = in_features) and the tokens flattened
# to T rows: grad_output dY [T, R], input X [T, C] (one dtype: fp32, bf16 or fp16; leading
# dims, equal in both, are flattened into T), indices [k] int32/int64 strictly increasing in
# [0, R * C):
#   g[j] = sum_t dY[t, idx[j] // C] * X[t, idx[j] % C]        fp32 accumulation, g [k] fp32
# i.e. (dY^T X).view(-1)[indices]. With `out` ([k] fp32, contiguous) g is added into it (the
# optimizer's compact gradient buffer) and `out` is returned.
# transformers' Conv1D stores W as [C, R] (y = x W + b): its flat index is (in-row, out-col),
# so callers swap the operands: sparse_weight_grad(X, dY, indices).
#   "torch"  chunks of entries: gather, fp32 product, sum over tokens (<= ~64 MB temporaries)
#   "cpp"    csrc/sparse_weight_grad.cpp: token-blocked fp32 transposes, SIMD dot products
#   "triton" triton_kernels/sparse_weight_grad.py: BLOCK_K entries per program, T in tiles
# Every backend starts with check_sparse_weight_grad_args, so bad arguments raise the same
# ValueError on each.
# ---------------------------------------------------------------------------------------

SPARSE_WEIGHT_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Temporaries of the reference per chunk of entries: three [T, chunk] tensors of <= 4 bytes.
_SPARSE_WEIGHT_GRAD_REF_BYTES = 64 << 20


def check_sparse_weight_grad_args(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate sparse_weight_grad's arguments; flatten the token dims.

    Returns:
        `(dY [T, R], X [T, C])`, 2-D views (or copies) of grad_output and input.

    Raises:
        ValueError: naming the bad argument (shape, dtype, device, unsorted, repeated or
            out-of-range indices, or an `out` that is not a contiguous fp32 [k] tensor).
    """
    for name, t in (("grad_output", grad_output), ("input", input), ("indices", indices)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if grad_output.dim() < 1 or input.dim() < 1:
        raise ValueError("grad_output and input must have at least one dim (features last)")
    if grad_output.shape[:-1] != input.shape[:-1]:
        raise ValueError(f"grad_output and input must have the same token dims, got grad_output "
                         f"{tuple(grad_output.shape)} and input {tuple(input.shape)}")
    if grad_output.dtype not in SPARSE_WEIGHT_GRAD_DTYPES:
        raise ValueError(f"grad_output must be float32, bfloat16 or float16, got {grad_output.dtype}")
    if input.dtype != grad_output.dtype:
        raise ValueError(f"input must have grad_output's dtype {grad_output.dtype}, got {input.dtype}")
    device = grad_output.device
    if input.device != device:
        raise ValueError(f"input must be on grad_output's device {device}, got {input.device}")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be a 1-D int32 or int64 tensor, got {indices.dtype} {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"indices must be on grad_output's device {device}, got {indices.device}")
    k, limit = indices.numel(), grad_output.shape[-1] * input.shape[-1]
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.shape != (k,)
                            or not out.is_contiguous() or out.device != device):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous float32 [{k}] tensor on {device} (k = indices.numel()), got {got}")
    if k and check_values:
        # One host sync for the three facts; the position is looked up only on failure. Callers
        # whose indices are already validated (the optimizer's) skip it: no sync per layer.
        descending = indices[1:] <= indices[:-1]
        flags = torch.stack([descending.any(), indices[0] < 0, indices[-1].long() >= limit]).tolist()
        if flags[0]:
            j = int(descending.nonzero()[0, 0]) + 1
            raise ValueError(f"indices must be strictly increasing: {int(indices[j])} at position {j} is not above "
                             f"{int(indices[j - 1])}")
        if flags[1] or flags[2]:
            j = 0 if flags[1] else k - 1
            raise ValueError(f"indices has {int(indices[j])} at position {j}, outside [0, {limit}) (R * C)")
    return grad_output.reshape(-1, grad_output.shape[-1]), input.reshape(-1, input.shape[-1])


def sparse_weight_grad_ref(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Plain-torch reference of the sampled product (see the contract above); fp32 math."""
    dy, x = check_sparse_weight_grad_args(grad_output, input, indices, out, check_values)
    (t, c), k = x.shape, indices.numel()
    if out is None:
        out = torch.zeros(k, dtype=torch.float32, device=dy.device)
    idx = indices.long()
    chunk = max(1, _SPARSE_WEIGHT_GRAD_REF_BYTES // (12 * max(t, 1)))
    for s in range(0, k, chunk):
        rows, cols = idx[s : s + chunk].div(c, rounding_mode="floor"), idx[s : s + chunk].remainder(c)
        prod = dy[:, rows].float().mul_(x[:, cols])
        out[s : s + chunk] += prod.sum(0)
    return out


define("sparse_weight_grad", sparse_weight_grad_ref)


@register("sparse_weight_grad", "cpp")
def _sparse_weight_grad_cpp(grad_output, input, indices, out=None, check_values=True):
    dy, x = check_sparse_weight_grad_args(grad_output, input, indices, out, check_values)
    # The kernel reads rows with unit stride; any row stride is fine.
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.zeros(indices.numel(), dtype=torch.float32, device=dy.device)
    torch.ops.sift.sparse_weight_grad_(dy, x, indices.contiguous(), out)
    return out


@register("sparse_weight_grad", "triton")
def _sparse_weight_grad_triton(grad_output, input, indices, out=None, check_values=True):
    from sift.triton_kernels.sparse_weight_grad import sparse_weight_grad as launch

    dy, x = check_sparse_weight_grad_args(grad_output, input, indices, out, check_values)
    return launch(dy, x, indices, out)


def _sparse_weight_grad_traced(dy, x, indices, out, isa="auto", token_block=0) -> None:
    # Index values are not read in a trace (a host sync in the graph); the eager op checks them.
    _sparse_weight_grad_triton(dy, x, indices, out, check_values=False)


# The raw kernel op: 2-D operands, `out` given (sparse_weight_grad below is the checked entry).
define_schema("sparse_weight_grad_", 'sparse_weight_grad_(Tensor grad_output, Tensor input, Tensor indices, '
              'Tensor(a!) out, str isa="auto", int token_block=0) -> ()', _no_output,
              lambda dy, x, indices, out, isa="auto", token_block=0: call("sparse_weight_grad", dy, x, indices, out),
              traced=_sparse_weight_grad_traced, registry="sparse_weight_grad")


def sparse_weight_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """The weight gradient dY^T X of a linear layer at its chosen flat entries only.

    `g[j] = sum_t grad_output[t, row_j] * input[t, col_j]` with `row_j = indices[j] // C`,
    `col_j = indices[j] % C`, summed in fp32 without forming the dense [R, C] product.

    Args:
        grad_output: dY `[..., R]` (R = out_features), fp32, bf16 or fp16.
        input: X `[..., C]` (C = in_features), grad_output's dtype, device and token dims.
        indices: `[k]` int32/int64 flat positions into W `[R, C]`, strictly increasing.
        out: optional `[k]` fp32 contiguous; the result is added into it and it is returned.
        backend: force "torch", "cpp" or "triton" (default: the automatic choice).

    Returns:
        `[k]` fp32: the gradient at `indices` (plus `out`'s previous values when given).

    Raises:
        ValueError: a bad argument, named (see `check_sparse_weight_grad_args`).

    Example:
        >>> layer = torch.nn.Linear(5, 3)
        >>> x, dy = torch.randn(4, 5), torch.randn(4, 3)
        >>> idx = torch.tensor([0, 7, 14])
        >>> torch.allclose(sparse_weight_grad(dy, x, idx), (dy.T @ x).view(-1)[idx], atol=1e-5)
        True

        transformers' Conv1D keeps W as `[in, out]` (y = x W + b), so its flat index is
        `in * out_features + out`: pass the operands swapped.

        >>> w_conv1d_grad = x.T @ dy  # [5, 3], the dense gradient of a Conv1D(3, 5) weight
        >>> torch.allclose(sparse_weight_grad(x, dy, idx), w_conv1d_grad.view(-1)[idx], atol=1e-5)
        True
    """
    return call("sparse_weight_grad", grad_output, input, indices, out, backend=backend)
