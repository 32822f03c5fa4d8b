"""ServedDeltas over a bitsandbytes 4-bit (NF4) or 8-bit (LLM.int8()) base on CPU: each row of a mixed batch
equals its fine-tune attached the documented way (`apply_`, the quantized layers' frozen deltas) within
fp32 rounding, rows on the base are the base's bits, and `switch_to` is refused with nothing changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sift import ServedDeltas, SparseDelta
from sift.delta import BaseFingerprint, DeltaEntry
from sift.delta.fingerprint import logical_state

bnb = pytest.importorskip("bitsandbytes")

KINDS = ["nf4", "int8"]
# A served row adds x S^T to bitsandbytes' own product; the attached fine-tune multiplies x by
# dequant(Wq) + S in one product: both fp32, so they differ by a few fp32 roundings per layer.
TOL = dict(rtol=1e-5, atol=1e-6)
# (inputs, hidden, hidden, outputs): odd for int8; for NF4 what bitsandbytes' CPU inference path takes on
# AVX512-BF16 machines, where it repacks the weight: outputs a multiple of 32, inputs whole 64-blocks.
SHAPES = {"int8": (40, 24, 19, 9), "nf4": (64, 32, 64, 32)}


def _model(kind: str) -> nn.Module:
    """Two quantized layers around a plain fp32 one, of `SHAPES[kind]`."""
    torch.manual_seed(0)
    n_in, h1, h2, out = SHAPES[kind]
    dense = nn.Sequential(nn.Linear(n_in, h1), nn.Tanh(), nn.Linear(h1, h2), nn.Tanh(), nn.Linear(h2, out))

    def layer(n_in, n_out):
        if kind == "int8":
            return bnb.nn.Linear8bitLt(n_in, n_out, has_fp16_weights=False)
        return bnb.nn.Linear4bit(n_in, n_out, compute_dtype=torch.float32, quant_type="nf4")

    quantized = nn.Sequential(layer(n_in, h1), nn.Tanh(), nn.Linear(h1, h2), nn.Tanh(), layer(h2, out))
    quantized.load_state_dict(dense.state_dict())
    quantized = quantized.to("cpu").eval()  # bitsandbytes quantizes on the move
    for m in quantized.modules():
        # On AVX512-BF16 machines bitsandbytes' own 4-bit inference product runs in bf16: the contract here
        # is against its fp32 product, the one every other CPU computes (docs/quantized.md).
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return quantized


def _fine_tune(model: nn.Module, seed: int, density: float = 0.2, layers=("0", "2", "4")) -> SparseDelta:
    """Entries of the [out, in] weights the quantized layers were made from (and of the plain layer)."""
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    entries = {}
    for name in layers:
        m = modules[name]
        numel = m.out_features * m.in_features
        k = int(density * numel)
        idx = torch.randperm(numel, generator=gen)[:k].sort().values.int()
        entries[f"{name}.weight"] = DeltaEntry((m.out_features, m.in_features), torch.float32, idx,
                                               torch.randn(k, generator=gen) * 0.3)
    return SparseDelta(entries, BaseFingerprint.of(logical_state(model)))


@pytest.mark.parametrize("kind", KINDS)
def test_each_row_gets_its_attached_fine_tune_and_base_rows_their_bits(kind):
    model = _model(kind)
    deltas = {"a": _fine_tune(model, 1), "b": _fine_tune(model, 2, layers=("0", "4"))}
    served = ServedDeltas(model)
    for name, d in deltas.items():
        served.load_delta(name, d)
    rows = ["a", None, "b", "a", None, "b"]
    x = torch.randn(len(rows), 3, SHAPES[kind][0], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(x)
        got = served(x, delta_names=rows)
        for name, d in deltas.items():
            d.apply_(model)  # the quantized layers' frozen deltas: x (dequant(Wq) + S)^T
            own = model(x)
            d.remove_(model)
            for r, row_name in enumerate(rows):
                if row_name == name:
                    torch.testing.assert_close(got[r], own[r], **TOL)
            assert not torch.allclose(own, base)
    for r, row_name in enumerate(rows):
        if row_name is None:
            assert torch.equal(got[r], base[r])
    served.close()
    with torch.no_grad():
        assert torch.equal(model(x), base)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fine_tune_directory_loads_and_switch_to_is_refused(kind, tmp_path):
    model = _model(kind)
    delta = _fine_tune(model, 4)
    delta.save_pretrained(tmp_path, model)
    served = ServedDeltas(model)
    served.load_delta("a", tmp_path)
    x = torch.randn(2, SHAPES[kind][0], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = served(x, delta_names=["a", "a"])
        delta.apply_(model)
        want = model(x)
        delta.remove_(model)
    torch.testing.assert_close(got, want, **TOL)
    packed = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="bitsandbytes quantized layer"):
        served.switch_to("a")
    assert served.in_place is None and all(torch.equal(p, q) for p, q in zip(model.parameters(), packed))


def test_a_delta_of_another_shape_is_refused():
    model = _model("nf4")
    bad = SparseDelta({"0.weight": DeltaEntry((32, 65), torch.float32, torch.tensor([0], dtype=torch.int32),
                                              torch.ones(1))})
    served = ServedDeltas(model)
    with pytest.raises(Exception, match=r"0.weight: delta \(32, 65\), quantized layer \(32, 64\)"):
        served.load_delta("bad", bad)
    assert served.list_deltas() == []
