"""The machine-limit probe of `python -m sift.bench adamw`: `bench/adamw_probe.cpp`, compiled here.

The probe is the sparse step's access pattern and nothing else (gather the gradient and the
weight at k sorted positions, update fp32 moments and the weight with AdamW's math, scatter the
weight), one plain loop built with `-O3 -march=native -fopenmp` and run on torch's thread count,
in three forms: the loop alone, and the loop with software prefetch at the exact step's distance
(32 entries ahead) and at the lean step's (64): the sorted indices are known ahead, which no
hardware prefetcher follows. The suite times SparseAdamW's step against all three on the same
weights, gradients and indices, in turn, and reports the step's speed as a share of the fastest
one's: the limit is the best that loop does, with or without the hint, at either distance.

It is compiled with the system compiler into a small shared library under the cache folder
(`<cache>/adamw-probe/`, about a second, once per source and compiler) and loaded with ctypes;
its OpenMP calls resolve to the libgomp torch has already loaded. The source lives in the
checkout's `bench/`, so an installed wheel reports the probe unavailable.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence

import torch

from sift._host import cache_root

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
# Weight dtypes the probe's loop handles (its `bf16` switch).
DTYPES = (torch.float32, torch.bfloat16)


def source_path() -> str | None:
    """`bench/adamw_probe.cpp` of the checkout this package runs from, or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "..", "bench", "adamw_probe.cpp"))
    return path if os.path.isfile(path) else None


def build() -> str:
    """Compile the probe (once per source, flags and compiler) and return the library's path.

    Raises:
        RuntimeError: no source, no compiler, or the compiler failed (its message).
    """
    src = source_path()
    if src is None:
        raise RuntimeError("bench/adamw_probe.cpp not found (the probe runs from a source checkout)")
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler on PATH ($CXX, else c++)")
    with open(src, "rb") as f:
        digest = hashlib.sha1(f.read())
    digest.update(" ".join((cxx, *FLAGS)).encode())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update(version.encode())
    out_dir = os.path.join(cache_root(), "adamw-probe")
    lib = os.path.join(out_dir, f"adamw_probe-{digest.hexdigest()[:16]}.so")
    if not os.path.exists(lib):
        os.makedirs(out_dir, exist_ok=True)
        tmp = f"{lib}.{os.getpid()}.tmp"
        done = subprocess.run([cxx, *FLAGS, src, "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"compiling the probe failed: {(done.stderr or done.stdout).strip()[:500]}")
        os.replace(tmp, lib)
    return lib


class AdamWProbe:
    """One probe step over fixed tensors, callable like `optimizer.step`.

    Args:
        params: the weights (fp32 or bf16), written at `indices`.
        indices: per weight, [k] sorted flat positions (int32 or int64 below 2**31 elements).
        step: the bias corrections' step count (they only scale the update).
        prefetch: prefetch the gradient's and the weight's lines this many entries ahead (0: no
            prefetch).

    Example:
        >>> probe = AdamWProbe(params, [opt.indices_of(p) for p in params])  # doctest: +SKIP
        >>> probe()  # doctest: +SKIP
    """

    def __init__(self, params: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], step: int = 10,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, prefetch: int = 0) -> None:
        dtype = params[0].dtype
        if dtype not in DTYPES:
            raise RuntimeError(f"the probe runs fp32 and bf16 weights, not {dtype}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch < 2**31:
            raise ValueError(f"prefetch must be a distance in entries, an int >= 0, got {prefetch!r}")
        self._lib = ctypes.CDLL(build())
        self._keep = [list(params), [p.grad for p in params], [i.int().contiguous() for i in indices]]
        self._keep += [[torch.zeros(i.numel()) for i in indices] for _ in range(2)]  # the probe's m and v

        def pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
            return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])

        n = len(params)
        beta1, beta2 = betas
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        f = ctypes.c_float
        self._args = (ctypes.c_int(n), *(pointers(ts) for ts in self._keep),
                      (ctypes.c_int64 * n)(*[i.numel() for i in indices]), ctypes.c_int(int(dtype == torch.bfloat16)),
                      f(lr), f(beta1), f(beta2), f(eps), f(weight_decay), f(lr / bc1), f(bc2**-0.5))
        self._prefetch = ctypes.c_int(int(prefetch))

    @property
    def moments(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The probe's own exp_avg and exp_avg_sq, per weight [k] fp32 (zero before its first call)."""
        return self._keep[3], self._keep[4]

    def __call__(self) -> None:
        self._lib.adamw_probe_step(*self._args, ctypes.c_int(torch.get_num_threads()), self._prefetch)
