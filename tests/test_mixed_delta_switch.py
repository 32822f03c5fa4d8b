"""delta_bank_switch_: one delta of the banks out of the weights and another in, in place; every backend
gives what the restore and the apply ops give (bit for bit, every dtype, odd shapes, a transposed
weight, several threads), and bad arguments are named with nothing written."""

from __future__ import annotations

import pytest
import torch
from conftest import require_backend

from sift import _ops
from sift._ops import DeltaBank

BACKENDS = ("torch", "cpp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (R, C): a single row, a single column, odd sizes, more rows than one C++ task takes (64).
SHAPES = [(1, 7), (9, 1), (37, 65), (131, 29)]
DENSITIES = (0.3, 0.05, 0.0)


def _bank(shape: tuple[int, int], gen: torch.Generator,
          values_dtype: torch.dtype = torch.float32) -> tuple[DeltaBank, list[torch.Tensor]]:
    """A bank of deltas of `shape` with values in `values_dtype`, and each delta's flat positions in its CSR order."""
    r, c = shape
    deltas, flats = [], []
    for density in DENSITIES:
        k = int(density * r * c)
        flat = torch.randperm(r * c, generator=gen)[:k].sort().values
        # Values across magnitudes: tiny next to the weight, comparable, and huge (w + v cancels or overflows).
        vals = torch.randn(k, generator=gen) * 10.0 ** torch.randint(-8, 6, (k,), generator=gen).float()
        deltas.append((flat // c, flat % c, vals.to(values_dtype)))
        flats.append(flat)
    return DeltaBank.from_rows_and_cols(shape, deltas), flats


def _in_form(bank: DeltaBank, row_ptr=None, col=None) -> DeltaBank:
    return DeltaBank(bank.row_ptr.to(row_ptr or bank.row_ptr.dtype), bank.col_indices.to(col or bank.col_indices.dtype),
                     bank.values, bank.max_row_entries, bank.in_features)


# Values in fp32 or in the weight's own 16-bit dtype (a 16-bit fine-tune's), and the index forms: int32 row
# pointers and int16 columns as built, int64 and int32 as a bank past their range has them.
VALUES = {"values-fp32": None, "values-own": "own"}
FORMS = {"ptr32-col16": (None, None), "ptr64-col32": (torch.int64, torch.int32)}


def _applied(w: torch.Tensor, flat: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    out = w.clone()
    _ops.sparse_delta_apply_ref([out.view(-1)], [flat], [vals], 1.0, [])
    return out


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES + [(3, 40_000)], ids=lambda s: "R{}xC{}".format(*s))
def test_switch_gives_the_applied_weights_and_the_base_back(shape, dtype, backend, threads, values, form):
    require_backend(backend)
    gen = torch.Generator().manual_seed(0)
    bank, flats = _bank(shape, gen, dtype if values == "own" else torch.float32)
    assert bank.col_indices.dtype == (torch.int32 if shape[1] > 32768 else torch.int16)
    bank = _in_form(bank, *form)
    base = (torch.randn(shape, generator=gen) * 100).to(dtype)
    w = base.clone()
    # The apply's reference takes fp32 values: a 16-bit bank's upcast (exact) must give the same bits.
    values = [bank.values[int(bank.row_ptr[d, 0]) : int(bank.row_ptr[d, -1])].float() for d in range(bank.n_deltas)]
    saved, before = [], threads
    torch.set_num_threads(threads)
    try:
        for off, on in ((-1, 0), (0, 1), (1, 2), (2, 0), (0, -1)):
            new = [torch.empty(flats[on].numel(), dtype=dtype)] if on >= 0 else []
            _ops.delta_bank_switch_([w], [bank], off, on, saved if off >= 0 else [], new, backend=backend)
            saved = new
            want = base if on < 0 else _applied(base, flats[on], values[on])
            assert torch.equal(w, want), (off, on)
            if on >= 0:
                assert torch.equal(saved[0], base.view(-1)[flats[on]])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_transposed_weight_is_written_through_its_strides(backend):
    """Conv1D keeps W as [in, out]: the switch gets the [out, in] view and writes the [in, out] storage."""
    require_backend(backend)
    gen = torch.Generator().manual_seed(1)
    bank, flats = _bank((23, 11), gen)
    storage = torch.randn(11, 23, generator=gen).bfloat16()
    base = storage.clone()
    saved = [torch.empty(flats[1].numel(), dtype=torch.bfloat16)]
    _ops.delta_bank_switch_([storage.t()], [bank], -1, 1, [], saved, backend=backend)
    want = _applied(base.t().contiguous(), flats[1], bank.values[int(bank.row_ptr[1, 0]) : int(bank.row_ptr[1, -1])])
    assert torch.equal(storage.t(), want)
    _ops.delta_bank_switch_([storage.t()], [bank], 1, -1, saved, [], backend=backend)
    assert torch.equal(storage, base)


def _bad_cases():
    bank, _ = _bank((5, 4), torch.Generator().manual_seed(2))
    k0 = int(bank.row_ptr[0, -1] - bank.row_ptr[0, 0])

    def edited(**fields):
        parts = {"row_ptr": bank.row_ptr, "col_indices": bank.col_indices, "values": bank.values,
                 "max_row_entries": bank.max_row_entries, "in_features": bank.in_features}
        return DeltaBank(**{**parts, **fields})

    ok = dict(weights=[torch.zeros(5, 4)], banks=[bank], off=-1, on=0, originals_off=[],
              originals_on=[torch.empty(k0)])
    return ok, {
        "banks": dict(banks=[]),
        "off": dict(off=-2),
        "on": dict(on=7),
        "originals_off": dict(off=1, originals_off=[]),
        "originals_on": dict(originals_on=[torch.empty(k0 + 1)]),
        "weights": dict(weights=[torch.zeros(4, 5)]),
        "weights[0] dtype": dict(weights=[torch.zeros(5, 4, dtype=torch.float64)]),
        "originals_on dtype": dict(originals_on=[torch.empty(k0, dtype=torch.float16)]),
        "row_ptr int16": dict(banks=[edited(row_ptr=bank.row_ptr.short())]),
        "col_indices int64": dict(banks=[edited(col_indices=bank.col_indices.long())]),
        "values fp64": dict(banks=[edited(values=bank.values.double())]),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(_bad_cases()[1]))
def test_bad_input_raises_value_error_naming_it_and_writes_nothing(backend, case):
    require_backend(backend)
    ok, cases = _bad_cases()
    args = {**ok, **cases[case]}
    before = [w.clone() for w in args["weights"]]
    with pytest.raises(ValueError, match=case.split()[0].replace("[", r"\[").replace("]", r"\]")):
        _ops.delta_bank_switch_(**args, backend=backend)
    assert all(torch.equal(w, b) for w, b in zip(args["weights"], before))


def test_cpp_op_refuses_a_bad_column_before_writing():
    require_backend("cpp")
    bank, _ = _bank((6, 5), torch.Generator().manual_seed(3))
    w = torch.randn(6, 5)
    before = w.clone()
    saved = [torch.empty(int(bank.row_ptr[1, -1] - bank.row_ptr[1, 0]))]  # the last entry is delta 1's
    for column in (5, -1):  # a negative int16 column reads as a huge unsigned one
        col = bank.col_indices.clone()
        col[-1] = column
        with pytest.raises(RuntimeError, match="col_indices"):
            torch.ops.sift.delta_bank_switch_([w], [bank.row_ptr], [col], [bank.values], -1, 1, [], saved)
        assert torch.equal(w, before)
