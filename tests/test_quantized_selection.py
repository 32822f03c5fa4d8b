"""How a 4-bit layer's sparse delta chooses its entries (`sift.quantized`): under GradScaler, across a resume in
the middle of a multi-step selection, in a job of several processes, by the seeded "random" rule; and what
`trainable_summary` counts of a 4-bit model. References: the dequantized 16-bit twin, or one uninterrupted
one-process run."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import sift
from conftest import backward_and_step, gloo_rank, run_ranks
from sift import SparseAdamW

bnb = pytest.importorskip("bitsandbytes")
from test_quantized import _batch, _effective, _optimizers, _pair, _top_grad  # noqa: E402


LAYERS = (0, 2)


def _step(model, opt, step: int, scaler=None, poison: bool = False) -> None:
    """One training step on batch `step`; `poison`: an inf input, so every gradient is inf/NaN."""
    x, y = _batch(step)
    if poison:
        x[0, 0] = float("inf")
    backward_and_step(opt, (model(x).float() - y).square().mean(), scaler)
    opt.zero_grad()


def _entries(model) -> list[torch.Tensor]:
    return [model[i]._sift_quantized.indices.long() for i in LAYERS]


@pytest.mark.parametrize("memory", ["plain", "low"])
def test_an_overflow_on_a_scoring_only_step_is_skipped_and_backs_off_the_scale(memory):
    """A 4-bit layer's inf/NaN selection score on a scoring-only step was not seen: the step ran, the scale
    stayed, the NaN score was kept and the entries degenerated to the flat positions 0..k-1."""
    quantized, _ = _pair(compute_dtype=torch.float16)
    opt = _top_grad(quantized, density=0.1, lr=1e-2, target_modules=list(map(str, LAYERS)),
                    select_steps=3, memory=memory)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    _step(quantized, opt, 0, scaler, poison=True)
    assert opt.last_step_skipped
    assert scaler.get_scale() == 2.0**7
    assert all(not opt.state.get(quantized[i].sift_delta) for i in LAYERS), "a skipped step left selection state"

    fresh, _ = _pair(compute_dtype=torch.float16)
    opt_fresh = _top_grad(fresh, density=0.1, lr=1e-2, target_modules=list(map(str, LAYERS)),
                          select_steps=3, memory=memory)
    scaler_fresh = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=1000)
    for step in range(1, 5):
        _step(quantized, opt, step, scaler)
        _step(fresh, opt_fresh, step, scaler_fresh)
    for got, want in zip(_entries(quantized), _entries(fresh)):
        assert torch.equal(got, want)
        assert not torch.equal(got, torch.arange(got.numel())), "the entries degenerated to 0..k-1"
    for i in LAYERS:
        assert torch.equal(_effective(quantized, i), _effective(fresh, i))


@pytest.mark.parametrize("memory", ["plain", "low"])
def test_scores_add_unscaled_when_the_scale_changes_between_selection_steps(memory):
    """The 4-bit score was summed still loss-scaled: with a scale that grows between selection steps the
    layer chose other entries than its dequantized 16-bit twin (71 of 96 shared)."""
    quantized, dense = _pair()
    opt_q = _top_grad(quantized, density=0.1, lr=1e-2, weight_decay=0.0,
                      target_modules=list(map(str, LAYERS)), memory=memory, select_steps=3)
    _, opt_d = _optimizers(_pair()[0], dense, select_steps=3)  # the twin's half
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1) for _ in range(2)]
    for step in range(4):
        _step(quantized, opt_q, step, scalers[0])
        _step(dense, opt_d, step, scalers[1])
    assert scalers[0].get_scale() == 2.0**8, "the scale must change between the selection steps"
    for i in LAYERS:
        assert torch.equal(quantized[i]._sift_quantized.indices.long(), opt_d.indices_of(dense[i].weight).long())
        torch.testing.assert_close(_effective(quantized, i), dense[i].weight.detach(), rtol=1e-5, atol=1e-6)


def _resumed(saved: dict, values: list[torch.Tensor], start: int, steps: int, **kwargs):
    model, _ = _pair()
    opt = _top_grad(model, density=0.1, lr=1e-2, target_modules=list(map(str, LAYERS)), **kwargs)
    with torch.no_grad():
        for i, v in zip(LAYERS, values):
            model[i].sift_delta.copy_(v)
    opt.load_state_dict(saved)
    for step in range(start, start + steps):
        _step(model, opt, step)
    return model


@pytest.mark.parametrize("through", ["state_dict", "deepcopy", "pickle"])
@pytest.mark.parametrize("state", ["exact", "lean"])
def test_a_resume_between_selection_steps_continues_bit_for_bit(through, state):
    """The 4-bit layer's accumulated selection score was not in state_dict: a resume in the middle of a
    multi-step selection chose other entries (40 of 96 shared)."""
    kwargs = dict(select_steps=3, state=state)
    model, _ = _pair()
    opt = _top_grad(model, density=0.1, lr=1e-2, target_modules=list(map(str, LAYERS)), **kwargs)
    _step(model, opt, 0)
    source = {"state_dict": opt, "deepcopy": copy.deepcopy(opt), "pickle": pickle.loads(pickle.dumps(opt))}[through]
    saved = copy.deepcopy(source.state_dict())
    values = [model[i].sift_delta.detach().clone() for i in LAYERS]
    for step in range(1, 5):
        _step(model, opt, step)
    again = _resumed(saved, values, 1, 4, **kwargs)
    for i in LAYERS:
        assert torch.equal(again[i]._sift_quantized.indices, model[i]._sift_quantized.indices)
        assert torch.equal(_effective(again, i), _effective(model, i))
    assert all(model[i].sift_delta.abs().max() > 0 for i in LAYERS)


def test_a_saved_score_of_another_size_is_refused():
    model, _ = _pair()
    opt = _top_grad(model, density=0.1, target_modules=list(map(str, LAYERS)), select_steps=3)
    _step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["score"].shape == (24 * 40,)
    saved["state"][0]["score"] = saved["state"][0]["score"][:-1]
    with pytest.raises(ValueError, match="score"):
        opt.load_state_dict(saved)


# ------------------------------------------------------------ several processes


def _independent_run(seed: int, steps: int = 3) -> list[torch.Tensor]:
    """One 4-bit model trained on its own data (`seed`), in whatever process calls it."""
    model, _ = _pair()
    opt = _top_grad(model, density=0.1, lr=1e-2, target_modules=list(map(str, LAYERS)), select_steps=2)
    for step in range(steps):
        _step(model, opt, 100 * seed + step)
    return _entries(model) + [model[i].sift_delta.detach().clone() for i in LAYERS]


def _shared_run(rank: int = 0, world: int = 1, steps: int = 3) -> list[torch.Tensor]:
    """One 4-bit model trained on rows `rank`::`world` of each batch, averaged over the optimizer's
    process_group (no DDP) when `world` > 1."""
    model, _ = _pair()
    group = {"process_group": torch.distributed.group.WORLD} if world > 1 else {}
    opt = _top_grad(model, density=0.1, lr=1e-2, target_modules=list(map(str, LAYERS)), select_steps=2,
                    compact_grads=True, **group)
    for step in range(steps):
        x, y = _batch(step)
        (model(x[rank::world]) - y[rank::world]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return _entries(model) + [model[i].sift_delta.detach().clone() for i in LAYERS]


@gloo_rank
def _independent_worker(rank: int, world: int, out: str) -> None:
    torch.save({"independent": _independent_run(seed=rank + 1), "shared": _shared_run(rank, world)},
               f"{out}.{rank}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_independent_worker, 2, tmp_path_factory.mktemp("quantized-ranks"))


def test_ranks_sharing_an_optimizer_process_group_choose_the_whole_batchs_entries(two_ranks):
    """Without DDP, a 4-bit layer whose values the optimizer's process_group averages chooses from the
    averaged score: every rank equals one process on the whole batch."""
    want = _shared_run()
    for rank, r in enumerate(two_ranks):
        got = r["shared"]
        for g, w in zip(got[:2], want[:2]):
            assert torch.equal(g, w), f"rank {rank}: entries"
        for g, w in zip(got[2:], want[2:]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: values")


def test_ranks_training_independent_models_keep_their_own_entries(two_ranks):
    """Without DDP or a process_group, a selecting step all-reduced a 4-bit layer's dense score over the
    default group: two independent runs in one job changed each other's entries."""
    ranks = [r["independent"] for r in two_ranks]
    for rank, got in enumerate(ranks):
        want = _independent_run(seed=rank + 1)
        for g, w in zip(got[:2], want[:2]):
            assert torch.equal(g, w), f"rank {rank}: entries"
        for g, w in zip(got[2:], want[2:]):  # a rank runs one thread: sums may round apart
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: values")
    assert not torch.equal(ranks[0][0], ranks[1][0]), "the two runs must choose apart for the test to mean anything"


# ------------------------------------------------------------------- "random"


def _mixed(seed: int = 0) -> nn.Module:
    """A 16-bit and a 4-bit linear layer of the same shape."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 24), nn.Tanh(), bnb.nn.Linear4bit(24, 24, compute_dtype=torch.float32))
    return model.to("cpu")


def _random_entries(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    model = _mixed()
    opt = _top_grad(model, density=0.1, target_modules=["0", "2"], selection="random", seed=seed)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    opt.step()
    return opt.indices_of(model[0].weight).long(), model[2]._sift_quantized.indices.long()


def test_the_random_rule_draws_each_weight_by_its_name():
    """The 16-bit and 4-bit lists each seeded their first weight by position 0: two weights of the same shape
    trained the same random entries."""
    plain, quantized = _random_entries(seed=3)
    assert plain.numel() == quantized.numel() == 58
    assert not torch.equal(plain, quantized)
    again = _random_entries(seed=3)
    assert torch.equal(again[0], plain) and torch.equal(again[1], quantized)
    other = _random_entries(seed=4)
    assert not torch.equal(other[0], plain) and not torch.equal(other[1], quantized)


def test_the_random_rule_keys_a_4_bit_layer_as_the_16_bit_weight_of_its_name():
    """A 4-bit layer and a 16-bit weight of the same name (its dequantized twin) draw the same entries, and a
    param without a name keeps the seed offset by its position."""
    quantized, dense = _pair()
    opt_q = _top_grad(quantized, density=0.1, target_modules=["0", "2"], selection="random", seed=5)
    named = SparseAdamW([("0.weight", dense[0].weight), ("2.weight", dense[2].weight)], density=0.1,
                        selection="random", seed=5)
    _step(quantized, opt_q, 0)
    _step(dense, named, 0)
    for i in LAYERS:
        assert torch.equal(quantized[i]._sift_quantized.indices.long(), named.indices_of(dense[i].weight).long())
    w = nn.Parameter(torch.randn(24, 40))
    unnamed = SparseAdamW([w], density=0.1, selection="random", seed=5)
    w.grad = torch.ones_like(w)
    unnamed.step()
    gen = torch.Generator().manual_seed(5 * 1_000_003)
    want = torch.rand(w.numel(), generator=gen).topk(unnamed.indices_of(w).numel()).indices.sort().values
    assert torch.equal(unnamed.indices_of(w).long(), want)


# ------------------------------------------------------------------- summary


def test_trainable_summary_counts_a_4_bit_weight_by_its_logical_elements():
    """The packed 4-bit bytes were counted as elements (shape [480, 1]): the trainable share of a 4-bit model
    differed from its 16-bit twin's."""
    quantized, dense = _pair()
    opt_q = _top_grad(quantized, density=0.1, target_modules=["0", "2"])
    opt_d = _top_grad(dense, density=0.1, target_modules=["0", "2"])
    _step(quantized, opt_q, 0)
    _step(dense, opt_d, 0)
    table_q, table_d = sift.trainable_summary(quantized, opt_q), sift.trainable_summary(dense, opt_d)
    assert "| 0.weight | [24, 40] | frozen |" in table_q, table_q
    total_q, total_d = (next(line for line in t.splitlines() if line.startswith("| **total**"))
                        for t in (table_q, table_d))
    elements = f"{sum(p.numel() for p in dense.parameters()):,} elements"
    assert elements in total_q and elements in total_d, (total_q, total_d)
    share = total_d.split("**")[3]  # "(x% of all)" after the entries
    assert share in total_q, (total_q, total_d)


def test_a_zero_gradient_before_selection_does_not_count_an_adam_step():
    """DDP hands the delta values a zero gradient on a scoring-only step (its backward did not reach them): the
    optimizer stepped them densely, counting an Adam step, so the first real update's bias correction was off."""
    runs = []
    for ddp_zeros in (False, True):
        quantized, _ = _pair()
        opt = _top_grad(quantized, density=0.1, lr=1e-2, weight_decay=0.0, target_modules=["0", "2"],
                        select_steps=2, memory="plain")
        for step in range(3):
            x, y = _batch(step)
            (quantized(x) - y).square().mean().backward()
            for layer in (quantized[0], quantized[2]):
                if ddp_zeros and layer.sift_delta.grad is None:
                    layer.sift_delta.grad = torch.zeros_like(layer.sift_delta)
            opt.step()
            opt.zero_grad()
        runs.append([_effective(quantized, i) for i in (0, 2)])
        assert all(int(opt.state[layer.sift_delta]["step"]) == 2 for layer in (quantized[0], quantized[2]))
    for plain, zeros in zip(*runs):
        assert torch.equal(plain, zeros)


@pytest.mark.parametrize("select_steps", [1, 2])
def test_a_score_that_ranks_nothing_leaves_a_4_bit_layer_pending_as_its_16_bit_twin(select_steps):
    """A 4-bit layer whose selection score was zero everywhere chose the flat positions 0..k-1, silently, where
    its dequantized 16-bit twin warned and stayed pending: the two rules had drifted apart."""
    quantized, dense = _pair()
    opt_q, opt_d = _optimizers(quantized, dense, select_steps=select_steps)

    def step(model, opt, i, zero):
        x, y = _batch(i)
        loss = (model(x).float() - y).square().mean()
        backward_and_step(opt, loss * 0.0 if zero else loss)
        opt.zero_grad()

    for model, opt in ((quantized, opt_q), (dense, opt_d)):
        with pytest.warns(UserWarning, match="'0.weight' is zero everywhere"):
            step(model, opt, 0, zero=True)
    assert not quantized[0]._sift_quantized.selected and "indices" not in opt_d.state[dense[0].weight]
    assert "selection_calls" not in opt_q.state[quantized[0].sift_delta], "a step that ranked nothing was counted"
    for i in range(1, 1 + select_steps):
        step(quantized, opt_q, i, zero=False)
        step(dense, opt_d, i, zero=False)
    for i in (0, 2):
        got = quantized[i]._sift_quantized.indices.long()
        assert torch.equal(got, opt_d.indices_of(dense[i].weight).long())
        assert not torch.equal(got, torch.arange(got.numel()))
