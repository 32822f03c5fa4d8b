"""Where Triton serves an op (CUDA tensors), torch.compile's functionalized graph holds the op's
Triton kernel launches (`triton_kernel_wrapper_functional` nodes), not an opaque call. The step
kernels, which eagerly reach all tensors through a table of addresses, are recorded as DIRECT
launches (one per tensor, operands as arguments), which must compute what the table launch does.

No GPU is needed to trace: a subprocess without the interpreter (whose kernels torch does not
wrap) traces with fake CUDA tensors, and each launch is checked for the kernel, the graph
inputs it reads and writes and its scalars. The DIRECT launches run under the interpreter. On a
GPU, the `gpu` test compiles with Inductor and compares with the eager result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import exact_step_lists, lean_step_lists, requires_triton

pytestmark = requires_triton

SCRIPT = r'''
import json
import torch
import sift  # noqa: F401  (defines torch.ops.sift)
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx

mode = FakeTensorMode()


def cuda(*shape, dtype=torch.float32):
    with mode:
        return torch.empty(*shape, dtype=dtype, device="cuda")


def nodes(fn, *args):
    """The graph's calls in order: a launch as {kernel, grid, inputs, scalars}, any other op by name."""
    gm = make_fx(dispatch_functionalize(fn), tracing_mode="fake")(*args)
    placeholders = {n.name: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    out = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kwargs = node.kwargs["kwargs"]
            out.append({
                "kernel": kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__,
                "grid": [list(g) for g in node.kwargs["grid"]],
                # Which graph inputs (by position) reach the kernel, through views or directly.
                "inputs": {k: _source(v, placeholders) for k, v in kwargs.items() if isinstance(v, torch.fx.Node)},
                "scalars": {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float))},
            })
        elif "auto_functionalized" in str(node.target):  # a mutating op kept whole
            out.append({"op": str(node.args[0])})
        elif str(node.target).startswith("sift."):
            out.append({"op": str(node.target)})
    return out


def _source(node, placeholders):
    while node.name not in placeholders and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return placeholders.get(node.name)


def weight_grad(dy, x, idx, out):
    torch.ops.sift.sparse_weight_grad_(dy, x, idx, out)
    return out * 2


def apply(w0, w1, i0, i1, v0, v1, o0, o1):
    torch.ops.sift.sparse_delta_apply_([w0, w1], [i0, i1], [v0, v1], 0.5, [o0, o1])


def restore(w0, w1, i0, i1, o0, o1):
    torch.ops.sift.sparse_delta_restore_([w0, w1], [i0, i1], [o0, o1])


def mixed(y, x, ids, row_ptr, col, val):
    torch.ops.sift.mixed_delta_matmul_(y, x, ids, row_ptr, col, val, 3)
    return y * 2


HYPER = (1e-3, 0.9, 0.999, 1e-8, 0.0, False)


def step(p0, p1, g0, g1, i0, i1, m0, m1, v0, v1, d0, d1, b0, b1, s0, s1):
    torch.ops.sift.sparse_adamw_([p0, p1], [g0, g1], [i0, i1], [m0, m1], [v0, v1], [d0, d1], [b0, b1], [s0, s1],
                                 *HYPER, True)


def lean_step(p, g, low, off, m, v, r, s):
    torch.ops.sift.sparse_adamw_lean_([p], [g], [low], [off], [m], [v], [r], [s], *HYPER, False)


found = {
    "weight_grad": nodes(weight_grad, cuda(9, 6), cuda(9, 10), cuda(4, dtype=torch.int64), cuda(4)),
    "apply": nodes(apply, cuda(50), cuda(7, 3, dtype=torch.bfloat16), cuda(3, dtype=torch.int32),
                   cuda(2, dtype=torch.int64), cuda(3), cuda(2), cuda(3), cuda(2, dtype=torch.bfloat16)),
    "restore": nodes(restore, cuda(50), cuda(21), cuda(3, dtype=torch.int32), cuda(2, dtype=torch.int32),
                     cuda(3), cuda(2)),
    "mixed_delta": nodes(mixed, cuda(9, 70, dtype=torch.bfloat16), cuda(9, 33, dtype=torch.bfloat16),
                         cuda(9, dtype=torch.int32), cuda(2, 71, dtype=torch.int64), cuda(40, dtype=torch.int32),
                         cuda(40)),
    "singular_values": nodes(lambda x: torch.ops.sift.singular_values(x), cuda(6, 20, 7)),
    "singular_values_large": nodes(lambda x: torch.ops.sift.singular_values(x), cuda(2, 300, 200)),
    "step": nodes(step, cuda(100, dtype=torch.bfloat16), cuda(30, dtype=torch.bfloat16), cuda(5), cuda(3),
                  cuda(5, dtype=torch.int64), cuda(3, dtype=torch.int64), *(cuda(n) for n in (5, 3, 5, 3, 5, 3)),
                  cuda(5, dtype=torch.bfloat16), cuda(3, dtype=torch.bfloat16), cuda(1), cuda(1)),
    "lean_step": nodes(lean_step, cuda(70000, dtype=torch.bfloat16), cuda(70000, dtype=torch.bfloat16),
                       cuda(9, dtype=torch.int16), cuda(3, dtype=torch.int32), cuda(9, dtype=torch.bfloat16),
                       cuda(9, dtype=torch.bfloat16), cuda(9, dtype=torch.int8), cuda(1)),
}
from sift.env import report  # noqa: E402

found["env"] = [line.strip() for line in report().splitlines() if "torch.compile" in line]
print(json.dumps(found))
'''


@pytest.fixture(scope="module")
def traced() -> dict:
    # The recorded launches need compiled kernels: torch does not wrap the interpreter's.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SIFT_BACKEND")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_env_report_says_whether_launches_are_recorded(traced, monkeypatch):
    from sift.env import report

    # Without a CUDA device the report does not describe CUDA's behaviour as this machine's.
    expected = ("Triton launches recorded in graphs (CUDA)" if torch.cuda.is_available() else
                "each op one graph node (no CUDA device: the C++ CPU kernels, opaque to Inductor)")
    assert traced["env"] == [f"torch.compile: {expected}"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter's kernels, which torch does not wrap
    assert "torch.compile: Triton ops stay opaque in graphs: TRITON_INTERPRET=1" in report()


def test_sparse_weight_grad_records_its_kernel(traced):
    (launch,) = traced["weight_grad"]
    assert launch["kernel"] == "_sparse_weight_grad_kernel"
    assert launch["inputs"] == {"dy_ptr": 0, "x_ptr": 1, "idx_ptr": 2, "out_ptr": 3}
    assert launch["scalars"]["T"] == 9 and launch["scalars"]["C"] == 10 and launch["scalars"]["k"] == 4
    assert launch["grid"] == [[1, 1, 1]]


def test_mixed_delta_matmul_records_its_kernel(traced):
    (launch,) = traced["mixed_delta"]
    assert launch["kernel"] == "_mixed_delta_matmul_kernel"
    assert launch["inputs"] == {"y_ptr": 0, "x_ptr": 1, "ids_ptr": 2, "row_ptr_ptr": 3, "col_ptr": 4, "val_ptr": 5}
    assert (launch["scalars"]["T"], launch["scalars"]["R"], launch["scalars"]["max_row_entries"]) == (9, 70, 3)
    assert launch["scalars"]["IS_BF16"] is True
    assert launch["grid"] == [[1, 2, 1]]


def test_delta_apply_and_restore_record_one_launch_per_tensor(traced):
    apply = traced["apply"]
    assert [n["kernel"] for n in apply] == ["_sparse_delta_apply_kernel"] * 2
    assert [n["inputs"] for n in apply] == [{"w_ptr": 0, "idx_ptr": 2, "val_ptr": 4, "saved_ptr": 6},
                                            {"w_ptr": 1, "idx_ptr": 3, "val_ptr": 5, "saved_ptr": 7}]
    assert [(n["scalars"]["k"], n["scalars"]["SAVE"], n["scalars"]["IS_BF16"]) for n in apply] == [
        (3, True, False), (2, True, True)]
    assert [n["scalars"]["scale"] for n in apply] == [0.5, 0.5]
    restore = traced["restore"]
    assert [n["kernel"] for n in restore] == ["_sparse_delta_restore_kernel"] * 2
    assert [n["inputs"] for n in restore] == [{"w_ptr": 0, "idx_ptr": 2, "saved_ptr": 4},
                                              {"w_ptr": 1, "idx_ptr": 3, "saved_ptr": 5}]


def test_singular_values_records_its_kernel_up_to_its_size_limit(traced):
    (launch,) = traced["singular_values"]
    assert launch["kernel"] == "_gram_tridiag_singular_values_kernel"
    assert launch["grid"] == [[6, 1, 1]] and launch["inputs"]["x_ptr"] == 0
    # min(S, D) = 200 is beyond the kernel: the op stays whole (its eager path uses LAPACK).
    assert traced["singular_values_large"] == [{"op": "sift.singular_values.default"}]


def test_step_ops_record_one_direct_launch_per_tensor(traced):
    step = traced["step"]
    assert [n["kernel"] for n in step] == ["_sparse_adamw_kernel"] * 2
    # Operands by graph input: p0 p1 g0 g1 i0 i1 m0 m1 v0 v1 d0 d1 b0 b1 s0 s1 (compact grads).
    assert [n["inputs"] for n in step] == [
        {f"{name}_arg": 2 * j + t for j, name in enumerate(("w", "g", "i", "m", "v", "d", "b", "step"))}
        for t in (0, 1)]
    assert [(n["scalars"]["k"], n["scalars"]["DIRECT"], n["scalars"]["COMPACT_GRAD"]) for n in step] == [
        (5, True, True), (3, True, True)]
    assert [n["grid"] for n in step] == [[[1, 1, 1]], [[1, 1, 1]]]
    (lean,) = traced["lean_step"]
    assert lean["kernel"] == "_sparse_adamw_lean_kernel"
    assert lean["inputs"] == {"w_arg": 0, "g_arg": 1, "low_arg": 2, "off_arg": 3, "m_arg": 4, "v_arg": 5,
                              "r_arg": 6, "step_arg": 7}
    assert (lean["scalars"]["windows"], lean["scalars"]["search_steps_arg"], lean["scalars"]["k"]) == (2, 1, 9)


@pytest.mark.parametrize("lr_on_device", [False, True], ids=["lr-float", "lr-tensor"])
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grads", "compact-grads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["exact", "lean"])
def test_direct_step_launches_compute_what_the_table_launch_does(layout, dtype, compact, lr_on_device):
    from sift.triton_kernels import _launch
    from sift.triton_kernels.sparse_adamw import sparse_adamw_
    from sift.triton_kernels.sparse_adamw_lean import sparse_adamw_lean_

    make, launcher = (exact_step_lists, sparse_adamw_) if layout == "exact" else (lean_step_lists, sparse_adamw_lean_)
    table, direct, before = (make(dtype, 7, compact) for _ in range(3))
    lr = torch.tensor([2e-3]) if lr_on_device else 2e-3
    hyper = dict(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, maximize=True, compact_grads=compact)
    launcher(*table, **hyper)
    with _launch.recording():  # the interpreter's kernels are launched as they are, DIRECT
        launcher(*direct, **hyper)
    for j, (got_list, want_list) in enumerate(zip(direct, table)):
        for i, (got, want) in enumerate(zip(got_list, want_list)):
            assert torch.equal(got, want), f"list {j}, tensor {i}"
    assert not torch.equal(direct[0][0], before[0][0]), "the step wrote nothing"


@pytest.mark.gpu
def test_inductor_runs_the_recorded_kernels_as_eager():
    from sift import _ops

    gen = torch.Generator().manual_seed(0)
    dy, x = torch.randn(300, 64, generator=gen).cuda(), torch.randn(300, 96, generator=gen).cuda()
    idx = torch.randperm(64 * 96, generator=gen)[:500].sort().values.cuda()
    params = [torch.randn(4000, generator=gen).cuda(), torch.randn(40, 50, generator=gen).bfloat16().cuda()]
    indices = [torch.randperm(p.numel(), generator=gen)[:300].sort().values.cuda() for p in params]
    values = [torch.randn(300, generator=gen).cuda() for _ in params]

    state = [[t.cuda() for t in lst] for lst in exact_step_lists(torch.bfloat16, 8, compact=True)]

    def run(dy, x, params, originals, state):
        out = torch.zeros(idx.numel(), device=dy.device)
        torch.ops.sift.sparse_weight_grad_(dy, x, idx, out)
        torch.ops.sift.sparse_delta_apply_(params, indices, values, 0.5, originals)
        torch.ops.sift.sparse_adamw_(*state, 1e-3, 0.9, 0.999, 1e-8, 0.01, False, True)
        return out, torch.ops.sift.singular_values(x.view(3, 100, 96))

    def copies():
        return ([p.clone() for p in params], _ops.originals_like(params, indices),
                [[t.clone() for t in lst] for lst in state])

    eager, compiled = copies(), copies()
    want = run(dy, x, *eager)
    torch._dynamo.reset()
    got = torch.compile(run, fullgraph=True)(dy, x, *compiled)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # The step: DIRECT launches compiled, the table launch eager; the same arithmetic.
    for g, w in zip(compiled[0] + compiled[1] + sum(compiled[2], []), eager[0] + eager[1] + sum(eager[2], [])):
        assert torch.equal(g, w)
