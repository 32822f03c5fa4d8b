"""The machine-limit probe of `python -m sift.bench adamw` does the step's work, so its time bounds the step's.

A probe that skipped entries or arithmetic would report a limit the step could never be held to: each form
(plain, prefetching 32 or 64 entries ahead) must write AdamW's update at exactly the selected entries and nothing elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from sift.bench._adamw_probe import AdamWProbe

LR, BETAS, EPS, DECAY, STEP = 1e-2, (0.9, 0.999), 1e-8, 1e-2, 10


def _assert_untouched(after: torch.Tensor, before: torch.Tensor, idx: torch.Tensor) -> None:
    """Every entry outside `idx` is bit for bit what it was."""
    keep = torch.ones(after.numel(), dtype=torch.bool)
    keep[idx] = False
    assert torch.equal(after.flatten()[keep], before.flatten()[keep])


def _expected(w: torch.Tensor, g: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW update from zero moments at step STEP, on the flat entries `idx` (fp32 math)."""
    b1, b2 = (torch.tensor(b, dtype=torch.float32) for b in BETAS)  # 1 - beta in fp32, as the loop has it
    gj, wj = g.flatten()[idx].float(), w.flatten()[idx].float()
    m, v = (1 - b1) * gj, (1 - b2) * gj * gj
    upd = -LR * DECAY * wj - (LR / (1 - BETAS[0]**STEP)) * m / (v.sqrt() * (1 - BETAS[1]**STEP) ** -0.5 + EPS)
    out = w.clone()
    out.view(-1)[idx] = (wj + upd).to(w.dtype)
    return out, m, v


@pytest.mark.parametrize("prefetch", [0, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_probe_form_writes_adamw_at_the_selected_entries_only(dtype, prefetch):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (33, 130), (7, 5)]  # the last has fewer entries than the prefetch distance
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    indices = [torch.randperm(p.numel(), generator=gen)[: max(1, p.numel() // 7)].sort().values for p in params]
    expected = [_expected(p, p.grad, i) for p, i in zip(params, indices)]
    probe = AdamWProbe(params, indices, step=STEP, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                       prefetch=prefetch)
    probe()
    # fp32: the compiler may contract a multiply and an add into an FMA (-march=native); bf16 rounds
    # the same fp32 value once, so an FMA's last-bit change can move it by one bf16 step.
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    for p, i, (w, m, v), probe_m, probe_v in zip(params, indices, expected, *probe.moments):
        torch.testing.assert_close(probe_m, m, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(probe_v, v, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(p, w, **tol)
        _assert_untouched(p, w, i)


def test_the_probe_forms_agree_bit_for_bit():
    """Prefetch is a hint: the same loop with and without it writes the same bits."""
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(96, 80, generator=gen) for _ in range(3)]
    grads = [torch.randn(96, 80, generator=gen) for _ in range(3)]
    indices = [torch.randperm(96 * 80, generator=gen)[:700].sort().values for _ in range(3)]
    out = []
    for prefetch in (0, 32, 64):
        params = [b.clone() for b in base]
        for p, g in zip(params, grads):
            p.grad = g
        AdamWProbe(params, indices, prefetch=prefetch)()
        out.append(params)
    for form in out[1:]:
        for a, b in zip(out[0], form):
            assert torch.equal(a, b)
    for a, b, i in zip(out[0], base, indices):  # and nothing but the selected entries moved
        _assert_untouched(a, b, i)
        assert (a.flatten()[i] != b.flatten()[i]).all()


@pytest.mark.parametrize("prefetch", [True, -1, 2.0])
def test_a_prefetch_that_is_not_a_distance_is_refused(prefetch):
    params = [torch.randn(8, 8)]
    params[0].grad = torch.randn(8, 8)
    before = params[0].clone()
    with pytest.raises(ValueError, match="prefetch must be a distance"):
        AdamWProbe(params, [torch.tensor([1, 5])], prefetch=prefetch)
    assert torch.equal(params[0], before)
