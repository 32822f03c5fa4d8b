"""The `singular_values` op (HiFi's head importance): batched singular values, its reference and
the Gram + eigenvalue routes of the faster backends."""

from __future__ import annotations

import math

import torch

from sift._ops.registry import call, define, define_schema, register


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
