"""The sparse weight gradient against the dense product it replaces, on the workloads of
`python -m sift.bench backward` (`sift.bench.backward`): dY and X of one linear layer, k
sorted chosen entries of its weight, accumulation into a compact fp32 buffer."""

from __future__ import annotations

import pytest
import torch

from sift import _ops
from sift.bench import backward


def _cases(quick: bool) -> list[tuple[int, int, int]]:
    shapes, tokens = (backward.QUICK_SHAPES, backward.QUICK_TOKENS) if quick else (backward.SHAPES, backward.TOKENS)
    return [(r, c, t) for r, c in shapes for t in tokens]


@pytest.mark.parametrize("dtype", list(backward.DTYPES))
@pytest.mark.parametrize("density", [pytest.param(d, id=f"{100 * d:g}%") for d in backward.DENSITIES])
def test_sparse_weight_grad(measure, device, quick, dtype, density):
    """k entries of dY^T X, summed straight into the compact buffer (the layer path)."""
    gen = torch.Generator().manual_seed(0)
    for r, c, t in _cases(quick)[:1]:
        dy, x = backward.op_workload(r, c, t, backward.DTYPES[dtype], device, gen)
        idx, out = backward.op_entries(r, c, density, device, gen)
        workload = f"[{r}, {c}] T={t} {dtype}"
        measure(lambda: _ops.sparse_weight_grad(dy, x, idx, out), group=f"weight gradient {workload}",
                workload=workload, implementation=f"sparse {100 * density:g}%")


@pytest.mark.parametrize("dtype", list(backward.DTYPES))
def test_dense_weight_grad(measure, device, quick, dtype):
    """The dense dY^T X the dense backward forms before any entry can be gathered."""
    gen = torch.Generator().manual_seed(0)
    r, c, t = _cases(quick)[0]
    dy, x = backward.op_workload(r, c, t, backward.DTYPES[dtype], device, gen)
    workload = f"[{r}, {c}] T={t} {dtype}"
    measure(lambda: dy.T @ x, group=f"weight gradient {workload}", workload=workload, implementation="dense")
