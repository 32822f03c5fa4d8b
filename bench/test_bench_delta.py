"""Sparse deltas on the CPU: the k-way merge and the apply, C++ against plain torch.

The workloads and the compared implementations are those of `python -m sift.bench delta`
(`sift.bench.delta`): random sorted deltas in a large index space, merged or added to a
weight in place.
"""

from __future__ import annotations

import pytest
import torch

from sift.bench import delta

MERGES = [
    pytest.param(delta.TORCH_MERGES[0], id="torch-sort"),
    pytest.param(delta.TORCH_MERGES[1], id="torch-unique"),
    pytest.param("sum", id="cpp-sum"),
    pytest.param("ties", id="cpp-ties"),
]
APPLIES = [
    pytest.param("index_add_", id="torch-index_add_"),
    pytest.param("cpp", id="cpp"),
    pytest.param("cpp+save", id="cpp-save_originals"),
]


@pytest.fixture(scope="module")
def merge_inputs(quick):
    k, n, space = delta.workload_sizes(quick)
    return delta.merge_workload(k, n, space, torch.Generator().manual_seed(0)), f"{k} x {n} entries in {space}"


@pytest.mark.parametrize("route", MERGES)
def test_merge(measure, cpp_extension, merge_inputs, route):
    """k deltas merged into one sorted list (sum, or the TIES sign election)."""
    (indices, values), workload = merge_inputs
    fn = delta.merge_routes(indices, values)[route]
    measure(fn, group=f"merge_sorted_deltas {workload}", workload=workload, implementation=route)


@pytest.mark.parametrize("route", APPLIES)
def test_apply(measure, cpp_extension, quick, route):
    """One delta added in place to a weight (the C++ scatter-add, alone or saving the originals)."""
    _, n, space = delta.workload_sizes(quick)
    idx, val, weight = delta.apply_workload(n, space, torch.Generator().manual_seed(0))
    workload = f"{n} entries into {space}"
    measure(delta.apply_routes(idx, val, weight)[route], group=f"sparse_delta_apply_ {workload}", workload=workload,
            implementation=route)
