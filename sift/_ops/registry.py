"""The op registry and dispatch: each op's name, its reference and per-backend implementations
(`define`, `register`), the one place a backend is chosen (`resolve`, `call`), and the
`torch.ops.sift` library the ops' schemas and fake kernels are defined in (`define_schema`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

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


def define_ordered(name: str, schema: str, impl: Callable) -> None:
    """Define `torch.ops.sift.<name>`, an op returning nothing whose effect its schema cannot state
    (state outside its arguments), with one Python kernel for every device.

    Its ordered effect keeps every call, in order, in a torch.compile graph: a node with no
    outputs and no mutated arguments would otherwise be dropped as dead code. Dynamo never traces
    the kernel: a training step compiled whole runs it from the eager backward, where tracing its
    Python state would only add graphs.
    """
    _LIB.define(schema)
    torch.library.register_fake(f"sift::{name}", _no_output, lib=_LIB)
    _LIB.impl(name, torch.compiler.disable(impl), "CompositeExplicitAutograd")
    from torch._higher_order_ops import effects

    op = getattr(torch.ops.sift, name).default
    if hasattr(torch.library, "_register_effectful_op"):
        torch.library._register_effectful_op(op, effects._EffectType.ORDERED, lib=_LIB)
    else:  # older torch: the effects table itself
        effects.SIDE_EFFECTS[op] = effects._EffectType.ORDERED


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


def _no_output(*args) -> None:
    return None
