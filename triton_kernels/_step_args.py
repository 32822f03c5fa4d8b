"""The SparseAdamW step's arguments as named structures, and their one argument check.

Both state layouts of the step (`ExactState`, `LeanState`) and its scalars (`AdamWHyper`) are
described here once; the plain-torch references in `sift._ops`, the Triton launchers next to
this file and the C++ entry all take them apart from these fields. `check_step` is the
argument check every backend's entry runs. Imports torch only (no triton), so the references
use it on machines without Triton.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ._checks import check_lengths

STEP_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LEAN_WINDOW_BITS = 16


@dataclass(frozen=True)
class AdamWHyper:
    """The step's scalars.

    Attributes:
        lr: learning rate, a float or a one-element fp32 tensor on the params' device (read
            inside the kernel, so a captured CUDA graph follows a scheduler).
        beta1, beta2: moment decay rates in [0, 1).
        eps: added to the bias-corrected sqrt(v).
        weight_decay: decoupled decay, applied as -lr * weight_decay * w.
        maximize: step along +grad instead of -grad.
    """

    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool = False

    @property
    def lr_on_device(self) -> bool:
        return isinstance(self.lr, torch.Tensor)

    def kernel_args(self, placeholder: torch.Tensor | None) -> tuple:
        """The step kernels' runtime scalars: `(lr_ptr, lr, beta1, beta2, 1 - beta1, 1 - beta2,
        log2(beta1), log2(beta2), eps, weight_decay)`; `lr_ptr` is `placeholder` for a float lr.

        1 - beta is taken in fp64 on the host, as torch's AdamW does: in fp32, 1 - 0.999f is
        off by 5e-5 relative, a bias every second moment would carry.
        """
        b1, b2 = float(self.beta1), float(self.beta2)
        lr_ptr, lr = (self.lr, 0.0) if self.lr_on_device else (placeholder, float(self.lr))
        return (lr_ptr, lr, b1, b2, 1.0 - b1, 1.0 - b2, _log2(b1), _log2(b2), float(self.eps),
                float(self.weight_decay))


def _log2(beta: float) -> float:
    # beta == 0 gives bias correction 1 at every step: exp2(-inf) == 0.
    return math.log2(beta) if beta > 0 else float("-inf")


@dataclass
class StepOperands:
    """What both state layouts of the step hold, one entry per tensor i.

    Attributes:
        params: weights, any shape, contiguous, one dtype (fp32, bf16 or fp16); written only
            at their chosen entries.
        grads: dense grads (params[i]'s shape and dtype) or, with `compact_grads`, `[k_i]` fp32.
        steps: one-element fp32 tensors, already incremented for this step (keyword-only).
        compact_grads: whether `grads` are already gathered at the chosen entries (keyword-only).
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    steps: list[torch.Tensor] = field(kw_only=True)
    compact_grads: bool = field(default=False, kw_only=True)
    #: The tensor lists in the ops' positional order (schema, C++ entry, flat call).
    LISTS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_lists(cls, *lists: list[torch.Tensor], compact_grads: bool = False) -> StepOperands:
        """From the tensor lists in `LISTS` order."""
        if len(lists) != len(cls.LISTS):
            raise TypeError(f"{cls.__name__} takes {len(cls.LISTS)} tensor lists {cls.LISTS}, got {len(lists)}")
        return cls(**dict(zip(cls.LISTS, lists)), compact_grads=compact_grads)

    def lists(self) -> tuple[list[torch.Tensor], ...]:
        """The tensor lists in `LISTS` order."""
        return tuple(getattr(self, name) for name in self.LISTS)


@dataclass
class ExactState(StepOperands):
    """Operands of the exact step (`SparseAdamW(state="exact")`): `StepOperands` and

    Attributes:
        indices: `[k_i]` int32/int64, the chosen flat positions, sorted ascending.
        exp_avgs, exp_avg_sqs, deltas: `[k_i]` fp32, updated in place (deltas: the total
            increment since the entries were chosen).
        bases: empty, or `[k_i]` in the param dtype (the weights at selection time; required
            for bf16/fp16 params, optional for fp32 ones).
    """

    indices: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    deltas: list[torch.Tensor]
    bases: list[torch.Tensor]
    LISTS: ClassVar[tuple[str, ...]] = ("params", "grads", "indices", "exp_avgs", "exp_avg_sqs", "deltas", "bases",
                                        "steps")


@dataclass
class LeanState(StepOperands):
    """Operands of the lean step (`SparseAdamW(state="lean")`, at most 8 bytes per entry):
    `StepOperands` and

    Attributes:
        indices_low: `[k_i]` int16, the low 16 bits of the sorted flat positions.
        window_offsets: `[ceil(numel_i / 65536) + 1]` int32, CSR over 65536-element windows.
        exp_avgs, exp_avg_sqs: `[k_i]` bf16, stored by stochastic rounding.
        residuals: `[k_i]` int8 per bf16/fp16 param (empty for fp32 params): the exact weight is
            fp32(w) + residual * unit(w).
    """

    indices_low: list[torch.Tensor]
    window_offsets: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    residuals: list[torch.Tensor]
    LISTS: ClassVar[tuple[str, ...]] = ("params", "grads", "indices_low", "window_offsets", "exp_avgs", "exp_avg_sqs",
                                        "residuals", "steps")


def takes_step_lists(layout: type) -> Callable[[Callable], Callable]:
    """Let `fn(state, hyper, **options)` also be called with today's flat arguments.

    The flat form is the eight tensor lists of `layout` in `layout.LISTS` order, then the keywords
    `lr, beta1, beta2, eps, weight_decay, maximize, compact_grads` and `fn`'s own options
    (`table_cache`, launch settings). The structured form stays reachable as `.structured`.
    """

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def flat(*lists, lr, beta1, beta2, eps, weight_decay, maximize, compact_grads, **options):
            state = layout.from_lists(*lists, compact_grads=compact_grads)
            return fn(state, AdamWHyper(lr, beta1, beta2, eps, weight_decay, maximize), **options)

        flat.structured = fn
        return flat

    return deco


def check_state_lengths(state: ExactState | LeanState) -> dict[str, list[torch.Tensor]]:
    """Raise unless every list holds one tensor per param (bases / residuals: or none).

    Returns:
        The lists after `params`, by field name.
    """
    lists = {name: getattr(state, name) for name in state.LISTS[1:]}
    # zip() over the lists would silently skip the params past a shorter one.
    check_lengths(len(state.params), **{name: lst for name, lst in lists.items()
                                        if lst or name not in ("bases", "residuals")})
    return lists


def check_step(state: ExactState | LeanState, hyper: AdamWHyper) -> None:
    """Validate one step's operands (shapes, dtypes, layout and device; not index values).

    Every backend's entry runs this before touching memory: the kernels read the tensors
    through raw addresses, so a strided view, a short or wrong-dtype tensor, or one on another
    device would be read or written out of bounds without an error.

    Raises:
        ValueError: naming the bad argument, e.g. `exp_avgs[1] must be a contiguous ...`.
    """
    lists = check_state_lengths(state)
    params = state.params
    lean = isinstance(state, LeanState)
    if not params:
        return
    device, w_dtype = params[0].device, params[0].dtype
    if w_dtype not in STEP_PARAM_DTYPES:
        raise ValueError(f"params must be float32, bfloat16 or float16, got {w_dtype}")
    if any(p.dtype != w_dtype or p.device != device for p in params):
        raise ValueError("params must share one device and dtype")
    if lean:
        if w_dtype == torch.float32 and state.residuals:
            raise ValueError("residuals must be empty for float32 params")
        if w_dtype != torch.float32:
            check_lengths(len(params), residuals=state.residuals)
    elif not state.bases and w_dtype != torch.float32:
        raise ValueError("bases are required for bf16/fp16 params")
    lr = hyper.lr
    if isinstance(lr, torch.Tensor) and (lr.device != device or lr.numel() != 1):
        raise ValueError(f"lr must be a float or a one-element tensor on {device}, got {lr.device} with {lr.numel()}")
    for i, p in enumerate(params):
        if not p.is_contiguous():
            raise ValueError(f"params[{i}] must be contiguous")
        k = _check_positions(state, i, p, device) if lean else _check_indices(state.indices[i], i, device)
        g = state.grads[i]
        if state.compact_grads:
            if g.dtype != torch.float32 or g.numel() != k or not g.is_contiguous() or g.device != device:
                raise ValueError(f"grads[{i}] must be float32 with one entry per index on {device} (compact_grads)")
        elif g.dtype != p.dtype or g.numel() != p.numel() or not g.is_contiguous() or g.device != device:
            raise ValueError(f"grads[{i}] must have the shape and dtype of params[{i}], be contiguous and on {device}")
        for name, dtype in _state_dtypes(state, p.dtype):
            t = lists[name][i]
            if t.dtype != dtype or t.numel() != k or not t.is_contiguous() or t.device != device:
                raise ValueError(f"{name}[{i}] must be a contiguous {dtype} tensor with one entry per index on {device}")
        step = state.steps[i]
        if step.dtype != torch.float32 or step.numel() != 1 or step.device != device:
            raise ValueError(f"steps[{i}] must be a one-element float32 tensor on {device}")


def _check_indices(idx: torch.Tensor, i: int, device: torch.device) -> int:
    if idx.dim() != 1 or not idx.is_contiguous() or idx.device != device or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices[{i}] must be a contiguous 1-D int32 or int64 tensor on {device}")
    return idx.numel()


def _check_positions(state: LeanState, i: int, p: torch.Tensor, device: torch.device) -> int:
    low, off = state.indices_low[i], state.window_offsets[i]
    if low.dtype != torch.int16 or low.dim() != 1 or not low.is_contiguous() or low.device != device:
        raise ValueError(f"indices_low[{i}] must be a contiguous 1-D int16 tensor on {device}, got {low.dtype} "
                         f"{tuple(low.shape)}")
    windows = -(-p.numel() >> LEAN_WINDOW_BITS)
    if off.dtype != torch.int32 or off.shape != (windows + 1,) or not off.is_contiguous() or off.device != device:
        raise ValueError(f"window_offsets[{i}] must be a contiguous int32 tensor of shape ({windows + 1},) on {device} "
                         f"for a param of {p.numel()} elements, got {off.dtype} {tuple(off.shape)}")
    return low.numel()


def _state_dtypes(state: ExactState | LeanState, w_dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    if isinstance(state, LeanState):
        moments = [("exp_avgs", torch.bfloat16), ("exp_avg_sqs", torch.bfloat16)]
        return moments + ([("residuals", torch.int8)] if state.residuals else [])
    exact = [("exp_avgs", torch.float32), ("exp_avg_sqs", torch.float32), ("deltas", torch.float32)]
    return exact + ([("bases", w_dtype)] if state.bases else [])
