"""Periodic re-selection (`reselect_every`): drop and grow against a plain-torch reference, the grown
entries' bias correction, resuming across a re-selection, the refusals, the schedules, delta files."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from sift import SparseAdamW, SparseDelta
from sift.optim.reselection import fraction_at, reselect_settings

LR, BETAS, EPS, WD, DENSITY = 1e-2, (0.9, 0.999), 1e-8, 1e-2, 0.3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(6, 13, generator=gen) for _ in range(n)]


def _backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


class Reference:
    """SIFT with drop-and-grow re-selection, written out in plain torch, one weight at a time."""

    def __init__(self, model: torch.nn.Module, every: int, fraction: float, rule: str, drop: str,
                 max_norm: float | None = None, steps: int = 1):
        self.params = list(model.parameters())
        self.every, self.fraction, self.rule, self.drop, self.max_norm = every, fraction, rule, drop, max_norm
        self.steps = steps  # the steps whose scores add up, the re-selecting one included
        self.state: dict[int, dict] = {}

    def step(self) -> None:
        grown = {}
        for i, p in enumerate(self.params):
            flat, g = p.data.view(-1), p.grad.reshape(-1).float()
            if i not in self.state:
                k = max(1, math.ceil(DENSITY * flat.numel()))
                idx = torch.sort(torch.argsort(-g.abs(), stable=True)[:k]).values
                self.state[i] = dict(idx=idx, m=torch.zeros(k), v=torch.zeros(k), d=torch.zeros(k),
                                     base=flat[idx].clone(), t=0, retired={})
            s = self.state[i]
            score = g.abs() * flat.abs() if self.rule == "saliency" else g.abs()
            ahead = -s["t"] % self.every
            if s["t"] and ahead == 0:
                if "acc" in s:
                    score = score + s.pop("acc")
                grown[i] = self._reselect(s, flat, score)
            elif 0 < ahead < self.steps:
                s["acc"] = score if "acc" not in s else s["acc"] + score
        # Clipped by the global norm of the entries this step updates (the new ones on a re-selecting step).
        coef = 1.0
        if self.max_norm is not None:
            total = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1)[self.state[i]["idx"]]
                                                        for i, p in enumerate(self.params)]))
            coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        for i, p in enumerate(self.params):
            s, g = self.state[i], p.grad.reshape(-1).float() * coef
            c1, c2 = 1 - BETAS[0] ** s["t"], 1 - BETAS[1] ** s["t"]
            for j, pos in grown.get(i, ()):  # the grown entries' seeds, from the gradient the update applies
                s["m"][j], s["v"][j] = c1 * g[pos], c2 * g[pos] * g[pos]
            self._adamw(s, p.data.view(-1), g)

    def _reselect(self, s: dict, flat: torch.Tensor, score: torch.Tensor) -> None:
        k = s["idx"].numel()
        n = min(int(self.fraction * k), flat.numel() - k)
        moved = s["d"].abs() if self.rule == "spiel" else score[s["idx"]]
        dropped = set(torch.argsort(moved, stable=True)[:n].tolist())  # ties: the lower index goes
        outside = torch.ones(flat.numel(), dtype=torch.bool)
        outside[s["idx"]] = False
        candidates = outside.nonzero().view(-1)
        grown = candidates[torch.argsort(-score[candidates], stable=True)[:n]].tolist()
        rows = []  # (flat index, m, v, delta, base)
        for j, pos in enumerate(s["idx"].tolist()):
            if j not in dropped:
                rows.append((pos, s["m"][j], s["v"][j], s["d"][j], s["base"][j]))
            elif self.drop == "revert":
                flat[pos] = s["base"][j]
            elif s["d"][j] != 0:
                s["retired"][pos] = (s["d"][j].clone(), s["base"][j].clone())
        for pos in grown:
            d, base = s["retired"].pop(pos, (torch.tensor(0.0), flat[pos].clone()))
            rows.append((pos, 0.0, 0.0, d, base))  # moments seeded by `step`
        rows.sort(key=lambda r: r[0])
        s["idx"] = torch.tensor([r[0] for r in rows])
        for j, key in enumerate(("m", "v", "d", "base")):
            s[key] = torch.stack([torch.as_tensor(r[j + 1], dtype=torch.float32) for r in rows])
        return [(j, pos) for j, pos in enumerate(s["idx"].tolist()) if pos in grown]

    def _adamw(self, s: dict, flat: torch.Tensor, g: torch.Tensor) -> None:
        s["t"] += 1
        gi = g[s["idx"]]
        s["m"].mul_(BETAS[0]).add_(gi, alpha=1 - BETAS[0])
        s["v"].mul_(BETAS[1]).addcmul_(gi, gi, value=1 - BETAS[1])
        step_size = torch.tensor(LR / (1 - BETAS[0] ** s["t"]), dtype=torch.float64).float()
        bc2_sqrt = torch.tensor(1 - BETAS[1] ** s["t"], dtype=torch.float64).sqrt().float()
        w = s["base"] + s["d"]
        upd = -torch.tensor(LR, dtype=torch.float64).float() * WD * w - step_size * s["m"] / (s["v"].sqrt() / bc2_sqrt
                                                                                              + EPS)
        s["d"].add_(upd)
        flat[s["idx"]] = s["base"] + s["d"]


def _optimizer(model: torch.nn.Module, **kwargs) -> SparseAdamW:
    return SparseAdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, density=DENSITY,
                       backend="torch", **kwargs)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("rule", ["spiel", "magnitude", "saliency"])
@pytest.mark.parametrize("drop", ["merge", "revert"])
def test_matches_plain_torch_reference_step_by_step(rule, drop, steps):
    model = _model()
    twin = copy.deepcopy(model)
    opt = _optimizer(model, reselect_every=3, reselect_fraction=0.5, reselect_rule=rule, reselect_drop=drop,
                     reselect_steps=steps)
    ref = Reference(twin, every=3, fraction=0.5, rule=rule, drop=drop, steps=steps)
    changed = 0
    for x in _batches(11):
        for m in (model, twin):
            m.zero_grad()
            _backward(m, x)
        before = [opt.state[p]["indices"].clone() if p in opt.state else None for p in model.parameters()]
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
            state, s = opt.state[p], ref.state[i]
            assert torch.equal(state["indices"].long(), s["idx"]), f"param {i}"
            changed += before[i] is not None and not torch.equal(before[i], state["indices"])
            torch.testing.assert_close(state["exp_avg"], s["m"], rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(state["exp_avg_sq"], s["v"], rtol=1e-5, atol=1e-10)
            torch.testing.assert_close(state["delta"], s["d"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(state["base"], s["base"], rtol=0, atol=1e-6)
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
            retired = state.get("retired_indices", torch.empty(0, dtype=torch.long)).long().tolist()
            assert retired == sorted(s["retired"]), f"param {i}"
    assert changed == 3 * 4  # every param re-selected at updates 3, 6 and 9


def test_grown_entries_first_update_is_a_fresh_adam_entrys():
    """The shared step count's bias correction, applied to the rescaled seeds, gives a grown entry a fresh
    Adam entry's first update (a seed of (1-b1) g would take a step about 4x too large)."""
    model = _model()
    opt = _optimizer(model, reselect_every=4, reselect_fraction=0.5)
    w = model[0].weight
    for x in _batches(5):
        model.zero_grad()
        _backward(model, x)
        if int(opt.state.get(w, {}).get("step", 0)) == 4:
            old, value = opt.state[w]["indices"].clone(), w.detach().clone().view(-1)
            g = w.grad.clone().view(-1)
        opt.step()
    state = opt.state[w]
    fresh = ~torch.isin(state["indices"], old)
    pos = state["indices"][fresh].long()
    gi = g[pos]
    # A fresh entry after one step: m = (1-b1) g, v = (1-b2) g^2, corrections 1 - b^1.
    m_hat, v_hat = ((1 - BETAS[0]) * gi) / (1 - BETAS[0]), ((1 - BETAS[1]) * gi * gi) / (1 - BETAS[1])
    expected = -LR * WD * value[pos] - LR * m_hat / (v_hat.sqrt() + EPS)
    torch.testing.assert_close(state["delta"][fresh], expected, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(state["exp_avg"][fresh], (1 - BETAS[0] ** 5) * gi, rtol=1e-5, atol=0)
    torch.testing.assert_close(state["exp_avg_sq"][fresh], (1 - BETAS[1] ** 5) * gi * gi, rtol=1e-5, atol=0)


def round_trip(model: torch.nn.Module, opt: SparseAdamW) -> dict:
    """The model's and the optimizer's state, through `torch.save` and `torch.load`, as a checkpoint takes them."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)


def _run(model, opt, batches):
    for x in batches:
        model.zero_grad()
        _backward(model, x)
        opt.step()


@pytest.mark.parametrize("drop", ["merge", "revert"])
def test_resume_across_a_reselection_is_bit_for_bit(drop):
    batches = _batches(10)
    model = _model()
    opt = _optimizer(model, reselect_every=3, reselect_fraction=0.4, reselect_drop=drop)
    _run(model, opt, batches)
    half = _model()
    half_opt = _optimizer(half, reselect_every=3, reselect_fraction=0.4, reselect_drop=drop)
    _run(half, half_opt, batches[:4])  # one re-selection behind it, two ahead
    saved = round_trip(half, half_opt)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    # Built without the reselect arguments: the settings come back with the param groups.
    resumed_opt = _optimizer(resumed)
    resumed_opt.load_state_dict(saved["opt"])
    _run(resumed, resumed_opt, batches[4:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        a, b = opt.state[p], resumed_opt.state[q]
        assert sorted(a) == sorted(b)
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


@pytest.mark.parametrize("kwargs, message", [
    (dict(reselect_every=0), "reselect_every"),
    (dict(reselect_every=True), "reselect_every"),
    (dict(reselect_every=2.5), "reselect_every"),
    (dict(reselect_every=5, reselect_fraction=0.0), "reselect_fraction"),
    (dict(reselect_every=5, reselect_fraction=1.5), "reselect_fraction"),
    (dict(reselect_every=5, reselect_schedule="step"), "reselect_schedule"),
    (dict(reselect_every=5, reselect_schedule="cosine"), "reselect_total_steps"),
    (dict(reselect_every=5, reselect_total_steps=0), "reselect_total_steps"),
    (dict(reselect_every=5, reselect_rule="random"), "reselect_rule"),
    (dict(reselect_every=5, reselect_drop="keep"), "reselect_drop"),
    (dict(reselect_every=5, reselect_steps=6), "reselect_steps"),
    (dict(reselect_every=5, reselect_steps=0), "reselect_steps"),
    (dict(reselect_every=5, state="lean"), "reselect_rule='spiel' ranks each entry's delta"),
], ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None)
def test_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _optimizer(_model(), **kwargs)


def test_for_model_refuses_4bit_bases_before_anything_changes():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=48, num_labels=2)

    class Params4bit(torch.nn.Parameter):  # matched by class name, as bitsandbytes' is
        pass

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    layer = model.bert.encoder.layer[0].attention.self.query
    layer.weight = Params4bit(layer.weight.detach().clone())
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match="reselect_drop='merge' cannot fold"):
        SparseAdamW.for_model(model, density=0.05, reselect_every=10)
    assert flags == [p.requires_grad for p in model.parameters()]


def test_schedule_values():
    f = 0.2
    const, linear, cosine = (reselect_settings(5, f, s, 100) for s in ("constant", "linear", "cosine"))
    for step, lin, cos in [(0, f, f), (25, 0.75 * f, f * (1 + math.cos(math.pi / 4)) / 2), (50, f / 2, f / 2),
                           (100, 0.0, 0.0), (150, 0.0, 0.0)]:
        assert fraction_at(const, step) == f
        assert fraction_at(linear, step) == pytest.approx(lin, abs=1e-12)
        assert fraction_at(cosine, step) == pytest.approx(cos, abs=1e-12)


def test_linear_schedule_changes_floor_f_k_entries_each_time():
    model = _model()
    opt = _optimizer(model, reselect_every=2, reselect_fraction=0.5, reselect_schedule="linear",
                     reselect_total_steps=8)
    w = model[0].weight
    changes = []
    for x in _batches(9):
        model.zero_grad()
        _backward(model, x)
        before = opt.state[w]["indices"].clone() if w in opt.state else None
        opt.step()
        if before is not None:
            changes.append(int((~torch.isin(opt.state[w]["indices"], before)).sum()))
    # changes[c - 1]: the step after update c. Re-selections at updates 2, 4, 6, 8: fractions 3/8, 2/8, 1/8, 0.
    k = opt.state[w]["indices"].numel()
    expected = [0] * 8
    for count, frac in [(2, 0.375), (4, 0.25), (6, 0.125)]:
        expected[count - 1] = int(frac * k)
    assert k == 28 and changes == expected


@pytest.mark.parametrize("drop", ["merge", "revert"])
def test_delta_from_optimizer_holds_every_changed_entry(drop):
    model = _model()
    initial = copy.deepcopy(model)
    opt = _optimizer(model, reselect_every=2, reselect_fraction=0.5, reselect_drop=drop)
    _run(model, opt, _batches(9))
    assert drop == "revert" or "retired_indices" in opt.state[model[0].weight]
    delta = SparseDelta.from_optimizer(opt, model)
    rebuilt = copy.deepcopy(initial)
    delta.apply_(rebuilt)
    for (name, p), q, r in zip(model.named_parameters(), initial.parameters(), rebuilt.parameters()):
        assert torch.equal(p, r), name
        changed = (p != q).view(-1)
        assert not (changed & (delta.to_dense(name).view(-1) == 0)).any(), name


@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaler.step", "unscale_-then-step"])
def test_grad_scaler_reselects_as_unscaled_training(unscale_first):
    model, twin = _model(), _model()
    opt = _optimizer(model, reselect_every=2, reselect_fraction=0.5)
    twin_opt = _optimizer(twin, reselect_every=2, reselect_fraction=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for x in _batches(7):
        for m in (model, twin):
            m.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        _backward(twin, x)
        twin_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[p]["indices"], twin_opt.state[q]["indices"])
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], twin_opt.state[q]["exp_avg"], rtol=1e-6, atol=1e-9)
