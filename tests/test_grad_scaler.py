"""SparseAdamW under torch.amp.GradScaler: the scale and the inf flag reach the step itself.

Each test trains with a real `torch.amp.GradScaler("cpu")` and compares against training
without one (the reference): an overflowing step must change nothing, and clean steps must
give what unscaled training gives, in plain mode, hook mode (`compact_grads`) and with the
sparse backward.
"""

from __future__ import annotations

import contextlib

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


def test_inf_in_a_compact_gradient_backs_off_without_the_link():
    """Regression: without `grad_scaler` an inf in a compact gradient skipped the step but never lowered the
    scale, so fp16 training stalled for good; the step now finds the scaler that called it and reports."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, opt = _scaled_backward_after_selection("hook", scaler, link=False)
    opt.grad_scaler = None  # as a fresh optimizer has it: no link at all
    opt.compact_grad(model[0].weight)[0] = float("nan")
    _assert_step_leaves_params(model, lambda: scaler.step(opt), contextlib.nullcontext())
    scaler.update()
    assert scaler.get_scale() == 512.0, "the scaler did not learn of the NaN"
    assert opt.grad_scaler is scaler and opt.last_step_skipped


def test_a_scaler_the_step_cannot_find_is_refused():
    """A step handed GradScaler's scale by a caller it cannot find refuses, changing nothing (it could not
    report the compact gradients' inf/NaN check, and the scale would never back off)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, opt = _scaled_backward_after_selection("sparse_backward", scaler, link=False)
    opt.grad_scaler = None
    opt.grad_scale, opt.found_inf = scaler._scale, torch.zeros(())
    _assert_step_leaves_params(model, opt.step, pytest.raises(RuntimeError, match="optimizer.grad_scaler"))


@pytest.mark.parametrize("mode", ["hook", "sparse_backward"])
def test_only_sparse_params_under_the_scaler(mode):
    """Regression: with no trained param keeping a dense .grad, scaler.step handed found_inf = 0 (an int) and
    scaler.update() found no inf check; now training equals unscaled training and an overflow backs off."""

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(13, 21, bias=False), torch.nn.Tanh(),
                                    torch.nn.Linear(21, 7, bias=False))
        opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.15, compact_grads=True)
        if mode == "sparse_backward":
            sift.enable_sparse_backward(model, opt)
        return model, opt

    batches = _batches(5)
    model, opt = build()
    scaler = torch.amp.GradScaler("cpu", **OVERFLOW)
    assert _train(model, opt, batches, scaler) == [False, True, True, True, True]
    assert scaler.get_scale() == 2.0**15
    ref_model, ref_opt = build()
    _train(ref_model, ref_opt, batches[1:])
    _assert_same(model, opt, ref_model, ref_opt)


def test_overflow_in_a_weight_gradient_only_does_not_stall():
    """Regression: fp16 weights, an overflow in a sparse weight's gradient only and `scaler.step(opt)` alone
    (no link): the step was skipped but the scale never backed off, so an overflowing scale stayed for good.
    Now each overflow halves the scale and training goes on."""
    model, opt = _build("hook", torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    overflow = {1, 2}
    step = [0]
    # The weight's fp16 gradient overflows on these steps (what a large scale does to dY^T X), nothing else.
    model[0].weight.register_hook(lambda g: g * float("inf") if step[0] in overflow else g)
    ran = []
    for x, y in _batches(5, torch.float16):
        ran += _train(model, opt, [(x, y)], scaler)
        step[0] += 1
    assert ran == [True, False, False, True, True]
    assert scaler.get_scale() == 2.0**8
    assert opt.state[model[0].weight]["step"].item() == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_gpt2_lm_through_for_model_with_grad_scaler():
    """Regression: for_model on an fp16 GPT-2 LM (the tied lm_head leaves no dense group) crashed at step 1
    under GradScaler. Scaled training now follows unscaled training within fp16 precision."""
    transformers = pytest.importorskip("transformers")

    def build(mode):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=4,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config).half()
        kwargs = {"sparse_backward": True} if mode == "sparse_backward" else {"compact_grads": True}
        opt = SparseAdamW.for_model(model, density=0.05, lr=1e-3, **kwargs)
        assert all(group["density"] < 1.0 for group in opt.param_groups)
        return model, opt

    def train(model, opt, scaler=None):
        for step in range(4):
            ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(step))
            loss = model(input_ids=ids, labels=ids).loss
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()

    for mode in ("hook", "sparse_backward"):
        model, opt = build(mode)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        train(model, opt, scaler)
        assert scaler.get_scale() == 2.0**8  # no overflow, no skip
        ref_model, ref_opt = build(mode)
        train(ref_model, ref_opt)
        # fp16: a one-ulp difference in a near-zero gradient can turn Adam's normalised step around (2 lr).
        for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=8e-3, msg=lambda m: f"{mode} {name}: {m}")
        assert not torch.equal(model.transformer.h[0].attn.c_attn.weight,
                               build(mode)[0].transformer.h[0].attn.c_attn.weight)


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


def test_unscale_and_clip_without_setting_the_link():
    """The first scaler.step links the optimizer to its scaler, so a later scaler.unscale_ + clip needs no
    `grad_scaler` and trains as the linked optimizer does."""
    batches = _batches(4)
    runs = []
    for link in (True, False):
        model, opt = _build("hook")
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        if link:
            opt.grad_scaler = scaler
        _train(model, opt, batches, scaler, clip=0.5, unscale=True)
        runs.append((model, opt))
    _assert_same(*runs[0], *runs[1], rtol=0, atol=0)


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


def _clipped_scaled_run(model_seed: int, steps: range, opt=None, model=None, scaler=None, link: bool = True):
    """for_model's default (hook mode + sparse backward) under GradScaler with `scaler.unscale_` + clip."""
    if model is None:
        torch.manual_seed(model_seed)
        model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    if opt is None:
        opt = SparseAdamW.for_model(model, density=0.2, lr=1e-2, target_modules=["0", "2"])
    scaler = scaler or torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    if link:
        opt.grad_scaler = scaler
    for step in steps:
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(6, 12, generator=g)).square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        sift.clip_grad_norm_(opt, 0.05)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


def test_a_resumed_optimizer_without_the_scaler_link_refuses_to_clip_scaled_gradients():
    """A resumed compact-mode optimizer lost its implicit link to the scaler and clipped the still loss-scaled
    compact gradients by a norm `scale` times too large, silently."""
    import copy

    model, opt, scaler = _clipped_scaled_run(0, range(2), link=False)  # linked implicitly by its first step
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), scaler.state_dict())
    reference, _, _ = _clipped_scaled_run(0, range(2, 4), opt=opt, model=model, scaler=scaler, link=False)
    reference = {n: p.detach().clone() for n, p in reference.named_parameters()}

    def resumed():
        torch.manual_seed(0)
        fresh = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
        fresh_opt = SparseAdamW.for_model(fresh, density=0.2, lr=1e-2, target_modules=["0", "2"])
        fresh.load_state_dict(saved[0])
        fresh_opt.load_state_dict(saved[1])
        fresh_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        fresh_scaler.load_state_dict(saved[2])
        return fresh, fresh_opt, fresh_scaler

    fresh, fresh_opt, fresh_scaler = resumed()
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    with pytest.raises(RuntimeError, match="optimizer.grad_scaler = scaler"):
        _clipped_scaled_run(0, range(2, 3), opt=fresh_opt, model=fresh, scaler=fresh_scaler, link=False)
    assert all(torch.equal(p.detach(), before[n]) for n, p in fresh.named_parameters())
    fresh, fresh_opt, fresh_scaler = resumed()
    _clipped_scaled_run(0, range(2, 4), opt=fresh_opt, model=fresh, scaler=fresh_scaler, link=True)
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), reference[name]), name
