"""Re-selection over a 4-bit or int8 base (`sift.quantized`): each layer re-selects, in its backward, the entries
its dequantized 16-bit twin re-selects and trains as it does (`reselect_drop="revert"`: a packed base cannot take a
dropped increment), under a clip, an overflow on the re-selecting step, a resume just before it; "merge" refused."""

from __future__ import annotations

import io

import pytest
import torch


bnb = pytest.importorskip("bitsandbytes")
from test_quantized import _effective, _optimizers, _pair, _top_grad, _train  # noqa: E402


def _twins(quant_type: str = "nf4", memory: str = "low", **kwargs):
    """A quantized MLP and its dequantized fp32 twin, with their optimizers (`memory` for the quantized one)."""
    quantized, dense = _pair(quant_type)
    _, opt_d = _optimizers(_pair(quant_type)[0], dense, **kwargs)
    opt_q = _top_grad(quantized, density=0.1, lr=1e-2, weight_decay=0.0, target_modules=["0", "2"],
                      memory=memory, **kwargs)
    return quantized, opt_q, dense, opt_d

RESELECT = dict(reselect_every=2, reselect_fraction=0.5, reselect_drop="revert")


def _assert_twins(quantized, opt_q, dense, opt_d) -> None:
    for i in (0, 2):
        assert torch.equal(quantized[i]._sift_quantized.indices.long(), opt_d.indices_of(dense[i].weight).long())
        torch.testing.assert_close(_effective(quantized, i), dense[i].weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("rule", ["spiel", "magnitude", "saliency"])
@pytest.mark.parametrize("memory", ["plain", "low", "lowest"])
@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_a_quantized_layer_reselects_as_its_dequantized_16_bit_twin(quant_type, memory, rule, steps):
    """Re-selection used to be refused on 4-bit and int8 bases."""
    quantized, opt_q, dense, opt_d = _twins(quant_type, memory, reselect_rule=rule, reselect_steps=steps, **RESELECT)
    first = quantized[0]._sift_quantized
    seen = []
    for step in range(7):
        _train(quantized, opt_q, 1, start=step)
        _train(dense, opt_d, 1, start=step)
        seen.append(first.indices.clone())
    # Selected at step 0; re-selected before updates 3 and 5: half of the entries each time.
    changed = [int((~torch.isin(b, a)).sum()) for a, b in zip(seen, seen[1:])]
    assert changed == [0, first.k // 2, 0, first.k // 2, 0, first.k // 2]
    _assert_twins(quantized, opt_q, dense, opt_d)


def test_a_clip_on_the_reselecting_step_matches_the_twin():
    quantized, opt_q, dense, opt_d = _twins(**RESELECT)
    _train(quantized, opt_q, 6, clip=0.05)
    _train(dense, opt_d, 6, clip=0.05)
    _assert_twins(quantized, opt_q, dense, opt_d)


def test_an_overflow_on_the_reselecting_step_is_skipped_never_scored():
    quantized, opt_q, dense, opt_d = _twins(**RESELECT)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    _train(quantized, opt_q, 2, scaler=scaler)
    before = quantized[0]._sift_quantized.indices.clone()
    loss = quantized(torch.full((6, 40), float("inf"))).square().mean()  # step 2 would re-select
    scaler.scale(loss).backward()
    scaler.step(opt_q)
    scaler.update()
    opt_q.zero_grad()
    assert scaler.get_scale() == 2.0 ** 9 and torch.equal(quantized[0]._sift_quantized.indices, before)
    _train(quantized, opt_q, 3, start=2, scaler=scaler)
    _train(dense, opt_d, 5)
    _assert_twins(quantized, opt_q, dense, opt_d)


def _resumed(half, opt_h, make):
    """A fresh quantized model and its optimizer, `make()`, given `half`'s deltas and `opt_h`'s state (through
    `torch.save`), as a fine-tune resumes over a base loaded again."""
    buf = io.BytesIO()
    torch.save({"deltas": [half[i].sift_delta.detach().clone() for i in (0, 2)], "opt": opt_h.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    resumed, opt_r = make()
    with torch.no_grad():
        for i, values in zip((0, 2), saved["deltas"]):
            resumed[i].sift_delta.copy_(values)
    opt_r.load_state_dict(saved["opt"])
    return resumed, opt_r


def _quantized(**kwargs):
    quantized, dense = _pair()
    return quantized, _optimizers(quantized, dense, **kwargs)[0]


@pytest.mark.parametrize("steps", [1, 2])
def test_resume_just_before_a_reselecting_step_is_bit_for_bit(steps):
    quantized, opt_q = _quantized(**RESELECT, reselect_steps=steps)
    _train(quantized, opt_q, 7)
    half, opt_h = _quantized(**RESELECT, reselect_steps=steps)
    _train(half, opt_h, 4)
    assert opt_h.reselector.fires(half[0].sift_delta)
    assert ("reselect_score" in opt_h.state[half[0].sift_delta]) == (steps == 2)
    resumed, opt_r = _resumed(half, opt_h, lambda: _quantized(**RESELECT, reselect_steps=steps))
    _train(resumed, opt_r, 3, start=4)
    for i in (0, 2):
        assert torch.equal(resumed[i]._sift_quantized.indices, quantized[i]._sift_quantized.indices)
        assert torch.equal(_effective(resumed, i), _effective(quantized, i))


def test_merge_is_refused_on_a_quantized_base_before_anything_changes():
    quantized, _ = _pair()
    flags = [p.requires_grad for p in quantized.parameters()]
    with pytest.raises(ValueError, match="reselect_drop='merge' cannot fold"):
        _top_grad(quantized, density=0.1, target_modules=["0", "2"], reselect_every=2)
    assert flags == [p.requires_grad for p in quantized.parameters()]
    assert not any(hasattr(quantized[i], "sift_delta") for i in (0, 2))


def _lean():
    quantized, _ = _pair()
    return quantized, _top_grad(quantized, density=0.1, lr=1e-2, weight_decay=0.0, target_modules=["0", "2"],
                                state="lean", reselect_rule="magnitude", **RESELECT)


def test_the_lean_state_reselects_a_quantized_layer_and_resumes_bit_for_bit():
    quantized, opt_q = _lean()
    first = quantized[0]._sift_quantized
    seen = []
    for step in range(7):
        _train(quantized, opt_q, 1, start=step)
        seen.append(first.indices.clone())
    changed = [int((~torch.isin(b, a)).sum()) for a, b in zip(seen, seen[1:])]
    assert changed == [0, first.k // 2, 0, first.k // 2, 0, first.k // 2]
    half, opt_h = _lean()
    _train(half, opt_h, 4)
    resumed, opt_r = _resumed(half, opt_h, _lean)
    _train(resumed, opt_r, 3, start=4)
    for i in (0, 2):
        assert torch.equal(resumed[i]._sift_quantized.indices, quantized[i]._sift_quantized.indices)
        assert torch.equal(_effective(resumed, i), _effective(quantized, i))
