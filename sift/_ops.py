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
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sift.triton_kernels._checks import check_lengths

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


def sparse_adamw_ref(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    deltas: list[torch.Tensor],
    bases: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    compact_grads: bool,
    table_cache: dict | None = None,
) -> None:
    """Plain-torch reference of one fused SparseAdamW step (see the contract above).

    `table_cache` (the caller's dict for a backend's launch tables) is accepted and unused.
    """
    check_lengths(len(params), grads=grads, indices=indices, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                  deltas=deltas, steps=steps, **({"bases": bases} if bases else {}))
    for i, p in enumerate(params):
        flat = p.view(-1)
        idx = indices[i].long()
        g = grads[i] if compact_grads else grads[i].reshape(-1)[idx]
        g = g.float()
        if maximize:
            g = -g
        m, v, d = exp_avgs[i], exp_avg_sqs[i], deltas[i]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = steps[i].double()
        bc1 = 1 - beta1**t
        bc2 = 1 - beta2**t
        lr_f = lr.double() if isinstance(lr, torch.Tensor) else torch.tensor(float(lr), dtype=torch.float64)
        step_size = (lr_f / bc1).float().to(p.device)
        bc2_sqrt = bc2.sqrt().float().to(p.device)
        lr32 = lr_f.float().to(p.device)
        w = flat[idx].float() if not bases else bases[i].float() + d
        upd = -lr32 * weight_decay * w - step_size * m / (v.sqrt() / bc2_sqrt + eps)
        d.add_(upd)
        if bases:
            flat[idx] = (bases[i].float() + d).to(p.dtype)
        else:
            flat[idx] = w + upd


define("sparse_adamw_", sparse_adamw_ref)


@register("sparse_adamw_", "cpp")
def _sparse_adamw_cpp(params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps, *, lr, beta1, beta2,
                      eps, weight_decay, maximize, compact_grads, table_cache=None):
    lr = float(lr)  # CPU: a 0-d tensor lr is read here, no device sync involved
    torch.ops.sift.sparse_adamw_(params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps, lr, beta1,
                                 beta2, eps, weight_decay, maximize, compact_grads)


@register("sparse_adamw_", "triton")
def _sparse_adamw_triton(*args, **kwargs):
    from sift.triton_kernels.sparse_adamw import sparse_adamw_

    sparse_adamw_(*args, **kwargs)


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
#     old = w[indices[i]]                                  (returned when save_originals)
#     w[indices[i]] = dtype(fp32(old) + fp32(scale) * values[i])
#   Returns the list of `old` tensors ([k_i], param dtype), or [] without save_originals.
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
    save_originals: bool,
) -> list[torch.Tensor]:
    """Plain-torch reference of the scatter-add apply with the fused gather of originals."""
    check_lengths(len(params), indices=indices, values=values)
    saved = []
    for p, idx, val in zip(params, indices, values):
        flat = p.view(-1)
        idx = idx.long()
        old = flat[idx]
        if save_originals:
            saved.append(old)
        flat[idx] = (old.float() + scale * val.float()).to(p.dtype)
    return saved


def sparse_delta_restore_ref(params: list[torch.Tensor], indices: list[torch.Tensor],
                             originals: list[torch.Tensor]) -> None:
    """Plain-torch reference of the restore: writes the saved originals back."""
    check_lengths(len(params), indices=indices, originals=originals)
    for p, idx, old in zip(params, indices, originals):
        p.view(-1)[idx.long()] = old


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
def _sparse_delta_apply_cpp(params, indices, values, scale, save_originals):
    return list(torch.ops.sift.sparse_delta_apply_(params, indices, values, float(scale), bool(save_originals)))


@register("sparse_delta_restore_", "cpp")
def _sparse_delta_restore_cpp(params, indices, originals):
    torch.ops.sift.sparse_delta_restore_(params, indices, originals)


@register("sparse_delta_apply_", "triton")
def _sparse_delta_apply_triton(params, indices, values, scale, save_originals):
    from sift.triton_kernels.delta import sparse_delta_apply_

    return sparse_delta_apply_(params, indices, values, scale, save_originals)


@register("sparse_delta_restore_", "triton")
def _sparse_delta_restore_triton(params, indices, originals):
    from sift.triton_kernels.delta import sparse_delta_restore_

    sparse_delta_restore_(params, indices, originals)



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
