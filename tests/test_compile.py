"""The C++ ops trace under torch.compile: each has a shape-only (fake) kernel, and a compiled
call (aot_eager: FakeTensor tracing and functionalisation, no code generation) gives the
eager result, mutations included."""

from __future__ import annotations

import pytest
import torch

from conftest import cpp_available, requires_cpp

pytestmark = requires_cpp


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def test_singular_values_compiles():
    x = torch.randn(10, 20, 7, generator=torch.Generator().manual_seed(0))
    got = _compile(lambda t: torch.ops.sift.singular_values(t) * 2)(x)
    torch.testing.assert_close(got, 2 * torch.ops.sift.singular_values(x), rtol=0, atol=0)


def test_sparse_adamw_step_compiles_with_its_mutations():
    g = torch.Generator().manual_seed(1)
    w, grad = torch.randn(100, generator=g), torch.randn(100, generator=g)
    idx = torch.arange(3, 100, 7, dtype=torch.int32)
    m, v, d = (torch.zeros(idx.numel()) for _ in range(3))
    ref = [t.clone() for t in (w, m, v, d)]
    step = torch.ones(())

    def run(w, m, v, d):
        torch.ops.sift.sparse_adamw_([w], [grad], [idx], [m], [v], [d], [], [step], 1e-2, 0.9, 0.999, 1e-8, 0.01,
                                     False, False)

    _compile(run)(w, m, v, d)
    run(*ref)
    for got, want in zip((w, m, v, d), ref):
        assert torch.equal(got, want)
    assert not torch.equal(w[idx.long()], torch.zeros(idx.numel()))


def test_delta_restore_and_merge_compile():
    p = torch.randn(50, generator=torch.Generator().manual_seed(2))
    ix = torch.tensor([1, 5, 9], dtype=torch.int32)
    original = p[ix.long()].clone()
    p[ix.long()] += 1
    _compile(lambda t: torch.ops.sift.sparse_delta_restore_([t], [ix], [original]))(p)
    assert torch.equal(p[ix.long()], original)

    a, b = torch.tensor([1, 5, 9], dtype=torch.int32), torch.tensor([2, 5, 10], dtype=torch.int32)
    va, vb = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])
    merged_idx, merged_val = _compile(
        lambda x, y: torch.ops.sift.merge_sorted_deltas([x, y], [va, vb], [1.0, 1.0], [2], False))(a, b)
    assert merged_idx[0].tolist() == [1, 2, 5, 9, 10]  # a data-dependent length
    assert merged_val[0].tolist() == [1.0, 10.0, 22.0, 3.0, 30.0]
