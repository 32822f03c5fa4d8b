"""SparseAdamW(state="lean"): the <= 8-byte state, its op on every backend, and the optimizer paths."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sift import SparseAdamW, SparseDelta, _ops, clip_grad_norm_
from sift.triton_kernels._rounding import round_to_bf16  # noqa: F401  (Triton importable where the tests run)
from conftest import BACKENDS, DTYPES, cpu_isa_levels, requires_cpp, with_cpu_isas

# Weights of the kernel tests: several 65536-element windows (one left empty), a short tail
# window, and tensors smaller than one window.
KERNEL_SHAPES = [(70001, 3), (300, 501), (7,), (1, 1)]


def _state_tensor_bytes(opt: SparseAdamW) -> tuple[int, int]:
    """(bytes of every tensor in the optimizer's per-param states, trainable entries)."""
    total = entries = 0
    for state in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        entries += state["indices_low"].numel()
    return total, entries


def _lean_operands(dtype: torch.dtype, seed: int, compact: bool, step: float = 7.0) -> list:
    """Random operands of sparse_adamw_lean_ over KERNEL_SHAPES, in the order of its signature."""
    gen = torch.Generator().manual_seed(seed)
    params, grads, lows, offsets, ms, vs, residuals, steps = [], [], [], [], [], [], [], []
    for shape in KERNEL_SHAPES:
        p = torch.randn(shape, generator=gen).to(dtype)
        n = p.numel()
        k = max(1, n // 20)
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        if n > 3 * 65536:
            idx = idx[(idx >> 16) != 1]  # window 1 holds no entry
            k = idx.numel()
        low, off = _ops.encode_lean_indices(idx, n)
        params.append(p)
        grads.append(torch.randn(k, generator=gen) if compact else torch.randn(shape, generator=gen).to(dtype))
        lows.append(low)
        offsets.append(off)
        ms.append((torch.randn(k, generator=gen) * 0.1).bfloat16())
        vs.append((torch.rand(k, generator=gen) * 0.01).bfloat16())
        residuals.append(torch.randint(-128, 128, (k,), generator=gen, dtype=torch.int8))
        steps.append(torch.tensor(step))
    return [params, grads, lows, offsets, ms, vs, residuals if dtype != torch.float32 else [], steps]


def _quadratic_grad(w: torch.Tensor, target: torch.Tensor, curvature: torch.Tensor) -> torch.Tensor:
    return (curvature * (w.double() - target)).to(w.dtype)


# ------------------------------------------------------------------ layout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.05], ids=["0.1%", "1%", "5%"])
def test_at_most_8_bytes_per_entry(dtype, density):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1000), torch.nn.Linear(1000, 769)).to(dtype)
    opt = SparseAdamW(model.parameters(), lr=1e-3, density=density, state="lean")
    model(torch.randn(4, 1024).to(dtype)).float().square().mean().backward()
    opt.step()
    total, entries = _state_tensor_bytes(opt)
    per_entry = total / entries
    assert per_entry <= 8.0, per_entry
    # 6 B per entry for fp32 (index half, two bf16 moments), 7 with the int8 residual.
    assert per_entry >= (6 if dtype == torch.float32 else 7)
    assert opt.state_bytes()["state_bytes"] == total and opt.state_bytes()["trainable_entries"] == entries


def test_encode_decode_round_trip_past_2_31_elements():
    numel = 2**31 + 70000
    idx = torch.tensor([0, 65535, 65536, 2**31 - 1, 2**31, numel - 1], dtype=torch.int64)
    low, off = _ops.encode_lean_indices(idx, numel)
    assert low.dtype == torch.int16 and off.dtype == torch.int32 and off.numel() == _ops.lean_num_windows(numel) + 1
    assert torch.equal(_ops.decode_lean_indices(low, off), idx)


def test_unit_is_ulp_over_256():
    """unit(w) is ulp(w) / 256 for normal weights: bf16 2^(e-7), fp16 2^(e-10)."""
    w = torch.tensor([1.0, -3.0, 1000.0, 2.0**-100])
    torch.testing.assert_close(_ops.lean_unit(w.bfloat16()), torch.tensor([2.0**-7, 2.0**-6, 2.0**2, 2.0**-107]) / 256)
    torch.testing.assert_close(_ops.lean_unit(w[:3].half()), torch.tensor([2.0**-10, 2.0**-9, 2.0**-1]) / 256)
    # Zero and subnormals: fp16's subnormal spacing 2^-24; bf16 below 2^-111 a floor of 2^-126.
    assert _ops.lean_unit(torch.zeros(1, dtype=torch.float16)).item() == 2.0**-32
    assert _ops.lean_unit(torch.zeros(1, dtype=torch.bfloat16)).item() == 2.0**-126


def test_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2.0**-10)  # a quarter of a bf16 ulp above 1
    bits = _ops.lean_random_bits(torch.arange(x.numel()), torch.tensor(3.0))
    mean = _ops.lean_round_bf16(x, bits & 0xFFFF).double().mean().item()
    assert abs(mean - (1.0 + 2.0**-10)) < 2e-5
    nearest = x.bfloat16().double().mean().item()
    assert nearest == 1.0  # what rounding to nearest would store, every time


# ------------------------------------------------------------------ the op


KERNELS = [b for b in BACKENDS if b.values[0] != "torch"]  # the backends that are not the reference itself


def _ulp_over_256(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """unit(w) written from the formats' definitions: ulp(w) / 256 in fp64, with the documented floors
    (fp16: its subnormal spacing 2**-24 / 256; bf16: 2**-126)."""
    _, exponent = torch.frexp(w.double())  # |w| = mantissa * 2**exponent, mantissa in [0.5, 1)
    mantissa_bits, floor = (7, 2.0**-126) if dtype == torch.bfloat16 else (10, 2.0**-32)
    return torch.pow(2.0, (exponent - 1 - mantissa_bits - 8).double()).clamp(min=floor)


def _assert_matches_fp64_adamw(before: list, after: list, lr: float, beta1: float, beta2: float, eps: float,
                               weight_decay: float, maximize: bool, compact: bool) -> None:
    """The lean step against AdamW in fp64 with the documented rounding: each moment is one of the two bf16
    values around the exact one (stochastic rounding), and a 16-bit weight plus its residual * unit is the
    exact new value to one unit (to half an fp32 ulp for fp32 weights, which keep no residual)."""
    params0, grads, lows, offsets, m0s, v0s, r0s, steps = before
    params1, _, _, _, m1s, v1s, r1s, _ = after
    for i, p0 in enumerate(params0):
        idx = _ops.decode_lean_indices(lows[i], offsets[i])
        g = grads[i].double() if compact else grads[i].reshape(-1)[idx].double()
        g = -g if maximize else g
        m = beta1 * m0s[i].double() + (1 - beta1) * g
        v = beta2 * v0s[i].double() + (1 - beta2) * g * g
        # The step sums the two terms in fp32: where they cancel, its error is theirs, not the result's.
        m_terms = (beta1 * m0s[i].double()).abs() + ((1 - beta1) * g).abs()
        v_terms = (beta2 * v0s[i].double()).abs() + (1 - beta2) * g * g
        t = float(steps[i])
        stored0 = p0.reshape(-1)[idx]
        w = stored0.double()
        if r0s:
            w = w + r0s[i].double() * _ulp_over_256(stored0, p0.dtype)
        denominator = v.sqrt() / (1 - beta2**t) ** 0.5 + eps
        upd = -lr * weight_decay * w - lr / (1 - beta1**t) * m / denominator
        expected = w + upd
        # fp32 arithmetic: a few roundings of the update's terms (m's own terms where they cancel) and of the sum.
        slack = (lr / (1 - beta1**t) * m_terms / denominator + (lr * weight_decay * w).abs() + upd.abs()) * 2.0**-20 \
            + expected.abs() * 2.0**-23
        for name, got, exact, terms in (("exp_avg", m1s[i], m, m_terms), ("exp_avg_sq", v1s[i], v, v_terms)):
            bf16_ulp = torch.pow(2.0, (torch.frexp(exact)[1] - 8).double())
            ok = (got.double() - exact).abs() <= bf16_ulp + terms * 2.0**-22
            assert bool(ok.all()), f"{name}[{i}]: {got[~ok][:3]} against {exact[~ok][:3]}"
        stored1 = params1[i].reshape(-1)[idx]
        if r1s:
            unit = _ulp_over_256(stored1, p0.dtype)
            value = stored1.double() + r1s[i].double() * unit
            bound = unit + slack
        else:
            value = stored1.double()
            bound = slack
        ok = (value - expected).abs() <= bound
        assert bool(ok.all()), f"params[{i}]: {value[~ok][:3]} against {expected[~ok][:3]} (from {w[~ok][:3]})"
        untouched = torch.ones(p0.numel(), dtype=torch.bool)
        untouched[idx] = False
        assert torch.equal(params1[i].reshape(-1)[untouched], p0.reshape(-1)[untouched]), f"params[{i}] elsewhere"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grad", "compact-grad"])
@pytest.mark.parametrize("step", [1.0, 7.0, 1000.0], ids=["t1", "t7", "t1000"])
def test_every_backend_matches_fp64_adamw(backend, dtype, compact, step):
    """Regression: the torch row of the kernel test compared the reference with itself. Each backend, the
    reference included, now meets an fp64 AdamW written out here."""
    got = _lean_operands(dtype, seed=1, compact=compact, step=step)
    before = copy.deepcopy(got)
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, maximize=False)
    _, fn = _ops.resolve("sparse_adamw_lean_", "cpu", backend)
    fn(*got, **hyper, compact_grads=compact)
    _assert_matches_fp64_adamw(before, got, **hyper, compact=compact)


@pytest.mark.parametrize(("backend", "cpu_isa"), with_cpu_isas(KERNELS, "sparse_adamw_lean_"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grad", "compact-grad"])
@pytest.mark.parametrize("step", [1.0, 7.0, 1000.0], ids=["t1", "t7", "t1000"])
def test_kernel_matches_reference(backend, cpu_isa, dtype, compact, step):
    got = _lean_operands(dtype, seed=1, compact=compact, step=step)
    want = copy.deepcopy(got)
    kwargs = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, maximize=False,
                  compact_grads=compact)
    _ops.sparse_adamw_lean_ref(*want, **kwargs)
    _, fn = _ops.resolve("sparse_adamw_lean_", "cpu", backend)
    fn(*got, **kwargs)
    # Every operation is rounded as the reference rounds it: the same bits.
    for name, gs, ws in zip(("params", "grads", "indices_low", "window_offsets", "exp_avgs", "exp_avg_sqs",
                             "residuals", "steps"), got, want):
        for i, (g, w) in enumerate(zip(gs, ws)):
            assert torch.equal(g, w), f"{name}[{i}]"


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_maximize_and_tensor_lr(backend):
    got = _lean_operands(torch.bfloat16, seed=2, compact=False)
    before = copy.deepcopy(got)
    hyper = dict(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, maximize=True)
    _, fn = _ops.resolve("sparse_adamw_lean_", "cpu", backend)
    fn(*got, lr=torch.tensor(2e-3), **hyper, compact_grads=False)
    _assert_matches_fp64_adamw(before, got, lr=float(torch.tensor(2e-3)), **hyper, compact=False)
    if backend != "torch":
        want = copy.deepcopy(before)
        _ops.sparse_adamw_lean_ref(*want, lr=2e-3, **hyper, compact_grads=False)
        for gs, ws in zip(got, want):
            for g, w in zip(gs, ws):
                assert torch.equal(g, w)


def test_residual_is_the_sub_ulp_part_of_the_exact_value():
    """After a step, w + residual * unit(w) is the value the step computed, to one unit (half a unit
    by rounding; a full one where a tie at +ulp / 2 is clamped from 128 to 127)."""
    ops = _lean_operands(torch.bfloat16, seed=3, compact=True)
    before = copy.deepcopy(ops)
    _ops.sparse_adamw_lean_ref(*ops, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False,
                               compact_grads=True)
    for i, p in enumerate(ops[0]):
        idx = _ops.decode_lean_indices(ops[2][i], ops[3][i])
        w_old = before[0][i].reshape(-1)[idx]
        exact_old = w_old.float() + before[6][i].float() * _ops.lean_unit(w_old)
        w_new = p.reshape(-1)[idx]
        exact_new = w_new.float() + ops[6][i].float() * _ops.lean_unit(w_new)
        # An independent fp64 recomputation of the update from the moments the step used.
        g = before[1][i].double()
        m = 0.9 * before[4][i].double() + 0.1 * g
        v = 0.999 * before[5][i].double() + 0.001 * g * g
        t = 7.0
        upd = -1e-3 / (1 - 0.9**t) * m / (v.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8)
        expected = exact_old.double() + upd
        err = (exact_new.double() - expected).abs()
        bound = _ops.lean_unit(w_new).double() + expected.abs() * 2.0**-22
        assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_bad_inputs_raise_naming_the_argument(backend):
    _, fn = _ops.resolve("sparse_adamw_lean_", "cpu", backend)
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, compact_grads=False)
    ops = _lean_operands(torch.bfloat16, seed=4, compact=False)
    bad = copy.deepcopy(ops)
    bad[2][0] = bad[2][0].int()
    with pytest.raises((ValueError, RuntimeError), match="indices_low"):
        fn(*bad, **kwargs)
    bad = copy.deepcopy(ops)
    bad[3][1] = bad[3][1][:-1]
    with pytest.raises((ValueError, RuntimeError), match="window_offsets"):
        fn(*bad, **kwargs)
    bad = copy.deepcopy(ops)
    bad[4][0] = bad[4][0].float()
    with pytest.raises((ValueError, RuntimeError), match="exp_avgs"):
        fn(*bad, **kwargs)
    bad = copy.deepcopy(ops)
    bad[6] = []
    with pytest.raises((ValueError, RuntimeError), match="residuals"):
        fn(*bad, **kwargs)
    # Nothing was written by any refused call.
    fresh = _lean_operands(torch.bfloat16, seed=4, compact=False)
    for gs, ws in zip(ops, fresh):
        for g, w in zip(gs, ws):
            assert torch.equal(g, w)


@requires_cpp
def test_cpp_step_rejects_low_halves_out_of_order():
    ops = _lean_operands(torch.float32, seed=5, compact=False)
    ops[2][1] = ops[2][1].flip(0)
    with pytest.raises(RuntimeError, match="indices_low\\[1\\]"):
        torch.ops.sift.sparse_adamw_lean_(*ops, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)


# --------------------------------------------------------------- optimizer


def _problem(dtype: torch.dtype, seed: int = 0, shape=(97, 131)):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    target = torch.randn(shape, generator=gen, dtype=torch.float64)
    curvature = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5
    return w0, target, curvature


def _run(opt_kwargs: dict, dtype: torch.dtype, steps: int, seed: int = 0, shape=(97, 131)):
    w0, target, curvature = _problem(dtype, seed, shape)
    w = torch.nn.Parameter(w0.to(dtype))
    opt = SparseAdamW([w], **opt_kwargs)
    for _ in range(steps):
        w.grad = _quadratic_grad(w.detach(), target, curvature)
        opt.step()
    return w, opt


def _oracle(idx: torch.Tensor, dtype: torch.dtype, steps: int, lr: float, wd: float, seed: int = 0,
            shape=(97, 131), betas=(0.9, 0.999), eps=1e-8) -> torch.Tensor:
    """fp64 AdamW on the chosen entries of the quadratic problem (gradients taken in fp64)."""
    w0, target, curvature = _problem(dtype, seed, shape)
    w = w0.to(dtype).double().reshape(-1).clone()
    t_, c_ = target.reshape(-1)[idx], curvature.reshape(-1)[idx]
    x = w[idx].clone()
    m = torch.zeros_like(x)
    v = torch.zeros_like(x)
    for t in range(1, steps + 1):
        g = c_ * (x - t_)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        x = x - lr * wd * x - lr / (1 - betas[0] ** t) * m / (v.sqrt() / (1 - betas[1] ** t) ** 0.5 + eps)
    w[idx] = x
    return w


# |lean - fp64 oracle| on the chosen entries after 100 steps, max over entries, relative to the
# total movement of the oracle; measured 1.0-1.1% (fp32/bf16/fp16: the bf16 moments), against
# 2e-6 / 5e-4 / 9e-5 for the exact state.
LEAN_VS_ORACLE = {torch.float32: 0.02, torch.bfloat16: 0.02, torch.float16: 0.02}


@pytest.mark.parametrize(("backend", "cpu_isa"), with_cpu_isas(BACKENDS, "sparse_adamw_lean_"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_follows_fp64_adamw_over_100_steps(backend, cpu_isa, dtype):
    kwargs = dict(lr=1e-2, weight_decay=0.01, density=0.05, backend=backend)
    w_lean, opt = _run({**kwargs, "state": "lean"}, dtype, 100)
    w_exact, opt_exact = _run(kwargs, dtype, 100)
    idx = opt.indices_of(w_lean).long()
    assert torch.equal(idx, opt_exact.state[w_exact]["indices"].long())
    oracle = _oracle(idx, dtype, 100, lr=1e-2, wd=0.01)[idx]
    w0 = _problem(dtype)[0].to(dtype).double().reshape(-1)[idx]
    movement = (oracle - w0).abs().max().item()
    state = opt.state[w_lean]
    lean = w_lean.detach().reshape(-1)[idx]
    exact_value = lean.double() + (state["residual"].double() * _ops.lean_unit(lean).double()
                                   if "residual" in state else 0)
    err_lean = (exact_value - oracle).abs().max().item() / movement
    exact = w_exact.detach().reshape(-1)[idx].double()
    if dtype != torch.float32:
        exact = (opt_exact.state[w_exact]["base"].double() + opt_exact.state[w_exact]["delta"].double())
    err_exact = (exact - oracle).abs().max().item() / movement
    assert err_lean <= LEAN_VS_ORACLE[dtype], (err_lean, err_exact)
    # ... and close to the exact state's trajectory.
    assert (exact_value - exact).abs().max().item() / movement <= LEAN_VS_ORACLE[dtype]
    # Entries outside the selection never move.
    outside = torch.ones(w_lean.numel(), dtype=torch.bool)
    outside[idx] = False
    assert torch.equal(w_lean.detach().reshape(-1)[outside], _problem(dtype)[0].to(dtype).reshape(-1)[outside])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_sub_ulp_updates_accumulate(backend, dtype):
    """Each update is ulp/20 of the weight: plain low-precision AdamW never moves it, lean does."""
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    lr = ulp / 20
    w = torch.nn.Parameter(torch.ones(64, 64, dtype=dtype))
    plain = torch.nn.Parameter(torch.ones(64, 64, dtype=dtype))
    opt = SparseAdamW([w], lr=lr, weight_decay=0.0, density=0.05, state="lean", backend=backend)
    ref = torch.optim.AdamW([plain], lr=lr, weight_decay=0.0)
    for _ in range(100):
        w.grad = torch.ones_like(w)  # Adam's normalised step is then lr every step
        plain.grad = torch.ones_like(plain)
        opt.step()
        ref.step()
    assert torch.equal(plain, torch.ones_like(plain))
    idx = opt.indices_of(w).long()
    moved = 1.0 - w.detach().reshape(-1)[idx].double()
    exact = moved - opt.state[w]["residual"].double() * _ops.lean_unit(w.detach().reshape(-1)[idx]).double()
    assert bool((moved > 0).all())
    # 100 updates of lr (5 ulps in all): up to the bf16 moments' rounding noise (measured <= 1.8%).
    torch.testing.assert_close(exact, torch.full_like(exact, 100 * lr), rtol=0.03, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
def test_state_dict_mid_run_continues_identically(dtype, compact):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(23, 19), torch.nn.Tanh(), torch.nn.Linear(19, 7)).to(dtype)
    kwargs = dict(lr=1e-2, density=0.2, state="lean", compact_grads=compact)
    opt = SparseAdamW(model.parameters(), **kwargs)

    def train(m, o, steps, start):
        for s in range(start, start + steps):
            x = torch.randn(8, 23, generator=torch.Generator().manual_seed(s)).to(dtype)
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()

    train(model, opt, 3, 0)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["sift"]["state"] == "lean"
    twin = copy.deepcopy(model)
    train(model, opt, 3, 3)
    twin_opt = SparseAdamW(twin.parameters(), lr=1e-2, density=0.2, compact_grads=compact)  # "exact" until loaded
    twin_opt.load_state_dict(saved)
    assert twin_opt.state_layout == "lean"
    train(twin, twin_opt, 3, 3)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, twin_opt.state[q][key]) if isinstance(value, torch.Tensor) else \
                value == twin_opt.state[q][key], key


@pytest.mark.parametrize("dtype", DTYPES)
def test_set_indices_keeps_moments_and_residual_of_kept_entries(dtype):
    w, opt = _run(dict(lr=1e-3, density=0.1, state="lean"), dtype, 3, shape=(300, 301))
    old_idx = opt.indices_of(w).long()
    old = {k: v.clone() for k, v in opt.state[w].items() if isinstance(v, torch.Tensor)}
    # Keep every other old entry, add new ones, two of them in a window of their own.
    added = torch.tensor([1, 65536 + 17, 90000 - 1])
    added = added[~torch.isin(added, old_idx)]
    new_idx = torch.cat([old_idx[::2], added]).unique()
    weight_before = w.detach().clone()
    opt.set_indices(w, new_idx)
    assert torch.equal(opt.indices_of(w).long(), new_idx)
    assert opt.indices_of(w).dtype == torch.int32
    state = opt.state[w]
    pos_old = {int(i): j for j, i in enumerate(old_idx)}
    for j, i in enumerate(new_idx.tolist()):
        for key in ("exp_avg", "exp_avg_sq") + (("residual",) if dtype != torch.float32 else ()):
            want = old[key][pos_old[i]] if i in pos_old else torch.zeros((), dtype=old[key].dtype)
            assert torch.equal(state[key][j], want), (key, i)
    assert torch.equal(state["step"], old["step"])
    # Dropped entries leave (no increment to keep in the state); their positions are recorded, so that a delta
    # built against the base still holds what they changed in the weight.
    assert "delta" not in state
    assert torch.equal(state["retired_indices"].long(), old_idx[~torch.isin(old_idx, new_idx)])
    assert torch.equal(w.detach(), weight_before)  # set_indices writes no weight
    w.grad = torch.ones_like(w)
    opt.step()
    changed = (w.detach() != weight_before).reshape(-1).nonzero().reshape(-1)
    assert bool(torch.isin(changed, new_idx).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
def test_hook_mode_equals_plain_mode(dtype, clip):
    def run(compact):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(23, 19), torch.nn.Tanh(), torch.nn.Linear(19, 7)).to(dtype)
        opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, state="lean", compact_grads=compact,
                          select_steps=2, max_grad_norm=0.05 if clip else None)
        # Micro-batches accumulate in the weight dtype in plain mode and in fp32 in hook mode:
        # the same bits only for fp32 weights, so bf16/fp16 take one batch a step.
        micro_batches = 2 if dtype == torch.float32 else 1
        for s in range(5):
            for micro in range(micro_batches):
                x = torch.randn(4, 23, generator=torch.Generator().manual_seed(10 * s + micro)).to(dtype)
                model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    (ma, oa), (mb, ob) = run(False), run(True)
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
        for key, value in oa.state[p].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, ob.state[q][key]), key


def test_clip_grad_norm_on_lean_matches_exact():
    def build(state):
        torch.manual_seed(0)
        model = torch.nn.Linear(40, 30)
        opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1, state=state)
        model(torch.randn(4, 40)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        model(torch.randn(4, 40, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        return model, opt

    (ml, ol), (me, oe) = build("lean"), build("exact")
    norm_lean, norm_exact = clip_grad_norm_(ol, 0.01), clip_grad_norm_(oe, 0.01)
    # The norm over the chosen entries, from the exact state's stored indices.
    expected = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1)[oe.state[p]["indices"].long()]
                                                   for p in me.parameters()]))
    torch.testing.assert_close(norm_lean, expected)
    torch.testing.assert_close(norm_exact, expected)
    for p, q in zip(ml.parameters(), me.parameters()):
        torch.testing.assert_close(ol.compact_grad(p), oe.compact_grad(q))


def test_lean_errors_are_clear_and_change_nothing():
    w = torch.nn.Parameter(torch.randn(20, 20))
    with pytest.raises(ValueError, match="state must be 'exact' or 'lean'"):
        SparseAdamW([w], state="compact")
    model = torch.nn.Linear(20, 20)
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1, state="lean")
    model(torch.randn(3, 20)).square().mean().backward()
    opt.step()
    with pytest.raises(ValueError, match="needs base="):
        SparseDelta.from_optimizer(opt, model)
    with pytest.raises(ValueError, match="no chosen entries"):
        SparseAdamW([w], state="lean").indices_of(w)
    before = copy.deepcopy(opt.state_dict())

    def refused(sd, match):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        after = opt.state_dict()
        assert after["sift"] == before["sift"]
        for pid, st in before["state"].items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, after["state"][pid][key])

    sd = copy.deepcopy(before)
    sd["sift"]["state"] = "exact"
    refused(sd, "lean state")
    sd = copy.deepcopy(before)
    sd["sift"]["state"] = "dense"
    refused(sd, "must be 'exact' or 'lean'")
    sd = copy.deepcopy(before)
    sd["state"][0]["window_offsets"][1] += 1
    refused(sd, "window_offsets|decoded indices")
    sd = copy.deepcopy(before)
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].float()
    refused(sd, "exp_avg must be torch.bfloat16")
    sd = copy.deepcopy(before)
    sd["state"][0]["delta"] = torch.zeros(sd["state"][0]["indices_low"].numel())
    refused(sd, "delta in a lean state")
    # An exact state_dict into a lean optimizer: load adopts "exact" (the saved layout).
    exact = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
    model(torch.randn(3, 20)).square().mean().backward()
    exact.step()
    sd = exact.state_dict()
    sd["sift"]["state"] = "lean"
    refused(sd, "indices")



@requires_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grad", "compact-grad"])
def test_cpp_every_isa_level_matches_reference(dtype, compact):
    """The C++ step's SIMD form and its scalar loop give the reference's bits, the param's last element chosen."""
    gen = torch.Generator().manual_seed(3)
    ops = [[] for _ in range(8)]
    for n, k in ((70001, 3501), (150301, 7517), (13, 5)):
        # The last element chosen: a 16-bit load there must read no byte past the param.
        idx = torch.cat([torch.randperm(n - 1, generator=gen)[:k - 1].sort().values, torch.tensor([n - 1])])
        low, off = _ops.encode_lean_indices(idx, n)
        for j, t in enumerate((torch.randn(n, generator=gen).to(dtype),
                               torch.randn(k, generator=gen) if compact else torch.randn(n, generator=gen).to(dtype),
                               low, off, (torch.randn(k, generator=gen) * 0.1).bfloat16(),
                               (torch.rand(k, generator=gen) * 0.01).bfloat16(),
                               torch.randint(-128, 128, (k,), generator=gen, dtype=torch.int8), torch.tensor(7.0))):
            ops[j].append(t)
    if dtype == torch.float32:
        ops[6] = []
    want = copy.deepcopy(ops)
    args = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, maximize=True, compact_grads=compact)
    _ops.sparse_adamw_lean_ref(*want, **args)
    for isa in cpu_isa_levels("sparse_adamw_lean_"):
        got = copy.deepcopy(ops)
        torch.ops.sift.sparse_adamw_lean_(*got, *args.values(), isa)
        for name, j in (("params", 0), ("exp_avgs", 4), ("exp_avg_sqs", 5), ("residuals", 6)):
            for i, (g, w) in enumerate(zip(got[j], want[j])):
                assert torch.equal(g, w), f"{isa}: {name}[{i}]"



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_lean_fine_tune_is_a_delta_given_its_base(dtype):
    """The lean state keeps no increments: with the base, the delta of its entries reproduces the tuned
    16-bit weights bit for bit, and its head whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dtype)
    base = copy.deepcopy(model.state_dict())
    # eps above fp16's underflow: torch's AdamW keeps the dense head's moments in the param dtype.
    opt = SparseAdamW([{"params": [model[0].weight]}, {"params": [model[2].weight, model[2].bias], "density": 1.0}],
                      lr=1e-2, eps=1e-4, density=0.1, state="lean")
    for step in range(4):
        model(torch.randn(5, 20, generator=torch.Generator().manual_seed(step)).to(dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    delta = SparseDelta.from_optimizer(opt, model, base=base)
    assert delta["0.weight"].nnz == math.ceil(0.1 * 240) and sorted(delta.dense) == ["2.bias", "2.weight"]
    fresh = torch.nn.Sequential(torch.nn.Linear(20, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dtype)
    fresh.load_state_dict(base)
    delta.apply_(fresh)
    for (name, a), b in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
