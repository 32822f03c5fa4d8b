"""Where Triton serves an op (CUDA tensors), torch.compile's functionalized graph holds the op's
Triton kernel launches (`triton_kernel_wrapper_functional` nodes), not an opaque call; the step
ops, whose kernels reach the tensors through a table of addresses, stay one node.

No GPU is needed to trace: a subprocess without the interpreter (whose kernels torch does not
wrap) traces with fake CUDA tensors, and each launch is checked for the kernel, the graph
inputs it writes and its scalars. On a GPU, the `gpu` test compiles with Inductor and compares
with the eager result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import requires_triton

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
    """The graph's calls in order: a launch as {kernel, writes, scalars}, any other op by name."""
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


def step(p, g, i, m, v, d, s):
    torch.ops.sift.sparse_adamw_([p], [g], [i], [m], [v], [d], [], [s], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)


found = {
    "weight_grad": nodes(weight_grad, cuda(9, 6), cuda(9, 10), cuda(4, dtype=torch.int64), cuda(4)),
    "apply": nodes(apply, cuda(50), cuda(7, 3, dtype=torch.bfloat16), cuda(3, dtype=torch.int32),
                   cuda(2, dtype=torch.int64), cuda(3), cuda(2), cuda(3), cuda(2, dtype=torch.bfloat16)),
    "restore": nodes(restore, cuda(50), cuda(21), cuda(3, dtype=torch.int32), cuda(2, dtype=torch.int32),
                     cuda(3), cuda(2)),
    "singular_values": nodes(lambda x: torch.ops.sift.singular_values(x), cuda(6, 20, 7)),
    "singular_values_large": nodes(lambda x: torch.ops.sift.singular_values(x), cuda(2, 300, 200)),
    "step": nodes(step, cuda(100), cuda(100), cuda(5, dtype=torch.int32), cuda(5), cuda(5), cuda(5), cuda(1)),
}
print(json.dumps(found))
'''


@pytest.fixture(scope="module")
def traced() -> dict:
    # The recorded launches need compiled kernels: torch does not wrap the interpreter's.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SIFT_BACKEND")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sparse_weight_grad_records_its_kernel(traced):
    (launch,) = traced["weight_grad"]
    assert launch["kernel"] == "_sparse_weight_grad_kernel"
    assert launch["inputs"] == {"dy_ptr": 0, "x_ptr": 1, "idx_ptr": 2, "out_ptr": 3}
    assert launch["scalars"]["T"] == 9 and launch["scalars"]["C"] == 10 and launch["scalars"]["k"] == 4
    assert launch["grid"] == [[1, 1, 1]]


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


def test_step_ops_stay_one_node(traced):
    assert traced["step"] == [{"op": "sift.sparse_adamw_.default"}]


@pytest.mark.gpu
def test_inductor_runs_the_recorded_kernels_as_eager():
    from sift import _ops

    gen = torch.Generator().manual_seed(0)
    dy, x = torch.randn(300, 64, generator=gen).cuda(), torch.randn(300, 96, generator=gen).cuda()
    idx = torch.randperm(64 * 96, generator=gen)[:500].sort().values.cuda()
    params = [torch.randn(4000, generator=gen).cuda(), torch.randn(40, 50, generator=gen).bfloat16().cuda()]
    indices = [torch.randperm(p.numel(), generator=gen)[:300].sort().values.cuda() for p in params]
    values = [torch.randn(300, generator=gen).cuda() for _ in params]

    def run(dy, x, params, originals):
        out = torch.zeros(idx.numel(), device=dy.device)
        torch.ops.sift.sparse_weight_grad_(dy, x, idx, out)
        torch.ops.sift.sparse_delta_apply_(params, indices, values, 0.5, originals)
        return out, torch.ops.sift.singular_values(x.view(3, 100, 96))

    eager_params, compiled_params = [p.clone() for p in params], [p.clone() for p in params]
    eager_saved, compiled_saved = _ops.originals_like(params, indices), _ops.originals_like(params, indices)
    want = run(dy, x, eager_params, eager_saved)
    torch._dynamo.reset()
    got = torch.compile(run, fullgraph=True)(dy, x, compiled_params, compiled_saved)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for g, w in zip(compiled_params + compiled_saved, eager_params + eager_saved):
        assert torch.equal(g, w)
