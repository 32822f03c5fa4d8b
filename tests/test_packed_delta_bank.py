"""PackedDeltaBank, the CPU serving form: it holds the same entries as the CSR bank it was packed from
(round trip over the hard shapes), costs no more than the fine-tune's file at sift's default density,
and both ops over it give the CSR kernels' bits; a malformed bank is refused with nothing written."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import requires_cpp

from sift import _ops
from sift._ops import DeltaBank, PackedDeltaBank
from sift.delta import SparseDelta
from sift.delta.serving import ServedDeltas

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (R, C): one row, one column, rows not a multiple of a block (32), a bucket (256) wider than a row and
# rows wider than one, int32 columns in CSR (C > 32768), a row block of 256 rows and more.
SHAPES = [(1, 7), (40, 1), (37, 65), (33, 300), (3, 40_000), (300, 700)]
# A dense delta, sift's range, one with long runs of empty buckets, and an empty one.
DENSITIES = (1.0, 0.05, 0.01, 0.001, 0.0)


def _bank(shape: tuple[int, int], gen: torch.Generator, values_dtype: torch.dtype = torch.float32) -> DeltaBank:
    r, c = shape
    deltas = []
    for density in DENSITIES:
        k = int(density * r * c)
        flat = torch.randperm(r * c, generator=gen)[:k]
        deltas.append((flat // c, flat % c, torch.randn(k, generator=gen).to(values_dtype)))
    return DeltaBank.from_rows_and_cols(shape, deltas)


def _same(a: DeltaBank, b: DeltaBank) -> bool:
    return (torch.equal(a.row_ptr, b.row_ptr) and torch.equal(a.col_indices, b.col_indices)
            and torch.equal(a.values, b.values) and a.max_row_entries == b.max_row_entries)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}xC{}".format(*s))
def test_packing_keeps_every_entry_and_value_in_order(shape):
    bank = _bank(shape, torch.Generator().manual_seed(shape[0] * 7 + shape[1]))
    packed = bank.packed()
    assert _same(packed.unpacked(), bank)
    assert packed.entry_counts() == bank.entry_counts()
    assert (packed.n_deltas, packed.out_features, packed.in_features) == (bank.n_deltas, *shape)
    # Loading and unloading in the packed form: the CSR bank's own edits, packed.
    gen = torch.Generator().manual_seed(1)
    flat = torch.randperm(shape[0] * shape[1], generator=gen)[:5]
    more = (flat // shape[1], flat % shape[1], torch.randn(flat.numel(), generator=gen))
    assert _same(packed.appended(*more).unpacked(), bank.appended(*more))
    assert _same(packed.without(1).unpacked(), bank.without(1))
    assert _same(DeltaBank.from_rows_and_cols(shape, []).packed().unpacked(), DeltaBank.from_rows_and_cols(shape, []))


def test_the_packed_bytes_are_the_layout_s():
    """Per delta: a low byte and a value per entry, the unary words, the block pointers."""
    bank = _bank((300, 700), torch.Generator().manual_seed(2))
    packed = bank.packed()
    buckets = -(-300 * 700 // 256)
    for d, k in enumerate(bank.entry_counts()):
        words = -(-(k + buckets) // 64)
        assert packed.delta_bytes(d) == k * 5 + 8 * words + (-(-300 // 32) + 1) * 4
        assert int(packed.high_start[d + 1] - packed.high_start[d]) == words


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_loaded_fine_tune_holds_no_more_than_its_file_at_the_default_density(tmp_path):
    """sift's default, a random 1% of q/k/v/o of a 576-wide fp32 model: the bytes served equal at most the
    file's (the target of serving many fine-tunes), where CSR holds about a quarter more."""
    base = _tiny_llama()
    gen = torch.Generator().manual_seed(3)
    tuned = _tiny_llama()
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if any(t in name for t in ("q_proj", "k_proj", "v_proj", "o_proj")):
                p += (torch.rand(p.shape, generator=gen) < 0.01) * torch.randn(p.shape, generator=gen) * 1e-3
    delta = SparseDelta.from_diff(base, tuned, density=1.0)
    delta.save_pretrained(tmp_path)
    file_bytes = sum(os.path.getsize(os.path.join(tmp_path, f)) for f in os.listdir(tmp_path)
                     if f.endswith(".safetensors"))
    served = ServedDeltas(base, backend="torch")
    served.load_delta("d", delta)
    held = served.held_bytes("d")
    csr = sum(layer.bank.unpacked().delta_bytes(0) for layer in served._layers.values())
    served.close()
    assert held <= file_bytes < csr, (held, file_bytes, csr)


def _ids(tokens: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-1, n, (tokens,), generator=gen, dtype=torch.int32)


@requires_cpp
@pytest.mark.parametrize("tokens", [1, 8, 9, 40], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("values", ["fp32", "own"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}xC{}".format(*s))
def test_the_packed_product_is_the_csr_kernel_s_bits(shape, dtype, values, tokens):
    """Token groups of one (read in place), of eight (the panel) and a ragged ninth, ids of -1 and of every
    delta: the C++ kernel over the packed bank writes the CSR kernel's bits, and the packed reference
    agrees with both within fp32 summation order."""
    gen = torch.Generator().manual_seed(tokens * 31 + shape[0])
    bank = _bank(shape, gen, torch.float32 if values == "fp32" else dtype)
    packed = bank.packed()
    x = torch.randn(tokens, shape[1], generator=gen).to(dtype)
    y = torch.randn(tokens, shape[0], generator=gen).to(dtype)
    ids = _ids(tokens, bank.n_deltas, gen)
    want = _ops.mixed_delta_matmul_(y.clone(), x, ids, bank, backend="cpp")
    got = _ops.mixed_delta_matmul_(y.clone(), x, ids, packed, backend="cpp")
    assert torch.equal(got, want)
    ref = _ops.mixed_delta_matmul_(y.clone(), x, ids, packed, backend="torch")
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(ref.float(), got.float(), rtol=tol, atol=tol)
    assert torch.equal(got[ids == -1], y[ids == -1])


@requires_cpp
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_packed_switch_is_the_csr_kernel_s_bits(dtype):
    """Two layers (one a transposed view, as Conv1D's weight is served), every (off, on) pair in turn: the
    weights and saved values are the CSR kernel's bits, and the base comes back."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(37, 65), (300, 700)]
    banks = [_bank(s, gen) for s in shapes]
    packed = [b.packed() for b in banks]
    base = [torch.randn(37, 65, generator=gen).to(dtype), torch.randn(700, 300, generator=gen).to(dtype).t()]
    csr_w = [w.clone() for w in base]
    packed_w = [torch.randn(700, 300).to(dtype).t() for _ in base[1:]]
    packed_w = [base[0].clone(), packed_w[0]]
    packed_w[1].copy_(base[1])
    saved_csr, saved_packed, current = [], [], -1
    for on in (0, 2, 1, -1, 3, 4, -1):
        sizes = [b.entry_counts()[on] for b in banks] if on >= 0 else []
        new_csr = [torch.empty(k, dtype=dtype) for k in sizes]
        new_packed = [torch.empty(k, dtype=dtype) for k in sizes]
        _ops.delta_bank_switch_(csr_w, banks, current, on, saved_csr, new_csr, backend="cpp")
        _ops.delta_bank_switch_(packed_w, packed, current, on, saved_packed, new_packed, backend="cpp")
        assert all(torch.equal(a, b) for a, b in zip(csr_w, packed_w)), on
        assert all(torch.equal(a, b) for a, b in zip(new_csr, new_packed)), on
        saved_csr, saved_packed, current = new_csr, new_packed, on
    assert all(torch.equal(a, b) for a, b in zip(packed_w, base))


def _corrupt(packed: PackedDeltaBank, how: str) -> PackedDeltaBank:
    """`packed` with delta 0 (the dense one) damaged as `how` says."""
    import dataclasses

    if how == "block_ptr decreases":
        ptr = packed.block_ptr.clone()
        ptr[0, 1], ptr[0, 2] = ptr[0, 2] + 1, ptr[0, 1]
        return dataclasses.replace(packed, block_ptr=ptr)
    if how == "high_start past high":
        start = packed.high_start.clone()
        start[-1] += 10
        return dataclasses.replace(packed, high_start=start)
    if how == "positions out of order":
        low = packed.low.clone()
        low[:4] = torch.tensor([200, 100, 50, 10], dtype=torch.uint8)  # delta 0 is dense: one bucket
        return dataclasses.replace(packed, low=low)
    if how == "words cut short":
        start = packed.high_start.clone()
        start[1:] -= 2
        return dataclasses.replace(packed, high=packed.high[:-2], high_start=start)
    raise AssertionError(how)


CORRUPTIONS = ["block_ptr decreases", "high_start past high", "positions out of order", "words cut short"]


@requires_cpp
@pytest.mark.parametrize("how", CORRUPTIONS)
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_a_malformed_packed_bank_is_refused_with_nothing_written(how, backend):
    gen = torch.Generator().manual_seed(6)
    bank = _bank((300, 700), gen)
    bad = _corrupt(bank.packed(), how)
    w = torch.randn(300, 700, generator=gen)
    kept = w.clone()
    k = bad.entry_counts()[0]
    with pytest.raises(ValueError):
        _ops.delta_bank_switch_([w], [bad], -1, 0, [], [torch.empty(max(k, 0))], backend=backend)
    assert torch.equal(w, kept)
    x, y = torch.randn(4, 700, generator=gen), torch.randn(4, 300, generator=gen)
    y0 = y.clone()
    with pytest.raises(ValueError):
        _ops.mixed_delta_matmul_(y, x, torch.tensor([0, 0, -1, 0], dtype=torch.int32), bad, backend=backend)
    assert torch.equal(y, y0)


@requires_cpp
@pytest.mark.parametrize("how", ["positions out of order", "words cut short"])
def test_the_raw_kernel_stops_on_a_position_it_cannot_decode(how):
    """torch.ops.sift.mixed_delta_matmul_packed_ is public: it decodes each position checked."""
    gen = torch.Generator().manual_seed(7)
    bad = _corrupt(_bank((300, 700), gen).packed(), how)
    x, y = torch.randn(1, 700, generator=gen), torch.randn(1, 300, generator=gen)
    with pytest.raises(RuntimeError, match="decodes to positions"):
        torch.ops.sift.mixed_delta_matmul_packed_(y, x, torch.tensor([0], dtype=torch.int32), bad.block_ptr,
                                                  bad.low, bad.high, bad.high_start, bad.values)


def test_mixing_packed_and_csr_banks_in_one_switch_is_refused():
    bank = _bank((37, 65), torch.Generator().manual_seed(8))
    w = [torch.zeros(37, 65), torch.zeros(37, 65)]
    with pytest.raises(ValueError, match="a mix"):
        _ops.delta_bank_switch_(w, [bank, bank.packed()], -1, -1, [], [])


def test_a_packed_and_a_csr_served_model_give_the_same_bits():
    """layout='packed' (the CPU default) and layout='csr': the same rows and the same switched weights."""
    base = _tiny_llama()
    gen = torch.Generator().manual_seed(9)
    deltas = {}
    for name in ("a", "b"):
        tuned = _tiny_llama()
        with torch.no_grad():
            for n, p in tuned.named_parameters():
                if "proj" in n:
                    p += (torch.rand(p.shape, generator=gen) < 0.02) * torch.randn(p.shape, generator=gen) * 1e-2
        deltas[name] = SparseDelta.from_diff(base, tuned, density=1.0)
    ids = torch.randint(0, 64, (3, 5), generator=gen)
    got = {}
    for layout in ("packed", "csr"):
        served = ServedDeltas(base, layout=layout)
        for name, delta in deltas.items():
            served.load_delta(name, delta)
        kind = PackedDeltaBank if layout == "packed" else DeltaBank
        assert all(isinstance(layer.bank, kind) for layer in served._layers.values())
        with torch.no_grad():
            logits = served(ids, delta_names=["a", None, "b"]).logits
            served.switch_to("b")
            weights = {n: p.clone() for n, p in base.state_dict().items()}
            served.switch_to(None)
        got[layout] = (logits, weights)
        served.close()
    assert torch.equal(got["packed"][0], got["csr"][0])
    assert all(torch.equal(got["packed"][1][n], got["csr"][1][n]) for n in got["csr"][1])


def test_a_packed_layout_the_backend_cannot_read_is_refused():
    with pytest.raises(ValueError, match="layout='packed'"):
        ServedDeltas(_tiny_llama(), backend="triton", layout="packed")
    with pytest.raises(ValueError, match="layout must be"):
        ServedDeltas(_tiny_llama(), layout="coo")
