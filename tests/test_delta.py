"""Sparse deltas: the C++/Triton ops against their torch references, SparseDelta's round trips
(save/load, apply/remove), merging against dense sums, and every bad input they must refuse."""

from __future__ import annotations

import copy
import math
import os
import struct
import warnings

import pytest
import torch

from sift import SparseAdamW, SparseDelta, _ops, merge_deltas
from sift.delta import BaseFingerprint, DeltaEntry, DeltaError
from conftest import cpp_available, requires_cpp, requires_triton, spawned_rank


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]
INDEX_DTYPES = [pytest.param(torch.int32, id="i32"), pytest.param(torch.int64, id="i64")]


def _sorted_unique(n: int, space: int, gen: torch.Generator, dtype=torch.int64, lo: int = 0) -> torch.Tensor:
    n = min(n, space)
    return (torch.randperm(space, generator=gen)[:n].sort().values + lo).to(dtype)


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(23, 19), torch.nn.Tanh(), torch.nn.Linear(19, 7)).to(dtype)


def _random_delta(model: torch.nn.Module, seed: int, density: float = 0.3, std: float = 0.1) -> SparseDelta:
    """A delta with random entries on every weight of `model`, fingerprinted with it."""
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    entries = {}
    for name, t in state.items():
        k = max(1, int(density * t.numel()))
        idx = _sorted_unique(k, t.numel(), gen, torch.int32)
        entries[name] = DeltaEntry(tuple(t.shape), t.dtype, idx, torch.randn(k, generator=gen) * std)
    return SparseDelta(entries, BaseFingerprint.of(state))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _assert_bit_identical(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    for name, t in model.state_dict().items():
        # Compare the bit patterns: equal floats are not enough (-0.0 == 0.0, NaN != NaN).
        assert torch.equal(t.view(torch.int16 if t.element_size() == 2 else torch.int32),
                           snapshot[name].view(torch.int16 if t.element_size() == 2 else torch.int32)), name


# ----------------------------------------------------------------- ops: C++ against the reference

# (name, sizes of the inputs, index space per input, disjoint ranges)
MERGE_CASES = [
    pytest.param([50, 40, 60], 80, False, id="3-inputs-dense-dups"),
    pytest.param([1000], 5000, False, id="1-input"),
    pytest.param([0, 17, 0], 100, False, id="empty-inputs"),
    pytest.param([1, 1], 1, False, id="single-shared-entry"),
    pytest.param([70_000, 50_000, 90_000], 400_000, False, id="3x-multi-range"),
    pytest.param([70_000, 70_000, 70_000], 70_000, True, id="3x-disjoint-ranges"),
    pytest.param([3000] * 9, 20_000, False, id="9-inputs"),
]


@requires_cpp
@pytest.mark.parametrize("ties", [pytest.param(False, id="sum"), pytest.param(True, id="ties")])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("sizes,space,disjoint", MERGE_CASES)
def test_merge_cpp_matches_reference(sizes, space, disjoint, index_dtype, ties):
    gen = torch.Generator().manual_seed(len(sizes) * 1000 + space)
    indices = [_sorted_unique(n, space, gen, index_dtype, lo=i * space if disjoint else 0)
               for i, n in enumerate(sizes)]
    # Integer-valued halves make many exact cancellations, which the ties rule must handle.
    values = [torch.randint(-4, 5, (len(i),), generator=gen).float() / 2 for i in indices]
    weights = [1.0 + 0.25 * i for i in range(len(sizes))]
    got_idx, got_val = _ops.call("merge_sorted_deltas", indices, values, weights, [len(sizes)], ties, backend="cpp")
    ref_idx, ref_val = _ops.merge_sorted_deltas_ref(indices, values, weights, [len(sizes)], ties)
    assert got_idx[0].dtype == index_dtype
    assert torch.equal(got_idx[0], ref_idx[0])
    assert torch.equal(got_val[0], ref_val[0])
    if not disjoint and len(sizes) > 1 and min(sizes) > 1:
        assert got_idx[0].numel() < sum(sizes), "the case must contain indices shared across inputs"


@requires_cpp
def test_merge_cpp_groups_mixed_index_dtypes_and_random_values():
    gen = torch.Generator().manual_seed(7)
    sizes = [3, 1, 2]
    indices, values, weights = [], [], []
    for g, size in enumerate(sizes):
        for i in range(size):
            dtype = torch.int64 if (g + i) % 2 else torch.int32
            indices.append(_sorted_unique(200 + 50 * i, 1000, gen, dtype))
            values.append(torch.randn(len(indices[-1]), generator=gen))
            weights.append(0.3 - 0.2 * i)
    got_idx, got_val = _ops.call("merge_sorted_deltas", indices, values, weights, sizes, False, backend="cpp")
    ref_idx, ref_val = _ops.merge_sorted_deltas_ref(indices, values, weights, sizes, False)
    for gi, gv, ri, rv in zip(got_idx, got_val, ref_idx, ref_val):
        assert torch.equal(gi.long(), ri.long())
        torch.testing.assert_close(gv, rv, rtol=0, atol=0)


@requires_cpp
@pytest.mark.parametrize("bad,match", [
    pytest.param("negative", "indices must be non-negative", id="negative-index"),
    pytest.param("fp16-values", "values must be contiguous 1-D float32", id="fp16-values"),
    pytest.param("length", "values must have one entry per index", id="length-mismatch"),
    pytest.param("groups", "group_sizes must add up", id="bad-group-sizes"),
])
def test_merge_cpp_checks_name_the_argument(bad, match):
    idx = [torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32)]
    val = [torch.ones(2), torch.ones(2)]
    sizes = [2]
    if bad == "negative":
        idx[0] = torch.tensor([-1, 3], dtype=torch.int32)
    elif bad == "fp16-values":
        val[1] = val[1].half()
    elif bad == "length":
        val[1] = torch.ones(3)
    elif bad == "groups":
        sizes = [3]
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sift.merge_sorted_deltas(idx, val, [1.0, 1.0], sizes, False)


def _apply_case(dtype, index_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 29), (1,), (513,), (3, 5, 7), (200, 170)]
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    ks = [300, 1, 0, 50, 20_000]  # the last spans several C++ chunks
    indices = [_sorted_unique(k, p.numel(), gen, index_dtype) for k, p in zip(ks, params)]
    values = [torch.randn(len(i), generator=gen) for i in indices]
    return params, indices, values


@requires_cpp
@pytest.mark.parametrize("scale", [pytest.param(1.0, id="scale1"), pytest.param(-0.37, id="scale-0.37")])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_and_restore_cpp_match_reference(dtype, index_dtype, scale):
    params, indices, values = _apply_case(dtype, index_dtype, seed=3)
    originals = [p.clone() for p in params]
    ref_params = [p.clone() for p in params]
    saved, ref_saved = _ops.originals_like(params, indices), _ops.originals_like(params, indices)
    _ops.call("sparse_delta_apply_", params, indices, values, scale, saved, backend="cpp")
    _ops.sparse_delta_apply_ref(ref_params, indices, values, scale, ref_saved)
    for p, r, s, rs in zip(params, ref_params, saved, ref_saved):
        assert torch.equal(p, r)
        assert s.dtype == dtype and torch.equal(s, rs)
    assert not all(torch.equal(p, o) for p, o in zip(params, originals))
    _ops.call("sparse_delta_restore_", params, indices, saved, backend="cpp")
    for p, o in zip(params, originals):
        assert torch.equal(p, o)


@requires_cpp
def test_apply_cpp_without_saving_and_its_checks():
    w = torch.zeros(10)
    _ops.call("sparse_delta_apply_", [w], [torch.tensor([2, 9])], [torch.ones(2)], 2.0, [], backend="cpp")
    assert w.tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 2]
    with pytest.raises(RuntimeError, match=r"indices must lie in \[0, param.numel\(\)\)"):
        torch.ops.sift.sparse_delta_apply_([w], [torch.tensor([2, 10])], [torch.ones(2)], 1.0, [])
    with pytest.raises(RuntimeError, match="originals must have the dtype of their params"):
        torch.ops.sift.sparse_delta_apply_([w], [torch.tensor([2, 9])], [torch.ones(2)], 1.0,
                                           [torch.empty(2, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="originals must have one tensor per param"):
        torch.ops.sift.sparse_delta_apply_([w, w], [torch.tensor([2, 9])] * 2, [torch.ones(2)] * 2, 1.0,
                                           [torch.empty(2)])
    assert w.tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 2]


# Each case: (indices of the bad tensor, numel of its param, position and value the error names).
# The C++ ops only range-checked the first and last index, trusting sortedness checked in Python.
_BAD_INDEX_CASES = [
    pytest.param([5, 10**9, 7], 16, 1, 10**9, id="unsorted-huge-inside"),
    pytest.param([5, 16, 20, 3], 16, 1, 16, id="unsorted-past-end-inside"),
    pytest.param([2, -7, 9], 16, 1, -7, id="negative-inside"),
    pytest.param([-1, 3], 16, 0, -1, id="negative-first"),
    pytest.param([1, 4, 4, 9], 16, 2, 4, id="duplicate"),
    pytest.param([9, 3, 15], 16, 1, 3, id="descending-in-range"),
    pytest.param([3, 16], 16, 1, 16, id="past-end-last"),
    # Sorted everywhere but across the boundary of the C++ validation chunks (2**16 entries).
    pytest.param(list(range(2**16)) + [2**16 - 1] + list(range(2**16 + 1, 2**17)), 2**17, 2**16, 2**16 - 1,
                 id="repeat-at-chunk-boundary"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


@requires_cpp
@pytest.mark.parametrize("bad_tensor", [0, 1], ids=["bad-first", "bad-second"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("bad,numel,position,value", _BAD_INDEX_CASES)
def test_raw_apply_and_restore_check_every_index_before_writing(bad, numel, position, value, index_dtype,
                                                                bad_tensor):
    """The raw C++ apply/restore checked only the end indices: unsorted ones wrote out of bounds."""
    gen = torch.Generator().manual_seed(11)
    good_w = torch.randn(64, generator=gen).to(torch.bfloat16)
    good_idx = torch.tensor([0, 7, 63], dtype=index_dtype)
    bad_w = torch.randn(numel, generator=gen)
    bad_idx = torch.tensor(bad, dtype=index_dtype)
    params, indices = [good_w, bad_w], [good_idx, bad_idx]
    if bad_tensor == 0:
        params, indices = params[::-1], indices[::-1]
    before = [_bits(p) for p in params]
    match = (rf"indices must lie in \[0, param.numel\(\)\) and be strictly increasing: "
             rf"indices\[{bad_tensor}\] has {value} at position {position}\b")
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sift.sparse_delta_apply_(params, indices, [torch.ones(i.numel()) for i in indices], 1.0,
                                           _ops.originals_like(params, indices))
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sift.sparse_delta_restore_(params, indices, [torch.zeros(i.numel(), dtype=p.dtype)
                                                               for p, i in zip(params, indices)])
    for p, b in zip(params, before):
        assert torch.equal(_bits(p), b)


@requires_cpp
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("bad,position", [
    pytest.param([5, 10**9, 7], 2, id="unsorted"),
    pytest.param([2, -7, 9], 1, id="negative-inside"),
    pytest.param([1, 4, 4, 9], 2, id="duplicate"),
])
def test_raw_merge_checks_every_index(bad, position, index_dtype):
    """The raw C++ merge checked only the end indices: unsorted or negative ones broke its tree and ranges."""
    idx = [torch.tensor([0, 3], dtype=index_dtype), torch.tensor(bad, dtype=index_dtype)]
    val = [torch.ones(2), torch.ones(len(bad))]
    with pytest.raises(RuntimeError, match=rf"indices must be non-negative, strictly increasing and below 2\*\*61: "
                                           rf"indices\[1\] has -?\d+ at position {position}\b"):
        torch.ops.sift.merge_sorted_deltas(idx, val, [1.0, 1.0], [2], False)
    if index_dtype == torch.int64:
        idx[1] = torch.tensor([1, 2**61, 2**61 + 1])
        with pytest.raises(RuntimeError, match=r"indices\[1\] has 2305843009213693952 at position 1, outside"):
            torch.ops.sift.merge_sorted_deltas(idx, [torch.ones(2), torch.ones(3)], [1.0, 1.0], [2], False)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_and_restore_triton_match_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(37, 29, generator=gen).to(dtype), torch.randn(3000, generator=gen).to(dtype)]
    indices = [_sorted_unique(200, params[0].numel(), gen, torch.int32),
               _sorted_unique(1500, params[1].numel(), gen, torch.int64)]
    values = [torch.randn(len(i), generator=gen) for i in indices]
    originals = [p.clone() for p in params]
    ref_params = [p.clone() for p in params]
    saved, ref_saved = _ops.originals_like(params, indices), _ops.originals_like(params, indices)
    _ops.call("sparse_delta_apply_", params, indices, values, -0.5, saved, backend="triton")
    _ops.sparse_delta_apply_ref(ref_params, indices, values, -0.5, ref_saved)
    for p, r, s, rs in zip(params, ref_params, saved, ref_saved):
        assert torch.equal(p, r) and torch.equal(s, rs)
    _ops.call("sparse_delta_restore_", params, indices, saved, backend="triton")
    for p, o in zip(params, originals):
        assert torch.equal(p, o)


# ----------------------------------------------------------------- SparseDelta: round trips


def test_save_load_round_trip_is_exact_and_the_file_holds_only_positions_and_values(tmp_path):
    """Was 8 bytes an entry (int32 indices), then 6 (16-bit index halves): positions in Elias-Fano form take
    2 + log2(numel / k) bits an entry, fp32 values 4 bytes."""
    model = _model()
    delta = _random_delta(model, seed=1)
    path = tmp_path / "d.safetensors"
    delta.save(path)
    loaded = SparseDelta.load(path)
    assert list(loaded) == list(delta)
    for name in delta:
        a, b = delta[name], loaded[name]
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert b.indices.dtype == torch.int32 and torch.equal(a.indices, b.indices)
        assert torch.equal(a.values, b.values)
    assert loaded.base == delta.base
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
    positions = 0
    for e in delta.entries.values():
        low = int(math.floor(math.log2(e.numel / e.nnz)))
        positions += low * -(-e.nnz // 8) + -(-(e.nnz + ((e.numel - 1) >> low) + 1) // 8)
    assert os.path.getsize(path) == 8 + header_len + positions + 4 * delta.nnz
    assert positions < 1.5 * delta.nnz
    assert not [p for p in os.listdir(tmp_path) if p != "d.safetensors"], "temp files left behind"


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_then_remove_is_bit_identical(dtype):
    model = _model(dtype=dtype)
    before = _snapshot(model)
    delta = _random_delta(model, seed=2, std=3e-3)  # small against the weights: rounding shows in bf16
    delta.apply_(model)
    assert not torch.equal(model[0].weight, before["0.weight"])
    delta.remove_(model)
    _assert_bit_identical(model, before)


@pytest.mark.parametrize("scale", [pytest.param(1.0, id="scale1"), pytest.param(0.3, id="scale0.3")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_equals_dense_reference(dtype, scale):
    model = _model(dtype=dtype)
    expected = _snapshot(model)
    delta = _random_delta(model, seed=3)
    for name, e in delta.entries.items():
        w = expected[name].view(-1)
        if dtype == torch.float32:
            w[e.indices.long()] += scale * e.values
        else:  # the contract: fp32 arithmetic, one rounding to the weight's dtype
            w[e.indices.long()] = (w[e.indices.long()].float() + scale * e.values).to(dtype)
    delta.apply_(model, scale=scale)
    _assert_bit_identical(model, expected)


def test_stacked_deltas_come_off_in_reverse_order():
    model = _model()
    before = _snapshot(model)
    a, b = _random_delta(model, seed=4), _random_delta(model, seed=5)
    a.apply_(model)
    after_a = _snapshot(model)
    b.apply_(model)  # b's base check skips the positions a changed
    with pytest.raises(DeltaError, match="applied after it must be removed first"):
        a.remove_(model)
    b.remove_(model)
    _assert_bit_identical(model, after_a)
    a.remove_(model)
    _assert_bit_identical(model, before)
    with pytest.raises(DeltaError, match="not applied to this model"):
        a.remove_(model)
    _assert_bit_identical(model, before)


def test_from_diff_density_and_threshold():
    base = {"w": torch.zeros(2, 5), "b": torch.zeros(3), "steps": torch.tensor(3)}
    tuned = {"w": torch.tensor([[0.0, 0.5, -3.0, 0.0, 0.1], [0.0, 0.0, 2.0, 0.0, 0.0]]),
             "b": torch.zeros(3), "steps": torch.tensor(9)}
    d = SparseDelta.from_diff(base, tuned, density=0.2)
    assert list(d) == ["w"]  # b has no change, integer tensors are not weights
    assert d["w"].indices.tolist() == [2, 7] and d["w"].values.tolist() == [-3.0, 2.0]
    d = SparseDelta.from_diff(base, tuned, threshold=0.3)
    assert d["w"].indices.tolist() == [1, 2, 7]
    with pytest.raises(ValueError, match="exactly one of density= or threshold="):
        SparseDelta.from_diff(base, tuned)


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_diff_full_density_reproduces_tuned(dtype):
    base, tuned = _model(0, dtype), _model(1, dtype)
    SparseDelta.from_diff(base, tuned, density=1.0).apply_(base, check_base=True)
    for (name, a), b in zip(base.state_dict().items(), tuned.state_dict().values()):
        if dtype == torch.float32:  # base + fp32(tuned - base) rounds twice
            torch.testing.assert_close(a, b, rtol=1.2e-7, atol=1e-8, msg=name)
        else:  # the fp32 difference of two half-precision values rounds back to tuned exactly
            assert torch.equal(a, b), name


def test_from_diff_skips_tied_duplicates():
    emb = torch.nn.Embedding(11, 4)
    model = torch.nn.Sequential(emb, torch.nn.Linear(4, 11, bias=False))
    model[1].weight = emb.weight
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned[0].weight.add_(1.0)
    d = SparseDelta.from_diff(model, tuned, density=1.0)
    assert list(d) == ["0.weight"]
    d.apply_(model)
    assert torch.equal(model[1].weight, tuned[1].weight)


def test_empty_delta_and_single_entry_tensors(tmp_path):
    model = _model()
    before = _snapshot(model)
    empty = SparseDelta()
    empty.apply_(model)
    empty.remove_(model)
    empty.save(tmp_path / "empty.safetensors")
    assert len(SparseDelta.load(tmp_path / "empty.safetensors")) == 0
    assert len(merge_deltas([empty, empty])) == 0
    one = SparseDelta({"2.bias": DeltaEntry((7,), torch.float32, torch.tensor([6], dtype=torch.int32),
                                            torch.tensor([0.25])),
                       "0.bias": DeltaEntry((19,), torch.float32, torch.zeros(0, dtype=torch.int32),
                                            torch.zeros(0))})
    one.save(tmp_path / "one.safetensors")
    one = SparseDelta.load(tmp_path / "one.safetensors")
    one.apply_(model)
    assert model[2].bias[6] == before["2.bias"][6] + 0.25
    one.remove_(model)
    _assert_bit_identical(model, before)
    merged = merge_deltas([one, one, empty])
    assert merged["2.bias"].indices.tolist() == [6] and merged["2.bias"].values.tolist() == [0.5]


# ----------------------------------------------------------------- merging


def _dense(delta: SparseDelta, name: str, shape) -> torch.Tensor:
    return delta.to_dense(name).double() if name in delta else torch.zeros(shape, dtype=torch.float64)


@pytest.mark.parametrize("method", ["sum", "mean", "ties"])
def test_merge_of_three_equals_the_dense_computation(method):
    model = _model()
    deltas = [_random_delta(model, seed=s, density=d) for s, d in ((10, 0.3), (11, 0.5), (12, 0.05))]
    del deltas[2].entries["0.weight"]  # a weight only some deltas touch
    weights = [1.0, -0.5, 2.0]
    merged = merge_deltas(deltas, weights=weights, method=method)
    for name, t in model.state_dict().items():
        dense = torch.stack([w * _dense(d, name, t.shape) for d, w in zip(deltas, weights)])
        if method == "sum":
            expected = dense.sum(0)
        elif method == "mean":
            expected = dense.sum(0) / sum(weights)
        else:
            elected = torch.sign(dense.sum(0))
            agree = (torch.sign(dense) == elected) & (dense != 0)
            expected = (dense * agree).sum(0) / agree.sum(0).clamp_min(1)
        torch.testing.assert_close(merged.to_dense(name).double(), expected, rtol=1e-6, atol=1e-7)
        union = torch.stack([_dense(d, name, t.shape) != 0 for d in deltas]).any(0).view(-1).nonzero().view(-1)
        assert torch.equal(merged[name].indices.long(), union)


def test_merge_of_one_delta_is_the_identity():
    delta = _random_delta(_model(), seed=13)
    merged = merge_deltas([delta])
    assert merged.base == delta.base
    for name in delta:
        assert torch.equal(merged[name].indices, delta[name].indices)
        assert torch.equal(merged[name].values, delta[name].values)


def test_operators():
    model = _model()
    a, b = _random_delta(model, seed=14), _random_delta(model, seed=15)
    name = "0.weight"
    torch.testing.assert_close((a + b).to_dense(name), a.to_dense(name) + b.to_dense(name))
    torch.testing.assert_close((2 * a).to_dense(name), 2 * a.to_dense(name))
    torch.testing.assert_close((a * 0.5 - b / 4).to_dense(name), 0.5 * a.to_dense(name) - b.to_dense(name) / 4)
    torch.testing.assert_close(sum([a, b, -a]).to_dense(name), b.to_dense(name))
    with pytest.raises(TypeError):
        a + 1  # noqa: B018


# ----------------------------------------------------------------- from a trained SparseAdamW


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(99)
    for _ in range(steps):
        x = torch.randn(8, 23, generator=gen).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_from_optimizer_reproduces_training(dtype):
    original = _model(dtype=dtype)
    model = copy.deepcopy(original)
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
    _train(model, opt)
    delta = SparseDelta.from_optimizer(opt, model)
    for name, p in model.named_parameters():
        st = opt.state[p]
        assert torch.equal(delta[name].indices, st["indices"].to(torch.int32))
        if dtype == torch.bfloat16:
            # A 16-bit weight's increment: the bf16 value that gives the tuned weight where one exists
            # (what its file keeps in 2 bytes), else tuned minus base (exact in fp32).
            tuned = p.detach().reshape(-1)[st["indices"].long()]
            exact = tuned.float() - st["base"].float()
            values = delta[name].values
            short = values.to(dtype).float() == values
            assert torch.equal(values[~short], exact[~short]) and short.float().mean() > 0.5
            assert torch.equal((st["base"].float() + values).to(dtype), tuned)
        else:
            assert torch.equal(delta[name].values, st["delta"])  # exactly the optimizer's increments
    target = copy.deepcopy(original)
    delta.apply_(target)  # also checks the fingerprint against the untrained copy
    for (name, got), want in zip(target.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name  # the optimizer writes round(base + delta) too
    # The trained model is not the base: its changed entries are what the check compares (the optimizer
    # keeps the base values at every chosen entry).
    with pytest.raises(DeltaError, match="another base model"):
        delta.apply_(model)


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_from_optimizer_after_set_indices_reproduces_training(dtype, compact):
    """set_indices dropped the increments of entries leaving the set, so from_optimizer lost them (and the base)."""
    original = _model(dtype=dtype)
    model = copy.deepcopy(original)
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1, compact_grads=compact)
    _train(model, opt, steps=3)
    first = {p: opt.state[p]["indices"].clone() for p in model.parameters()}
    for p in model.parameters():  # overlapping but different: every third position
        opt.set_indices(p, torch.arange(0, p.numel(), 3))
    _train(model, opt, steps=3)
    for p in model.parameters():  # back to the first set's even half, plus positions new to both
        again = torch.cat([first[p][::2].long(), torch.arange(1, p.numel(), 7)]).unique()
        opt.set_indices(p, again)
    _train(model, opt, steps=3)
    assert all(opt.state[p]["retired_indices"].numel() for p in model.parameters())
    delta = SparseDelta.from_optimizer(opt, model)
    for name, p in model.named_parameters():
        st = opt.state[p]
        idx = delta[name].indices
        assert idx.dtype == torch.int32 and bool((idx[1:] > idx[:-1]).all())
        assert idx.numel() == st["indices"].numel() + st["retired_indices"].numel()
    target = copy.deepcopy(original)
    delta.apply_(target)  # also checks the fingerprint against the untrained copy
    for (name, got), want in zip(target.state_dict().items(), model.state_dict().values()):
        if dtype == torch.bfloat16:
            assert torch.equal(got, want), name  # round(base + delta), as the optimizer writes it
        else:
            # The optimizer added each step to the weight in fp32; the delta holds their fp32 sum,
            # added once: a few roundings of |w| < 1 (ulp <= 2**-24) apart, never more.
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    if dtype == torch.bfloat16:  # retired entries keep their base values for the fingerprint too
        with pytest.raises(DeltaError, match="another base model"):
            delta.apply_(model)


def test_from_optimizer_keeps_dense_params_whole():
    """Regression: densely trained params were left out of the delta with a warning (a reloaded fine-tune
    lost its head), or, with base=, stored as differences that a freshly initialised head refused."""
    original = _model()
    model = copy.deepcopy(original)
    opt = SparseAdamW([{"params": [model[0].weight, model[2].weight], "density": 0.2},
                       {"params": [model[0].bias, model[2].bias], "density": 1.0}], lr=1e-2)
    _train(model, opt, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        delta = SparseDelta.from_optimizer(opt, model)
        with_base = SparseDelta.from_optimizer(opt, model, base=original)
    assert sorted(delta) == ["0.weight", "2.weight"] and sorted(delta.dense) == ["0.bias", "2.bias"]
    for d in (delta, with_base):
        target = copy.deepcopy(original)
        with torch.no_grad():  # another initialisation of the dense params: they are replaced whole
            target[0].bias.normal_()
            target[2].bias.normal_()
        before = {k: v.clone() for k, v in target.state_dict().items()}
        d.apply_(target)
        for (name, got), want in zip(target.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
        assert torch.equal(target[0].bias, model[0].bias)
        with pytest.raises(DeltaError, match="already applied"):
            d.apply_(target)
        d.remove_(target)
        for name, value in target.state_dict().items():
            assert torch.equal(value, before[name]), name


def test_dense_parts_survive_save_load_and_merges(tmp_path):
    original = _model()
    model = copy.deepcopy(original)
    opt = SparseAdamW([{"params": [model[0].weight], "density": 0.2},
                       {"params": [model[2].bias], "density": 1.0}], lr=1e-2)
    _train(model, opt, steps=2)
    delta = SparseDelta.from_optimizer(opt, model)
    delta.save(tmp_path / "d.safetensors")
    loaded = SparseDelta.load(tmp_path / "d.safetensors")
    assert torch.equal(loaded.dense["2.bias"], delta.dense["2.bias"]) and loaded.checksum() == delta.checksum()
    merged = merge_deltas([delta, loaded * 0.5])
    assert torch.equal(merged.dense["2.bias"], delta.dense["2.bias"])  # carried through, not scaled
    other = SparseDelta(dict(delta.entries), delta.base, {"2.bias": delta.dense["2.bias"] + 1})
    with pytest.raises(DeltaError, match="replace it with different tensors"):
        merge_deltas([delta, other])
    target = copy.deepcopy(original)
    delta.apply_(target)
    with pytest.raises(DeltaError, match="already applied"):  # the same fine-tune, loaded again
        loaded.apply_(target)
    loaded.apply_(target, stack=True)  # on purpose
    loaded.remove_(target)
    delta.remove_(target)
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), original.state_dict().values()))


# ----------------------------------------------------------------- bad input: clear error, nothing changed


def _saved_delta(tmp_path, model):
    delta = _random_delta(model, seed=20)
    path = tmp_path / "d.safetensors"
    delta.save(path)
    return delta, path


@pytest.mark.parametrize("damage,match", [
    pytest.param("truncate", "not a readable safetensors file", id="truncated"),
    pytest.param("flip-data", "checksum mismatch", id="corrupted-data"),
    pytest.param("flip-header", "not a readable safetensors file", id="corrupted-header"),
])
def test_damaged_file_is_refused(tmp_path, damage, match):
    _, path = _saved_delta(tmp_path, _model())
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip-data":
        data[-5] ^= 0x40
    else:
        data[12] = ord("}")
    path.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match=match):
        SparseDelta.load(path)
    assert path.read_bytes() == bytes(data)


def test_file_with_wrong_tensor_dtype_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sift.delta import _checksum

    _, path = _saved_delta(tmp_path, _model())
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["values.float32"] = tensors["values.float32"].half()
    meta["checksum"] = _checksum(tensors)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(DeltaError, match=r"shared tensors missing or of the wrong dtype: values\.float32"):
        SparseDelta.load(path)


def _corrupt(delta: SparseDelta, kind: str) -> None:
    e = delta["0.weight"]
    if kind == "unsorted":
        e.indices[[1, 2]] = e.indices[[2, 1]]
    elif kind == "duplicate":
        e.indices[3] = e.indices[2]
    elif kind == "out-of-range":
        e.indices[-1] = e.numel
    elif kind == "nan":
        e.values[5] = float("nan")


@pytest.mark.parametrize("kind,match", [
    pytest.param("unsorted", r"0\.weight: indices are not sorted and unique", id="unsorted"),
    pytest.param("duplicate", r"0\.weight: indices are not sorted and unique", id="duplicate"),
    pytest.param("out-of-range", r"0\.weight: indices out of range: span \[\d+, 437\]", id="out-of-range"),
    pytest.param("nan", r"0\.weight: 1 NaN and 0 infinite values", id="nan"),
])
def test_invalid_entries_are_refused_everywhere(tmp_path, kind, match):
    model = _model()
    before = _snapshot(model)
    delta = _random_delta(model, seed=21)
    _corrupt(delta, kind)
    with pytest.raises(DeltaError, match=match):
        delta.apply_(model)
    _assert_bit_identical(model, before)
    with pytest.raises(DeltaError, match=match):
        merge_deltas([delta, _random_delta(model, seed=22)])
    with pytest.raises(DeltaError, match=match):
        delta.save(tmp_path / "bad.safetensors")
    assert not os.listdir(tmp_path)


def test_wrong_model_problems_are_all_listed_and_nothing_changes():
    model = _model()
    before = _snapshot(model)
    delta = _random_delta(model, seed=23)
    delta.entries["3.weight"] = DeltaEntry((2, 2), torch.float32, torch.tensor([1], dtype=torch.int32),
                                           torch.ones(1))
    e = delta["2.weight"]
    delta.entries["2.weight"] = DeltaEntry((7, 20), e.dtype, e.indices, e.values)
    delta.entries["2.bias"] = DeltaEntry((7,), torch.bfloat16, delta["2.bias"].indices, delta["2.bias"].values)
    with pytest.raises(DeltaError) as info:
        delta.apply_(model, check_base=False)
    problems = info.value.problems
    assert any(p.startswith("3.weight: no such weight in the model") for p in problems)
    assert any(p.startswith("2.weight: shape mismatch: delta (7, 20), model (7, 19)") for p in problems)
    assert any(p.startswith("2.bias: dtype mismatch: delta torch.bfloat16, model torch.float32") for p in problems)
    assert len(problems) == 3
    assert "the model is unchanged" in str(info.value)
    _assert_bit_identical(model, before)  # 0.weight and 0.bias were valid and are untouched too


@pytest.mark.parametrize("other,match", [
    pytest.param("same-architecture", r"another base model: \d+ of \d+ sampled base values differ", id="other-weights"),
    pytest.param("other-architecture", "another base model: names, shapes or dtypes differ", id="other-structure"),
])
def test_delta_for_another_base_is_refused(tmp_path, other, match):
    base = _model(0)
    tuned = _model(1)
    delta = SparseDelta.from_diff(base, tuned, density=0.2)
    delta.save(tmp_path / "d.safetensors")
    delta = SparseDelta.load(tmp_path / "d.safetensors")
    target = _model(2) if other == "same-architecture" else torch.nn.Sequential(_model(0), torch.nn.Linear(7, 2))
    if other == "other-architecture":
        delta = SparseDelta({f"0.{n}": e for n, e in delta.entries.items()}, delta.base)
    before = _snapshot(target)
    with pytest.raises(DeltaError, match=match):
        delta.apply_(target)
    _assert_bit_identical(target, before)


def test_merge_refuses_deltas_of_different_bases():
    a = SparseDelta.from_diff(_model(0), _model(1), density=0.2)
    b = SparseDelta.from_diff(_model(2), _model(1), density=0.2)
    values = a["0.weight"].values.clone()
    with pytest.raises(DeltaError, match="delta 1 and delta 0 are for different base models: 16 sampled base values differ"):
        merge_deltas([a, b])
    assert torch.equal(a["0.weight"].values, values)


def test_merge_refuses_shape_mismatch_and_bad_arguments():
    model = _model()
    a, b = _random_delta(model, seed=30), _random_delta(model, seed=31)
    b.entries["0.bias"] = DeltaEntry((20,), torch.float32, b["0.bias"].indices, b["0.bias"].values)
    with pytest.raises(DeltaError, match=r"0\.bias: delta 1 has torch.float32 \(20,\), delta 0 has"):
        merge_deltas([a, b])
    with pytest.raises(ValueError, match="method must be one of"):
        merge_deltas([a], method="median")
    with pytest.raises(ValueError, match="got 1 weights for 2 deltas"):
        merge_deltas([a, a], weights=[1.0])


def test_interrupted_save_leaves_the_old_file(tmp_path, monkeypatch):
    """A crash mid-write must never leave a partial file under the destination name."""
    import safetensors.torch

    model = _model()
    old, path = _saved_delta(tmp_path, model)
    content = path.read_bytes()

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        _random_delta(model, seed=40).save(path)
    assert path.read_bytes() == content
    assert os.listdir(tmp_path) == ["d.safetensors"]


# ----------------------------------------------------------------- regressions found in review


def test_entry_shape_given_as_list_matches_the_model():
    """A DeltaEntry built with a list shape was refused as 'shape mismatch: delta [7, 19], model (7, 19)'."""
    model = _model()
    before = _snapshot(model)
    entry = DeltaEntry([7, 19], torch.float32, torch.tensor([0, 5], dtype=torch.int32), torch.ones(2))
    assert entry.shape == (7, 19)
    SparseDelta({"2.weight": entry}).apply_(model)
    assert model[2].weight.view(-1)[[0, 5]].tolist() == (before["2.weight"].view(-1)[[0, 5]] + 1).tolist()


def test_apply_accepts_strided_user_tensors():
    """Strided indices/values passed validation, then the C++ op raised 'values must be contiguous'."""
    model = _model()
    before = _snapshot(model)
    indices = torch.arange(0, 40, dtype=torch.int32)[::4]
    values = torch.arange(20, dtype=torch.float32)[::2]
    assert not indices.is_contiguous() and not values.is_contiguous()
    delta = SparseDelta({"2.weight": DeltaEntry((7, 19), torch.float32, indices, values)})
    delta.apply_(model)
    expected = before["2.weight"].clone()
    expected.view(-1)[indices.long()] += values
    assert torch.equal(model[2].weight, expected)
    delta.remove_(model)
    _assert_bit_identical(model, before)


def test_save_entries_sharing_memory(tmp_path):
    """One index tensor reused by two entries made safetensors refuse the save ('Some tensors share memory')."""
    indices = torch.tensor([1, 4, 6], dtype=torch.int32)
    values = torch.randn(3)
    delta = SparseDelta({"0.bias": DeltaEntry((19,), torch.float32, indices, values),
                         "2.bias": DeltaEntry((7,), torch.float32, indices, -values)})
    delta.save(tmp_path / "d.safetensors")
    loaded = SparseDelta.load(tmp_path / "d.safetensors")
    for name in delta:
        assert torch.equal(loaded[name].indices, delta[name].indices)
        assert torch.equal(loaded[name].values, delta[name].values)


def test_load_missing_file_raises_file_not_found(tmp_path):
    """A missing path was reported as a DeltaError 'truncated or corrupted?' file."""
    with pytest.raises(FileNotFoundError, match="no sparse delta file"):
        SparseDelta.load(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("entries", [
    pytest.param(lambda e: {n: {"dtype": "float32"} for n in e}, id="no-shape"),
    pytest.param(lambda e: {n: {"dtype": "float32", "shape": "7x19"} for n in e}, id="shape-string"),
    pytest.param(lambda e: {n: 3 for n in e}, id="entry-not-a-dict"),
    pytest.param(lambda e: list(e), id="entries-a-list"),
])
def test_malformed_metadata_raises_delta_error(tmp_path, entries):
    """Malformed metadata entries escaped load() as KeyError/AttributeError/ValueError, not DeltaError."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    _, path = _saved_delta(tmp_path, _model())
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["entries"] = json.dumps(entries(json.loads(meta["entries"])))
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(DeltaError, match="unreadable metadata"):
        SparseDelta.load(path)


def test_from_diff_density_count_is_exact_under_float_rounding():
    """density=0.07 of 100 entries kept 8: ceil(0.07 * 100) is ceil(7.000000000000001) in floats."""
    delta = SparseDelta.from_diff({"w": torch.zeros(100)}, {"w": torch.arange(1.0, 101.0)}, density=0.07)
    assert delta["w"].indices.tolist() == list(range(93, 100))


def test_from_optimizer_ignores_buffers_changed_by_training():
    """BatchNorm running stats changed in training went into the fingerprint, so the base was refused."""
    torch.manual_seed(0)
    original = torch.nn.Sequential(torch.nn.Linear(23, 19), torch.nn.BatchNorm1d(19), torch.nn.Linear(19, 7))
    model = copy.deepcopy(original)
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2)
    _train(model, opt, steps=3)
    assert not torch.equal(model[1].running_mean, original[1].running_mean)
    delta = SparseDelta.from_optimizer(opt, model)
    target = copy.deepcopy(original)
    delta.apply_(target)
    for name, p in model.named_parameters():
        torch.testing.assert_close(target.get_parameter(name), p, rtol=1e-6, atol=1e-7, msg=name)


@spawned_rank
def _fsdp2_from_optimizer_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2)
        _train(model, opt, steps=1)
        delta = SparseDelta.from_optimizer(opt, model)
        torch.save({n: (e.indices, e.values) for n, e in delta.entries.items()}, out)
    finally:
        dist.destroy_process_group()


def test_from_optimizer_of_fsdp2_shards_equals_unsharded(tmp_path):
    """FSDP2 (DTensor) params failed deep in indexing ('got mixed torch.Tensor and DTensor'); on one rank the
    sharded delta is the unsharded one (2 and 3 ranks: tests/test_fsdp.py)."""
    pytest.importorskip("torch.distributed.fsdp")
    import torch.multiprocessing as mp

    out = str(tmp_path / "delta.pt")
    mp.spawn(_fsdp2_from_optimizer_worker, args=(str(tmp_path / "init"), out), nprocs=1, join=True)
    got = torch.load(out, weights_only=True)
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2)
    _train(model, opt, steps=1)
    want = SparseDelta.from_optimizer(opt, model)
    assert sorted(got) == sorted(want.entries) and "0.weight" in got
    for name, entry in want.entries.items():
        assert torch.equal(got[name][0], entry.indices), name
        torch.testing.assert_close(got[name][1], entry.values, rtol=1e-6, atol=1e-7)


APPLY_BACKENDS = [pytest.param("torch", id="torch"),
                  pytest.param("cpp", id="cpp", marks=requires_cpp),
                  pytest.param("triton", id="triton", marks=requires_triton)]


@pytest.mark.parametrize("backend", APPLY_BACKENDS)
def test_apply_and_restore_refuse_lists_of_different_lengths(backend):
    """The torch and Triton apply/restore zip()ped their lists, silently skipping params past the shortest."""
    params = [torch.zeros(5), torch.zeros(3)]
    indices = [torch.tensor([1], dtype=torch.int32)]
    values = [torch.ones(1), torch.ones(1)]
    with pytest.raises((ValueError, RuntimeError), match="indices must have one tensor per param"):
        _ops.call("sparse_delta_apply_", params, indices, values, 1.0, [torch.zeros(1)] * 2, backend=backend)
    with pytest.raises((ValueError, RuntimeError), match="originals must have one tensor per param"):
        _ops.call("sparse_delta_restore_", params, indices + [indices[0]], [torch.zeros(1)], backend=backend)
    assert all(not p.any() for p in params)


def test_merge_reference_refuses_inconsistent_group_sizes():
    """The torch merge ignored inputs past sum(group_sizes) instead of refusing them."""
    idx = [torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32)]
    with pytest.raises(ValueError, match="group_sizes must be >= 1 and add up"):
        _ops.merge_sorted_deltas_ref(idx, [torch.ones(2), torch.ones(2)], [1.0, 1.0], [1], False)


def test_docstring_examples_run():
    """The examples in sift.delta's docstrings are executed, so they cannot drift."""
    import doctest
    import importlib
    import pkgutil

    import sift.delta

    attempted = 0
    for info in pkgutil.iter_modules(sift.delta.__path__, "sift.delta."):
        result = doctest.testmod(importlib.import_module(info.name), optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, f"{result.failed} examples in {info.name} failed (printed above)"
        attempted += result.attempted
    assert attempted > 10


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_apply_remove_and_merge_match_cpu(dtype):
    cpu_model = _model(dtype=dtype)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    before = _snapshot(gpu_model)
    a, b = _random_delta(cpu_model, seed=50), _random_delta(cpu_model, seed=51)
    merged = merge_deltas([a, b], method="ties")
    merged.apply_(cpu_model, scale=0.7)
    merged.apply_(gpu_model, scale=0.7)  # Triton scatter-add on CUDA tensors
    for (name, got), want in zip(gpu_model.state_dict().items(), cpu_model.state_dict().values()):
        # GPU may fuse the multiply-add into an FMA: one rounding instead of two.
        torch.testing.assert_close(got.cpu(), want, rtol=2e-7 if dtype == torch.float32 else 1e-2, atol=1e-7,
                                   msg=name)
    merged.remove_(gpu_model)
    _assert_bit_identical(gpu_model, before)
    idx = [e.indices.cuda() for d in (a, b) for e in d.entries.values()]
    val = [e.values.cuda() for d in (a, b) for e in d.entries.values()]
    sizes = [1] * len(idx)
    got_idx, got_val = _ops.call("merge_sorted_deltas", idx, val, [1.0] * len(idx), sizes, True)
    ref_idx, ref_val = _ops.merge_sorted_deltas_ref([i.cpu() for i in idx], [v.cpu() for v in val],
                                                    [1.0] * len(idx), sizes, True)
    for gi, gv, ri, rv in zip(got_idx, got_val, ref_idx, ref_val):
        assert torch.equal(gi.cpu(), ri) and torch.equal(gv.cpu(), rv)


@requires_cpp
def test_bench_quick_runs_and_saves_its_tables(tmp_path, monkeypatch):
    """Smoke run of `python -m sift.bench delta --quick`: tables and files, no timing checked."""
    import json

    from sift.bench import delta as bench

    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = bench.run(quick=True)
    assert markdown.splitlines()[2].startswith("Machine: ")
    impls = [line.split("|")[2].strip() for line in markdown.splitlines() if line.startswith("| merge |")
             or line.startswith("| apply |")]
    assert "sift C++ merge_sorted_deltas (sum)" in impls and "torch index_add_ (baseline)" in impls
    saved = json.loads((tmp_path / "delta-cpu-quick.json").read_text())
    assert len(saved["rows"]) == 8 and saved["quick"] is True
    # fp32 values and Elias-Fano positions, at most 2 + ceil(log2(space / entries)) bits an entry (1.07 B at
    # the one delta's 1%); the header (~350 B) adds little.
    space = 10_000_000
    for row in saved["files"]:
        bound = 4 + (2 + math.ceil(math.log2(space / row["entries"]))) / 8
        assert 4.5 < row["bytes / entry"] <= bound + 0.01, row


@requires_cpp
def test_cpp_merge_rejects_group_sizes_whose_sum_wraps():
    """merge_sorted_deltas summed group_sizes in int64 unchecked: sizes wrapping to len(indices) passed, then crashed."""
    ix, val = torch.tensor([1, 4], dtype=torch.int32), torch.ones(2)
    with pytest.raises(RuntimeError, match="group_sizes must add up to the number of indices tensors"):
        torch.ops.sift.merge_sorted_deltas([ix], [val], [1.0], [2**62] * 3 + [2**62 + 1], False)


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"), pytest.param("cpp", id="cpp", marks=requires_cpp)])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("ties", [pytest.param(False, id="sum"), pytest.param(True, id="ties")])
def test_merged_tensors_hold_no_storage_beyond_their_entries(backend, index_dtype, ties, monkeypatch):
    """merge_sorted_deltas shrank its outputs with resize_, keeping storage for the sum of its inputs."""
    gen = torch.Generator().manual_seed(11)
    shared = _sorted_unique(150_000, 600_000, gen, index_dtype)  # 8 copies: several ranges per thread
    groups = [
        [shared] * 8,
        [_sorted_unique(n, 3000, gen, index_dtype) for n in (1000, 2000, 1500)],
        [_sorted_unique(500, 1000, gen, index_dtype)],
        [torch.empty(0, dtype=index_dtype), _sorted_unique(10, 50, gen, index_dtype)],
        [torch.empty(0, dtype=index_dtype)] * 2,
    ]
    indices = [i for group in groups for i in group]
    values = [torch.randn(i.numel(), generator=gen) for i in indices]
    weights = [0.5 + 0.1 * j for j in range(len(indices))]
    sizes = [len(group) for group in groups]
    out_idx, out_val = _ops.call("merge_sorted_deltas", indices, values, weights, sizes, ties, backend=backend)
    assert out_idx[0].numel() == shared.numel()
    for t in (*out_idx, *out_val):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    # The user-facing merge, on deltas that share entries.
    monkeypatch.setenv("SIFT_BACKEND", backend)
    model = _model()
    merged = merge_deltas([_random_delta(model, seed) for seed in range(3)], method="ties" if ties else "sum")
    for entry in merged.entries.values():
        for t in (entry.indices, entry.values):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
