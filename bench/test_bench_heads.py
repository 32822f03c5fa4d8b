"""Batched singular values (HiFi's head scores): sift's kernels against torch.

The batches (`sv_shape`, parametrized in conftest.py) and the compared routes are those of
`python -m sift.bench heads` (`sift.bench.heads`): the active sift backend (and on CPU the
plain-torch one), `torch.linalg.svdvals`, and fp64 Gram + `eigvalsh`. On CUDA the two torch
baselines solve one matrix at a time and run on the first `GPU_BASELINE_MATRICES` only.
"""

from __future__ import annotations

import pytest

from sift.bench import heads

ROUTES = [
    pytest.param("sift.heads.singular_values", "active", id="sift"),
    pytest.param("sift.heads.singular_values", "torch", id="sift-torch_backend"),
    pytest.param("torch.linalg.svdvals", "torch", id="svdvals"),
    pytest.param("fp64 Gram + eigvalsh", "torch", id="gram_eigvalsh"),
]


@pytest.mark.parametrize(("method", "backend"), ROUTES)
def test_singular_values(measure, device, sv_shape, method, backend):
    """Singular values of every matrix of the batch (or of the timed part, see `matrices`)."""
    n, s, d = sv_shape
    routes = heads.singular_value_routes(heads.singular_value_workload(n, s, d, device))
    active = routes[0].backend
    want = active if backend == "active" else backend
    if method == "sift.heads.singular_values" and backend != "active" and want == active:
        pytest.skip(f"the {want} backend is the active one here (case 'sift')")
    route = next((r for r in routes if r.method == method and r.backend == want), None)
    if route is None:
        pytest.skip(f"{method} on the {want} backend is not compared on {device.type}")
    route.fn(route.x[:2])  # compiles the Triton kernel / initialises cuSOLVER outside the timing
    measure(lambda: route.fn(route.x), group=f"singular_values {n} x {s}x{d} {device.type}",
            workload=f"{n} x {s}x{d} fp32", method=method, backend=want, matrices=route.x.shape[0])
