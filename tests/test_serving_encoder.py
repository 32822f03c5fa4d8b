"""ServedDeltas over an encoder classifier (a tiny random BertForSequenceClassification): fine-tunes with a
classifier head trained densely serve each row with its own head and sparse attention deltas, equal to the
fine-tune applied in place; switch_to puts the head in and takes it out bit for bit; a dense norm is refused
by name with nothing changed."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import served_and_applied

from sift import DeltaError, ServedDeltas, SparseDelta

transformers = pytest.importorskip("transformers")

# Served rows round the base product before adding the delta's (see tests/test_serving.py): fp32 units.
TOL = dict(rtol=1e-5, atol=1e-5)


def _base() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(config).eval()


def _fine_tune(base: torch.nn.Module, seed: int, head: bool = True) -> SparseDelta:
    """Sparse entries in the attention projections and, with `head`, a new classifier trained densely."""
    gen = torch.Generator().manual_seed(seed)
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        for name, m in tuned.named_modules():
            if isinstance(m, torch.nn.Linear) and ".attention." in name:
                mask = torch.rand(m.weight.shape, generator=gen) < 0.1
                m.weight += mask * torch.randn(m.weight.shape, generator=gen) * 0.3
    delta = SparseDelta.from_diff(base, tuned, density=1.0)
    if head:
        delta.dense["classifier.weight"] = torch.randn(base.classifier.weight.shape, generator=gen)
        delta.dense["classifier.bias"] = torch.randn(base.classifier.bias.shape, generator=gen)
    return delta


def _batch(rows: int):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 61, (rows, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def test_rows_get_their_own_heads_and_deltas():
    base = _base()
    deltas = {"a": _fine_tune(base, 1), "b": _fine_tune(base, 2), "sparse": _fine_tune(base, 3, head=False)}
    served = ServedDeltas(base)
    for name, d in deltas.items():
        served.load_delta(name, d)
    rows = ["a", None, "b", "sparse", "a", None]
    ids, mask = _batch(len(rows))
    with torch.no_grad():
        plain = base(ids, attention_mask=mask).logits
        got = served(ids, attention_mask=mask, delta_names=rows).logits
        for name, d in deltas.items():
            d.apply_(base)
            own = base(ids, attention_mask=mask).logits
            d.remove_(base)
            assert not torch.allclose(own, plain)
            for r, row_name in enumerate(rows):
                if row_name == name:
                    torch.testing.assert_close(got[r], own[r], **TOL)
    for r, row_name in enumerate(rows):
        if row_name is None:
            assert torch.equal(got[r], plain[r])
    served.unload_delta("a")
    with torch.no_grad():
        assert torch.equal(served(ids, attention_mask=mask, delta_names=[None] * len(rows)).logits, plain)


def test_switch_to_puts_the_head_in_and_takes_it_out():
    """switch_to with dense heads: the model holds what apply_ gives, then the next delta's, then the base's."""
    base = _base()
    deltas = {"a": _fine_tune(base, 4), "sparse": _fine_tune(base, 5, head=False), "b": _fine_tune(base, 6)}
    served, original, want = served_and_applied(base, deltas)
    for name in ("a", "sparse", "b", "a", None):
        served.switch_to(name)
        expected = original if name is None else want[name]
        assert all(torch.equal(p, expected[n]) for n, p in base.state_dict().items()), name


def test_a_dense_norm_is_refused_by_name():
    base = _base()
    delta = _fine_tune(base, 8)
    delta.dense["bert.embeddings.LayerNorm.weight"] = torch.ones(24) * 2
    served = ServedDeltas(base)
    before = {n: p.clone() for n, p in base.state_dict().items()}
    with pytest.raises(DeltaError, match=r"bert.embeddings.LayerNorm.weight: a dense part of a LayerNorm"):
        served.load_delta("norm", delta)
    assert served.list_deltas() == [] and all(torch.equal(p, before[n]) for n, p in base.state_dict().items())
    assert sum(len(m._forward_hooks) for m in base.modules()) == 0
