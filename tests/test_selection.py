"""Which entries SparseAdamW trains: chosen only inside a step that updates, the same in hook
mode as in plain mode in the hard cases, by each rule's definition, with one tie rule."""

from __future__ import annotations

import math

import pytest
import torch

import sift
from sift import SparseAdamW, _ops
from sift._index import top_k_positions
from conftest import BACKENDS, capture_step



def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 5))


def _batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def _backward(model, step: int, micro: int = 1) -> None:
    x, y = _batch(step)
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        (torch.nn.functional.cross_entropy(model(xs), ys) * xs.shape[0] / x.shape[0]).backward()


# ----------------------------------------------------------- GradScaler


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
def test_step_skipped_by_grad_scaler_leaves_selection_pending(compact):
    """clip_grad_norm_ chose the entries from an overflowing step that GradScaler then skipped."""
    model, fresh = _model(), _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1, compact_grads=compact)
    opt_fresh = SparseAdamW(fresh.parameters(), lr=1e-2, density=0.1, compact_grads=compact)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    # A batch that overflows: inf gradients, which GradScaler must skip.
    x, y = _batch(0)
    x[0, 0] = float("inf")
    opt.zero_grad()
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    sift.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**16, "the scaler must have seen the overflow"
    assert all("indices" not in opt.state.get(p, {}) for p in model.parameters()), "selection must stay pending"
    assert all(not opt.state.get(p) for p in model.parameters()), "a skipped step must leave the state unchanged"
    # The next clean step chooses from its own gradient: the same entries as a fresh optimizer.
    for m, o, s in ((model, opt, scaler), (fresh, opt_fresh, torch.amp.GradScaler("cpu", init_scale=2.0**15))):
        o.zero_grad()
        x, y = _batch(1)
        s.scale(torch.nn.functional.cross_entropy(m(x), y)).backward()
        s.unscale_(o)
        sift.clip_grad_norm_(o, 1.0)
        s.step(o)
        s.update()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["indices"], opt_fresh.state[q]["indices"])
        torch.testing.assert_close(p, q)


def test_clip_before_a_skipped_step_changes_nothing():
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
    _backward(model, 0)
    grads = [p.grad.clone() for p in model.parameters()]
    sift.clip_grad_norm_(opt, 1e-3)
    assert all(not opt.state.get(p) for p in model.parameters())
    # Sparse weights' dense gradients are neither written nor replaced (dense groups: none here).
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.zero_grad()  # what a loop does after a skipped step
    assert not opt.selector.clipped and not opt.selector.tentative


# ---------------------------------------------------------- hook == plain


@pytest.mark.parametrize("selection", ["magnitude", "saliency", "random"])
@pytest.mark.parametrize("select_steps", [1, 2, 3])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_hook_mode_chooses_plain_modes_entries_with_accumulation(selection, select_steps, clip):
    """Hook mode chose at the first micro-batch and summed |g| per micro-batch (6 of 52 entries shared)."""
    model_a, model_b = _model(), _model()
    kw = dict(lr=1e-2, density=0.1, select_steps=select_steps, selection=selection)
    opt_a = SparseAdamW(model_a.parameters(), **kw)
    opt_b = SparseAdamW(model_b.parameters(), compact_grads=True, **kw)
    for step in range(select_steps + 2):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            _backward(model, step, micro=4)
            if clip is not None:
                sift.clip_grad_norm_(opt, clip)
            opt.step()
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        sa, sb = opt_a.state[p], opt_b.state[q]
        if "indices" in sa:
            assert torch.equal(sa["indices"], sb["indices"])
            for key in ("exp_avg", "exp_avg_sq", "delta"):
                torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-8)


def test_hook_mode_frees_dense_grads_once_selected():
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1, compact_grads=True)
    _backward(model, 0, micro=2)
    assert all(p.grad is not None for p in model.parameters()), "selecting: dense grads are kept"
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    _backward(model, 1, micro=2)
    assert all(p.grad is None for p in model.parameters())
    assert all(opt.compact_grad(p) is not None for p in model.parameters())


# ----------------------------------------------------------------- rules


def test_saliency_picks_by_its_definition_with_micro_batches_and_steps():
    """-theta * dL/dtheta summed over two selection steps (each the sum of its micro-batches), then |.|."""
    w_a = torch.nn.Parameter(torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.25, -0.5]))
    w_b = torch.nn.Parameter(w_a.detach().clone())
    # Per step, two micro-batches; the gradient of sum(c * w) is c.
    micro = [[torch.tensor([1.0, 2.0, -4.0, 0.1, 1.0, 0.0, 8.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.1, 0.5, 0.0, 0.0, 1.0])],
             [torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.5, 3.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 1.0])]]
    theta = w_a.detach().clone()
    criterion = sum(-theta * (c1 + c2) for c1, c2 in micro)
    want = torch.sort(criterion.abs(), descending=True, stable=True).indices[:3].sort().values
    for w, compact in ((w_a, False), (w_b, True)):
        opt = SparseAdamW([w], lr=1e-2, density=3 / 8, select_steps=2, selection="saliency", compact_grads=compact)
        for step in micro:
            opt.zero_grad()
            for c in step:
                (c * w).sum().backward()
            opt.step()
        assert opt.state[w]["indices"].long().tolist() == want.tolist()


def test_magnitude_sums_abs_of_each_steps_summed_gradient():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = SparseAdamW([w], lr=1e-2, density=0.25, select_steps=2, compact_grads=True)
    # Step 1: micro-batches +3 and -3 at entry 0 cancel (|sum| = 0), entry 1 gets 1 + 1.
    # Step 2: entry 2 gets 1.5. Plain mode's score: [0, 2, 1.5, 0] -> entry 1.
    for step in ([torch.tensor([3.0, 1.0, 0, 0]), torch.tensor([-3.0, 1.0, 0, 0])], [torch.tensor([0, 0, 1.5, 0])]):
        opt.zero_grad()
        for c in step:
            (c * w).sum().backward()
        opt.step()
    assert opt.state[w]["indices"].tolist() == [1]


# ------------------------------------------------------------------ ties


def test_top_k_positions_lower_index_wins_ties():
    score = torch.tensor([1.0, 5.0, 3.0, 3.0, 5.0, 3.0, float("nan"), 3.0])
    assert top_k_positions(score, 4).tolist() == [1, 2, 3, 4]
    assert top_k_positions(score, 2).tolist() == [1, 4]
    assert top_k_positions(score, 0).tolist() == []
    assert top_k_positions(score, 8).tolist() == list(range(8))
    with pytest.raises(ValueError, match="k must be"):
        top_k_positions(score, 9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_ties_choose_the_same_entries_on_every_backend(backend):
    """With bf16 gradients thousands of entries tie at the k-th value; topk broke them arbitrarily."""
    g = (torch.randn(64, 97, generator=torch.Generator().manual_seed(0)) * 4).round().to(torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(64, 97).to(torch.bfloat16))
    opt = SparseAdamW([w], lr=1e-2, density=0.05, backend=backend)
    w.grad = g.clone()
    opt.step()
    k = math.ceil(0.05 * w.numel())
    flat = g.float().abs().reshape(-1)
    threshold = flat.sort(descending=True).values[k - 1]
    assert int((flat == threshold).sum()) > k // 4, "the case must have many ties"
    want = torch.sort(flat, descending=True, stable=True).indices[:k].sort().values
    assert torch.equal(opt.state[w]["indices"].long(), want)


def test_delta_from_diff_uses_the_same_tie_rule():
    base = {"w": torch.zeros(10)}
    tuned = {"w": torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 2.0, 1.0, 0.0, 0.0, 1.0])}
    delta = sift.SparseDelta.from_diff(base, tuned, density=0.4)
    assert delta["w"].indices.long().tolist() == [1, 2, 3, 5]


# -------------------------------------------------------- smaller points


def test_step_count_unchanged_when_the_kernel_raises(monkeypatch):
    """Step counters were incremented before a kernel that can raise: the state changed on error."""
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.1)
    _backward(model, 0)
    opt.step()
    before = {p: opt.state[p]["step"].clone() for p in model.parameters()}

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(_ops, "resolve", lambda name, device, backend=None: ("broken", broken))
    _backward(model, 1)
    with pytest.raises(RuntimeError, match="kernel failed"):
        opt.step()
    for p in model.parameters():
        assert torch.equal(opt.state[p]["step"], before[p])


def test_dense_group_with_tensor_lr_matches_torch_adamw():
    model_a, model_b = _model(), _model()
    opt_a = SparseAdamW(model_a.parameters(), lr=torch.tensor(1e-2), density=1.0)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2, weight_decay=1e-2)
    for step in range(3):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            _backward(model, step)
            opt.step()
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_dense_and_sparse_groups_with_tensor_lr_capture_in_a_cuda_graph():
    """Dense groups called float(lr) / .item(), which breaks CUDA-graph capture with a tensor lr."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 33, device="cuda")), torch.nn.Parameter(torch.randn(33, device="cuda"))]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lr = torch.tensor(1e-2, device="cuda")
    groups = lambda ps: [{"params": [ps[0]], "density": 0.1}, {"params": [ps[1]], "density": 1.0}]
    opt = SparseAdamW(groups(params), lr=lr)
    opt_ref = SparseAdamW(groups(refs), lr=1e-2)
    for p, r in zip(params, refs):
        p.grad = torch.randn_like(p)
        r.grad = p.grad.clone()
    opt.step()
    opt_ref.step()
    graph = capture_step(opt)
    opt_ref.step()
    for _ in range(3):
        graph.replay()
        opt_ref.step()
    torch.cuda.synchronize()
    for p, r in zip(params, refs):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def _kernel_case(dtype: torch.dtype, index_dtype: torch.dtype, compact: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(37, 29, generator=g).to(dtype), torch.randn(513, generator=g).to(dtype)]
    grads = [torch.randn(p.shape, generator=g).to(dtype) for p in params]
    indices = [torch.randperm(p.numel(), generator=g)[: p.numel() // 5].sort().values.to(index_dtype) for p in params]
    if compact:
        grads = [gr.reshape(-1)[ix.long()].float() for gr, ix in zip(grads, indices)]
    state = [[torch.randn(ix.numel(), generator=g).abs() * s for ix in indices] for s in (0.1, 0.01)]
    deltas = [torch.zeros(ix.numel()) for ix in indices]
    bases = [p.reshape(-1)[ix.long()].clone() for p, ix in zip(params, indices)] if dtype != torch.float32 else []
    steps = [torch.tensor(3.0) for _ in params]
    return params, grads, indices, state[0], state[1], deltas, bases, steps


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compact", [False, True], ids=["dense-grad", "compact"])
def test_int64_indices_match_an_fp64_oracle_on_every_backend(backend, dtype, compact):
    """int64 indices (weights of 2**31 elements or more) were tested on no backend."""
    inputs = _kernel_case(dtype, torch.int64, compact, seed=5)
    params, grads, indices, m, v, d, bases, steps = inputs
    w0 = [(b.double() if bases else p.reshape(-1)[ix].double()) for p, ix, b in
          zip(params, indices, bases or [None] * len(params))]
    gs = [(gr if compact else gr.reshape(-1)[ix]).double() for gr, ix in zip(grads, indices)]
    want = []
    for i in range(len(params)):
        mi = 0.9 * m[i].double() + 0.1 * gs[i]
        vi = 0.999 * v[i].double() + 0.001 * gs[i] ** 2
        upd = -1e-2 * 0.1 * w0[i] - 1e-2 / (1 - 0.9**3) * mi / (vi.sqrt() / math.sqrt(1 - 0.999**3) + 1e-8)
        want.append(w0[i] + upd)
    untouched = [p.clone() for p in params]
    _ops.resolve("sparse_adamw_", "cpu", backend)[1](
        params, grads, indices, m, v, d, bases, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.1, maximize=False, compact_grads=compact)
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (8e-3, 1e-5)
    for p, ix, w, before in zip(params, indices, want, untouched):
        torch.testing.assert_close(p.reshape(-1)[ix].double(), w.to(dtype).double(), rtol=rtol, atol=atol)
        mask = torch.ones(p.numel(), dtype=torch.bool)
        mask[ix] = False
        assert torch.equal(p.reshape(-1)[mask], before.reshape(-1)[mask])
