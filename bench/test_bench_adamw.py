"""The fused SparseAdamW step (`sparse_adamw_`) per backend against torch's fused AdamW.

One group per dtype and density holds torch's fused AdamW and every sparse variant, timed on
the weights and fixed gradients of `python -m sift.bench adamw` (`sift.bench.adamw`): only
`optimizer.step()`, after selection and state allocation.
"""

from __future__ import annotations

import pytest
import torch

from sift.bench import adamw

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
DENSITIES = [pytest.param(d, id=f"{100 * d:g}%") for d in adamw.DENSITIES]
# (backend, captured in a CUDA graph, state layout)
SPARSE_VARIANTS = [
    pytest.param("cpp", False, "exact", id="cpp"),
    pytest.param("cpp", False, "lean", id="cpp-lean"),
    pytest.param("triton", False, "exact", id="triton"),
    pytest.param("triton", True, "exact", id="triton-cuda_graph"),
    pytest.param("triton", False, "lean", id="triton-lean"),
    pytest.param("torch", False, "exact", id="torch"),
]


def _group(dtype: torch.dtype, density: float, device: torch.device) -> str:
    return f"sparse_adamw_ {str(dtype).removeprefix('torch.')} {100 * density:g}% {device.type}"


def _params(device: torch.device, dtype: torch.dtype, quick: bool) -> tuple[list[torch.nn.Parameter], str]:
    shapes = adamw.workload_shapes(device, quick)
    workload = f"{len(shapes)} x {shapes[0][0]}x{shapes[0][1]} {str(dtype).removeprefix('torch.')}"
    return adamw.make_params(shapes, dtype, device), workload


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_adamw(measure, device, quick, dtype, density):
    """torch.optim.AdamW(fused=True) on the same weights: the yardstick of each group."""
    params, workload = _params(device, dtype, quick)
    opt = adamw.dense_adamw(params, "fused")
    measure(opt.step, group=_group(dtype, density, device), workload=workload, optimizer="AdamW(fused)")


@pytest.mark.parametrize(("backend", "graphed", "layout"), SPARSE_VARIANTS)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_adamw(measure, device, quick, dtype, density, backend, graphed, layout):
    """SparseAdamW.step() on one backend: one fused `sparse_adamw_` (or, lean, `sparse_adamw_lean_`)
    call for all weights."""
    if backend not in adamw.sparse_backends(device):
        pytest.skip(f"backend {backend!r} does not run on {device.type} here")
    if graphed and device.type != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    params, workload = _params(device, dtype, quick)
    opt = adamw.sparse_adamw(params, density, backend, state=layout)
    step = adamw.graphed(opt.step, device) if graphed else opt.step
    measure(step, group=_group(dtype, density, device), workload=workload, optimizer="SparseAdamW",
            backend=backend, cuda_graph=graphed, state=layout,
            state_bytes_per_entry=opt.state_bytes()["bytes_per_entry"])
