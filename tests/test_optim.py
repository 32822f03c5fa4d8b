"""SparseAdamW against torch's AdamW, a masked dense oracle, and its own reference."""

from __future__ import annotations

import copy
import io
import math
import subprocess
import sys

import pytest
import torch

import sift
from sift import SparseAdamW, _ops
from conftest import (BACKENDS, DTYPES, TOLERANCES, capture_step, cpu_isa_levels, requires_cpp, requires_triton,
                      triton_available, with_cpu_isas)

SHAPES = [pytest.param((37, 29), id="37x29"), pytest.param((1, 1), id="1x1"), pytest.param((513,), id="513"),
          pytest.param((3, 5, 7), id="3x5x7")]


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(23, 19), torch.nn.Tanh(), torch.nn.Linear(19, 7)).to(dtype)


def _batch(step: int, n: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, 23, generator=torch.Generator().manual_seed(1000 + step)).to(dtype)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _assert_states_equal(a: SparseAdamW, b: SparseAdamW, pa, pb, rtol=0.0, atol=0.0) -> None:
    for qa, qb in zip(pa, pb):
        torch.testing.assert_close(qa, qb, rtol=rtol, atol=atol)
        sa, sb = a.state.get(qa, {}), b.state.get(qb, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                torch.testing.assert_close(sa[key], sb[key], rtol=rtol, atol=atol, msg=f"state {key}")
            else:
                assert sa[key] == sb[key], key


# ----------------------------------------------------------------- semantics


def test_density_one_matches_torch_adamw_every_step():
    model_a, model_b = _model(), _model()
    opt_a = SparseAdamW(model_a.parameters(), lr=1e-2, weight_decay=0.1, density=1.0)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(20):
        x = _batch(step)
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            _loss(model, x).backward()
            opt.step()
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(opt_a.state[pa][key], opt_b.state[pb][key], rtol=1e-6, atol=1e-9)


def _masked_adamw_oracle(w0, grads, mask, lr, betas, eps, wd, maximize=False):
    """Dense fp64 AdamW whose update is applied only where `mask` is set."""
    w = w0.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.double() * (-1 if maximize else 1)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        upd = -lr * wd * w - lr / (1 - betas[0] ** t) * m / (v.sqrt() / math.sqrt(1 - betas[1] ** t) + eps)
        w = torch.where(mask, w + upd, w)
        out.append(w.clone())
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_sparse_matches_masked_dense_oracle(backend, maximize):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(41, 27))
    w0 = w.detach().clone()
    grads = [torch.randn(41, 27) for _ in range(12)]
    opt = SparseAdamW([w], lr=3e-2, weight_decay=0.05, density=0.07, maximize=maximize, backend=backend)
    k = math.ceil(0.07 * w.numel())
    mask = torch.zeros(w.numel(), dtype=torch.bool)
    mask[torch.topk(grads[0].abs().reshape(-1), k).indices] = True
    expected = _masked_adamw_oracle(w0, grads, mask.view_as(w), 3e-2, (0.9, 0.999), 1e-8, 0.05, maximize)
    for g, want in zip(grads, expected):
        w.grad = g.clone()
        opt.step()
        torch.testing.assert_close(w.detach().double(), want, rtol=2e-6, atol=2e-6)
        # Untouched entries stay bit for bit.
        assert torch.equal(w.detach().reshape(-1)[~mask], w0.reshape(-1)[~mask])
    idx = opt.state[w]["indices"]
    assert idx.dtype == torch.int32 and idx.numel() == k
    assert torch.equal(idx.long(), mask.nonzero().reshape(-1))


def test_selection_sizes_and_at_least_one():
    tiny = torch.nn.Parameter(torch.randn(3))
    big = torch.nn.Parameter(torch.randn(101, 3))
    opt = SparseAdamW([tiny, big], density=0.01)
    tiny.grad, big.grad = torch.randn(3), torch.randn(101, 3)
    opt.step()
    assert opt.state[tiny]["indices"].numel() == 1
    assert opt.state[big]["indices"].numel() == math.ceil(0.01 * 303)


def test_selection_size_is_not_inflated_by_float_rounding():
    """0.2 * 35 == 7.000000000000001 in floating point; ceil must still give 7."""
    w = torch.nn.Parameter(torch.randn(35))
    opt = SparseAdamW([w], density=0.2)
    w.grad = torch.randn(35)
    opt.step()
    assert opt.state[w]["indices"].numel() == 7


def test_select_steps_accumulates_magnitude_and_updates_on_last():
    w = torch.nn.Parameter(torch.zeros(50))
    opt = SparseAdamW([w], lr=0.1, density=0.1, select_steps=2, weight_decay=0.0)
    g1 = torch.zeros(50)
    g1[:5] = 1.0
    g2 = torch.zeros(50)
    g2[10:15] = 3.0
    g2[:5] = -0.5  # accumulated |g| keeps entries 0..4 ahead of 20..24
    g2[20:25] = 1.2
    w.grad = g1
    opt.step()
    assert torch.equal(w.detach(), torch.zeros(50)), "steps before the selection completes update nothing"
    assert "indices" not in opt.state[w]
    w.grad = g2
    opt.step()
    assert opt.state[w]["indices"].tolist() == [10, 11, 12, 13, 14]
    assert (w.detach()[10:15] != 0).all() and (w.detach()[:10] == 0).all()


def test_param_without_grad_on_the_first_step_is_selected_later():
    """Selection must keep scanning while a sparse param has not had a gradient yet."""
    a = torch.nn.Parameter(torch.randn(20))
    b = torch.nn.Parameter(torch.randn(20))
    opt = SparseAdamW([a, b], density=0.1)
    a.grad = torch.randn(20)
    opt.step()
    assert "indices" in opt.state[a] and not opt.state.get(b)
    b.grad = torch.randn(20)
    opt.step()
    assert opt.state[b]["indices"].numel() == 2
    c = torch.nn.Parameter(torch.randn(30))
    opt.add_param_group({"params": [c]})
    c.grad = torch.randn(30)
    opt.step()
    assert opt.state[c]["indices"].numel() == 3


def test_random_selection_is_seeded():
    def chosen(seed):
        w = torch.nn.Parameter(torch.zeros(1000))
        opt = SparseAdamW([w], density=0.05, selection="random", seed=seed)
        w.grad = torch.ones(1000)
        opt.step()
        return opt.state[w]["indices"]

    assert torch.equal(chosen(3), chosen(3))
    assert not torch.equal(chosen(3), chosen(4))


def test_bf16_sub_ulp_updates_accumulate():
    """A bf16 weight of 1.0 has an ulp of 2**-7; Adam moves it by ~lr=1e-4 per step."""
    w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    ref = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = SparseAdamW([w], lr=1e-4, weight_decay=0.0, density=0.5)
    opt_torch = torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0)
    for _ in range(300):
        w.grad = torch.ones(64, dtype=torch.bfloat16)
        ref.grad = torch.ones(64, dtype=torch.bfloat16)
        opt.step()
        opt_torch.step()
    state = opt.state[w]
    idx = state["indices"].long()
    torch.testing.assert_close(state["delta"], torch.full((32,), -0.03), rtol=1e-3, atol=0)
    expected = (state["base"].float() + state["delta"]).to(torch.bfloat16)
    assert torch.equal(w.detach()[idx], expected)
    assert (w.detach()[idx] < 1.0).all(), "sub-ulp updates were lost"
    assert torch.equal(ref.detach(), torch.ones(64, dtype=torch.bfloat16)), "plain bf16 AdamW loses them"


def test_param_groups_with_their_own_density_and_lr():
    model = _model()
    opt = SparseAdamW(
        [
            {"params": model[0].parameters(), "density": 0.1, "lr": 1e-2},
            {"params": model[2].parameters(), "density": 1.0, "lr": 1e-3},
        ],
        lr=5e-2,
    )
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, _batch(0)).backward()
    opt.step()
    w0, b0, w2, b2 = model.parameters()
    assert opt.state[w0]["indices"].numel() == math.ceil(0.1 * w0.numel())
    assert "indices" not in opt.state[w2] and opt.state[w2]["exp_avg"].shape == w2.shape
    changed0 = (w0.detach() != before[0]).sum().item()
    assert 0 < changed0 <= math.ceil(0.1 * w0.numel())
    assert (w2.detach() != before[2]).all()
    # First Adam step moves each trained entry by about lr (weight decay aside).
    moved = (w0.detach() - before[0]).abs()
    assert moved.max().item() == pytest.approx(1e-2, rel=1e-2)
    assert (w2.detach() - before[2]).abs().max().item() == pytest.approx(1e-3, rel=2e-2)


def test_frozen_and_gradless_params_are_skipped():
    a = torch.nn.Parameter(torch.randn(10))
    b = torch.nn.Parameter(torch.randn(10), requires_grad=False)
    c = torch.nn.Parameter(torch.randn(10))
    opt = SparseAdamW([a, b, c], density=0.3, compact_grads=True)
    (a.sum() * 2).backward()
    opt.step()
    assert "indices" in opt.state[a]
    assert not opt.state.get(b) and not opt.state.get(c)


def test_lr_scheduler_drives_the_sparse_step():
    w = torch.nn.Parameter(torch.zeros(20))
    opt = SparseAdamW([w], lr=1.0, weight_decay=0.0, density=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    moves = []
    for _ in range(3):
        before = w.detach().clone()
        w.grad = torch.ones(20)
        opt.step()
        sched.step()
        moves.append((w.detach() - before).abs().max().item())
    # Constant gradient: Adam's normalised step is exactly lr.
    assert moves == pytest.approx([1.0, 0.5, 0.25], rel=1e-5)


def test_set_indices_mask_and_moments_follow_their_indices():
    w = torch.nn.Parameter(torch.randn(4, 5))
    opt = SparseAdamW([w], lr=1e-2, density=0.5)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[0, :3] = True
    opt.set_indices(w, mask)
    assert opt.state[w]["indices"].tolist() == [0, 1, 2]
    w.grad = torch.randn(4, 5)
    opt.step()
    old = {k: v.clone() for k, v in opt.state[w].items() if isinstance(v, torch.Tensor)}
    opt.set_indices(w, torch.tensor([1, 2, 7]))
    state = opt.state[w]
    assert torch.equal(state["exp_avg"][:2], old["exp_avg"][1:3])
    assert torch.equal(state["delta"][:2], old["delta"][1:3])
    assert state["exp_avg"][2] == 0 and state["step"] == old["step"]


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
@pytest.mark.parametrize("density", [0.3, 1.0], ids=["sparse", "dense"])
def test_frozen_param_with_a_stale_grad_is_not_stepped(compact, density):
    """A param frozen after selection still moved when zero_grad(set_to_none=False) left it a grad."""
    w = torch.nn.Parameter(torch.randn(20))
    opt = SparseAdamW([w], density=density, compact_grads=compact)
    w.square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    w.requires_grad_(False)
    if w.grad is None:  # hook mode frees it; a stale one can still be left by hand
        w.grad = torch.zeros(20)
    before_w, before_state = w.detach().clone(), copy.deepcopy(dict(opt.state[w]))
    opt.step()
    assert torch.equal(w.detach(), before_w)
    assert all(torch.equal(v, opt.state[w][k]) for k, v in before_state.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
def test_param_unfrozen_after_the_first_step_is_selected_and_trained(compact):
    """A sparse param frozen while the others were selected was never selected (nor hooked) once unfrozen."""
    a = torch.nn.Parameter(torch.randn(20))
    b = torch.nn.Parameter(torch.randn(20), requires_grad=False)
    opt = SparseAdamW([a, b], lr=1e-2, density=0.2, compact_grads=compact)
    before = b.detach().clone()
    for step in range(3):
        if step == 1:
            b.requires_grad_(True)
        opt.zero_grad()
        loss = a.square().sum() + (b.square().sum() if b.requires_grad else 0)
        loss.backward()
        opt.step()
    assert opt.state[b]["indices"].numel() == 4
    assert opt.state[b]["step"].item() == 2
    assert (b.detach() != before).sum().item() == 4
    if compact:
        assert b.grad is None, "the unfrozen param's dense grad is gathered and freed"


def test_set_indices_between_backward_and_step_keeps_the_gathered_grad():
    """In hook mode set_indices after backward zeroed the gathered gradient of the entries it kept."""
    results = []
    for compact in (False, True):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 30).reshape(6, 5))
        opt = SparseAdamW([w], lr=0.1, density=0.2, compact_grads=compact)
        opt.set_indices(w, torch.tensor([1, 4, 9]))
        w.pow(3).sum().backward()
        opt.step()
        opt.zero_grad()
        w.pow(3).sum().backward()
        opt.set_indices(w, torch.tensor([1, 4, 9, 12]))
        opt.step()
        results.append((w.detach().reshape(-1)[[1, 4, 9]], opt.state[w]["exp_avg"][:3]))
    (w_plain, m_plain), (w_hook, m_hook) = results
    assert torch.equal(w_plain, w_hook) and torch.equal(m_plain, m_hook)


def _reselect_run(dtype, compact, backend=None, steps=(3, 3, 3), save_after=None):
    """Train a [7, 11] weight on three overlapping selections (A, then B, then C).

    A: even positions; B: multiples of 3 (A and B share the multiples of 6); C: multiples of 4
    (some of A retired by B, some of A kept by B, none of B's fresh odd positions).
    Returns (w, opt, w0, snapshots of the state right after each set_indices).
    """
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(7, 11).to(dtype))
    w0 = w.detach().clone()
    opt = SparseAdamW([w], lr=1e-2, density=0.3, compact_grads=compact, backend=backend)
    coef = torch.linspace(-2, 2, 77).reshape(7, 11)
    snapshots = []
    for phase, (every, n) in enumerate(zip((2, 3, 4), steps)):
        opt.set_indices(w, torch.arange(0, 77, every))
        snapshots.append({k: v.clone() for k, v in opt.state[w].items() if isinstance(v, torch.Tensor)})
        for _ in range(n):
            opt.zero_grad()
            (w.float() * coef).sin().sum().backward()
            opt.step()
        if save_after == phase:
            return w, opt, w0, snapshots
    return w, opt, w0, snapshots


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_set_indices_retires_dropped_increments_and_restores_them(dtype, compact):
    """set_indices dropped the delta (and base) of entries leaving the set; a re-added one restarted from 0."""
    w, opt, w0, (_, after_b, after_c) = _reselect_run(dtype, compact)
    a, b, c = (set(range(0, 77, e)) for e in (2, 3, 4))
    # After B: A's entries outside B are retired, with the increment they had; B's share of A kept it.
    retired_b = sorted(a - b)
    assert after_b["retired_indices"].tolist() == retired_b
    assert after_b["retired_indices"].dtype == after_b["indices"].dtype
    assert (after_b["retired_delta"] != 0).all()
    assert after_b["delta"][[i for i, j in enumerate(range(0, 77, 3)) if j not in a]].eq(0).all()
    # After C: C's entries come back from the record (A - B) or from B, never from zero.
    retired_c = sorted((a | b) - c)
    state = opt.state[w]
    assert after_c["retired_indices"].tolist() == retired_c
    c_list = list(range(0, 77, 4))
    from_record = [i for i, j in enumerate(c_list) if j in a - b]
    assert from_record, "C must re-add entries that B retired"
    rows = [retired_b.index(c_list[i]) for i in from_record]
    assert torch.equal(after_c["delta"][from_record], after_b["retired_delta"][rows])
    assert after_c["exp_avg"][from_record].eq(0).all() and after_c["exp_avg_sq"][from_record].eq(0).all()
    if dtype != torch.float32:
        assert torch.equal(after_c["base"][from_record], after_b["retired_base"][rows])
        assert torch.equal(after_c["base"], w0.view(-1)[after_c["indices"].long()])
        assert torch.equal(state["retired_base"], w0.view(-1)[state["retired_indices"].long()])
    _assert_weight_is_start_plus_increments(w, w0, state, a | b | c)


def _assert_weight_is_start_plus_increments(w, w0, state, trained: set[int]) -> None:
    """Every entry that ever trained is in exactly one of indices / retired_indices, with its
    total increment; every other entry is untouched."""
    active, retired = state["indices"].long(), state["retired_indices"].long()
    assert set(active.tolist()).isdisjoint(retired.tolist())
    assert sorted(active.tolist() + retired.tolist()) == sorted(trained)
    flat, flat0 = w.detach().view(-1), w0.view(-1)
    untouched = torch.ones(flat.numel(), dtype=torch.bool)
    untouched[active] = untouched[retired] = False
    assert torch.equal(flat[untouched], flat0[untouched])
    for idx, delta in ((active, state["delta"]), (retired, state["retired_delta"])):
        if w.dtype == torch.float32:
            # The weight summed the steps one by one in fp32, delta summed them apart: they agree
            # up to a few roundings of the weight (|w| < 4, ulp 2**-22), not bit for bit.
            torch.testing.assert_close(flat[idx], flat0[idx] + delta, rtol=0, atol=2e-6)
        else:
            assert torch.equal(flat[idx], (flat0[idx].float() + delta).to(w.dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_retired_increments_on_every_backend(backend):
    """Re-selection kept every increment on each backend (fp32: the Triton interpreter truncates
    fp32->bf16 casts, so bf16 exactness is pinned on the default backend above)."""
    w, opt, w0, _ = _reselect_run(torch.float32, False, backend=backend)
    trained = set(range(0, 77, 2)) | set(range(0, 77, 3)) | set(range(0, 77, 4))
    _assert_weight_is_start_plus_increments(w, w0, opt.state[w], trained)


def test_set_indices_drops_entries_without_an_increment():
    """Entries that never moved are not kept in the retired record (nothing to lose)."""
    w = torch.nn.Parameter(torch.randn(20))
    opt = SparseAdamW([w], lr=1e-2, density=0.3)
    opt.set_indices(w, torch.tensor([1, 2, 3]))
    opt.set_indices(w, torch.tensor([4, 5]))
    assert "retired_indices" not in opt.state[w]
    w.grad = torch.zeros(20)
    w.grad[4] = 1.0  # 5 sees a zero gradient and no weight decay: its delta stays 0
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()
    opt.set_indices(w, torch.tensor([6]))
    assert opt.state[w]["retired_indices"].tolist() == [4]
    opt.set_indices(w, torch.tensor([4, 6]))
    assert "retired_indices" not in opt.state[w], "an emptied record is removed"
    assert opt.state[w]["delta"][0] != 0


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_state_dict_with_retired_entries_continues_identically(dtype, compact):
    """The retired record of set_indices survives state_dict()/load_state_dict() and the run continues bit for bit."""
    w_a, opt_a, _, _ = _reselect_run(dtype, compact, save_after=1)
    assert "retired_indices" in opt_a.state[w_a]
    buf = io.BytesIO()
    torch.save({"w": w_a.detach(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    w_b = torch.nn.Parameter(saved["w"].clone())
    opt_b = SparseAdamW([w_b], lr=1.0, density=0.5, compact_grads=compact)
    opt_b.load_state_dict(saved["opt"])
    _assert_states_equal(opt_a, opt_b, [w_a], [w_b])
    coef = torch.linspace(-2, 2, 77).reshape(7, 11)
    for w, opt in ((w_a, opt_a), (w_b, opt_b)):
        opt.set_indices(w, torch.arange(0, 77, 4))
        for _ in range(3):
            opt.zero_grad()
            (w.float() * coef).sin().sum().backward()
            opt.step()
    _assert_states_equal(opt_a, opt_b, [w_a], [w_b])


def test_state_bytes_counts_the_retired_record():
    """state_bytes() must count the retired record of set_indices: it is memory the optimizer holds."""
    w = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
    opt = SparseAdamW([w], density=0.01)
    opt.set_indices(w, torch.arange(0, 10))
    w.grad = torch.randn(1000).to(torch.bfloat16)
    opt.step()
    before = opt.state_bytes()["state_bytes"]
    opt.set_indices(w, torch.arange(5, 15))
    # 5 kept, 5 new (same active size), 5 retired at 4 (int32) + 4 (delta) + 2 (bf16 base) bytes.
    assert opt.state_bytes()["state_bytes"] == before + 5 * 10
    assert opt.state_bytes()["trainable_entries"] == 10


# ----------------------------------------------------------- kernels vs ref


def _kernel_inputs(shapes, dtype, density, compact, seed, with_base=False):
    gen = torch.Generator().manual_seed(seed)
    params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps = ([] for _ in range(8))
    for shape in shapes:
        p = torch.randn(shape, generator=gen).to(dtype)
        numel = p.numel()
        k = max(1, math.ceil(density * numel))
        idx = torch.sort(torch.randperm(numel, generator=gen)[:k]).values.to(torch.int32)
        params.append(p)
        indices.append(idx)
        g = torch.randn(shape, generator=gen).to(dtype)
        grads.append(g.reshape(-1)[idx.long()].float() if compact else g)
        exp_avgs.append(torch.randn(k, generator=gen) * 0.1)
        exp_avg_sqs.append(torch.rand(k, generator=gen) * 0.01)
        deltas.append(torch.randn(k, generator=gen) * 1e-3)
        if dtype != torch.float32 or with_base:
            bases.append(p.reshape(-1)[idx.long()].clone())
        steps.append(torch.tensor(float(torch.randint(1, 50, (1,), generator=gen).item())))
    return [params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps]


@pytest.mark.parametrize(("backend", "cpu_isa"), with_cpu_isas([b for b in BACKENDS if b.values[0] != "torch"]))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grad", "compact-grad"])
@pytest.mark.parametrize("lr_tensor", [False, True], ids=["lr-float", "lr-tensor"])
def test_kernel_matches_reference(backend, cpu_isa, dtype, compact, lr_tensor):
    shapes = [(37, 29), (1,), (513,), (3, 5, 7), (2049,)]
    inputs = _kernel_inputs(shapes, dtype, 0.3, compact, seed=7)
    expected = copy.deepcopy(inputs)
    lr = torch.tensor(3e-3) if lr_tensor else 3e-3
    kwargs = dict(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=compact)
    _, fn = _ops.resolve("sparse_adamw_", "cpu", backend)
    fn(*inputs, **kwargs)
    _ops.sparse_adamw_ref(*expected, **kwargs)
    rtol, atol = TOLERANCES[dtype]
    for got_list, want_list, name in zip(inputs, expected, ["params", "grads", "indices", "exp_avg", "exp_avg_sq",
                                                           "delta", "base", "step"]):
        for got, want in zip(got_list, want_list):
            if name == "params":
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=name)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


_SIMD_ISAS = cpu_isa_levels()[1:] or [pytest.param("avx2", marks=pytest.mark.skip("this CPU has no SIMD form"))]


def _step_every_isa_and_compare(inputs, isa, steps, lr, maximize, compact):
    """Run `steps` C++ steps with `isa` and with the scalar loop on copies of `inputs`; every
    output tensor must match bit for bit."""
    scalar = copy.deepcopy(inputs)
    for _ in range(steps):
        for run, form in ((inputs, isa), (scalar, "generic")):
            torch.ops.sift.sparse_adamw_(*run, lr, 0.9, 0.99, 1e-8, 0.05, maximize, compact, form)
            for s in run[7]:
                s += 1
    names = ["params", "grads", "indices", "exp_avg", "exp_avg_sq", "delta", "base", "step"]
    for got_list, want_list, name in zip(inputs, scalar, names):
        for i, (got, want) in enumerate(zip(got_list, want_list)):
            # Compare bits, so that signed zeros and NaN payloads count too (the NaNs here come
            # from one NaN operand; two may meet in either order, see sparse_adamw_simd.h).
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), \
                f"{name}[{i}] differs between {isa} and the scalar loop"


@requires_cpp
@pytest.mark.parametrize("isa", _SIMD_ISAS)
@pytest.mark.parametrize("dtype, with_base", [(torch.float32, False), (torch.float32, True),
                                              (torch.bfloat16, True), (torch.float16, True)],
                         ids=["fp32", "fp32-base", "bf16", "fp16"])
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grad", "compact-grad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
def test_cpp_simd_forms_bit_identical_to_scalar_loop(isa, dtype, with_base, compact, maximize):
    """The AVX2 / AVX-512 forms of the step (full vectors, then one masked vector for a
    chunk's tail; bf16/fp16 rebuilt from base + delta and rounded in vector registers) give
    the scalar loop's results bit for bit: same operations, same order, no fused multiply-add.
    Lengths cover partial vectors and several 512-entry chunks, tensors whose last element is
    chosen (the 16-bit gather reads that one alone) and tensors whose last element is not;
    five steps, so the moments are no longer their first-step values."""
    shapes = [(1,), (15,), (16,), (17,), (40, 13), (3000,), (7, 9, 11), (2048,)]
    inputs = _kernel_inputs(shapes, dtype, 0.55, compact, seed=11, with_base=with_base)
    last_chosen = [int(i[-1]) == p.numel() - 1 for p, i in zip(inputs[0], inputs[2])]
    assert any(last_chosen) and not all(last_chosen)
    before = [p.clone() for p in inputs[0]]
    _step_every_isa_and_compare(inputs, isa, 5, 3e-3, maximize, compact)
    assert all(not torch.equal(p, b) for p, b in zip(inputs[0], before)), "the steps must move every param"


@requires_cpp
@pytest.mark.parametrize("isa", _SIMD_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpp_simd_rounding_of_low_precision_weights_matches_scalar_loop(isa, dtype):
    """With lr = 0 the step writes round(base + delta) exactly as stored, so the deltas below
    put the weight on rounding ties, past the largest finite value, into the subnormals, on
    signed zeros, infinities and NaNs (with payloads): the vector rounding must write what
    torch's scalar conversion writes."""
    info = torch.finfo(dtype)
    base = torch.tensor([1.0, 1.0, -1.0, 3.0, info.max, -info.max, info.tiny, 0.0, -0.0, 0.0, 1.0, 2.0,
                         0.0, 1.0, 100.0, 7.0, 0.5, -2.0, 1.0, 0.0], dtype=dtype)
    ulp_at_1 = float(info.eps)
    nan_payload = torch.tensor([0x7FA00001], dtype=torch.int32).view(torch.float32).item()
    delta = torch.tensor([ulp_at_1 / 2, ulp_at_1 * 1.5, -ulp_at_1 / 2, 3 * ulp_at_1, float(info.max),
                          -float(info.max) / 2 ** 3, -float(info.tiny) / 3, float(info.tiny) / 7, -0.0, -0.0,
                          float("inf"), float("-inf"), float("nan"), nan_payload, -float("nan"), 1e-30,
                          ulp_at_1 / 4 * 3, -ulp_at_1, 1 / 3, float(info.smallest_normal) * 0.75])
    k = base.numel()
    numel = 64
    idx = torch.arange(1, 2 * k, 2, dtype=torch.int32)
    params = [torch.zeros(numel, dtype=dtype)]
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dtype)]
    inputs = [params, grads, [idx], [torch.zeros(k)], [torch.zeros(k)], [delta], [base], [torch.ones(())]]
    _step_every_isa_and_compare(inputs, isa, 1, 0.0, False, False)
    want = (base.float() + delta).to(dtype)
    got = params[0][idx.long()]
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()]), "lr=0 must write round(base + delta)"


@requires_cpp
def test_cpp_step_rejects_unknown_isa_before_writing():
    inputs = _kernel_inputs([(64,)], torch.float32, 0.5, False, seed=2)
    before = copy.deepcopy(inputs)
    with pytest.raises(RuntimeError, match="isa must be one of 'auto', 'generic', 'avx2', 'avx512', got 'sse9'"):
        torch.ops.sift.sparse_adamw_(*inputs, 1e-2, 0.9, 0.999, 1e-8, 0.0, False, False, "sse9")
    assert all(torch.equal(a, b) for la, lb in zip(inputs, before) for a, b in zip(la, lb))
    assert torch.ops.sift.sparse_adamw_isa() in ("generic", "avx2", "avx512")


@pytest.mark.parametrize(("backend", "cpu_isa"), with_cpu_isas(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_optimizer_steps_side_by_side_with_reference(backend, cpu_isa, dtype, shape):
    """Every step: params and every state tensor equal the torch-reference optimizer's (other
    backends), and the chosen entries equal torch's own AdamW on an fp32 copy (every backend,
    the reference included: an oracle that shares no code with it)."""
    torch.manual_seed(1)
    pa = torch.nn.Parameter(torch.randn(shape).to(dtype))
    pb = torch.nn.Parameter(pa.detach().clone())
    oracle = torch.nn.Parameter(pa.detach().float().clone())
    opt_a = SparseAdamW([pa], lr=1e-2, density=0.2, backend=backend)
    opt_b = SparseAdamW([pb], lr=1e-2, density=0.2, backend="torch")
    opt_oracle = torch.optim.AdamW([oracle], lr=1e-2, weight_decay=1e-2, foreach=False)
    rtol, atol = TOLERANCES[dtype]
    for step in range(4):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        pa.grad, pb.grad, oracle.grad = g.clone(), g.clone(), g.float()
        opt_a.step()
        opt_b.step()
        opt_oracle.step()
        if backend != "torch":
            torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol)
            for key in ("indices", "exp_avg", "exp_avg_sq", "delta", "step"):
                torch.testing.assert_close(opt_a.state[pa][key], opt_b.state[pb][key], rtol=1e-5, atol=1e-7)
        idx = opt_a.state[pa]["indices"].long()
        if step == 0:
            k = math.ceil(0.2 * pa.numel())
            # Ties (bf16 has many) go to the lower flat index: a stable descending sort says which.
            order = torch.sort(g.float().abs().reshape(-1), descending=True, stable=True).indices
            assert torch.equal(idx, order[:k].sort().values)
            mask = torch.zeros(pa.numel(), dtype=torch.bool)
            mask[idx] = True
        want = oracle.detach().reshape(-1)
        got = pa.detach().reshape(-1)
        torch.testing.assert_close(got[mask], want[mask].to(dtype), rtol=rtol, atol=atol)
        assert torch.equal(got[~mask], pb.detach().reshape(-1)[~mask])
        torch.testing.assert_close(opt_a.state[pa]["exp_avg"], opt_oracle.state[oracle]["exp_avg"].reshape(-1)[idx],
                                   rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(opt_a.state[pa]["exp_avg_sq"],
                                   opt_oracle.state[oracle]["exp_avg_sq"].reshape(-1)[idx], rtol=1e-5, atol=1e-9)


def test_low_precision_kernel_error_within_twice_torch_rounding():
    """Low-precision rule: the kernel's bf16 error against fp64 is at most 2x plain bf16 rounding."""
    inputs = _kernel_inputs([(4099,)], torch.bfloat16, 0.5, False, seed=3)
    exact = copy.deepcopy(inputs)
    exact[0] = [p.double() for p in exact[0]]
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, compact_grads=False)
    w = exact[6][0].double() + exact[5][0].double()
    _ops.resolve("sparse_adamw_", "cpu")[1](*inputs, **kwargs)
    g = exact[1][0].reshape(-1)[exact[2][0].long()].double()
    m = 0.9 * exact[3][0].double() + 0.1 * g
    v = 0.999 * exact[4][0].double() + 0.001 * g * g
    t = exact[7][0].double()
    want = w - 1e-2 / (1 - 0.9**t) * m / (v.sqrt() / (1 - 0.999**t).sqrt() + 1e-8)
    got = inputs[0][0].reshape(-1)[inputs[2][0].long()].double()
    kernel_err = (got - want).abs().max()
    torch_err = (want.to(torch.bfloat16).double() - want).abs().max()
    assert kernel_err <= 2 * torch_err


@requires_triton
@pytest.mark.parametrize("beta2", [0.999, 0.9999, 0.99999], ids=["b2=0.999", "b2=0.9999", "b2=0.99999"])
def test_triton_bias_correction_exact_for_beta_near_one(beta2):
    """The Triton step formed 1 - beta^t in fp32: at t=1, beta2=0.99999 its update was off by ~0.1%."""
    from sift.triton_kernels.sparse_adamw import sparse_adamw_

    inputs = _kernel_inputs([(37, 29), (513,)], torch.float32, 0.3, True, seed=5)
    inputs[7] = [torch.tensor(1.0) for _ in inputs[7]]
    inputs[5] = [torch.zeros_like(d) for d in inputs[5]]  # the delta becomes the update itself
    expected = copy.deepcopy(inputs)
    kwargs = dict(lr=1e-3, beta1=0.9999, beta2=beta2, eps=1e-12, weight_decay=0.0, maximize=False,
                  compact_grads=True)
    sparse_adamw_(*inputs, **kwargs)
    _ops.sparse_adamw_ref(*expected, **kwargs)
    for got, want in zip(inputs[5], expected[5]):
        torch.testing.assert_close(got, want, rtol=TOLERANCES[torch.float32][0], atol=0.0)


def _adamw_bad_input(kind, inputs):
    params, grads, indices, exp_avgs, exp_avg_sqs, deltas, bases, steps = inputs
    if kind == "strided-indices":
        wide = torch.zeros(2 * indices[1].numel(), dtype=indices[1].dtype)
        wide[::2] = indices[1]
        indices[1] = wide[::2]
    elif kind == "short-exp-avg":
        exp_avgs[1] = exp_avgs[1][:-1]
    elif kind == "fp64-step":
        steps[0] = steps[0].double()
    elif kind == "missing-delta":
        deltas.pop()
    elif kind == "short-compact-grad":
        grads[1] = grads[1][:-1]
    elif kind == "wrong-base-dtype":
        bases[0] = bases[0].float()
    return inputs


@requires_triton
@pytest.mark.parametrize("kind, dtype, match", [
    pytest.param("strided-indices", torch.float32, r"indices\[1\] must be a contiguous", id="strided-indices"),
    pytest.param("short-exp-avg", torch.float32, r"exp_avgs\[1\] must be .* one entry per index", id="short-exp-avg"),
    pytest.param("fp64-step", torch.float32, r"steps\[0\] must be a one-element float32", id="fp64-step"),
    pytest.param("missing-delta", torch.float32, r"deltas must have one tensor per param \(got 1 for 2\)",
                 id="missing-delta"),
    pytest.param("short-compact-grad", torch.float32, r"grads\[1\] must be float32 with one entry per index",
                 id="short-compact-grad"),
    pytest.param("wrong-base-dtype", torch.bfloat16, r"bases\[0\] must be a contiguous torch.bfloat16",
                 id="wrong-base-dtype"),
])
def test_triton_step_rejects_bad_tensors_before_writing(kind, dtype, match):
    """The Triton launcher read strided/short/wrong-dtype state tensors through raw addresses, silently."""
    from sift.triton_kernels import sparse_adamw as kernel_module

    table_cache: dict = {}  # a fresh owner: no table from an earlier test's addresses
    inputs = _adamw_bad_input(kind, _kernel_inputs([(37, 29), (513,)], dtype, 0.3, True, seed=6))
    before = copy.deepcopy(inputs)
    with pytest.raises(ValueError, match=match):
        kernel_module.sparse_adamw_(*inputs, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                    maximize=False, compact_grads=True, table_cache=table_cache)
    assert kernel_module.owner_tables(table_cache) == []  # a refused call keeps no table
    for got_list, want_list in zip(inputs, before):
        for got, want in zip(got_list, want_list):
            assert torch.equal(got, want)


# ---------------------------------------------------- hook mode, accumulation


def _train(model, opt, steps, micro=1, clip=None, start=0):
    dtype = next(model.parameters()).dtype
    for step in range(start, start + steps):
        x = _batch(step, n=8, dtype=dtype)
        opt.zero_grad()
        for chunk in x.chunk(micro):
            (_loss(model, chunk) * chunk.shape[0] / x.shape[0]).backward()
        if clip is not None:
            sift.clip_grad_norm_(opt, clip)
        opt.step()


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_hook_mode_equals_plain_mode(clip):
    model_a, model_b = _model(), _model()
    opt_a = SparseAdamW(model_a.parameters(), lr=1e-2, density=0.1)
    opt_b = SparseAdamW(model_b.parameters(), lr=1e-2, density=0.1, compact_grads=True)
    for step in range(6):
        _train(model_a, opt_a, 1, clip=clip, start=step)
        _train(model_b, opt_b, 1, clip=clip, start=step)
        _assert_states_equal(opt_a, opt_b, list(model_a.parameters()), list(model_b.parameters()),
                             rtol=1e-6, atol=1e-8)
    for p in model_b.parameters():
        assert p.grad is None, "hook mode frees dense gradients"


def test_hook_mode_group_added_later_gets_its_hooks_once():
    """add_param_group in compact_grads mode attached no hooks when the first groups had none."""
    head = torch.nn.Parameter(torch.randn(4))
    w = torch.nn.Parameter(torch.randn(6, 5))
    opt = SparseAdamW([{"params": [head], "density": 1.0}], lr=1e-2, compact_grads=True)
    opt.add_param_group({"params": [w], "density": 0.2})
    assert len(opt.grads.hook_handles) == 1
    (w.sum() * 3 + head.sum()).backward()
    assert w.grad is not None and head.grad is not None  # selecting: the dense grad is kept until step()
    opt.step()
    assert opt.state[w]["indices"].numel() == 6 and w.grad is None
    (w.sum() * 3 + head.sum()).backward()
    assert w.grad is None and head.grad is not None


def test_hook_mode_holds_at_most_one_dense_grad():
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(4)])
    opt = SparseAdamW(model.parameters(), density=0.1, compact_grads=True)
    alive = []

    def count(_):
        alive.append(sum(p.grad is not None for p in model.parameters()))

    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # the selection step keeps dense grads until it chooses
    opt.zero_grad()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(count)
    model(torch.randn(4, 16)).sum().backward()
    assert max(alive) <= 1
    opt.step()


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
def test_four_micro_batches_equal_one_batch(compact):
    model_a, model_b = _model(), _model()
    opt_a = SparseAdamW(model_a.parameters(), lr=1e-2, density=0.1, compact_grads=compact)
    opt_b = SparseAdamW(model_b.parameters(), lr=1e-2, density=0.1, compact_grads=compact)
    # The selection step accumulates micro-batches too: both choose from the same summed gradient.
    _train(model_a, opt_a, 6, micro=1)
    _train(model_b, opt_b, 6, micro=4)
    _assert_states_equal(opt_a, opt_b, list(model_a.parameters()), list(model_b.parameters()),
                         rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_uses_the_chosen_entries():
    w = torch.nn.Parameter(torch.zeros(100))
    opt = SparseAdamW([w], density=0.04)
    g = torch.zeros(100)
    g[:4] = torch.tensor([3.0, 4.0, 0.0, 0.0]) + 10  # chosen: the four largest
    g[4:] = 0.1
    w.grad = g.clone()
    norm = sift.clip_grad_norm_(opt, max_norm=1.0)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(g[:4]))
    assert "indices" not in opt.state[w], "clipping must not commit the selection"
    assert torch.equal(w.grad, g), "clipping must not write the dense gradient"
    opt.step()
    assert opt.state[w]["indices"].tolist() == [0, 1, 2, 3]
    clipped = opt.state[w]["exp_avg"] / (1 - 0.9)  # first moment of the first step: the gradient used
    torch.testing.assert_close(torch.linalg.vector_norm(clipped), torch.tensor(1.0), rtol=1e-5, atol=0)


# ----------------------------------------------------------------- state dict


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_state_dict_mid_run_continues_identically(compact, dtype):
    model_a = _model(dtype=dtype)
    opt_a = SparseAdamW(
        [{"params": model_a[0].parameters(), "density": 0.1}, {"params": model_a[2].parameters(), "density": 1.0}],
        lr=1e-2, compact_grads=compact,
    )
    _train(model_a, opt_a, 3)
    buf = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model_b = _model(seed=99, dtype=dtype)
    model_b.load_state_dict(saved["model"])
    opt_b = SparseAdamW(
        [{"params": model_b[0].parameters(), "density": 0.1}, {"params": model_b[2].parameters(), "density": 1.0}],
        lr=1.0, compact_grads=compact,
    )
    opt_b.load_state_dict(saved["opt"])
    _assert_states_equal(opt_a, opt_b, list(model_a.parameters()), list(model_b.parameters()))
    _train(model_a, opt_a, 3, start=3)
    _train(model_b, opt_b, 3, start=3)
    _assert_states_equal(opt_a, opt_b, list(model_a.parameters()), list(model_b.parameters()))


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
def test_load_state_dict_follows_the_saved_density(compact):
    """A sparse state was checked against the constructed group's density (1.0) and refused, though the saved one is installed."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = SparseAdamW([w], lr=1e-2, density=0.1, compact_grads=compact)
    w.pow(3).sum().backward()
    opt.step()
    opt.zero_grad()
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = SparseAdamW([w2], lr=1e-2, density=1.0, compact_grads=compact)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["density"] == 0.1
    assert len(opt2.grads.hook_handles) == (1 if compact else 0)
    for _ in range(3):
        for p, o in ((w, opt), (w2, opt2)):
            p.pow(3).sum().backward()
            o.step()
            o.zero_grad()
    _assert_states_equal(opt, opt2, [w], [w2])


def test_load_state_dict_does_not_share_the_lr_tensor():
    """load_state_dict installed the source's lr tensor itself, so one scheduler drove both optimizers."""
    a, b = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt_a = SparseAdamW([a], lr=torch.tensor(0.1), density=0.5)
    opt_b = SparseAdamW([b], lr=torch.tensor(0.1), density=0.5)
    opt_b.load_state_dict(opt_a.state_dict())
    opt_b.param_groups[0]["lr"].fill_(0.05)  # what a scheduler does to a tensor lr
    assert opt_a.param_groups[0]["lr"].item() == pytest.approx(0.1)


def test_load_state_dict_runs_torch_load_hooks():
    """load_state_dict skipped torch's register_load_state_dict_pre_hook/post_hook hooks."""
    _, source = _trained_opt()
    _, target = _trained_opt()
    calls = []

    def pre(opt, sd):
        calls.append("pre")
        sd = dict(sd)
        sd["param_groups"] = [{**g, "lr": 0.5} for g in sd["param_groups"]]
        return sd

    target.register_load_state_dict_pre_hook(pre)
    target.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    target.load_state_dict(source.state_dict())
    assert calls == ["pre", "post"] and target.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_keeps_its_settings_and_trains(compact, how):
    """copy.deepcopy / pickle kept only torch's attributes, so the copy's step() raised AttributeError."""
    import pickle

    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1, compact_grads=compact, select_steps=2)
    _train(model, opt, 1)  # mid-selection
    pair = {"model": model, "opt": opt}
    copied = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    model_c, opt_c = copied["model"], copied["opt"]
    assert opt_c.select_steps == 2 and opt_c.compact_grads == compact
    _train(model, opt, 3, start=1)
    _train(model_c, opt_c, 3, start=1)
    _assert_states_equal(opt, opt_c, list(model.parameters()), list(model_c.parameters()))


def test_state_bytes_within_budget():
    for dtype, expected in ((torch.float32, 20), (torch.bfloat16, 18)):
        w = torch.nn.Parameter(torch.randn(1000, 100).to(dtype))
        opt = SparseAdamW([w], density=0.01)
        w.grad = torch.randn(1000, 100).to(dtype)
        opt.step()
        report = opt.state_bytes()
        assert report["trainable_entries"] == 1000
        assert report["bytes_per_entry"] == pytest.approx(expected + 4 / 1000)  # + the 0-d step


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(density=0.0), "density", id="density-0"),
        pytest.param(dict(density=1.5), "density", id="density-1.5"),
        pytest.param(dict(lr=-1e-3), "lr", id="lr-negative"),
        pytest.param(dict(eps=-1.0), "eps", id="eps-negative"),
        pytest.param(dict(betas=(1.0, 0.9)), r"betas\[0\]", id="beta1-1"),
        pytest.param(dict(betas=(0.9, -0.1)), r"betas\[1\]", id="beta2-negative"),
        pytest.param(dict(weight_decay=-0.1), "weight_decay", id="wd-negative"),
        pytest.param(dict(select_steps=0), "select_steps", id="select-steps-0"),
        pytest.param(dict(selection="best"), "selection", id="selection-unknown"),
        pytest.param(dict(backend="cuda"), "backend", id="backend-unknown"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseAdamW([torch.nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize(
    "param, match",
    [
        pytest.param(torch.zeros(3, dtype=torch.int64), "floating point", id="int"),
        pytest.param(torch.zeros(3, dtype=torch.complex64), "floating point", id="complex"),
        pytest.param(torch.zeros(3, dtype=torch.float64), "float32, bfloat16 and float16", id="fp64-sparse"),
    ],
)
def test_bad_params_raise(param, match):
    with pytest.raises(ValueError, match=match):
        SparseAdamW([param], density=0.5)


def test_same_param_twice_raises():
    """A param listed twice was stepped twice per step, the fused kernels racing on its entries."""
    w = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match=r"same tensor twice \(positions 0 and 1\)"):
        SparseAdamW([w, w], density=0.5)


def test_param_set_in_add_param_group_raises():
    """add_param_group accepted a set of params, whose order (and so the state_dict ids) varies between runs."""
    opt = SparseAdamW([torch.nn.Parameter(torch.randn(3))], density=0.5)
    with pytest.raises(TypeError, match="not a set"):
        opt.add_param_group({"params": {torch.nn.Parameter(torch.randn(3))}})
    assert len(opt.param_groups) == 1


def test_forced_backend_that_cannot_run_changes_nothing(monkeypatch):
    """A forced backend that cannot run raised only after the selection had been made."""
    if torch.cuda.is_available():
        pytest.skip("triton can run here")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = torch.nn.Parameter(torch.randn(10))
    before = w.detach().clone()
    opt = SparseAdamW([w], density=0.5, backend="triton")
    w.grad = torch.randn(10)
    with pytest.raises(RuntimeError, match="requested"):
        opt.step()
    assert torch.equal(w.detach(), before) and not opt.state.get(w)


def test_bad_group_added_later_leaves_optimizer_unchanged():
    w = torch.nn.Parameter(torch.randn(3))
    opt = SparseAdamW([w], density=0.5)
    with pytest.raises(ValueError, match="density"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "density": 2.0})
    assert len(opt.param_groups) == 1


class _CountedGroups(list):
    """A param_groups list that counts the scans over it."""

    scans = 0

    def __iter__(self):
        type(self).scans += 1
        return super().__iter__()


def test_group_of_is_one_look_up_and_follows_added_groups():
    """EntryState.group_of scanned every group's params by identity on each call (a weight stepped in backward, a
    re-selecting one, asked once per step each): it is one look-up in a table kept by add_param_group, loads and
    copies, and finds a group added later."""
    model = _model()
    opt = SparseAdamW([{"params": [model[0].weight]}, {"params": [model[0].bias], "density": 1.0}], density=0.2)
    extra = torch.nn.Parameter(torch.randn(5, 7))
    opt.add_param_group({"params": [model[2].weight, extra], "density": 0.5})
    expected = {model[0].weight: 0, model[0].bias: 1, model[2].weight: 2, extra: 2}
    opt.param_groups = _CountedGroups(opt.param_groups)
    for p, gi in expected.items():
        assert opt.entries.group_of(p) is opt.param_groups[gi]
    assert _CountedGroups.scans == 0, "group_of scanned the groups"
    with pytest.raises(ValueError, match="not managed"):
        opt.entries.group_of(model[2].bias)
    opt.param_groups = list(opt.param_groups)
    model(_batch(0)).square().mean().backward()
    extra.grad = torch.randn(5, 7)
    opt.step()
    for clone in (copy.deepcopy(opt), _loaded(opt, model, extra)):
        params = [p for group in clone.param_groups for p in group["params"]]
        for p, gi in zip(params, (0, 1, 2, 2)):
            assert clone.entries.group_of(p) is clone.param_groups[gi]
        assert clone.entries.group_of(params[3])["density"] == 0.5


def _loaded(opt: SparseAdamW, model: torch.nn.Module, extra: torch.Tensor) -> SparseAdamW:
    """A fresh optimizer over the same params, built as `opt` was, with `opt`'s state loaded."""
    fresh = SparseAdamW([{"params": [model[0].weight]}, {"params": [model[0].bias], "density": 1.0}], density=0.2)
    fresh.add_param_group({"params": [model[2].weight, extra], "density": 0.5})
    fresh.load_state_dict(opt.state_dict())
    return fresh


def test_sparse_layout_grad_raises_and_changes_nothing():
    w = torch.nn.Parameter(torch.randn(10))
    before = w.detach().clone()
    opt = SparseAdamW([w], density=0.5)
    w.grad = torch.randn(10).to_sparse()
    with pytest.raises(ValueError, match="sparse-layout"):
        opt.step()
    assert torch.equal(w.detach(), before) and not opt.state.get(w)


@pytest.mark.parametrize(
    "indices, match",
    [
        pytest.param(torch.tensor([0, 3, 20]), "out of range", id="out-of-range"),
        pytest.param(torch.tensor([-1, 3]), "out of range", id="negative"),
        pytest.param(torch.tensor([3, 1]), "sorted", id="unsorted"),
        pytest.param(torch.tensor([1, 1, 2]), "sorted ascending without duplicates", id="duplicated"),
        pytest.param(torch.tensor([1.0, 2.0]), "int32 or int64", id="float"),
        pytest.param(torch.tensor([[1, 2]]), "1-D", id="2d"),
        pytest.param(torch.zeros(4, 4, dtype=torch.bool), "shape", id="mask-shape"),
        pytest.param(torch.tensor([1, 2], device="meta"), "meta device", id="meta"),
    ],
)
def test_set_indices_bad_input_raises_and_keeps_state(indices, match):
    w = torch.nn.Parameter(torch.randn(4, 5))
    opt = SparseAdamW([w], density=0.5)
    opt.set_indices(w, torch.tensor([1, 2]))
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.set_indices(w, indices)
    _assert_state_dicts_equal(opt.state_dict(), before)


def _assert_state_dicts_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid in a["state"]:
        for key, value in a["state"][pid].items():
            other = b["state"][pid][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def _trained_opt():
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
    _train(model, opt, 2)
    return model, opt


def _retired_opt():
    w, opt, _, _ = _reselect_run(torch.bfloat16, False, steps=(2, 1, 1), save_after=1)
    return w, opt


@pytest.mark.parametrize(
    "corrupt, match",
    [
        pytest.param(lambda sd: sd["state"][0].pop("retired_delta"), "missing retired_delta", id="missing-delta"),
        pytest.param(lambda sd: sd["state"][0].pop("retired_indices"), "missing retired_indices",
                     id="missing-indices"),
        pytest.param(lambda sd: sd["state"][0].pop("retired_base"), "missing retired_base", id="missing-base"),
        pytest.param(lambda sd: sd["state"][0].__setitem__("retired_delta", sd["state"][0]["retired_delta"][1:]),
                     r"retired_delta must have shape \(\d+,\) to match retired_indices", id="delta-length"),
        pytest.param(lambda sd: sd["state"][0].__setitem__("retired_base", sd["state"][0]["retired_base"][:, None]),
                     "retired_base must have shape", id="base-shape"),
        pytest.param(lambda sd: sd["state"][0].__setitem__("retired_indices",
                                                           sd["state"][0]["retired_indices"].flip(0)),
                     "retired_indices must be sorted", id="unsorted"),
        pytest.param(lambda sd: sd["state"][0].__setitem__("retired_indices",
                                                           sd["state"][0]["retired_indices"] + 1000),
                     "retired_indices out of range", id="out-of-range"),
        pytest.param(lambda sd: sd["state"][0]["retired_indices"].__setitem__(0, sd["state"][0]["indices"][0]),
                     "retired_indices must be disjoint from indices", id="overlap"),
        pytest.param(lambda sd: sd["state"].__setitem__(0, {"retired_indices": torch.tensor([1]),
                                                            "retired_delta": torch.ones(1)}),
                     "retired_indices, retired_delta without indices", id="without-indices"),
    ],
)
def test_corrupted_retired_record_raises_and_keeps_state(corrupt, match):
    """load_state_dict took a retired record (of set_indices) unchecked; a bad one now raises naming the key."""
    _assert_refused_load_keeps_state(_retired_opt, corrupt, match)


@pytest.mark.parametrize(
    "corrupt, match",
    [
        pytest.param(lambda sd: sd["param_groups"].pop(), "param groups", id="group-count"),
        pytest.param(lambda sd: sd["param_groups"][0]["params"].pop(), "params", id="param-count"),
        pytest.param(lambda sd: sd["state"][0].__setitem__("indices", sd["state"][0]["indices"] + 10_000),
                     "out of range", id="indices-out-of-range"),
        pytest.param(lambda sd: sd["state"][0].__setitem__("indices", sd["state"][0]["indices"].flip(0)),
                     "sorted", id="indices-unsorted"),
        pytest.param(lambda sd: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"][:-1]),
                     "exp_avg must have shape", id="moment-length"),
        pytest.param(lambda sd: sd["state"][0].pop("delta"), "missing delta", id="missing-key"),
        pytest.param(lambda sd: sd["state"].__setitem__(17, {}), "param id 17", id="unknown-param"),
        pytest.param(lambda sd: sd["param_groups"][0].__setitem__("density", 2.0), "param group 0 .*density",
                     id="saved-density"),
        pytest.param(lambda sd: sd["state"].__setitem__(0, {"score": torch.zeros(3), "selection_calls": 1}),
                     "score has 3 entries", id="score-size"),
    ],
)
def test_mismatched_state_dict_raises_and_keeps_state(corrupt, match):
    _assert_refused_load_keeps_state(_trained_opt, corrupt, match)


def _assert_refused_load_keeps_state(make_opt, corrupt, match):
    """Corrupt a saved state with `corrupt`; loading it must raise `match` and change nothing."""
    _, source = make_opt()
    sd = copy.deepcopy(source.state_dict())
    corrupt(sd)
    _, target = make_opt()
    target.param_groups[0]["lr"] = 0.123
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(sd)
    _assert_state_dicts_equal(target.state_dict(), before)


def test_forced_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.setenv("SIFT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("triton can run here")
    with pytest.raises(RuntimeError, match="requested"):
        _ops.resolve("sparse_adamw_", "cpu")
    monkeypatch.setenv("SIFT_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="SIFT_BACKEND"):
        _ops.resolve("sparse_adamw_", "cpu")


def test_env_report_names_every_op():
    from sift.env import report

    text = report()
    for name in _ops.ops():
        assert f"| {name} | cpu |" in text


# ------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_on_cuda_matches_reference(dtype):
    inputs = _kernel_inputs([(4096, 37), (1,), (12345,)], dtype, 0.05, False, seed=11)
    inputs = [[t.cuda() for t in group] for group in inputs]
    expected = copy.deepcopy(inputs)
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=False)
    _ops.resolve("sparse_adamw_", "cuda", "triton")[1](*inputs, **kwargs)
    _ops.sparse_adamw_ref(*expected, **kwargs)
    rtol, atol = TOLERANCES[dtype]
    for got, want in zip(inputs[0], expected[0]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for group in (3, 4, 5):
        for got, want in zip(inputs[group], expected[group]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_triton_on_cuda_fp32_base_layout_matches_reference():
    """The fp32 base layout (weight rebuilt as base + delta, never read) on the GPU kernel."""
    inputs = _kernel_inputs([(4096, 37), (1,), (12345,)], torch.float32, 0.05, False, seed=12)
    inputs[6] = [p.reshape(-1)[i.long()] - d for p, i, d in zip(inputs[0], inputs[2], inputs[5])]
    inputs = [[t.cuda() for t in group] for group in inputs]
    expected = copy.deepcopy(inputs)
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=False)
    _ops.resolve("sparse_adamw_", "cuda", "triton")[1](*inputs, **kwargs)
    _ops.sparse_adamw_ref(*expected, **kwargs)
    for group in (0, 3, 4, 5):
        for got, want in zip(inputs[group], expected[group]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_capture_follows_lr_tensor(dtype):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(1000, 100, device="cuda", dtype=dtype))
    ref = torch.nn.Parameter(w.detach().clone())
    lr = torch.tensor(1e-2, device="cuda")
    opt = SparseAdamW([w], lr=lr, density=0.05)
    opt_ref = SparseAdamW([ref], lr=1e-2, density=0.05, backend="torch")
    g = torch.randn(1000, 100, device="cuda", dtype=dtype)
    w.grad, ref.grad = g.clone(), g.clone()
    opt.step()  # selection happens eagerly
    opt_ref.step()
    graph = capture_step(opt)  # its warm-up step compiles the kernel
    opt_ref.step()
    for new_lr in (5e-3, 1e-3):
        lr.fill_(new_lr)
        opt_ref.param_groups[0]["lr"] = new_lr
        graph.replay()
        opt_ref.step()
    torch.cuda.synchronize()
    torch.testing.assert_close(w, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- missing dependencies

_FALLBACK_SCRIPT = """
import logging, sys
{block}
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
import torch, sift
from sift import _ops
w = torch.nn.Parameter(torch.randn(50))
opt = sift.SparseAdamW([w], density=0.1)
w.grad = torch.randn(50)
opt.step()
print("BACKEND", _ops.resolve("sparse_adamw_", "cpu")[0])
"""


@pytest.mark.parametrize(
    "block, env",
    [
        pytest.param("sys.modules['triton'] = None", {}, id="no-triton"),
        pytest.param("", {"SIFT_SKIP_EXT": "1"}, id="no-cpp-extension"),
    ],
)
def test_import_and_step_work_without_optional_backends(block, env):
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT.format(block=block)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    if env.get("SIFT_SKIP_EXT") == "1":
        assert "BACKEND torch" in out.stdout
        assert out.stderr.count("falls back from cpp") == 1, out.stderr
    else:
        assert "BACKEND cpp" in out.stdout


@pytest.mark.gpu
def test_captured_step_survives_another_optimizer_of_the_same_shapes():
    """A second optimizer with identical shapes once overwrote the segment table a captured graph reads."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(257, 129, device="cuda")) for _ in range(2)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    others = [torch.nn.Parameter(torch.randn(257, 129, device="cuda")) for _ in range(2)]
    opt = SparseAdamW(params, lr=1e-2, density=0.05)
    opt_ref = SparseAdamW(refs, lr=1e-2, density=0.05, backend="torch")
    opt_other = SparseAdamW(others, lr=1e-2, density=0.05)
    for p, r, o in zip(params, refs, others):
        g = torch.randn_like(p)
        p.grad, r.grad, o.grad = g.clone(), g.clone(), torch.randn_like(o)
    opt.step()
    opt_ref.step()
    graph = capture_step(opt)
    opt_ref.step()
    for _ in range(3):
        opt_other.step()  # same shapes and dtypes: same cache key before the fix
        graph.replay()
        opt_ref.step()
    torch.cuda.synchronize()
    for p, r in zip(params, refs):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "torch"])
def test_fp32_base_layout_matches_reference_and_the_read_layout(backend):
    """fp32 weights with a base (rebuilt as base + delta, never read) step like the reference and like no base."""
    shapes = [(37, 29), (1,), (513,), (2049,)]
    inputs = _kernel_inputs(shapes, torch.float32, 0.3, False, seed=11)
    no_base = copy.deepcopy(inputs)
    # base + delta == the weight at the chosen entries, as the optimizer would keep it
    inputs[6] = [p.reshape(-1)[i.long()] - d for p, i, d in zip(inputs[0], inputs[2], inputs[5])]
    expected = copy.deepcopy(inputs)
    kwargs = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=False)
    _, fn = _ops.resolve("sparse_adamw_", "cpu", backend)
    fn(*inputs, **kwargs)
    _ops.sparse_adamw_ref(*expected, **kwargs)
    fn(*no_base, **kwargs)
    for got, want, plain in zip(inputs[0], expected[0], no_base[0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-7)  # same step, one rounding apart
    for j in (3, 4, 5):  # the tolerance of test_kernel_matches_reference for state
        for got, want in zip(inputs[j], expected[j]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for got, want in zip(inputs[6], expected[6]):
        assert torch.equal(got, want), "the base is read only"


def _raw_cpp_step(params, indices, steps=None):
    k = [i.numel() for i in indices]
    torch.ops.sift.sparse_adamw_(params, [torch.ones_like(p) for p in params], indices, [torch.zeros(n) for n in k],
                                 [torch.zeros(n) for n in k], [torch.zeros(n) for n in k], [],
                                 steps or [torch.ones(()) for _ in params], 1e-2, 0.9, 0.999, 1e-8, 0.01, False, False)


@requires_cpp
@pytest.mark.parametrize("bad, match", [pytest.param([3, 10], "10 at position 1, outside", id="past-end"),
                                        pytest.param([-1, 3], "-1 at position 0, outside", id="negative"),
                                        pytest.param([3, 3], "3 at position 1, not above 3", id="repeated"),
                                        pytest.param([5, 3], "3 at position 1, not above 5", id="descending")])
def test_cpp_step_rejects_bad_indices_before_writing(bad, match):
    """The raw C++ sparse_adamw_ wrote outside its param for out-of-range indices (and raced on repeats)."""
    buf = torch.zeros(25)
    first, second = buf[:5], buf[10:20]  # contiguous views: a wild write lands in buf[5:10] or buf[20:]
    with pytest.raises(RuntimeError, match=f"indices\\[1\\] has {match}"):
        _raw_cpp_step([first, second], [torch.tensor([0, 2]), torch.tensor(bad)])
    assert torch.equal(buf[5:], torch.zeros(20))  # the chunk holding the bad index is not stepped


@requires_cpp
def test_cpp_step_names_a_step_tensor_without_one_value():
    """The raw C++ sparse_adamw_ failed on a multi-element step with an error not naming `steps`."""
    with pytest.raises(RuntimeError, match=r"steps must hold one value per param, got 2 in steps\[0\]"):
        _raw_cpp_step([torch.zeros(4)], [torch.tensor([1])], steps=[torch.ones(2)])


@requires_triton
def test_triton_bf16_weights_are_round_to_nearest_of_base_plus_delta():
    """Under the interpreter the Triton step truncated bf16 weights instead of rounding base + delta to nearest."""
    inputs = _kernel_inputs([(4099,), (37, 29)], torch.bfloat16, 0.5, False, seed=5)
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=False)
    _ops.resolve("sparse_adamw_", "cpu", "triton")[1](*inputs, **kwargs)
    for p, idx, d, base in zip(inputs[0], inputs[2], inputs[5], inputs[6]):
        want = (base.float() + d).to(torch.bfloat16)
        assert torch.equal(p.reshape(-1)[idx.long()], want)


# ----------------------------------------------------------------- fp32 bases


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "torch"])
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grad", "compact-grad"])
def test_kernel_fp32_base_matches_reference(backend, compact):
    """fp32 weights with a base: each kernel rebuilds w = base + delta like the reference."""
    inputs = _kernel_inputs([(37, 29), (1,), (513,), (2049,)], torch.float32, 0.3, compact, seed=5, with_base=True)
    expected = copy.deepcopy(inputs)
    kwargs = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=compact)
    _ops.resolve("sparse_adamw_", "cpu", backend)[1](*inputs, **kwargs)
    _ops.sparse_adamw_ref(*expected, **kwargs)
    for got_list, want_list in zip(inputs, expected):
        for got, want in zip(got_list, want_list):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
def test_fp32_weights_are_written_as_base_plus_delta(backend, compact):
    """The exact state keeps an fp32 weight's base (20 B an entry in all), and every step writes the chosen
    entries as base + delta: the exported increment reproduces the tuned weight bit for bit."""
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1, compact_grads=compact, backend=backend)
    _train(model, opt, 6)
    for p in model.parameters():
        state = opt.state[p]
        assert state["base"].dtype == torch.float32 and state["base"].shape == state["indices"].shape
        assert torch.equal(p.detach().reshape(-1)[state["indices"].long()], state["base"] + state["delta"])
    report = opt.state_bytes()
    assert report["state_bytes"] - 4 * len(list(model.parameters())) == 20 * report["trainable_entries"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_step_never_reads_a_chosen_fp32_entry(backend):
    """The chosen entries are rebuilt as base + delta: a value written into one by someone else is
    replaced at the next step; entries not chosen stay bit-identical."""
    w = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(0)))
    opt = SparseAdamW([w], lr=1e-2, density=0.25, backend=backend)
    w.grad = torch.randn(64, generator=torch.Generator().manual_seed(1))
    opt.step()
    state = opt.state[w]
    idx = state["indices"].long()
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[idx] = False
    before = w.detach().clone()
    with torch.no_grad():
        w[idx[0]] = 1e6
    opt.step()
    assert torch.equal(w.detach()[idx], state["base"] + state["delta"])
    assert torch.equal(w.detach()[untouched], before[untouched])


def test_an_fp32_state_saved_without_bases_loads_with_them_rebuilt():
    """States saved by versions that kept no fp32 base (and carried a `keep_base` setting) still load:
    each base is rebuilt as weight minus increment, and training continues from there."""
    model_a = _model()
    opt_a = SparseAdamW(model_a.parameters(), lr=1e-2, density=0.1)
    _train(model_a, opt_a, 3)
    old = copy.deepcopy(opt_a.state_dict())
    old["sift"]["keep_base"] = False
    for st in old["state"].values():
        st.pop("base")
    model_b = _model(seed=5)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = SparseAdamW(model_b.parameters(), lr=1.0, density=0.1)
    opt_b.load_state_dict(old)
    for p in model_b.parameters():
        st = opt_b.state[p]
        torch.testing.assert_close(st["base"], opt_a.state[dict(zip(model_b.parameters(), model_a.parameters()))[p]][
            "base"], rtol=0, atol=1e-6)
    _train(model_a, opt_a, 3, start=3)
    _train(model_b, opt_b, 3, start=3)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_a_malformed_base_is_refused_and_loses_nothing():
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
    _train(model, opt, 2)
    before = copy.deepcopy(opt.state_dict())
    broken = copy.deepcopy(before)
    first = next(iter(broken["state"].values()))
    first["base"] = first["base"][:-1]
    with pytest.raises(ValueError, match=r"base must have shape"):
        opt.load_state_dict(broken)
    after = opt.state_dict()
    for pid, st in before["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][pid][key])), key


def test_set_indices_keeps_fp32_bases_and_the_delta_reproduces_the_tuned_weights():
    """set_indices keeps an fp32 base for retired entries too, and SparseDelta.from_optimizer's increments
    applied to the untrained model give the tuned fp32 weights bit for bit."""
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
    _train(model, opt, 2)
    w = model[0].weight
    opt.set_indices(w, torch.arange(0, w.numel(), 3))
    _train(model, opt, 2, start=2)
    st = opt.state[w]
    assert st["retired_base"].shape == st["retired_indices"].shape
    assert torch.equal(st["retired_base"], _model().state_dict()["0.weight"].reshape(-1)[st["retired_indices"].long()])
    fresh = _model()
    sift.SparseDelta.from_optimizer(opt, model).apply_(fresh)
    for name, p in model.named_parameters():
        assert torch.equal(fresh.get_parameter(name), p), name


_GUARD_PAGE_SCRIPT = r"""
import ctypes, mmap, sys
import torch
import sift._ext as ext
ext.load_extension()
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None)
mm = mmap.mmap(-1, 2 * PAGE)
addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
assert libc.mprotect(ctypes.c_void_p(addr + PAGE), PAGE, 0) == 0  # the page after the grad faults
for dtype in (torch.bfloat16, torch.float16):
    grad = torch.frombuffer(mm, dtype=dtype, count=PAGE // 2)  # ends where the guard page starts
    grad.copy_(torch.randn(PAGE // 2))
    n = grad.numel()
    for isa in sys.argv[1:]:
        for k in (1, 17, 513, 600):  # the tensor's last element chosen, in the first or a later chunk
            idx = torch.arange(n - k, n, dtype=torch.int32)
            p = torch.randn(n).to(dtype)
            runs = []
            for form in (isa, "generic"):
                inputs = [[p.clone()], [grad], [idx], [torch.zeros(k)], [torch.zeros(k)], [torch.zeros(k)],
                          [p[idx.long()].clone()], [torch.tensor(1.0)]]
                torch.ops.sift.sparse_adamw_(*inputs, 1e-3, 0.9, 0.99, 1e-8, 0.0, False, False, form)
                runs.append(inputs[0][0])
            assert torch.equal(runs[0], runs[1]), (dtype, isa, k)
        # A checked first chunk ending at the last element, then a chunk that fails the check:
        # the error is raised, and nothing past the gradient is read on the way.
        idx = torch.cat([torch.arange(n - 512, n), torch.arange(0, 512)]).int()
        k = idx.numel()
        inputs = [[torch.zeros(n, dtype=dtype)], [grad], [idx], [torch.zeros(k)], [torch.zeros(k)],
                  [torch.zeros(k)], [torch.zeros(k, dtype=dtype)], [torch.tensor(1.0)]]
        try:
            torch.ops.sift.sparse_adamw_(*inputs, 1e-3, 0.9, 0.99, 1e-8, 0.0, False, False, isa)
        except RuntimeError as exc:
            assert "strictly increasing" in str(exc), exc
        else:
            raise AssertionError("bad indices in the second chunk were not reported")
    # The lean step gathers the 16-bit weights as well: the weight (compact grads) or the
    # gradient (dense grads) ends at the guard page.
    from sift import _ops
    for isa in [i for i in sys.argv[1:] if i in torch.ops.sift.sparse_adamw_lean_isa_levels().split(",")]:
        for k in (1, 17, 513, 600):
            idx = torch.arange(n - k, n)
            low, off = _ops.encode_lean_indices(idx, n)
            for compact in (True, False):
                runs = []
                for form in (isa, "generic"):
                    weight = grad if compact else torch.randn(n).to(dtype)
                    weight.copy_(torch.linspace(-1, 1, n))
                    g = torch.randn(k) if compact else grad
                    inputs = [[weight], [g], [low], [off], [torch.zeros(k, dtype=torch.bfloat16)],
                              [torch.zeros(k, dtype=torch.bfloat16)], [torch.zeros(k, dtype=torch.int8)],
                              [torch.tensor(1.0)]]
                    torch.manual_seed(0)
                    inputs[1][0].copy_(torch.randn(inputs[1][0].numel()))
                    torch.ops.sift.sparse_adamw_lean_(*inputs, 1e-3, 0.9, 0.99, 1e-8, 0.0, False, compact, form)
                    runs.append(weight.clone())
                assert torch.equal(runs[0], runs[1]), ("lean", dtype, isa, k, compact)
print("guard page ok")
"""


@requires_cpp
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mmap/mprotect guard page: Linux only")
@pytest.mark.skipif(not cpu_isa_levels()[1:], reason="this CPU has no SIMD form")
def test_cpp_simd_16bit_gather_never_reads_past_the_gradient():
    """The bf16/fp16 forms gather 2-byte grads (and the lean form 2-byte weights) as 4-byte
    words, which reads 2 bytes past each: with the gradient or weight ending right before an
    unreadable page, choosing its last element (in any chunk, valid or followed by a chunk that
    fails the index check) must not fault. In a subprocess, so a fault fails this test instead of
    killing the run."""
    out = subprocess.run([sys.executable, "-c", _GUARD_PAGE_SCRIPT, *cpu_isa_levels()[1:]], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "guard page ok" in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])


def test_process_group_sync_skips_frozen_dense_params():
    """_sync_grads averaged the stale .grad of a frozen dense param every step (a wasted
    collective for a param the step then skips)."""
    frozen, live = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = SparseAdamW([{"params": [frozen, live], "density": 1.0}], compact_grads=True)
    averaged = []
    opt.process_group = object()  # stands for a real group: only the averaging is watched
    opt.grads.average_across_ranks = lambda t: averaged.append(t) or t
    opt.amp.agree = lambda found_inf: False  # the ranks' agreement is a collective over the group: nothing to agree
    frozen.grad, live.grad = torch.ones(4), torch.ones(4)
    frozen.requires_grad_(False)
    opt.step()
    assert len(averaged) == 1 and averaged[0] is live.grad


def test_reference_step_checks_list_lengths():
    """sparse_adamw_ref ignored params past a shorter list (zip) instead of raising."""
    inputs = _kernel_inputs([(8,), (9,)], torch.float32, 0.5, False, seed=1)
    inputs[1] = inputs[1][:1]
    with pytest.raises(ValueError, match=r"grads must have one tensor per param \(got 1 for 2\)"):
        _ops.sparse_adamw_ref(*inputs, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, maximize=False,
                              compact_grads=False)


def _two_weights():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Tanh(), torch.nn.Linear(64, 32, bias=False))


def _two_weight_steps(model, opt, steps, start=0):
    for step in range(start, start + steps):
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(step)).to(model[0].weight.dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("state", ["exact", "lean"])
def test_load_state_dict_matches_params_by_name(state):
    """Regression: params were matched by position only, so a state saved with the params in the other order
    loaded onto the other weight; with param_names on both sides it now loads onto the weight it belongs to."""
    model = _two_weights().to(torch.bfloat16)
    named = lambda order: [(f"{i}.weight", model[i].weight) for i in order]  # noqa: E731
    opt = SparseAdamW(named([0, 2]), lr=1e-2, density=0.05, state=state)
    _two_weight_steps(model, opt, 2)
    saved, params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
    _two_weight_steps(model, opt, 2, start=2)
    expected = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, p0 in zip(model.parameters(), params):
            p.copy_(p0)
    swapped = SparseAdamW(named([2, 0]), lr=1e-2, density=0.05, state=state)
    swapped.load_state_dict(saved)
    assert torch.equal(swapped.indices_of(model[0].weight), opt.indices_of(model[0].weight))
    _two_weight_steps(model, swapped, 2, start=2)
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p, e)


@pytest.mark.parametrize("named", [False, True], ids=["by-position", "other-names"])
def test_load_state_dict_refuses_another_weights_state(named):
    """Regression: a sparse state was checked against the element count only, so [64, 32]'s state loaded onto
    [32, 64] by position; now refused with both params named, and nothing changes."""
    model = _two_weights()
    params = lambda order, names: [(n, model[i].weight) for i, n in zip(order, names)] if named else \
        [model[i].weight for i in order]  # noqa: E731
    opt = SparseAdamW(params([0, 2], ["0.weight", "2.weight"]), lr=1e-2, density=0.05)
    _two_weight_steps(model, opt, 1)
    saved = opt.state_dict()
    other = SparseAdamW(params([2, 0], ["up.weight", "down.weight"]), lr=1e-2, density=0.05)
    match = r"'0.weight'.*'up.weight'" if named else r"state of param 0.*shape \(64, 32\).*shape \(32, 64\)"
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(saved)
    assert not other.state and other.param_groups[0]["params"][0] is model[2].weight


def test_meta_device_params_are_refused_at_construction():
    """Regression: a model on the meta device was accepted and failed later inside torch."""
    with torch.device("meta"):
        model = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="'weight' is on the meta device"):
        SparseAdamW(list(model.named_parameters()), density=0.1)
    with pytest.raises(ValueError, match="param 0 of the new group is on the meta device"):
        SparseAdamW(model.parameters(), density=0.1)
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=2)
    with torch.device("meta"):
        bert = transformers.BertForSequenceClassification(config)
    flags = {name: p.requires_grad for name, p in bert.named_parameters()}
    with pytest.raises(ValueError, match="query.weight' is on the meta device"):
        SparseAdamW.for_model(bert, density=0.1)
    assert flags == {name: p.requires_grad for name, p in bert.named_parameters()}


def test_an_integer_weight_is_refused_by_name():
    """Regression: an int8 weight's error gave its position only, not the param."""
    weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="param 'layer.weight' has dtype torch.int8"):
        SparseAdamW([("layer.weight", weight)], density=0.1)
