"""The L2 fetch granularity of a CUDA context (`CU_LIMIT_MAX_L2_FETCH_GRANULARITY`).

On a miss, the L2 cache of NVIDIA GPUs may fetch more than the 32-byte sector a load asked
for (sector promotion to 64 or 128 bytes). For streaming kernels that is free prefetch; for
the random gathers and scatters of a sparse step at low density it moves bytes nobody reads.
The driver takes an upper bound on the fetch size per context, as a hint it may clamp or
ignore. Only the benchmarks set it (`python -m sift.bench adamw`, `bench/gpu_sector_ceiling.py`,
`bench/adamw_gpu_sweep.py`; `python -m sift.env` reads it): it changes a process-wide setting,
so the optimizer never touches it on its own.

The driver API is reached through ctypes (`libcuda.so.1`, present wherever CUDA runs), on the
primary context that torch uses for the device.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_CU_LIMIT_MAX_L2_FETCH_GRANULARITY = 0x05
_MAX_BYTES = 128


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # pragma: no cover - only without a driver
        raise RuntimeError(f"the CUDA driver library libcuda.so.1 could not be loaded: {e}") from None
    lib.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    lib.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise RuntimeError("the L2 fetch granularity needs a CUDA device; none is available")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(name.value or b'?').decode()})")


def get_l2_fetch_granularity(device: torch.device | str | int | None = None) -> int:
    """The context's current upper bound on the L2 fetch size, in bytes (0-128)."""
    dev = _cuda_device(device)
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)  # makes torch's primary context current on this thread
        value = ctypes.c_size_t()
        _check(_libcuda().cuCtxGetLimit(ctypes.byref(value), _CU_LIMIT_MAX_L2_FETCH_GRANULARITY),
               "cuCtxGetLimit(MAX_L2_FETCH_GRANULARITY)")
        return int(value.value)


def set_l2_fetch_granularity(nbytes: int, device: torch.device | str | int | None = None) -> int:
    """Set the context's L2 fetch-size bound (a hint the driver may clamp); returns the old one.

    Args:
        nbytes: 0 to 128 bytes; 32 asks for sector-sized fetches.
        device: a CUDA device; None is the current one.

    Example:
        >>> old = set_l2_fetch_granularity(32)   # doctest: +SKIP
        >>> set_l2_fetch_granularity(old)        # doctest: +SKIP
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= _MAX_BYTES:
        raise ValueError(f"nbytes must be an int in [0, {_MAX_BYTES}], got {nbytes!r}")
    dev = _cuda_device(device)
    old = get_l2_fetch_granularity(dev)
    with torch.cuda.device(dev):
        _check(_libcuda().cuCtxSetLimit(_CU_LIMIT_MAX_L2_FETCH_GRANULARITY, nbytes),
               "cuCtxSetLimit(MAX_L2_FETCH_GRANULARITY)")
    return old


def l2_fetch_granularity_unavailable(device: torch.device | str | int | None = None) -> str | None:
    """Why the bound cannot be read here (no CUDA, no driver library, the driver refuses), else None."""
    try:
        get_l2_fetch_granularity(device)
    except (RuntimeError, ValueError, OSError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@contextmanager
def l2_fetch_granularity(nbytes: int | None, device: torch.device | str | int | None = None) -> Iterator[int]:
    """Run a block with the L2 fetch-size bound set to `nbytes` (None: leave it), then restore it.

    Yields:
        the bound the driver reports inside the block (it may clamp the request).
    """
    if nbytes is None:
        yield get_l2_fetch_granularity(device)
        return
    old = set_l2_fetch_granularity(nbytes, device)
    try:
        yield get_l2_fetch_granularity(device)
    finally:
        set_l2_fetch_granularity(old, device)
