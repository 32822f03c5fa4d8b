"""The delta file's compact encodings (format 5): Elias-Fano positions, 16-bit words with their wider
exceptions, the shortest 16-bit increments, and older formats still read."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sift import SparseDelta, _ops
from sift.delta import DeltaEntry, DeltaError
from sift.delta.packing import (decode_positions, decode_words, encode_positions, encode_words, pack_bits,
                                shortest_increments, unpack_bits)
from sift.delta.storage import _checksum
from conftest import requires_cpp

HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def _rewrite(path, metadata, tensors):
    metadata = dict(metadata, checksum=_checksum(tensors))  # well-formed file, wrong content
    save_file(tensors, str(path), metadata=metadata)


def test_bits_pack_and_unpack_least_significant_first():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [0b10000001, 1]
    assert torch.equal(unpack_bits(pack_bits(bits), 9), bits)


@pytest.mark.parametrize("numel, k", [(1, 0), (1, 1), (10, 10), (147456, 1475), (147456, 147), (1000, 999),
                                      (5, 2), (2**20, 7), (2**33, 10)])
def test_positions_round_trip_at_elias_fanos_size(numel, k):
    gen = torch.Generator().manual_seed(numel % 1000 + k)
    if numel < 2**24:
        x = torch.randperm(numel, generator=gen)[:k].sort().values
    else:  # a weight past 2**31 elements: int64 positions
        x = torch.randint(0, numel, (k,), generator=gen).unique().sort().values
        k = x.numel()
    low_bits, low, high = encode_positions(x, numel)
    assert torch.equal(decode_positions(low_bits, low, high, k, numel), x)
    if k:
        assert low_bits == int(math.floor(math.log2(numel / k)))
        # Elias-Fano's bound: at most 2 + ceil(log2(numel / k)) bits an entry, plus a byte's padding for the
        # upper bits and for each bit plane of the low ones.
        assert 8 * (low.numel() + high.numel()) <= k * (2 + math.ceil(math.log2(numel / k))) + 8 * (low_bits + 1)


def test_damaged_positions_are_refused():
    x = torch.tensor([3, 9, 40, 41, 99])
    low_bits, low, high = encode_positions(x, 100)
    with pytest.raises(ValueError, match="upper bits mark 4 positions, not 5"):
        decode_positions(low_bits, low, unpack_clear_first(high), 5, 100)
    with pytest.raises(ValueError, match="low and"):
        decode_positions(low_bits, low[:-1], high, 5, 100)
    # Equal positions (two entries in one bucket with equal low bits) are not sorted and unique.
    low_bits, low, high = encode_positions(torch.tensor([8, 9]), 16)
    dup_low = torch.zeros(3, dtype=torch.uint8)  # three bit planes, both entries' low bits 0
    with pytest.raises(ValueError, match="not sorted, unique"):
        decode_positions(low_bits, dup_low, high, 2, 16)


def unpack_clear_first(high: torch.Tensor) -> torch.Tensor:
    """The upper bits with their first set bit cleared."""
    bits = unpack_bits(high, 8 * high.numel()).clone()
    bits[int(bits.nonzero()[0])] = False
    return pack_bits(bits)


@pytest.mark.parametrize("dtype", HALF)
def test_words_hold_every_fp32_value_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(3000, generator=gen) * torch.logspace(-30, 30, 3000)
    values = torch.cat([values, torch.tensor([0.0, -0.0, 1e-40, -1e-42, 3.0e38]), values.to(dtype).float()])
    words, mask, rest = encode_words(values, dtype)
    assert words.dtype == torch.int16 and words.numel() == values.numel()
    fits = values.to(dtype).float().view(torch.int32) == values.view(torch.int32)
    assert rest.numel() == int((~fits).sum()) and mask.numel() == -(-values.numel() // 8)
    assert torch.equal(decode_words(words, mask, rest, dtype).view(torch.int32), values.view(torch.int32))
    short = values[fits]
    words, mask, rest = encode_words(short, dtype)
    assert mask.numel() == 0 and rest.numel() == 0
    assert torch.equal(decode_words(words, mask, rest, dtype).view(torch.int32), short.view(torch.int32))


def _hard_pairs(dtype, n=600, seed=0):
    """Base and tuned 16-bit values: small moves, moves past zero, weights that shrank or grew a lot."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen) * 0.05
    move = torch.randn(n, generator=gen) * torch.logspace(-4, 0, n)
    tuned = base + move
    tuned[::7] = -base[::7] * 0.01  # crossed zero, near it
    tuned[::11] = base[::11] * 1e-3  # shrank to almost nothing
    base, tuned = base.to(dtype), tuned.to(dtype)
    return base, tuned, tuned.float() - base.float()


@pytest.mark.parametrize("dtype", HALF)
def test_shortest_increments_are_16_bit_exactly_where_some_16_bit_value_works(dtype):
    """Against a search over all 65536 16-bit values: an entry gets a 16-bit increment if and only if one
    exists, and every increment gives the tuned weight through the apply op."""
    base, tuned, exact = _hard_pairs(dtype)
    out = shortest_increments(base, tuned, exact)
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    every = every[torch.isfinite(every)]
    exists = torch.zeros(base.numel(), dtype=torch.bool)
    for i in range(0, base.numel(), 50):
        b, t = base[i:i + 50].float().view(-1, 1), tuned[i:i + 50].view(-1, 1)
        exists[i:i + 50] = ((b + every).to(dtype) == t).any(dim=1)
    is_16 = out.to(dtype).float() == out
    assert torch.equal(is_16, exists)
    assert 0 < int((~exists).sum()) < base.numel() // 2  # the hard cases are there
    assert torch.equal(out[~exists], exact[~exists])
    applied = base.clone()
    _ops.sparse_delta_apply_ref([applied], [torch.arange(base.numel())], [out], 1.0, [])
    assert torch.equal(applied.view(torch.int16), tuned.view(torch.int16))


@requires_cpp
@pytest.mark.parametrize("dtype", HALF)
def test_shortest_increments_give_the_tuned_weight_through_the_cpp_apply(dtype):
    base, tuned, exact = _hard_pairs(dtype, seed=1)
    out = shortest_increments(base, tuned, exact)
    applied = base.clone()
    idx = torch.arange(base.numel(), dtype=torch.int32)
    _ops.call("sparse_delta_apply_", [applied], [idx], [out], 1.0, _ops.originals_like([applied], [idx]),
              backend="cpp")
    assert torch.equal(applied.view(torch.int16), tuned.view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
def test_from_diff_of_16_bit_weights_stores_2_bytes_a_value_and_reloads_bit_exact(tmp_path, dtype):
    base, tuned, _ = _hard_pairs(dtype, n=4000, seed=2)
    delta = SparseDelta.from_diff({"w": base.view(40, 100)}, {"w": tuned.view(40, 100)}, density=0.25)
    path = tmp_path / "d.safetensors"
    delta.save(path)
    metadata, stored = _read(path)
    info = json.loads(metadata["entries"])["w"]
    k, wider = delta.nnz, stored["values.rest16"].numel()
    assert info["values"] == "words16" and info["rest"] == wider and 0 < wider < k // 2
    assert stored["values.words16"].numel() == k and stored["values.float32"].numel() == 0
    assert stored["values.mask"].numel() == -(-k // 8)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(base.view(40, 100).clone())
    SparseDelta.load(path).apply_(model)
    changed = base.view(40, 100) != tuned.view(40, 100)
    kept = torch.zeros(4000, dtype=torch.bool)
    kept[delta["w"].indices.long()] = True
    got = model.w.detach().reshape(-1)
    assert torch.equal(got[kept].view(torch.int16), tuned[kept].view(torch.int16))
    assert int(changed.sum()) >= k


def test_a_16_bit_delta_whose_values_mostly_need_32_bits_keeps_fp32(tmp_path):
    idx = torch.arange(0, 4000, 4, dtype=torch.int32)
    rough = torch.randn(1000, generator=torch.Generator().manual_seed(0))  # nearly none fit bf16
    fits = rough.to(torch.bfloat16).float()
    delta = SparseDelta({"a": DeltaEntry((4000,), torch.bfloat16, idx, rough),
                         "b": DeltaEntry((4000,), torch.bfloat16, idx, fits),
                         "c": DeltaEntry((4000,), torch.float32, idx, rough)})
    path = tmp_path / "d.safetensors"
    delta.save(path)
    metadata, stored = _read(path)
    info = json.loads(metadata["entries"])
    assert [info[n]["values"] for n in "abc"] == ["float32", "words16", "float32"]
    assert stored["values.float32"].numel() == 2000 and stored["values.words16"].numel() == 1000
    assert stored["values.mask"].numel() == 0 and stored["values.rest16"].numel() == 0
    loaded = SparseDelta.load(path)
    for name in "abc":
        assert torch.equal(loaded[name].values, delta[name].values) and torch.equal(loaded[name].indices, idx)


@pytest.mark.parametrize("damage, match", [
    pytest.param("rest", "the mask marks 20 values, the file holds 19 low halves", id="short-rest"),
    pytest.param("mask", "a mask of 124 bytes for 1000 words", id="short-mask"),
    pytest.param("extra", r"the shared tensors do not match the metadata: values\.float32 \(3 more\)", id="extra"),
    pytest.param("nnz", "unreadable metadata|upper bits mark", id="bad-nnz"),
])
def test_a_file_whose_shared_tensors_disagree_with_its_metadata_is_refused(tmp_path, damage, match):
    idx = torch.arange(0, 4000, 4, dtype=torch.int32)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float()
    values[::50] += 1e-5  # 20 values bf16 cannot hold
    path = tmp_path / "d.safetensors"
    SparseDelta({"a": DeltaEntry((4000,), torch.bfloat16, idx, values)}).save(path)
    metadata, tensors = _read(path)
    if damage == "rest":
        tensors["values.rest16"] = tensors["values.rest16"][:-1].clone()
    elif damage == "mask":
        tensors["values.mask"] = tensors["values.mask"][:-1].clone()
    elif damage == "extra":
        tensors["values.float32"] = torch.zeros(3)
    else:
        entries = json.loads(metadata["entries"])
        entries["a"]["nnz"] = 999
        metadata["entries"] = json.dumps(entries)
    _rewrite(tmp_path / "bad.safetensors", metadata, tensors)
    with pytest.raises(DeltaError, match=match):
        SparseDelta.load(tmp_path / "bad.safetensors")


def test_a_format_4_file_still_loads(tmp_path):
    """Files written before format 5: per-weight tensors, 16-bit index halves under a window table, 16-bit
    values with fp32 exceptions."""
    idx = torch.arange(0, 4000, 4, dtype=torch.int32)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).float()
    values[7] += 1e-5
    low, offsets = _ops.encode_lean_indices(idx, 4000)
    tensors = {"a.indices_low": low, "a.window_offsets": offsets, "a.values": values.to(torch.bfloat16),
               "a.exact_positions": torch.tensor([7], dtype=torch.int32), "a.exact_values": values[7:8].clone(),
               "b.indices_low": low.clone(), "b.window_offsets": offsets.clone(), "b.values": values * 2,
               "head.dense": torch.ones(3)}
    metadata = {"format": "sift.sparse_delta", "format_version": "4",
                "entries": json.dumps({"a": {"shape": [4000], "dtype": "bfloat16"},
                                       "b": {"shape": [40, 100], "dtype": "float32"}}),
                "dense": json.dumps(["head"])}
    _rewrite(tmp_path / "v4.safetensors", metadata, tensors)
    loaded = SparseDelta.load(tmp_path / "v4.safetensors")
    assert torch.equal(loaded["a"].indices, idx) and torch.equal(loaded["a"].values, values)
    assert torch.equal(loaded["b"].values, values * 2) and loaded["b"].shape == (40, 100)
    assert torch.equal(loaded.dense["head"], torch.ones(3))


def test_a_saved_delta_keeps_its_bytes(tmp_path):
    """Pins the bytes `save` writes (format 5), so a change to the code around the file cannot move them."""
    import hashlib
    import struct

    from sift.delta import BaseFingerprint

    base = {"a": torch.linspace(-1, 1, 70).reshape(7, 10), "b": torch.linspace(0, 3, 300).to(torch.bfloat16),
            "head": torch.zeros(3)}
    entries = {"a": DeltaEntry((7, 10), torch.float32, torch.tensor([0, 9, 33, 69], dtype=torch.int32),
                               torch.tensor([0.5, -0.25, 1e-3, 3.0])),
               # 0.5 fits bf16; 1/3 does not: one word with its low half under the mask
               "b": DeltaEntry((300,), torch.bfloat16, torch.tensor([1, 150, 299], dtype=torch.int32),
                               torch.tensor([0.5, 1 / 3, -2.0]))}
    SparseDelta(entries, BaseFingerprint.of(base), {"head": torch.tensor([1.0, -2.0, 0.5])}).save(tmp_path / "d")
    raw = (tmp_path / "d").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    # safetensors writes the metadata map in an order that changes from process to process: the header
    # is compared parsed, the tensor bytes as they are.
    header = json.dumps(json.loads(raw[8:8 + n]), sort_keys=True).encode()
    assert hashlib.sha256(header + raw[8 + n:]).hexdigest() == \
        "c3830bd472646acc8c03cea29b4b80dd6c1af327490dccec3c20feb6eb395afb"
