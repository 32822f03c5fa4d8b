"""sparse_weight_grad: the weight gradient at chosen entries, every backend against an fp64 oracle
`(dY^T X).view(-1)[idx]`, plus autograd of nn.Linear / Conv1D, accumulation, and bad input."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import cpp_available, require_backend
from sift import _ops

BACKENDS = ("torch", "cpp", "triton")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (T, R, C): single token, odd and non-power-of-two sizes, a single row or column.
SHAPES = [(1, 1, 1), (1, 3, 37), (7, 37, 3), (7, 65, 65), (130, 65, 37), (130, 1, 65), (130, 37, 1)]
# fp32 units of the sum of |terms| that any fp32 summation order may lose on top of the rule.
ATOL_UNITS = 8


def _oracle(dy: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return (dy2.double().T @ x2.double()).reshape(-1)[idx.long()]


def _assert_close(got: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> None:
    """Error vs fp64 at most 2x plain torch's same-dtype product's, plus a few fp32 units."""
    assert got.dtype == torch.float32 and got.shape == idx.shape
    if idx.numel() == 0:
        return
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    exact = _oracle(dy, x, idx)
    torch_err = ((dy2.T @ x2).float().reshape(-1)[idx.long()].double() - exact).abs().max()
    magnitude = (dy2.double().abs().T @ x2.double().abs()).reshape(-1)[idx.long()].max()
    atol = ATOL_UNITS * 2.0**-24 * magnitude
    err = (got.double() - exact).abs().max()
    assert err <= 2 * torch_err + atol, f"error {err:.3g} > 2 x torch's {torch_err:.3g} + {atol:.3g}"


def _random_indices(numel: int, k: int, gen: torch.Generator, dtype=torch.int64) -> torch.Tensor:
    return torch.randperm(numel, generator=gen)[:k].sort().values.to(dtype)


def _inputs(t: int, r: int, c: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, r, generator=gen).to(dtype), torch.randn(t, c, generator=gen).to(dtype), gen


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}xR{}xC{}".format(*s))
def test_matches_fp64_oracle(backend, dtype, shape):
    require_backend(backend)
    t, r, c = shape
    dy, x, gen = _inputs(t, r, c, dtype)
    idx = _random_indices(r * c, max(1, r * c // 3), gen)
    got = _ops.sparse_weight_grad(dy, x, idx, backend=backend)
    _assert_close(got, dy, x, idx)


INDEX_SETS = {
    "empty": lambda n: [],
    "first": lambda n: [0],
    "last": lambda n: [n - 1],
    "first-and-last": lambda n: [0, n - 1],
    "all": lambda n: list(range(n)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("which", INDEX_SETS.values(), ids=INDEX_SETS.keys())
def test_index_sets(backend, index_dtype, which):
    require_backend(backend)
    dy, x, _ = _inputs(13, 5, 7, torch.float32, seed=1)
    idx = torch.tensor(which(5 * 7), dtype=index_dtype)
    got = _ops.sparse_weight_grad(dy, x, idx, backend=backend)
    _assert_close(got, dy, x, idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_gives_zeros(backend):
    require_backend(backend)
    dy, x = torch.randn(0, 4), torch.randn(0, 6)
    got = _ops.sparse_weight_grad(dy, x, torch.tensor([0, 5, 23]), backend=backend)
    assert torch.equal(got, torch.zeros(3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_accumulates_into_out(backend, dtype):
    require_backend(backend)
    dy, x, gen = _inputs(33, 9, 11, dtype, seed=2)
    idx = _random_indices(99, 40, gen, torch.int32)
    before = torch.randn(40, generator=gen)
    out = before.clone()
    got = _ops.sparse_weight_grad(dy, x, idx, out, backend=backend)
    assert got is out
    _assert_close(out - before, dy, x, idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_batch_dims_are_tokens(backend):
    require_backend(backend)
    dy, x, gen = _inputs(2 * 3 * 5, 6, 10, torch.float32, seed=3)
    idx = _random_indices(60, 20, gen)
    got = _ops.sparse_weight_grad(dy.view(2, 3, 5, 6), x.view(2, 3, 5, 10), idx, backend=backend)
    _assert_close(got, dy, x, idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    require_backend(backend)
    gen = torch.Generator().manual_seed(4)
    dy = torch.randn(12, 40, generator=gen)[:, ::2]  # [12, 20], feature stride 2
    x = torch.randn(9, 12, generator=gen).T  # [12, 9], token stride 1
    idx = _random_indices(20 * 9, 50, gen)
    got = _ops.sparse_weight_grad(dy, x, idx, backend=backend)
    _assert_close(got, dy, x, idx)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_linear_autograd(backend, dtype):
    """The op at all entries equals autograd's weight gradient of nn.Linear."""
    require_backend(backend)
    layer = torch.nn.Linear(7, 5).to(dtype)
    x = torch.randn(3, 4, 7).to(dtype)
    dy = torch.randn(3, 4, 5).to(dtype)
    layer(x).backward(dy)
    idx = torch.arange(35)
    got = _ops.sparse_weight_grad(dy, x, idx, backend=backend)
    _assert_close(got, dy, x, idx)
    torch.testing.assert_close(got.to(dtype), layer.weight.grad.view(-1), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv1d_swapped_operands(backend):
    """transformers' Conv1D keeps W as [in, out]: (input, grad_output) swapped gives its gradient."""
    require_backend(backend)
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(nf=5, nx=7)  # weight [7, 5]
    x, dy = torch.randn(2, 6, 7), torch.randn(2, 6, 5)
    layer(x).backward(dy)
    idx = torch.tensor([0, 4, 5, 17, 33, 34])
    got = _ops.sparse_weight_grad(x, dy, idx, backend=backend)
    torch.testing.assert_close(got, layer.weight.grad.view(-1)[idx], rtol=1e-5, atol=1e-5)


def test_public_name_and_dispatch():
    import sift

    dy, x = torch.randn(4, 3), torch.randn(4, 2)
    torch.testing.assert_close(sift.sparse_weight_grad(dy, x, torch.tensor([1, 4])), (dy.T @ x).view(-1)[[1, 4]])
    assert _ops.resolve("sparse_weight_grad", "cpu", "torch")[1] is _ops.sparse_weight_grad_ref


# ---------------------------------------------------------------------------------------
# Bad input: the same ValueError, naming the argument, on every backend; out untouched.
# ---------------------------------------------------------------------------------------

def _bad_cases():
    dy, x = torch.randn(4, 3), torch.randn(4, 5)
    idx = torch.tensor([1, 6, 9])
    out = torch.zeros(3)
    return {
        "unsorted": ((dy, x, torch.tensor([6, 1, 9]), out), "strictly increasing: 1 at position 1"),
        "duplicate": ((dy, x, torch.tensor([1, 6, 6]), out), "strictly increasing: 6 at position 2"),
        "out-of-range": ((dy, x, torch.tensor([1, 6, 15]), out), r"indices has 15 at position 2, outside \[0, 15\)"),
        "negative": ((dy, x, torch.tensor([-1, 6, 9]), out), r"indices has -1 at position 0"),
        "token-mismatch": ((dy, torch.randn(5, 5), idx, out), "same token dims"),
        "dtype-mismatch": ((dy, x.bfloat16(), idx, out), "input must have grad_output's dtype"),
        "fp64": ((dy.double(), x.double(), idx, out), "grad_output must be float32, bfloat16 or float16"),
        "device-mismatch": ((dy, x.to("meta"), idx, out), "input must be on grad_output's device"),
        "float-indices": ((dy, x, idx.float(), out), "indices must be a 1-D int32 or int64"),
        "2d-indices": ((dy, x, idx.view(1, 3), out), "indices must be a 1-D int32 or int64"),
        "out-dtype": ((dy, x, idx, torch.zeros(3, dtype=torch.float64)), "out must be a contiguous float32 \\[3\\]"),
        "out-length": ((dy, x, idx, torch.zeros(4)), "out must be a contiguous float32 \\[3\\]"),
        "out-strided": ((dy, x, idx, torch.zeros(6)[::2]), "out must be a contiguous float32 \\[3\\]"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_value_error(backend, case):
    require_backend(backend)
    args, message = _bad_cases()[case]
    out = args[3]
    before = out.clone()
    with pytest.raises(ValueError, match=message):
        _ops.sparse_weight_grad(*args, backend=backend)
    assert torch.equal(out, before)


# ---------------------------------------------------------------------------------------
# Kernel-level: the C++ op's instruction sets and token blocks, and the Triton launcher's
# block sizes and strides, all against the oracle.
# ---------------------------------------------------------------------------------------

def _cpp_isas() -> list[str]:
    if os.environ.get("SIFT_SKIP_EXT") == "1" or not cpp_available():
        return ["generic"]
    best = torch.ops.sift.sparse_weight_grad_isa()
    return ["generic"] + ([best] if best != "generic" else [])


@pytest.mark.parametrize("token_block", [0, 8, 13, 64], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("isa", _cpp_isas())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_cpp_isa_and_token_blocks(isa, token_block, dtype, index_dtype):
    """Several token blocks (with a ragged last one), each instruction set, both index types."""
    require_backend("cpp")
    dy, x, gen = _inputs(301, 19, 45, dtype, seed=5)
    idx = _random_indices(19 * 45, 300, gen, index_dtype)
    out = torch.zeros(300)
    torch.ops.sift.sparse_weight_grad_(dy, x, idx, out, isa, token_block)
    _assert_close(out, dy, x, idx)


def _assert_adds_into_out(dy, x, idx, gen, isa: str, token_block: int, threads: int) -> None:
    """The C++ op on `threads` threads adds the sampled product into a non-zero `out`."""
    before = torch.randn(idx.numel(), generator=gen)
    out = before.clone()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.sift.sparse_weight_grad_(dy, x, idx, out, isa, token_block)
    finally:
        torch.set_num_threads(saved)
    _assert_close(out - before, dy, x, idx)


@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
def test_cpp_token_ranges_per_thread(threads):
    """Each thread sums its own range of tokens into a partial sum; the ranges add up to all tokens."""
    require_backend("cpp")
    dy, x, gen = _inputs(1001, 41, 33, torch.float32, seed=7)
    idx = _random_indices(41 * 33, 1300, gen, torch.int32)
    _assert_adds_into_out(dy, x, idx, gen, "auto", 16, threads)



@pytest.mark.parametrize("threads", [1, 2], ids=lambda n: f"threads{n}")
@pytest.mark.parametrize("isa", _cpp_isas())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cpp_several_column_blocks(dtype, isa, threads):
    """A wide X is packed in L2-sized column blocks whose entries are summed out of idx order."""
    require_backend("cpp")
    dy, x, gen = _inputs(150, 7, 3001, dtype, seed=8)  # 64-token blocks: X in 1024-column blocks
    idx = _random_indices(7 * 3001, 2000, gen, torch.int32)
    _assert_adds_into_out(dy, x, idx, gen, isa, 64, threads)


def test_cpp_op_refuses_bad_indices():
    """The public torch.ops op checks indices itself: a wild read or a race otherwise."""
    require_backend("cpp")
    dy, x, out = torch.randn(4, 3), torch.randn(4, 5), torch.zeros(2)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.sift.sparse_weight_grad_(dy, x, torch.tensor([1, 15]), out)
    with pytest.raises(RuntimeError, match="strictly increasing"):
        torch.ops.sift.sparse_weight_grad_(dy, x, torch.tensor([3, 3]), out)
    assert torch.equal(out, torch.zeros(2))


@pytest.mark.parametrize("blocks", [(1, 1), (4, 8), (16, 16), (32, 4)], ids=lambda b: "k{}t{}".format(*b))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_triton_block_sizes_and_strides(blocks, dtype):
    require_backend("triton")
    from sift.triton_kernels.sparse_weight_grad import sparse_weight_grad as launch

    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(37, 2 * 21, generator=gen).to(dtype)[:, ::2]  # feature stride 2
    x = torch.randn(11, 37, generator=gen).to(dtype).T  # token stride 1, feature stride 37
    idx = _random_indices(21 * 11, 70, gen, torch.int32)
    got = launch(dy, x, idx, block_k=blocks[0], block_t=blocks[1])
    _assert_close(got, dy, x, idx)


def test_cpp_op_traces_with_fake_tensors():
    """The op's Meta kernel lets FakeTensor (torch.compile) trace it without running it."""
    require_backend("cpp")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.zeros(3)
        torch.ops.sift.sparse_weight_grad_(torch.randn(4, 3), torch.randn(4, 5), torch.tensor([1, 6, 9]), out)
        assert out.shape == (3,) and out.dtype == torch.float32


def test_bench_backward_op_table_quick():
    """The benchmark's op table runs and has one row per configuration."""
    from sift.bench import backward

    rows, markdown = backward._op_table(quick=True)
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(backward.OP_COLUMNS)
    n = len(backward.QUICK_SHAPES) * len(backward.QUICK_TOKENS) * len(backward.DTYPES) * len(backward.DENSITIES)
    assert len(lines) == n + 2 and len(rows) == n
    assert all(r["median ms"] > 0 and r["dense median ms"] > 0 for r in rows)
