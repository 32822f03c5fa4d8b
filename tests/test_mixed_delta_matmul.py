"""mixed_delta_matmul_: each token's output gains its own sparse delta's product; every backend against
an fp64 oracle over odd shapes and every dtype, rows with no delta exactly unchanged, empty segments,
deltas with no entries, one delta on many rows, bad input named, and the kernels' own knobs."""

from __future__ import annotations


import pytest
import torch
from conftest import require_backend

from sift import _ops
from sift._ops import DeltaBank

BACKENDS = ("torch", "cpp", "triton")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (T, R, C): one token, odd and non-power-of-two sizes, a single row or column.
SHAPES = [(1, 1, 1), (1, 3, 37), (7, 37, 3), (13, 65, 65), (130, 65, 37), (130, 1, 65), (41, 37, 1)]
# fp32 units of the sum of |terms| that any fp32 summation order may lose on top of the rule.
ATOL_UNITS = 8
# Entries per delta as a fraction of the weight: a dense-ish one, a sparse one, none at all, one more.
DENSITIES = (0.5, 0.05, 0.0, 0.2)


def _deltas(shape: tuple[int, int], gen: torch.Generator, densities=DENSITIES):
    r, c = shape
    out = []
    for density in densities:
        k = int(density * r * c)
        flat = torch.randperm(r * c, generator=gen)[:k]
        out.append((flat // c, flat % c, torch.randn(k, generator=gen)))
    return out


def _dense(shape, delta) -> torch.Tensor:
    dense = torch.zeros(shape, dtype=torch.float64)
    rows, cols, vals = delta
    dense[rows, cols] = vals.double()
    return dense


def _ids(t: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Every delta id and -1 in turn over the first tokens, then random ones; delta n - 1 never (an empty segment)."""
    ids = torch.randint(-1, n - 1, (t,), generator=gen)
    ids[: min(t, n)] = torch.arange(-1, n - 1)[: min(t, n)]
    return ids


def _assert_close(got, y0, x, ids, deltas) -> None:
    """Rows with a delta: error vs fp64 at most 2x plain torch's same-dtype sum's, plus a few fp32 units;
    rows without one: the same bits."""
    r, c = y0.shape[-1], x.shape[-1]
    y2, x2 = y0.reshape(-1, r), x.reshape(-1, c)
    got2 = got.reshape(-1, r)
    served = ids >= 0
    assert torch.equal(got2[~served], y2[~served])
    if not bool(served.any()):
        return
    dense = [_dense((r, c), d) for d in deltas]
    exact = torch.stack([y2[t].double() + (dense[int(d)] @ x2[t].double() if d >= 0 else 0)
                         for t, d in enumerate(ids.tolist())])
    same_dtype = torch.stack([y2[t] + (dense[int(d)].to(y0.dtype) @ x2[t] if d >= 0 else 0)
                              for t, d in enumerate(ids.tolist())])
    magnitude = torch.stack([y2[t].double().abs() + (dense[int(d)].abs() @ x2[t].double().abs() if d >= 0 else 0)
                             for t, d in enumerate(ids.tolist())])[served].max()
    torch_err = (same_dtype.double() - exact)[served].abs().max()
    err = (got2.double() - exact)[served].abs().max()
    atol = ATOL_UNITS * 2.0**-24 * magnitude
    assert err <= 2 * torch_err + atol, f"error {err:.3g} > 2 x torch's {torch_err:.3g} + {atol:.3g}"


def _case(t, r, c, dtype, seed=0, densities=DENSITIES, values_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    deltas = [(rows, cols, vals.to(values_dtype)) for rows, cols, vals in _deltas((r, c), gen, densities)]
    x = torch.randn(t, c, generator=gen).to(dtype)
    y0 = torch.randn(t, r, generator=gen).to(dtype)
    return y0, x, _ids(t, len(deltas), gen), deltas, DeltaBank.from_rows_and_cols((r, c), deltas)


def _in_form(bank: DeltaBank, row_ptr=None, col=None, values=None) -> DeltaBank:
    """The bank with its fields cast to other forms the kernels take (None: as built)."""
    return DeltaBank(bank.row_ptr.to(row_ptr or bank.row_ptr.dtype), bank.col_indices.to(col or bank.col_indices.dtype),
                     bank.values.to(values or bank.values.dtype), bank.max_row_entries, bank.in_features)


# A bank's forms: row pointers int32 (built) or int64, columns int16 (built for C <= 32768) or int32, values
# in the deltas' dtype. Each is read as fp32, so every form gives the bits of the same values held in fp32.
FORMS = {"ptr32-col16": (None, None), "ptr64-col16": (torch.int64, None), "ptr32-col32": (None, torch.int32),
         "ptr64-col32": (torch.int64, torch.int32)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("values_dtype", DTYPES.values(), ids=[f"values-{k}" for k in DTYPES])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_every_bank_form_gives_the_bits_of_its_values_in_fp32(backend, dtype, values_dtype, form):
    """16-bit values, int16 columns and int32 row pointers change no bit against the fp32/int32/int64 bank."""
    require_backend(backend)
    y0, x, ids, deltas, bank = _case(13, 23, 29, dtype, seed=8, values_dtype=values_dtype)
    assert bank.values.dtype == values_dtype
    assert (bank.row_ptr.dtype, bank.col_indices.dtype) == (torch.int32, torch.int16)
    wide = _in_form(bank, torch.int64, torch.int32, torch.float32)
    want = _ops.mixed_delta_matmul_(y0.clone(), x, ids, wide, backend=backend)
    got = _ops.mixed_delta_matmul_(y0.clone(), x, ids, _in_form(bank, *form), backend=backend)
    assert torch.equal(got, want)
    _assert_close(got, y0, x, ids, deltas)
    assert not torch.equal(got, y0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16], ids=["values-fp32", "values-bf16"])
def test_int32_columns_of_a_wide_weight(backend, values_dtype):
    """Beyond 32768 inputs the bank's columns are int32, and columns past 32767 are read right."""
    require_backend(backend)
    c = 40_000
    gen = torch.Generator().manual_seed(9)
    deltas = [(torch.tensor([0, 0, 2, 2]), torch.tensor([3, 39_999, 32_768, 35_001]),
               torch.randn(4, generator=gen).to(values_dtype)), (torch.tensor([1]), torch.tensor([32_767]),
                                                                  torch.ones(1, dtype=values_dtype))]
    bank = DeltaBank.from_rows_and_cols((3, c), deltas)
    assert bank.col_indices.dtype == torch.int32 and bank.values.dtype == values_dtype
    x = torch.randn(4, c, generator=gen)
    y0 = torch.randn(4, 3, generator=gen)
    ids = torch.tensor([0, 1, -1, 0])
    y = _ops.mixed_delta_matmul_(y0.clone(), x, ids, bank, backend=backend)
    _assert_close(y, y0, x, ids, deltas)
    assert y[0, 0] != y0[0, 0] and y[1, 1] != y0[1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}xR{}xC{}".format(*s))
def test_matches_fp64_oracle(backend, dtype, shape):
    require_backend(backend)
    y0, x, ids, deltas, bank = _case(*shape, dtype)
    y = y0.clone()
    got = _ops.mixed_delta_matmul_(y, x, ids, bank, backend=backend)
    assert got is y
    _assert_close(y, y0, x, ids, deltas)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_delta_without_entries_keeps_its_rows_exactly(backend, dtype):
    """A delta with zero entries (and a row of a delta with none) rewrites nothing: the same bits."""
    require_backend(backend)
    y0, x, _, _, bank = _case(9, 21, 17, dtype, seed=1)
    ids = torch.full((9,), 2)  # DENSITIES[2] == 0
    y = y0.clone()
    _ops.mixed_delta_matmul_(y, x, ids, bank, backend=backend)
    assert torch.equal(y, y0)
    # One entry in row 3 only: every other row keeps its bits.
    bank = DeltaBank.from_rows_and_cols((21, 17), [(torch.tensor([3]), torch.tensor([5]), torch.tensor([0.25]))])
    y = y0.clone()
    _ops.mixed_delta_matmul_(y, x, torch.zeros(9, dtype=torch.int32), bank, backend=backend)
    assert torch.equal(torch.cat([y[:, :3], y[:, 4:]], 1), torch.cat([y0[:, :3], y0[:, 4:]], 1))
    assert not torch.equal(y[:, 3], y0[:, 3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_one_delta_on_many_rows_and_none_anywhere(backend, dtype):
    """One delta served to every token equals a weight with the delta added; no delta leaves y alone."""
    require_backend(backend)
    y0, x, _, deltas, bank = _case(23, 19, 31, dtype, seed=2)
    for ids in (torch.zeros(23, dtype=torch.int64), torch.full((23,), -1), torch.tensor([3, 0] * 11 + [0])):
        y = y0.clone()
        _ops.mixed_delta_matmul_(y, x, ids, bank, backend=backend)
        _assert_close(y, y0, x, ids, deltas)
        assert torch.equal(y, y0) == bool((ids < 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_and_no_deltas(backend):
    require_backend(backend)
    _, _, _, _, bank = _case(1, 6, 5, torch.float32)
    y = torch.zeros(0, 6)
    _ops.mixed_delta_matmul_(y, torch.zeros(0, 5), torch.zeros(0, dtype=torch.int32), bank, backend=backend)
    empty = DeltaBank.from_rows_and_cols((6, 5), [])
    y0 = torch.randn(4, 6)
    y = y0.clone()
    _ops.mixed_delta_matmul_(y, torch.randn(4, 5), torch.full((4,), -1), empty, backend=backend)
    assert torch.equal(y, y0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_are_tokens(backend):
    """[batch, seq, features]: the ids are per token, a row's tokens all carrying the row's id."""
    require_backend(backend)
    y0, x, _, deltas, bank = _case(3 * 5, 13, 11, torch.float32, seed=3)
    ids = torch.tensor([1, -1, 0]).repeat_interleave(5)
    y = y0.clone().view(3, 5, 13)
    _ops.mixed_delta_matmul_(y, x.view(3, 5, 11), ids, bank, backend=backend)
    _assert_close(y, y0, x, ids, deltas)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_operands(backend):
    """x with any strides (a transposed view), y a row slice of a wider buffer."""
    require_backend(backend)
    y0, x, ids, deltas, bank = _case(12, 9, 20, torch.float32, seed=4)
    x_t = x.T.contiguous().T  # token stride 1
    wide = torch.randn(12, 15)
    wide[:, 2:11] = y0
    y = wide[:, 2:11]
    _ops.mixed_delta_matmul_(y, x_t, ids, bank, backend=backend)
    _assert_close(y, y0, x, ids, deltas)


def test_public_name_and_dispatch():
    assert _ops.resolve("mixed_delta_matmul_", "cpu", "torch")[1] is _ops.mixed_delta_matmul_ref
    assert "mixed_delta_matmul_" in _ops.ops()


def test_bank_layout():
    """CSR per delta, concatenated; entries sorted by (row, column) whatever order they came in."""
    bank = DeltaBank.from_rows_and_cols((3, 4), [(torch.tensor([2, 0, 2]), torch.tensor([1, 3, 0]),
                                                  torch.tensor([1.0, 2.0, 3.0])),
                                                 (torch.tensor([], dtype=torch.long),) * 2 + (torch.tensor([]),),
                                                 (torch.tensor([1]), torch.tensor([1]), torch.tensor([4.0]))])
    assert bank.row_ptr.tolist() == [[0, 1, 1, 3], [3, 3, 3, 3], [3, 3, 4, 4]]
    assert bank.col_indices.tolist() == [3, 0, 1, 1]
    assert bank.values.tolist() == [2.0, 3.0, 1.0, 4.0]
    assert (bank.row_ptr.dtype, bank.col_indices.dtype, bank.values.dtype) == (torch.int32, torch.int16, torch.float32)
    assert (bank.max_row_entries, bank.n_deltas, bank.out_features, bank.in_features) == (2, 3, 3, 4)
    assert bank.delta_bytes(0) == 3 * (2 + 4) + 4 * 4 and bank.delta_bytes(1) == 4 * 4
    with pytest.raises(ValueError, match="repeated"):
        DeltaBank.from_rows_and_cols((3, 4), [(torch.tensor([1, 1]), torch.tensor([2, 2]), torch.ones(2))])


def test_bank_values_take_the_widest_dtype_of_its_deltas():
    """bf16 stays bf16; bf16 next to fp16 or fp32 is fp32 (it holds both); a delta without entries has no say;
    narrowing to a 16-bit dtype happens only when every value is exact there, and removing the delta that
    needed fp32 lets the bank narrow again."""
    one = (torch.tensor([0]), torch.tensor([1]))
    none = (torch.tensor([], dtype=torch.long),) * 2 + (torch.tensor([]),)
    bf16 = DeltaBank.from_rows_and_cols((2, 3), [(*one, torch.tensor([0.5], dtype=torch.bfloat16)), none])
    assert bf16.values.dtype == torch.bfloat16 and bf16.delta_bytes(0) == 2 + 2 + 3 * 4
    mixed = bf16.appended(*one, torch.tensor([0.25], dtype=torch.float16))
    assert mixed.values.dtype == torch.float32 and mixed.values.tolist() == [0.5, 0.25]
    assert bf16.appended(*none).values.dtype == torch.bfloat16
    inexact = bf16.appended(*one, torch.tensor([0.1]))
    assert inexact.values.dtype == torch.float32
    assert inexact.narrowed(torch.bfloat16) is inexact
    back = inexact.without(2).narrowed(torch.bfloat16)
    assert back.values.dtype == torch.bfloat16 and torch.equal(back.values, bf16.values)
    assert torch.equal(back.row_ptr, bf16.row_ptr) and back.row_ptr.dtype == torch.int32
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        bf16.narrowed(torch.float64)
    with pytest.raises(ValueError, match="outside the \\[3, 4\\] weight"):
        DeltaBank.from_rows_and_cols((3, 4), [(torch.tensor([3]), torch.tensor([0]), torch.ones(1))])


# ---------------------------------------------------------------------------------------
# Bad input: the same ValueError, naming the argument, on every backend; y untouched.
# ---------------------------------------------------------------------------------------

def _bad_cases():
    y, x = torch.randn(4, 3), torch.randn(4, 5)
    ids = torch.tensor([0, -1, 1, 0])
    bank = DeltaBank.from_rows_and_cols((3, 5), [(torch.tensor([0, 2]), torch.tensor([4, 1]), torch.ones(2))] * 2)

    def edited(**fields):
        parts = {"row_ptr": bank.row_ptr, "col_indices": bank.col_indices, "values": bank.values,
                 "max_row_entries": bank.max_row_entries, "in_features": bank.in_features}
        parts.update(fields)
        return DeltaBank(**parts)

    return y, {
        "id-too-large": ((y, x, torch.tensor([0, 2, 1, 0]), bank), r"delta_ids has 2 at position 1, outside \[-1, 2\)"),
        "id-below-minus-one": ((y, x, torch.tensor([0, -2, 1, 0]), bank), r"delta_ids has -2 at position 1"),
        "ids-length": ((y, x, ids[:3], bank), "delta_ids must be a 1-D int32 or int64 tensor of 4 ids"),
        "ids-float": ((y, x, ids.float(), bank), "delta_ids must be a 1-D int32 or int64"),
        "token-mismatch": ((y, torch.randn(5, 5), ids, bank), "same token dims"),
        "dtype-mismatch": ((y, x.bfloat16(), ids, bank), "x must have y's dtype"),
        "fp64": ((y.double(), x.double(), ids, bank), "y must be float32, bfloat16 or float16"),
        "device-mismatch": ((y, x.to("meta"), ids, bank), "x must be on y's device"),
        "not-a-bank": ((y, x, ids, (bank.row_ptr, bank.col_indices, bank.values)), "bank must be a DeltaBank"),
        "row-ptr-width": ((y, x, ids, edited(row_ptr=bank.row_ptr[:, :3].contiguous())),
                          r"bank.row_ptr must be a contiguous int32 or int64 \[n_deltas, 4\]"),
        "row-ptr-int16": ((y, x, ids, edited(row_ptr=bank.row_ptr.short())),
                          "bank.row_ptr must be a contiguous int32 or int64"),
        "row-ptr-decreasing": ((y, x, ids, edited(row_ptr=torch.tensor([[0, 2, 1, 2], [2, 3, 3, 4]]))),
                               "bank.row_ptr must be non-decreasing"),
        "row-ptr-past-entries": ((y, x, ids, edited(row_ptr=torch.tensor([[0, 1, 1, 2], [2, 3, 3, 5]]))),
                                 r"within \[0, 4\]"),
        "cols-int64": ((y, x, ids, edited(col_indices=bank.col_indices.long())),
                       "bank.col_indices must be a contiguous 1-D int16 or int32"),
        "cols-int16-too-narrow": ((torch.randn(4, 3), torch.randn(4, 40_000), ids, edited(in_features=40_000)),
                                  "bank.col_indices is int16, which cannot address 40000 columns"),
        "col-out-of-range": ((y, x, ids, edited(col_indices=torch.tensor([4, 5, 4, 1], dtype=torch.int16))),
                             r"bank.col_indices must lie in \[0, 5\)"),
        "col-negative-int16": ((y, x, ids, edited(col_indices=torch.tensor([4, -1, 4, 1], dtype=torch.int16))),
                               r"bank.col_indices must lie in \[0, 5\)"),
        "values-length": ((y, x, ids, edited(values=torch.ones(3))),
                          r"bank.values must be a contiguous float32, bfloat16 or float16 \[4\]"),
        "values-fp64": ((y, x, ids, edited(values=torch.ones(4, dtype=torch.float64))), "bank.values must be"),
        "values-int16": ((y, x, ids, edited(values=torch.ones(4, dtype=torch.int16))), "bank.values must be"),
        "in-features": ((y, x, ids, edited(in_features=6)), "bank.in_features is 6, x has 5 features"),
        "max-row-too-small": ((y, x, ids, edited(row_ptr=torch.tensor([[0, 2, 2, 2], [2, 3, 3, 4]]))),
                              "bank.max_row_entries is 1, but a row holds 2 entries"),
        "y-not-viewable": ((torch.randn(2, 4, 3).transpose(0, 1), torch.randn(4, 2, 5), ids.repeat(2), bank),
                           r"y must be viewable as \[T, R\]"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(_bad_cases()[1]))
def test_bad_input_raises_value_error(backend, case):
    require_backend(backend)
    _, cases = _bad_cases()
    args, message = cases[case]
    y = args[0]
    before = y.clone()
    with pytest.raises(ValueError, match=message):
        _ops.mixed_delta_matmul_(*args, backend=backend)
    assert torch.equal(y, before)


# ---------------------------------------------------------------------------------------
# Kernel-level: the C++ op's own checks and threads, the Triton launcher's tiles.
# ---------------------------------------------------------------------------------------

def test_cpp_op_refuses_bad_ids_and_rows_before_writing():
    """The public torch.ops op checks what it reads through: a wild read otherwise."""
    require_backend("cpp")
    y0, x, ids, _, bank = _case(6, 7, 8, torch.float32, seed=5)
    y = y0.clone()
    op = torch.ops.sift.mixed_delta_matmul_
    with pytest.raises(RuntimeError, match=r"delta_ids has 4 at position 2, outside \[-1, 4\)"):
        op(y, x, torch.tensor([0, 1, 4, 0, 0, 0], dtype=torch.int32), bank.row_ptr, bank.col_indices, bank.values,
           bank.max_row_entries)
    bad_ptr = bank.row_ptr.clone()
    bad_ptr[1, 3] = bad_ptr[1, 2] - 1
    with pytest.raises(RuntimeError, match="row_ptr\\[1\\] decreases at row"):
        op(y, x, ids.int(), bad_ptr, bank.col_indices, bank.values, bank.max_row_entries)
    assert torch.equal(y, y0)
    for column in (8, -3):  # a negative int16 column reads as a huge unsigned one
        bad_col = bank.col_indices.clone()
        bad_col[0] = column
        with pytest.raises(RuntimeError, match=rf"col_indices has {column} at position 0, outside \[0, 8\)"):
            op(y, x, torch.zeros(6, dtype=torch.int32), bank.row_ptr, bad_col, bank.values, bank.max_row_entries)


# Delta ids per token: random, one delta for all (groups of 8 and a ragged one), runs of 3, and a decode step's
# rows sharing deltas out of order (groups of tokens that are not neighbours).
CPP_ID_PATTERNS = {"random": None, "one-delta": lambda t: torch.zeros(t, dtype=torch.int64),
                   "runs-of-3": lambda t: (torch.arange(t) // 3) % 3 - 1,
                   "interleaved": lambda t: torch.arange(t) % 3 - 1}


@pytest.mark.parametrize("ids_pattern", CPP_ID_PATTERNS.values(), ids=CPP_ID_PATTERNS.keys())
@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cpp_token_groups_and_row_blocks(threads, dtype, ids_pattern):
    """Groups of up to 8 tokens with one delta (neighbours or not), a token alone read in place; with fewer groups
    than twice the threads, tasks of 256-row blocks with a ragged last one."""
    require_backend("cpp")
    y0, x, ids, deltas, bank = _case(19, 600, 33, dtype, seed=6, densities=(0.02, 0.1, 0.0))
    if ids_pattern is not None:
        ids = ids_pattern(19)
    y = y0.clone()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _ops.mixed_delta_matmul_(y, x, ids, bank, backend="cpp")
    finally:
        torch.set_num_threads(saved)
    _assert_close(y, y0, x, ids, deltas)


@pytest.mark.parametrize("blocks", [(1, 1), (2, 8), (16, 16), (4, 64)], ids=lambda b: "t{}r{}".format(*b))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_triton_tiles_and_strides(blocks, dtype):
    require_backend("triton")
    from sift.triton_kernels.mixed_delta_matmul import mixed_delta_matmul_ as launch

    y0, x, ids, deltas, bank = _case(19, 21, 11, dtype, seed=7)
    wide = torch.randn(19, 2 * 21).to(dtype)
    y = wide[:, ::2]  # feature stride 2
    y.copy_(y0)
    x_t = x.T.contiguous().T  # token stride 1
    launch(y, x_t, ids.int(), bank, block_t=blocks[0], block_r=blocks[1])
    _assert_close(y, y0, x, ids, deltas)


def test_cpp_op_traces_with_fake_tensors():
    """The op's fake kernel lets FakeTensor (torch.compile) trace it without running it."""
    require_backend("cpp")
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, _, _, _, bank = _case(1, 3, 5, torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.zeros(4, 3)
        torch.ops.sift.mixed_delta_matmul_(y, torch.randn(4, 5), torch.zeros(4, dtype=torch.int32), bank.row_ptr,
                                           bank.col_indices, bank.values, bank.max_row_entries)
        assert y.shape == (4, 3)
