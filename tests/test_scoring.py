"""One scoring path: the selection of a 16-bit weight, its re-selection and a 4-bit layer's re-selection score
each entry as the plain fp64 formula rounded once to fp32 (|g| or -theta * g, |theta * g| for re-selection),
unscaled by GradScaler's inverse scale."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sift import SparseAdamW

SHAPES = [pytest.param((7, 13), id="7x13"), pytest.param((1, 17), id="1x17"), pytest.param((31, 5), id="31x5")]
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.float16)]
INV_SCALES = [pytest.param(None, id="unscaled"), pytest.param(2.0**-7, id="scaled")]
RULES = ["magnitude", "saliency"]


def _reference(rule: str, grad: torch.Tensor, weight: torch.Tensor, inv_scale: float | None, signed: bool
               ) -> torch.Tensor:
    """fp64 (each product of two fp32 values is exact there), rounded once to fp32."""
    g, w = grad.double(), weight.double()
    score = g.abs() if rule == "magnitude" else (-(w * g) if signed else (w * g).abs())
    if inv_scale is not None:
        score = score * inv_scale
    return score.float()


def _weight_and_grad(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
    weight.grad = (torch.randn(shape, generator=gen) * 100).to(dtype)
    return weight


def _inv(inv_scale):
    return None if inv_scale is None else torch.tensor(inv_scale, dtype=torch.float32)


@pytest.mark.parametrize("inv_scale", INV_SCALES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_selection_scores_by_the_formula(shape, dtype, rule, inv_scale):
    weight = _weight_and_grad(shape, dtype)
    opt = SparseAdamW([weight], density=0.1, selection=rule)
    opt.amp.grad_inv_scale = _inv(inv_scale)  # as a step under GradScaler holds it
    score = opt.selector.score_now(weight)
    assert score.dtype == torch.float32 and score.shape == shape
    assert torch.equal(score, _reference(rule, weight.grad, weight.detach(), inv_scale, signed=True))


@pytest.mark.parametrize("inv_scale", INV_SCALES)
@pytest.mark.parametrize("rule", ["spiel", "magnitude", "saliency"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_reselection_scores_by_the_formula(shape, dtype, rule, inv_scale):
    weight = _weight_and_grad(shape, dtype)
    opt = SparseAdamW([weight], density=0.1, reselect_every=2, reselect_rule=rule)
    group = opt.param_groups[0]
    score = opt.reselector.score_now(group, weight, weight.grad, _inv(inv_scale))
    expected = _reference("saliency" if rule == "saliency" else "magnitude", weight.grad, weight.detach(), inv_scale,
                          signed=False)
    assert score.dtype == torch.float32
    assert torch.equal(score, expected.reshape(-1))


@pytest.mark.parametrize("given_weight", [True, False], ids=["weight-given", "weight-dequantized"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_4_bit_layers_reselection_scores_by_the_formula(shape, rule, given_weight):
    """The score of a 4-bit layer's dense [out, in] fp32 gradient, formed in its backward; the weight it computes
    with is given, or rebuilt from the route (the dequantized base plus the deltas)."""
    gen = torch.Generator().manual_seed(1)
    values = torch.nn.Parameter(torch.randn(3, generator=gen))
    opt = SparseAdamW([{"params": [values], "density": 1.0}], reselect_every=2, reselect_rule=rule,
                      reselect_drop="revert")
    dense = torch.randn(shape, generator=gen) * 100
    weight = torch.randn(shape, generator=gen).to(torch.bfloat16)
    route = SimpleNamespace(values=values, indices=torch.tensor([0, 4, 9]),
                            weight=lambda dtype, vals, indices: weight.to(dtype))
    expected = _reference(rule, dense, weight.float(), None, signed=False).reshape(-1)
    score = opt.reselector.quantized_score(route, dense.clone(), weight if given_weight else None)
    assert torch.equal(score, expected)


def test_the_reference_tells_the_rules_apart():
    """The comparisons above can fail: a score of the other rule, or the signed saliency, differs from it."""
    weight = _weight_and_grad((7, 13), torch.float32)
    opt = SparseAdamW([weight], density=0.1, selection="saliency")
    score = opt.selector.score_now(weight)
    assert not torch.equal(score, _reference("magnitude", weight.grad, weight.detach(), None, signed=True))
    assert not torch.equal(score, _reference("saliency", weight.grad, weight.detach(), None, signed=False))
