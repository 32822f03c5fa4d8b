"""Re-selection (`reselect_every`) in every memory mode and on every route: each re-selects the entries
plain mode re-selects and trains as it does (bit for bit in one process without the sparse backward, to
summation order with it or across ranks), the dense gradient lives only on the re-selecting step, a clip
and an overflow on that step, resuming just before it, and the combinations refused before anything changes."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from sift import SparseAdamW, clip_grad_norm_, enable_sparse_backward
from conftest import gloo_rank, step_and_zero
from test_reselection import BETAS, DENSITY, EPS, LR, WD, Reference, _backward, _batches, _model, round_trip

RESELECT = dict(reselect_every=2, reselect_fraction=0.5)
MODES = {
    "compact_grads": dict(compact_grads=True),
    "sparse_backward": dict(compact_grads=True),
    "update_in_backward": dict(update_in_backward=True),
}


def _opt(model: torch.nn.Module, mode: str = "plain", **kwargs) -> SparseAdamW:
    opt = SparseAdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, density=DENSITY,
                      backend="torch", **MODES.get(mode, {}), **{**RESELECT, **kwargs})
    if mode == "sparse_backward":
        enable_sparse_backward(model, opt)
    return opt


def _train(model, opt, batches, accumulation: int = 1, clip: float | None = None, scaler=None, inf_at=None):
    for step, x in enumerate(batches):
        for micro in x.chunk(accumulation):
            loss = model(micro).square().mean() / accumulation
            if step == inf_at:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and clip is not None:
            scaler.unscale_(opt)
        if clip is not None:
            clip_grad_norm_(opt, clip)
        step_and_zero(opt, scaler)


def _assert_same(model, opt, twin, twin_opt, exact: bool = True) -> None:
    for p, q in zip(model.parameters(), twin.parameters()):
        a, b = opt.state[p], twin_opt.state[q]
        assert torch.equal(a["indices"], b["indices"])
        for key in ("exp_avg", "exp_avg_sq", "delta"):
            if exact:
                assert torch.equal(a[key], b[key]), key
            else:
                torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7)
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_memory_mode_reselects_and_trains_as_plain_mode(mode, accumulation, steps):
    """The compact modes used to refuse re-selection: their backward dropped the dense gradient the growth ranks."""
    if mode == "update_in_backward" and accumulation > 1:
        pytest.skip("the update in backward takes one backward per step")
    batches = _batches(9)
    model, twin = _model(), _model()
    opt, twin_opt = _opt(model, mode, reselect_steps=steps), _opt(twin, reselect_steps=steps)
    _train(model, opt, batches, accumulation)
    _train(twin, twin_opt, batches, accumulation)
    # Re-selections before updates 3, 5 and 7 each replaced half of the entries.
    assert "retired_indices" in opt.state[model[0].weight]
    _assert_same(model, opt, twin, twin_opt, exact=mode != "sparse_backward")


def test_the_update_in_backward_reselects_each_weight_in_its_own_backward():
    """A re-selecting step kept every due weight's dense gradient until step(); with the update in backward each
    weight now re-selects and steps as its gradient completes, so no two dense weight gradients live at once."""
    model = _model()
    opt = _opt(model, "update_in_backward")
    batches = _batches(4)
    _train(model, opt, batches[:2])
    w = model[0].weight
    assert opt.reselector.is_due(w)
    before = opt.indices_of(w).clone()
    _backward(model, batches[2])
    assert not torch.equal(opt.indices_of(w), before) and w.grad is None  # re-selected and stepped in backward
    assert not opt.reselector.is_due(w)
    opt.step()  # nothing left to re-select: the books only


@pytest.mark.parametrize("mode", ["compact_grads", "sparse_backward"])
def test_the_dense_gradient_lives_only_on_the_reselecting_step(mode):
    model = _model()
    opt = _opt(model, mode)
    w = model[0].weight
    kept = []
    for step, x in enumerate(_batches(6)):
        _backward(model, x)
        kept.append(w.grad is not None)
        assert opt.reselector.is_due(w) == kept[-1] or step == 0  # the first, selecting step keeps it too
        opt.step()
        assert w.grad is None  # freed by step() on the re-selecting step, by the hook or never formed otherwise
        opt.zero_grad()
    # Selection at step 0; updates 1..6; re-selections before updates 3 and 5 (steps 2 and 4).
    assert kept == [True, False, True, False, True, False]
    weight_sized = [k for k, v in opt.state[w].items() if isinstance(v, torch.Tensor) and v.numel() == w.numel()]
    assert not weight_sized


@pytest.mark.parametrize("mode", ["plain", "compact_grads"])
@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
def test_a_clip_on_the_reselecting_step_clips_the_new_entries_and_seeds_from_the_clipped_gradient(how, mode):
    """A clip before a re-selecting step was refused; `max_grad_norm` with re-selection too."""
    batches = _batches(7)
    model, ref_model = _model(), _model()
    kwargs = dict(max_grad_norm=0.05) if how == "max_grad_norm" else {}
    opt = _opt(model, mode, **kwargs)
    ref = Reference(ref_model, every=2, fraction=0.5, rule="spiel", drop="merge", max_norm=0.05)
    _train(model, opt, batches, clip=0.05 if how == "clip_grad_norm_" else None)
    for x in batches:
        ref_model.zero_grad()
        _backward(ref_model, x)
        ref.step()
    for i, p in enumerate(model.parameters()):
        assert torch.equal(opt.state[p]["indices"].long(), ref.state[i]["idx"])
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[i]["m"], rtol=1e-5, atol=1e-9)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("steps, inf_at", [(1, 2), (2, 1)], ids=["on-the-reselecting-step", "on-a-scoring-step"])
@pytest.mark.parametrize("mode", ["plain", "compact_grads", "sparse_backward"])
def test_an_overflow_on_the_reselecting_step_is_skipped_never_scored(mode, steps, inf_at):
    batches = _batches(7)
    model, twin = _model(), _model()
    opt, twin_opt = _opt(model, mode, reselect_steps=steps), _opt(twin, reselect_steps=steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    # Step 2 would re-select before update 3; with reselect_steps=2, step 1 scores for it.
    _train(model, opt, batches, scaler=scaler, inf_at=inf_at)
    assert scaler.get_scale() == 2.0 ** 9
    _train(twin, twin_opt, batches[:inf_at] + batches[inf_at + 1:])
    _assert_same(model, opt, twin, twin_opt, exact=mode != "sparse_backward")


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("mode", ["compact_grads", "sparse_backward"])
def test_resume_just_before_a_reselecting_step_is_bit_for_bit(mode, steps):
    """With `reselect_steps=2` the checkpoint falls between the scoring step and the re-selecting one: the score
    summed so far must come back with the state."""
    batches = _batches(8)
    model = _model()
    opt = _opt(model, mode, reselect_steps=steps)
    _train(model, opt, batches)
    half = _model()
    half_opt = _opt(half, mode, reselect_steps=steps)
    _train(half, half_opt, batches[:4])  # the next step re-selects
    assert half_opt.reselector.fires(half[0].weight)
    assert ("reselect_score" in half_opt.state[half[0].weight]) == (steps == 2)
    saved = round_trip(half, half_opt)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = _opt(resumed, mode, reselect_every=None)  # the settings come back with the param groups
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.reselector.is_due(resumed[0].weight)
    _train(resumed, resumed_opt, batches[4:])
    _assert_same(model, opt, resumed, resumed_opt)


def test_scores_add_unscaled_when_the_loss_scale_changes_between_scoring_steps():
    batches = _batches(7)
    model, twin = _model(), _model()
    opt, twin_opt = _opt(model, reselect_steps=2), _opt(twin, reselect_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)  # doubles every step
    _train(model, opt, batches, scaler=scaler)
    assert scaler.get_scale() == 2.0 ** 11
    _train(twin, twin_opt, batches)
    _assert_same(model, opt, twin, twin_opt, exact=False)


def test_copies_know_which_weights_reselect_next():
    model = _model()
    opt = _opt(model, "compact_grads")
    _train(model, opt, _batches(4))
    assert opt.reselector.is_due(model[0].weight)
    twin = copy.deepcopy((model, opt))
    assert twin[1].reselector.is_due(twin[0][0].weight)


@gloo_rank(timeout_s=60)
def _ranks_worker(rank: int, world: int, out: str, route: str) -> None:
    model = _model()
    batches = [x.chunk(world)[rank] for x in _batches(7)]
    caller = model
    if route == "ddp":
        opt = _opt(model)
        caller = torch.nn.parallel.DistributedDataParallel(model)
    elif route == "process_group":
        opt = _opt(model, "compact_grads", process_group=torch.distributed.group.WORLD)
    else:  # "fsdp2-<mode>": row shards of every layer, the whole weight's entries chosen across the shards
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from sift.optim.sharded import shard_offset

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        mode, _, steps = route.split("-", 1)[1].partition("-steps")
        opt = _opt(model, mode, reselect_steps=int(steps or 1))
    for x in batches:
        # The mean over the global batch: each rank's half, averaged across the ranks.
        caller(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if route.startswith("fsdp2"):
        indices = [opt.state[p]["indices"].long() + shard_offset(p) for p in model.parameters()]
        gathered = [[None] * world for _ in indices]
        for mine, into in zip(indices, gathered):
            torch.distributed.all_gather_object(into, mine)
        indices = [torch.cat(parts) for parts in gathered]
        params = [p.full_tensor().detach().clone() for p in model.parameters()]
    else:
        indices = [opt.state[p]["indices"].long().clone() for p in model.parameters()]
        params = [p.detach().clone() for p in model.parameters()]
    torch.save({"params": params, "indices": indices}, f"{out}.{rank}")


@pytest.mark.parametrize("route", ["ddp", "process_group", "fsdp2-plain", "fsdp2-compact_grads", "fsdp2-sparse_backward",
                                   "fsdp2-update_in_backward", "fsdp2-sparse_backward-steps2"])
def test_two_ranks_reselect_as_one_process_on_the_global_batch(route, tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(_ranks_worker, args=(2, f"{out}.init", out, route), nprocs=2, join=True)
    results = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]
    model = _model()
    opt = _opt(model, reselect_steps=2 if route.endswith("steps2") else 1)
    _train(model, opt, _batches(7))
    for result in results:
        for p, q, idx in zip(model.parameters(), result["params"], result["indices"]):
            assert torch.equal(opt.state[p]["indices"].long(), idx)
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


LEAN = dict(state="lean", reselect_rule="magnitude")


@pytest.mark.parametrize("mode", ["compact_grads", "sparse_backward", "update_in_backward"])
def test_the_lean_state_reselects_in_every_mode_as_in_plain_mode(mode):
    batches = _batches(9)
    model, twin = _model(), _model()
    opt, twin_opt = _opt(model, mode, **LEAN), _opt(twin, **LEAN)
    _train(model, opt, batches)
    _train(twin, twin_opt, batches)
    assert "retired_indices" in opt.state[model[0].weight]
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.indices_of(p), twin_opt.indices_of(q))
        if mode == "sparse_backward":  # another summation order, which the stochastic rounding follows
            torch.testing.assert_close(p, q, rtol=1e-3, atol=5e-4)
        else:
            assert torch.equal(p, q)


def test_a_lean_delta_holds_the_increments_of_the_entries_set_indices_dropped():
    """The lean state forgot the entries `set_indices` dropped, so `SparseDelta.from_optimizer` lost their
    increments, which stay in the weight."""
    from sift import SparseDelta

    model = _model()
    initial = copy.deepcopy(model)
    opt = SparseAdamW(model.parameters(), lr=LR, density=DENSITY, state="lean")
    _train(model, opt, _batches(3))
    w = model[0].weight
    opt.set_indices(w, opt.indices_of(w)[1:])
    _train(model, opt, _batches(2))
    delta = SparseDelta.from_optimizer(opt, model, base=initial.state_dict())
    rebuilt = copy.deepcopy(initial)
    delta.apply_(rebuilt)
    for p, q in zip(model.parameters(), rebuilt.parameters()):
        # A lean increment is tuned - base in fp32: base + increment may round an ulp off the tuned value.
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


@pytest.mark.parametrize("mode", ["plain", "compact_grads"])
def test_a_lean_resume_across_reselections_is_bit_for_bit_and_its_delta_holds_every_changed_entry(mode):
    from sift import SparseDelta

    batches = _batches(8)
    model = _model()
    initial = copy.deepcopy(model)
    opt = _opt(model, mode, **LEAN)
    _train(model, opt, batches)
    half = _model()
    half_opt = _opt(half, mode, **LEAN)
    _train(half, half_opt, batches[:4])
    saved = round_trip(half, half_opt)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = _opt(resumed, mode, state="lean", reselect_every=None)
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, batches[4:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["retired_indices"], resumed_opt.state[q]["retired_indices"])
    delta = SparseDelta.from_optimizer(resumed_opt, resumed, base=initial.state_dict())
    rebuilt = copy.deepcopy(initial)
    delta.apply_(rebuilt)
    for p, q in zip(model.parameters(), rebuilt.parameters()):
        # A lean increment is tuned - base in fp32: base + increment may round an ulp off the tuned value.
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(reselect_rule="spiel"), "reselect_rule='spiel' ranks each entry's delta"),
    (dict(reselect_rule="magnitude", reselect_drop="revert"), "reselect_drop='revert' writes each dropped entry"),
])
def test_the_lean_state_refuses_what_it_cannot_reselect_by(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _opt(_model(), state="lean", **kwargs)


def test_a_lean_state_dict_is_refused_by_groups_that_reselect_by_delta_and_nothing_changes():
    lean_model = _model()
    lean = SparseAdamW(lean_model.parameters(), lr=LR, density=DENSITY, state="lean")
    _train(lean_model, lean, _batches(2))
    model = _model()
    opt = _opt(model)
    _train(model, opt, _batches(2))
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="keeps no delta to drop by"):
        opt.load_state_dict(lean.state_dict())
    after = opt.state_dict()
    assert after["sift"] == before["sift"]
    for pid, state in after["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(before["state"][pid][k])) for k, v in state.items())


def test_for_model_keeps_the_memory_preset_and_lowest_keeps_the_exact_state(caplog):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=48, num_labels=2)
    torch.manual_seed(0)
    low = SparseAdamW.for_model(transformers.BertForSequenceClassification(config), density=0.05, reselect_every=10)
    assert low.compact_grads and low.sparse_backward_handle is not None and low.state_layout == "exact"
    with caplog.at_level(logging.WARNING, logger="sift"):
        lowest = SparseAdamW.for_model(transformers.BertForSequenceClassification(config), density=0.05,
                                       memory="lowest", reselect_every=10)
    assert lowest.update_in_backward and lowest.state_layout == "exact"
    assert any("without state='lean'" in r.getMessage() for r in caplog.records)
