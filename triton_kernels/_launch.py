"""Kernel launches that torch.compile can record.

A launcher writes `launchable(kernel)[grid](...)`. Called eagerly, that is the kernel itself.
Inside `recording()` (entered by `sift._ops` when torch.compile traces an op whose tensors
the Triton backend serves) it is `torch.library.wrap_triton(kernel)`, so the traced graph
holds the kernel launch itself, which Inductor compiles and schedules like its own kernels,
instead of one opaque call. Eager launches never pay for the tracing wrapper.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

_recording = contextvars.ContextVar("sift_triton_recording", default=False)


def record_unavailable_reason() -> str | None:
    """Why launches cannot be recorded into torch.compile graphs (the ops then stay opaque), or None."""
    if not hasattr(torch.library, "wrap_triton"):
        return f"torch {torch.__version__} has no torch.library.wrap_triton (torch >= 2.6 has)"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "TRITON_INTERPRET=1: torch does not wrap the interpreter's kernels"
    return None


def can_record() -> bool:
    """Whether launches can be recorded (see `record_unavailable_reason`)."""
    return record_unavailable_reason() is None


def is_recording() -> bool:
    """Whether launches are being recorded into a torch.compile trace."""
    return _recording.get()


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Launch through `torch.library.wrap_triton` inside this block."""
    token = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(token)


def launchable(kernel):
    """`kernel`, or while recording its `torch.library.wrap_triton` wrapper (same call syntax)."""
    return torch.library.wrap_triton(kernel) if _recording.get() else kernel
