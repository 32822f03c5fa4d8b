"""Every op defined in sift/_ops/ (schema and fake kernel there, CPU kernel in C++) traces
under torch.compile with fullgraph=True and gives the eager result, mutations included; the
step's named operands give the flat call's result; one check names a bad operand the same
way on every backend."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import exact_step_lists, lean_step_lists, requires_cpp
from sift import _ops
from sift.triton_kernels._step_args import AdamWHyper, ExactState, LeanState

pytestmark = requires_cpp

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, maximize=False)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _assert_lists_equal(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    for j, (gl, wl) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(gl, wl)):
            assert torch.equal(g, w), f"list {j}, tensor {i}"


@pytest.mark.parametrize("op, make", [pytest.param("sparse_adamw_", exact_step_lists, id="exact"),
                                      pytest.param("sparse_adamw_lean_", lean_step_lists, id="lean")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_step_ops_compile_with_their_mutations(op, make, dtype):
    eager = make(dtype, seed=1)
    compiled = copy.deepcopy(eager)
    scalars = [*HYPER.values(), False]

    def run(lists):
        getattr(torch.ops.sift, op)(*lists, *scalars)

    _compiled(run)(compiled)
    run(eager)
    _assert_lists_equal(compiled, eager)
    assert not torch.equal(compiled[0][0], make(dtype, seed=1)[0][0]), "the step wrote nothing"


def test_sparse_weight_grad_op_compiles():
    gen = torch.Generator().manual_seed(2)
    dy, x = torch.randn(9, 6, generator=gen), torch.randn(9, 10, generator=gen)
    idx = torch.tensor([0, 7, 13, 59], dtype=torch.int64)
    out = torch.ones(idx.numel())

    def run(dy, x, out):
        torch.ops.sift.sparse_weight_grad_(dy, x, idx, out)
        return out * 2

    got = _compiled(run)(dy, x, out.clone())
    torch.testing.assert_close(got, 2 * (1 + (dy.T @ x).view(-1)[idx]), rtol=1e-5, atol=1e-5)


def _delta_case():
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(50, generator=gen), torch.randn(7, 3, generator=gen).bfloat16()]
    indices = [torch.tensor([1, 5, 9], dtype=torch.int32), torch.tensor([0, 20])]
    return params, indices, [torch.randn(3, generator=gen), torch.randn(2, generator=gen)]


def test_delta_apply_and_restore_compile():
    params, indices, values = _delta_case()
    eager, before = copy.deepcopy(params), copy.deepcopy(params)
    saved, want_saved = _ops.originals_like(params, indices), _ops.originals_like(params, indices)
    _compiled(lambda ps, olds: torch.ops.sift.sparse_delta_apply_(ps, indices, values, 0.5, olds))(params, saved)
    _ops.sparse_delta_apply_ref(eager, indices, values, 0.5, want_saved)
    _assert_lists_equal([params, saved], [eager, want_saved])
    assert not torch.equal(params[0], before[0]), "the apply wrote nothing"
    _compiled(lambda ps, olds: torch.ops.sift.sparse_delta_restore_(ps, indices, olds))(params, saved)
    _assert_lists_equal([params], [before])


@pytest.mark.parametrize("ties", [False, True], ids=["sum", "ties"])
def test_delta_merge_compiles(ties):
    a, b = torch.tensor([1, 5, 9], dtype=torch.int32), torch.tensor([2, 5, 10], dtype=torch.int32)
    va, vb = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])
    merged = _compiled(lambda x, y: torch.ops.sift.merge_sorted_deltas([x, y], [va, vb], [1.0, 0.5], [2], ties))(a, b)
    want = _ops.merge_sorted_deltas_ref([a, b], [va, vb], [1.0, 0.5], [2], ties)
    assert merged[0][0].tolist() == [1, 2, 5, 9, 10]  # a data-dependent length
    _assert_lists_equal([list(merged[0]), list(merged[1])], [want[0], want[1]])


@pytest.mark.parametrize("shape", [(10, 20, 7), (3, 5, 9)], ids=["tall", "wide"])
def test_singular_values_op_compiles(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    got = _compiled(lambda t: torch.ops.sift.singular_values(t) * 2)(x)
    torch.testing.assert_close(got, 2 * _ops.singular_values_ref(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["exact", "lean"])
def test_named_operands_give_the_flat_calls_result(layout):
    make, ref, state_type = ((exact_step_lists, _ops.sparse_adamw_ref, ExactState) if layout == "exact"
                             else (lean_step_lists, _ops.sparse_adamw_lean_ref, LeanState))
    flat, named = make(torch.bfloat16, seed=5), make(torch.bfloat16, seed=5)
    ref(*flat, **HYPER, compact_grads=False)
    ref.structured(state_type.from_lists(*named), AdamWHyper(**HYPER))
    _assert_lists_equal(named, flat)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_step_check_names_the_operand_on_every_backend(backend):
    """Each backend validated the step's operands with its own code and its own words."""
    lists = exact_step_lists(torch.float32, seed=6)
    lists[4][1] = lists[4][1][:-1]
    before = copy.deepcopy(lists)
    _, fn = _ops.resolve("sparse_adamw_", "cpu", backend)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[1\] must be a contiguous torch.float32 tensor with one entry"):
        fn(*lists, **HYPER, compact_grads=False)
    _assert_lists_equal(lists, before)


@pytest.mark.parametrize("op, make, ref", [
    pytest.param("sparse_adamw_", exact_step_lists, _ops.sparse_adamw_ref, id="exact"),
    pytest.param("sparse_adamw_lean_", lean_step_lists, _ops.sparse_adamw_lean_ref, id="lean")])
def test_device_kernel_of_a_step_op_runs_the_registry_entry(op, make, ref, monkeypatch):
    """The CUDA kernel of torch.ops.sift.<step> maps the schema's flat arguments onto the registry's entry
    (run here on CPU tensors with the Triton entry forced, under TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("SIFT_BACKEND", "triton")
    got, want = make(torch.float32, seed=7), make(torch.float32, seed=7)
    state_type = ExactState if op == "sparse_adamw_" else LeanState
    _ops._step_on_device(op, state_type)(*got, *HYPER.values(), False, "auto")
    ref(*want, **HYPER, compact_grads=False)
    for j, (gl, wl) in enumerate(zip(got, want)):
        for g, w in zip(gl, wl):
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-6, msg=f"list {j}")


def test_mixed_delta_matmul_compiles_with_its_mutation():
    """The served-deltas op in a compiled graph (C++ kernel on CPU) writes y as eager does."""
    gen = torch.Generator().manual_seed(4)
    bank = _ops.DeltaBank.from_rows_and_cols((6, 10), [(torch.tensor([0, 5, 5]), torch.tensor([9, 0, 3]),
                                                        torch.randn(3, generator=gen)),
                                                       (torch.tensor([2]), torch.tensor([2]), torch.tensor([1.5]))])
    x, w = torch.randn(5, 10, generator=gen), torch.randn(6, 10, generator=gen)
    ids = torch.tensor([1, -1, 0, 0, 1], dtype=torch.int32)

    def run(x, ids):
        y = x @ w.T
        torch.ops.sift.mixed_delta_matmul_(y, x, ids, bank.row_ptr, bank.col_indices, bank.values,
                                           bank.max_row_entries)
        return y * 2

    want = run(x, ids)
    got = _compiled(run)(x, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(want, 2 * (x @ w.T)), "the op wrote nothing"
