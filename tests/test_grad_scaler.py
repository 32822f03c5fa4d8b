"""SparseAdamW under torch.amp.GradScaler: the scale and the inf flag reach the step itself.

Each test trains with a real `torch.amp.GradScaler("cpu")` and compares against training
without one (the reference): an overflowing step must change nothing, and clean steps must
give what unscaled training gives, in plain mode, hook mode (`compact_grads`) and with the
sparse backward.
"""

from __future__ import annotations

import pytest
import torch

import sift
from sift import SparseAdamW, clip_grad_norm_

MODES = ["plain", "hook", "sparse_backward"]
# fp32: a non-power-of-two scale rounds each scaled gradient once more than unscaled training does.
RTOL, ATOL = 1e-5, 1e-6
OVERFLOW = dict(init_scale=2.0**127, backoff_factor=2.0**-112)  # first step inf, then a scale of 2**15


def _build(mode: str, dtype: torch.dtype = torch.float32, select_steps: int = 1, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 21), torch.nn.Tanh(), torch.nn.Linear(21, 7)).to(dtype)
    groups = [{"params": [model[0].weight, model[2].weight]},
              {"params": [model[0].bias, model[2].bias], "density": 1.0}]
    opt = SparseAdamW(groups, lr=1e-2, density=0.15, select_steps=select_steps, compact_grads=mode != "plain",
                      **kwargs)
    if mode == "sparse_backward":
        sift.enable_sparse_backward(model, opt)
    return model, opt


def _batches(n: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 13, generator=g).to(dtype), torch.randn(6, 7, generator=g).to(dtype)) for _ in range(n)]


def _train(model, opt, batches, scaler=None, clip: float | None = None, unscale: bool = False) -> list[bool]:
    """Train on `batches`; returns, per batch, whether the step ran (the scaler did not back off)."""
    ran = []
    for x, y in batches:
        opt.zero_grad()
        loss = (model(x).float() - y.float()).square().sum()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if unscale and scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            clip_grad_norm_(opt, clip)
        if scaler is None:
            opt.step()
            ran.append(True)
            continue
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        ran.append(scaler.get_scale() >= before)
    return ran


def _assert_same(model_a, opt_a, model_b, opt_b, rtol=RTOL, atol=ATOL):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        state_a, state_b = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert state_a.keys() == state_b.keys(), name
        for key in state_a:
            if key == "indices":
                assert torch.equal(state_a[key], state_b[key]), f"{name}: another selection"
            elif isinstance(state_a[key], torch.Tensor):
                torch.testing.assert_close(state_a[key], state_b[key], rtol=rtol, atol=atol,
                                           msg=lambda m: f"{name}.{key}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_overflow_changes_nothing_and_selection_waits(mode):
    """A step the scaler skips for inf leaves params and state as they were; selection comes from the first clean step."""
    model, opt = _build(mode)
    scaler = torch.amp.GradScaler("cpu", **OVERFLOW)
    opt.grad_scaler = scaler
    initial = [p.detach().clone() for p in model.parameters()]
    batches = _batches(4)
    assert _train(model, opt, batches[:1], scaler) == [False], "the first step should overflow"
    for p, p0 in zip(model.parameters(), initial):
        assert torch.equal(p, p0)
    assert all(not opt.state.get(p) for p in model.parameters()), "a skipped step left state"
    assert _train(model, opt, batches[1:], scaler) == [True] * 3
    ref_model, ref_opt = _build(mode)
    _train(ref_model, ref_opt, batches[1:])
    _assert_same(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("unscale_and_clip", [False, True], ids=["scaler.step", "unscale_+clip"])
@pytest.mark.parametrize("mode", MODES)
def test_scaled_training_equals_unscaled(mode, unscale_and_clip):
    """Scaled training (a scale that is no power of two and doubles every step) equals unscaled training."""
    clip = 0.5 if unscale_and_clip else None
    batches = _batches(5)
    model, opt = _build(mode, select_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=3000.0, growth_interval=1)
    opt.grad_scaler = scaler
    assert all(_train(model, opt, batches, scaler, clip=clip, unscale=unscale_and_clip))
    ref_model, ref_opt = _build(mode, select_steps=2)
    _train(ref_model, ref_opt, batches, clip=clip)
    _assert_same(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("mode", MODES)
def test_max_grad_norm_clips_unscaled_gradients(mode):
    """The optimizer's own max_grad_norm clips after the scale is divided out."""
    batches = _batches(3)
    model, opt = _build(mode, max_grad_norm=0.3)
    scaler = torch.amp.GradScaler("cpu", init_scale=3000.0)
    _train(model, opt, batches, scaler)
    ref_model, ref_opt = _build(mode, max_grad_norm=0.3)
    _train(ref_model, ref_opt, batches)
    _assert_same(model, opt, ref_model, ref_opt)


def _scaled_backward_after_selection(mode: str, scaler, link: bool):
    """A model whose entries one scaled step chose, after the next scaled backward (step not taken)."""
    model, opt = _build(mode)
    if link:
        opt.grad_scaler = scaler
    batches = _batches(2)
    _train(model, opt, batches[:1], scaler)  # selects
    opt.zero_grad()
    x, y = batches[1]
    scaler.scale((model(x) - y).square().sum()).backward()
    return model, opt


@pytest.mark.parametrize("mode", ["hook", "sparse_backward"])
def test_inf_in_a_compact_gradient_only_skips_the_step(mode):
    """GradScaler's check reads .grad alone: inf in a compact gradient must still skip the step and back off the scale."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, opt = _scaled_backward_after_selection(mode, scaler, link=True)
    weight = model[2].weight
    assert weight.grad is None
    opt.compact_grad(weight)[3] = float("inf")
    params = [p.detach().clone() for p in model.parameters()]
    state = {p: {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
             for p in model.parameters()}
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0, "the scaler did not learn of the inf"
    for p, p0 in zip(model.parameters(), params):
        assert torch.equal(p, p0)
        for key, value in state[p].items():
            assert torch.equal(opt.state[p][key], value), key


def _assert_step_leaves_params(model, step, expectation) -> None:
    """`step()` under `expectation` (a pytest.raises / pytest.warns context) changes no parameter."""
    params = [p.detach().clone() for p in model.parameters()]
    with expectation:
        step()
    for p, p0 in zip(model.parameters(), params):
        assert torch.equal(p, p0)


def test_inf_in_a_compact_gradient_without_the_scaler_warns():
    """Without `grad_scaler` the step is still skipped, with a warning that the scale cannot back off."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, opt = _scaled_backward_after_selection("hook", scaler, link=False)
    opt.compact_grad(model[0].weight)[0] = float("nan")
    _assert_step_leaves_params(model, lambda: scaler.step(opt), pytest.warns(UserWarning, match="grad_scaler"))


def test_plain_mode_never_writes_a_sparse_weights_dense_gradient():
    """scaler.step in plain mode unscales the gathered [k] entries, not the sparse weight's .grad."""
    model, opt = _build("plain")
    scaler = torch.amp.GradScaler("cpu", init_scale=3000.0)
    for x, y in _batches(3):
        opt.zero_grad()
        scaler.scale((model(x) - y).square().sum()).backward()
        grads = {p: (p.grad, p.grad._version, p.grad.data_ptr(), p.grad.clone())
                 for p in (model[0].weight, model[2].weight)}
        scaler.step(opt)
        scaler.update()
        for p, (grad, version, ptr, values) in grads.items():
            assert p.grad is grad and grad._version == version and grad.data_ptr() == ptr
            assert torch.equal(grad, values)
    assert "indices" in opt.state[model[0].weight]


@pytest.mark.parametrize("mode", ["hook", "sparse_backward"])
def test_compact_modes_keep_no_dense_gradient(mode):
    """After selection the scaler path leaves the sparse weights without a .grad."""
    model, opt = _build(mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=3000.0)
    batches = _batches(3)
    _train(model, opt, batches[:1], scaler)
    for x, y in batches[1:]:
        opt.zero_grad()
        scaler.scale((model(x) - y).square().sum()).backward()
        assert model[0].weight.grad is None and model[2].weight.grad is None
        scaler.step(opt)
        scaler.update()
        assert model[0].weight.grad is None and model[2].weight.grad is None


def test_unscale_without_the_scaler_raises_and_changes_nothing():
    """After scaler.unscale_ in hook mode the step cannot know the scale of the compact buffers: it raises."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, opt = _scaled_backward_after_selection("hook", scaler, link=False)
    scaler.unscale_(opt)
    _assert_step_leaves_params(model, lambda: scaler.step(opt), pytest.raises(RuntimeError, match="grad_scaler"))


def test_fp16_sparse_backward_with_grad_scaler():
    """fp16 weights and gradients train with GradScaler and the sparse backward: an overflow is skipped, then
    training follows unscaled fp16 training within fp16 precision."""
    batches = _batches(4, torch.float16)
    model, opt = _build("sparse_backward", torch.float16)
    # fp16 overflows at a far lower scale: back off to 2**8 (output gradients near 1e3, below 65504).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-119)
    opt.grad_scaler = scaler
    assert _train(model, opt, batches, scaler) == [False, True, True, True]
    ref_model, ref_opt = _build("sparse_backward", torch.float16)
    _train(ref_model, ref_opt, batches[1:])
    # fp16: the scaled gradients round differently in fp16 than the unscaled ones (one ulp, about 1e-3).
    _assert_same(model, opt, ref_model, ref_opt, rtol=2e-3, atol=2e-3)
    assert opt.state[model[0].weight]["indices"].numel() > 0


def test_update_in_backward_refuses_a_grad_scaler():
    """Weights stepped inside backward cannot be unstepped: a GradScaler is refused."""
    model = torch.nn.Linear(5, 3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="GradScaler"):
        SparseAdamW(model.parameters(), compact_grads=True, update_in_backward=True, grad_scaler=scaler)
    opt = SparseAdamW(model.parameters(), compact_grads=True, update_in_backward=True)
    scaler.scale(model(torch.randn(2, 5)).sum()).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    with pytest.raises(TypeError, match="grad_scaler"):
        SparseAdamW(model.parameters(), grad_scaler=object())
