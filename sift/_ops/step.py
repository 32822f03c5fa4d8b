"""What the optimizer-step ops share: their schema, their CUDA, C++ and Triton entries, and the
fp32 gradient and bias corrections their references compute (`sparse_adamw_`, `sparse_adamw_lean_`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sift._ops.registry import _no_output, call, define, define_schema, register
from sift.triton_kernels._step_args import AdamWHyper, ExactState, LeanState, check_step, takes_step_lists


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
