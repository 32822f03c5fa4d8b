"""State that must survive or refuse: copies carry every attribute, `memory="lowest"` resumes in the mode its
first step chose, a clip is not applied to entries `set_indices` replaced, a degenerate score selects nothing,
and a state_dict is refused by another model's params."""

from __future__ import annotations

import copy
import logging
import pickle
import warnings

import pytest
import torch

import sift
from conftest import gloo_rank, run_ranks
from sift import SparseAdamW
from sift.optim.reselection import Reselector


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _lowest(model: torch.nn.Module) -> SparseAdamW:
    return SparseAdamW.for_model(model, density=0.2, lr=1e-2, target_modules=["0"], dense_modules=["2"],
                                 memory="lowest")


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(5, 12, generator=g), torch.randint(0, 3, (5,), generator=g)


def _train_steps(model, opt, steps, micro: int = 2) -> None:
    for step in steps:
        for m in range(micro):
            x, y = _batch(step, m)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _assert_same(model_a, opt_a, model_b, opt_b) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    for pa, pb in zip((p for g in opt_a.param_groups for p in g["params"]),
                      (p for g in opt_b.param_groups for p in g["params"])):
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), key
            else:
                assert sa[key] == sb[key], key


# ---------------------------------------------------------------- copies

COPIES = [pytest.param(copy.deepcopy, id="deepcopy"), pytest.param(lambda obj: pickle.loads(pickle.dumps(obj)),
                                                                    id="pickle")]


@pytest.mark.parametrize("make_copy", COPIES)
def test_a_copy_has_every_attribute_the_constructor_sets(make_copy):
    """A deepcopied or pickled optimizer lacked attributes the constructor set (`_quantized_handles`,
    `last_step_skipped`), so remove_hooks() raised AttributeError."""
    w = torch.nn.Parameter(torch.randn(6, 7))
    sgd = torch.optim.SGD([w])
    torch_drops = set(vars(sgd)) - set(vars(make_copy(sgd)))  # torch's own: none of this optimizer's
    for flags in (dict(), dict(compact_grads=True), dict(update_in_backward=True)):
        opt = SparseAdamW([w], density=0.3, **flags)
        dup = make_copy(opt)
        assert set(vars(opt)) - set(vars(dup)) <= torch_drops, flags
        assert set(vars(dup)) <= set(vars(opt)), flags
        assert dup.last_step_skipped is False
        dup.remove_hooks()
        assert not dup.grads.hook_handles and not dup.grads.quantized_handles


@pytest.mark.parametrize("make_copy", COPIES)
def test_a_copy_of_lowest_falls_back_from_accumulation_as_the_original(make_copy, caplog):
    """A copy of a memory="lowest" optimizer raised AttributeError in the accumulation fallback of its first
    step (remove_hooks read `_quantized_handles`, which copies lacked)."""
    model = _tiny()
    opt = _lowest(model)
    model_copy, opt_copy = make_copy((model, opt))
    with caplog.at_level(logging.WARNING, logger="sift"):
        _train_steps(model, opt, range(3))
        _train_steps(model_copy, opt_copy, range(3))
    assert not opt.update_in_backward and not opt_copy.update_in_backward
    _assert_same(model, opt, model_copy, opt_copy)


class CountingReselector(Reselector):
    """A part swapped in by a subclass: counts its per-step resets, saves them in state_dict and carries them."""

    def __init__(self, opt, settings) -> None:
        self.resets = 0
        super().__init__(opt, settings)  # which resets once

    def new_step(self) -> None:
        super().new_step()
        self.resets += 1

    def saved(self) -> dict:
        return {**super().saved(), "counted_resets": self.resets}

    def resume(self, saved: dict) -> None:
        super().resume(saved)
        self.resets = saved.get("counted_resets", 0)

    def carried(self) -> dict:
        return {**super().carried(), "resets": self.resets}

    def carry(self, carried: dict) -> None:
        super().carry(carried)
        self.resets = carried.get("resets", 0)


class CountingSparseAdamW(SparseAdamW):
    PARTS = tuple((name, CountingReselector if name == "reselector" else part) for name, part in SparseAdamW.PARTS)


@pytest.mark.parametrize("make_copy", COPIES)
def test_a_part_swapped_in_by_a_subclass_is_reset_copied_and_checkpointed(make_copy):
    """Besides SparseAdamW.PARTS the parts were listed by hand in the per-step reset and in the copies (which
    had lost the reselector), and state_dict knew only the memory policy: a part a subclass swaps in through
    PARTS was never reset, copied or checkpointed. All three now iterate PARTS."""
    model = _tiny()
    opt = CountingSparseAdamW(model.parameters(), lr=1e-2, density=0.2, reselect_every=1)
    assert type(opt.reselector) is CountingReselector
    resets = opt.reselector.resets
    for step in range(3):
        x, y = _batch(step, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert opt.reselector.resets == resets + 1, "the step did not reset the part"
        opt.zero_grad()
        resets += 2
    assert opt.reselector.resets == resets
    clone = make_copy(opt)
    assert type(clone.reselector) is CountingReselector and clone.reselector.opt is clone
    assert clone.reselector.resets == resets
    saved = opt.state_dict()
    assert saved["sift"]["counted_resets"] == resets and "update_in_backward_auto" in saved["sift"]
    fresh = CountingSparseAdamW(copy.deepcopy(model).parameters(), lr=1e-2, density=0.2, reselect_every=1)
    fresh.load_state_dict(saved)
    assert fresh.reselector.resets == resets


# ---------------------------------------------------------------- memory="lowest" resumed

def test_lowest_resumed_after_dropping_the_update_in_backward_continues_bit_for_bit():
    """memory="lowest" that dropped the update in backward at its first step (micro-batches accumulate) did
    not record it: the resumed optimizer stepped a weight inside backward, then raised at the next micro-batch."""
    model = _tiny()
    opt = _lowest(model)
    _train_steps(model, opt, range(1))
    assert not opt.update_in_backward
    model_sd = copy.deepcopy(model.state_dict())
    opt_sd = copy.deepcopy(opt.state_dict())
    _train_steps(model, opt, range(1, 4))

    resumed_model = _tiny(seed=1)
    resumed_model.load_state_dict(model_sd)
    resumed = _lowest(resumed_model)
    assert resumed.update_in_backward
    resumed.load_state_dict(opt_sd)
    assert not resumed.update_in_backward
    _train_steps(resumed_model, resumed, range(1, 4))
    _assert_same(model, opt, resumed_model, resumed)


def test_lowest_resumed_after_keeping_the_update_in_backward_keeps_it():
    """The other decision of memory="lowest"'s first step, kept as final by a resume: one backward per step
    continues bit for bit, and a second one raises as it would have in the saved run."""
    model = _tiny()
    opt = _lowest(model)
    _train_steps(model, opt, range(1), micro=1)
    assert opt.update_in_backward
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train_steps(model, opt, range(1, 3), micro=1)
    resumed_model = _tiny(seed=1)
    resumed_model.load_state_dict(model_sd)
    resumed = _lowest(resumed_model)
    resumed.load_state_dict(opt_sd)
    _train_steps(resumed_model, resumed, range(1, 3), micro=1)
    _assert_same(model, opt, resumed_model, resumed)
    assert resumed.update_in_backward
    with pytest.raises(RuntimeError, match="one backward per step"):
        _train_steps(resumed_model, resumed, range(3, 4), micro=2)


# ---------------------------------------------------------------- clip, then set_indices

def _loss(w: torch.Tensor, step: int) -> torch.Tensor:
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(step))
    return (x.to(w.dtype) @ w.T).float().sin().square().sum()


@pytest.mark.parametrize("layout", ["exact", "lean"])
def test_set_indices_after_a_clip_does_not_apply_the_former_entries_gradient(layout):
    """clip_grad_norm_ then set_indices: the step applied the gradient gathered at the former entries to the
    new ones (the cache was keyed by the gradient alone)."""
    results = []
    for clip_first in (True, False):
        w = torch.nn.Parameter(torch.randn(9, 11, generator=torch.Generator().manual_seed(0)))
        opt = SparseAdamW([w], lr=1e-2, density=0.2, state=layout)
        _loss(w, 0).backward()
        opt.step()
        opt.zero_grad()
        new = torch.arange(3, 99, 5)
        _loss(w, 1).backward()
        if clip_first:
            sift.clip_grad_norm_(opt, max_norm=1e6)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.set_indices(w, new)
        else:
            opt.set_indices(w, new)
            sift.clip_grad_norm_(opt, max_norm=1e6)  # the reference: the clip of the new entries
        opt.step()
        results.append((w.detach().clone(), {k: v for k, v in opt.state[w].items()}))
    (w_a, state_a), (w_b, state_b) = results
    assert torch.equal(w_a, w_b)
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]) if isinstance(state_a[key], torch.Tensor) else \
            state_a[key] == state_b[key], key
    assert any("set_indices after clip_grad_norm_" in str(c.message) for c in caught)


# ---------------------------------------------------------------- ShardedOptimizerState's bytes

class _Planted:
    """A class a checkpoint's pickle could name: unpickling must not build it."""

    def __reduce__(self):
        return (_Planted, ())


def test_sharded_state_bytes_load_tensors_and_plain_values_only(monkeypatch):
    """ShardedOptimizerState unpickled its checkpoint bytes with weights_only=False, so a checkpoint could
    build any object; the state holds tensors and plain values, which a weights-only load restores exactly."""
    import io

    from sift.optim.sharded import ShardedOptimizerState

    monkeypatch.setattr(ShardedOptimizerState, "_key", lambda self: "rank0_of_1")
    w = torch.nn.Parameter(torch.randn(9, 11, generator=torch.Generator().manual_seed(0)))
    opt = SparseAdamW([w], lr=torch.tensor(1e-2), density=0.2)
    _loss(w, 0).backward()
    opt.step()
    saved = ShardedOptimizerState(opt).state_dict()
    other = SparseAdamW([w], lr=torch.tensor(1e-2), density=0.2)
    ShardedOptimizerState(other).load_state_dict(saved)
    assert torch.equal(other.state[w]["delta"], opt.state[w]["delta"])
    assert other.state_dict()["param_groups"] == opt.state_dict()["param_groups"]

    planted = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "planted": _Planted()}, planted)
    with pytest.raises(pickle.UnpicklingError):
        ShardedOptimizerState(opt).load_state_dict({"rank0_of_1": planted})


# ---------------------------------------------------------------- a score that ranks nothing

def _sd_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_sd_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_sd_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
@pytest.mark.parametrize("select_steps", [1, 2])
@pytest.mark.parametrize("bad", ["zero", "nan"])
def test_a_score_that_ranks_nothing_leaves_the_weight_pending(bad, select_steps, compact):
    """Selection on an all-zero gradient (a zero-initialised head, labels all -100) or a NaN one kept positions
    arange(k) without a word; the weight now stays pending, warns once, and selects on a real gradient as a
    run that started there."""
    factor = 0.0 if bad == "zero" else float("nan")
    runs = []
    for bad_steps in (2, 0):
        w = torch.nn.Parameter(torch.randn(9, 11, generator=torch.Generator().manual_seed(0)))
        params = [("head.weight", w)] if bad == "zero" else [w]
        opt = SparseAdamW(params, lr=1e-2, density=0.2, select_steps=select_steps,
                          compact_grads=compact)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(bad_steps + 3):
                loss = _loss(w, step) * factor if step < bad_steps else _loss(w, step - bad_steps)
                loss.backward()
                if step < bad_steps:
                    before = copy.deepcopy(opt.state_dict())
                sift.clip_grad_norm_(opt, max_norm=1.0)
                opt.step()
                opt.zero_grad()
                if step < bad_steps:
                    assert _sd_equal(opt.state_dict(), before), step
        said = [str(c.message) for c in caught if "ranks them" in str(c.message)]
        runs.append((w.detach().clone(), dict(opt.state[w]), said))
    (w_late, state_late, said_late), (w_ref, state_ref, said_ref) = runs
    label = "'head.weight'" if bad == "zero" else "group 0, param 0"
    assert len(said_late) == 1 and label in said_late[0] and not said_ref
    assert torch.equal(w_late, w_ref)
    assert _sd_equal(state_late, state_ref)


def _zero_head_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 15), torch.nn.ReLU(), torch.nn.Linear(15, 3))
    with torch.no_grad():
        model[2].weight.zero_()  # the first layer's gradient is 0 until the head has trained a step
    return model


def _zero_head_run(model, rank: int, world: int) -> dict:
    """3 steps of the global batch split over the ranks: which weights are pending after each, what was said."""
    from sift.optim.state import is_selected

    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    opt = SparseAdamW([{"params": weights, "density": 0.2},
                       {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "density": 1.0}],
                      lr=1e-2)
    shard = slice(rank * 12 // world, (rank + 1) * 12 // world)
    pending = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(12, 12, generator=g), torch.randint(0, 3, (12,), generator=g)
            torch.nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
            opt.step()
            opt.zero_grad()
            pending.append([not is_selected(opt.state.get(p, {})) for p in weights])
    said = [str(c.message) for c in caught if "ranks them" in str(c.message)]
    return {"pending": pending, "said": said, "opt": opt, "weights": weights}


@gloo_rank
def _zero_head_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sift.optim.sharded import shard_offset

    model = _zero_head_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = _zero_head_run(model, rank, world)
    opt = run.pop("opt")
    run["indices"] = [(opt.indices_of(p).long() + shard_offset(p)) for p in run.pop("weights")]
    run["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    torch.save(run, f"{out}.{rank}")


def test_fsdp2_global_selection_keeps_a_weight_pending_on_every_rank(tmp_path):
    """Under FSDP2's global selection a weight whose whole gradient is 0 (below a zero-initialised head) chose
    arange(k) on every rank; now every rank keeps it pending alike and selects it as one process does."""
    pytest.importorskip("torch.distributed.fsdp")
    per_rank = run_ranks(_zero_head_worker, 2, tmp_path)
    model = _zero_head_model()
    ref = _zero_head_run(model, 0, 1)
    assert ref["pending"][0] == [True, False] and ref["pending"][1] == [False, False]
    for r in per_rank:
        assert r["pending"] == ref["pending"]
        assert len(r["said"]) == 1 and "group 0, param 0" in r["said"][0]
    for i, p in enumerate(ref["weights"]):
        assert torch.equal(torch.cat([r["indices"][i] for r in per_rank]), ref["opt"].indices_of(p).long())
    for name, p in model.named_parameters():
        torch.testing.assert_close(per_rank[0]["params"][name], p.detach(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- a state_dict of another model

def _trained(seed: int, named: bool, layout: str = "exact", dtype=torch.float32, steps: int = 2):
    model = torch.nn.Linear(11, 9).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.randn(9, 11, generator=torch.Generator().manual_seed(seed)))
    params = list(model.named_parameters()) if named else list(model.parameters())
    opt = SparseAdamW(params, lr=1e-2, density=0.2, state=layout)
    for step in range(steps):
        _loss(model.weight, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("named", [True, False], ids=["named", "positional"])
def test_a_state_dict_of_another_model_is_refused_and_nothing_changes(named, dtype):
    """An optimizer state_dict loaded into an optimizer over another model of the same shapes was accepted, and
    the next step wrote the first model's values (its `base`) into the second's chosen entries."""
    _, source = _trained(0, named, "exact", dtype)
    other, target = _trained(1, named, "exact", dtype, steps=1)
    before = copy.deepcopy(target.state_dict())
    weight_before = other.weight.detach().clone()
    theirs, ours = ("'weight'", "'weight'") if named else ("param 0", "group 0, param 0")
    with pytest.raises(ValueError, match=f"state of {theirs} does not belong to this optimizer's {ours}"):
        target.load_state_dict(source.state_dict())
    assert _sd_equal(target.state_dict(), before)
    assert torch.equal(other.weight, weight_before)


@pytest.mark.parametrize("layout", ["exact", "lean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_resume_on_the_trained_model_or_its_reloaded_copy_is_accepted(layout, dtype):
    """The refusal above keeps every legitimate resume: the same model after training, and a fresh model loaded
    from the checkpoint saved with the optimizer, continue bit for bit."""
    model, opt = _trained(0, True, layout, dtype)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    opt.load_state_dict(opt_sd)  # the same model after training
    fresh = torch.nn.Linear(11, 9).to(dtype)
    fresh.load_state_dict(model_sd)
    resumed = SparseAdamW(list(fresh.named_parameters()), lr=1e-2, density=0.2, state=layout)
    resumed.load_state_dict(opt_sd)
    for step in range(2, 4):
        for m, o in ((model, opt), (fresh, resumed)):
            _loss(m.weight, step).backward()
            o.step()
            o.zero_grad()
    assert torch.equal(model.weight, fresh.weight)
    assert _sd_equal(opt.state_dict(), resumed.state_dict())


def test_the_sharded_selection_rule_travels_in_state_dict():
    """`sharded_selection` decides which entries a pending FSDP2 weight takes, and was not in state_dict: a resume
    with the default chose the whole weight's top-k where the saved run chose per shard."""
    w = torch.nn.Parameter(torch.randn(6, 5))
    saved = SparseAdamW([w], density=0.2, sharded_selection="per_shard", select_steps=2).state_dict()
    assert saved["sift"]["sharded_selection"] == "per_shard" and saved["sift"]["compact_grads"] is False
    resumed = SparseAdamW([w], density=0.2, select_steps=2)
    resumed.load_state_dict(saved)
    assert resumed.sharded_selection == "per_shard"
    bad = {**saved, "sift": {**saved["sift"], "sharded_selection": "rows"}}
    other = SparseAdamW([w], density=0.2)
    with pytest.raises(ValueError, match="sharded_selection"):
        other.load_state_dict(bad)
    assert other.sharded_selection == "global" and other.select_steps == 1


# ---------------------------------------------------------------- a refused step changes nothing

def _assert_same_tree(a, b, where: str = "state_dict") -> None:
    """Two state_dicts (or any nest of dicts, lists and tensors) hold the same values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same_tree(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _model_loss(model, step: int, micro: int = 0) -> torch.Tensor:
    x, y = _batch(step, micro)
    return torch.nn.functional.cross_entropy(model(x), y)


def test_a_step_refused_for_a_bad_gradient_leaves_lowest_undecided(caplog):
    """step() let memory="lowest" drop the update in backward, for good, before it refused a bad gradient: the
    refused step now changes nothing, and the next one settles the mode as if the refusal never happened."""
    model, twin = _tiny(), _tiny()
    opt, twin_opt = _lowest(model), _lowest(twin)
    for m in range(2):  # micro-batches: the first step drops the update in backward
        _model_loss(model, 0, m).backward()
        _model_loss(twin, 0, m).backward()
    before = copy.deepcopy(opt.state_dict())
    bias = model[2].bias
    dense_grad = bias.grad
    bias.grad = dense_grad.to_sparse()
    with caplog.at_level(logging.WARNING, logger="sift"), pytest.raises(ValueError, match="sparse-layout"):
        opt.step()
    assert not caplog.records, "nothing may be dropped by a refused step"
    assert opt.update_in_backward and opt.memory.auto and opt.memory.accumulation_seen
    _assert_same_tree(opt.state_dict(), before)
    bias.grad = dense_grad
    opt.step()
    twin_opt.step()
    assert not opt.update_in_backward and not twin_opt.update_in_backward
    _assert_same(model, opt, twin, twin_opt)
    _assert_same_tree(opt.state_dict(), twin_opt.state_dict())
    _train_steps(model, opt, [1])
    _train_steps(twin, twin_opt, [1])
    _assert_same(model, opt, twin, twin_opt)


def test_a_grad_scaler_refused_with_the_update_in_backward_leaves_the_optimizer_unscaled():
    """ScalerLink.begin marked the optimizer loss_scaled (kept in state_dict) before refusing the update in backward
    under a GradScaler: the refused step now changes nothing, and an unscaled step afterwards is an unscaled run's."""
    model, twin = _tiny(), _tiny()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, update_in_backward=True)
    twin_opt = SparseAdamW(twin.parameters(), lr=1e-2, density=0.2, update_in_backward=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = copy.deepcopy(opt.state_dict())
    scaler.scale(_model_loss(model, 0)).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    assert not opt.loss_scaled and opt.grad_scaler is None
    _assert_same_tree(opt.state_dict(), before)
    del opt.grad_scale, opt.found_inf  # GradScaler.step leaves them when the step raises
    opt.step()  # the same gradients, stepped without the scaler
    (_model_loss(twin, 0) * 1024.0).backward()
    twin_opt.step()
    _model_loss(model, 1).backward()  # and a step in backward after it
    _model_loss(twin, 1).backward()
    opt.step()
    twin_opt.step()
    _assert_same(model, opt, twin, twin_opt)
    _assert_same_tree(opt.state_dict(), twin_opt.state_dict())


def test_a_step_refused_for_an_unknown_grad_scaler_links_and_marks_nothing():
    """ScalerLink.begin marked the optimizer loss_scaled before refusing a GradScaler it cannot find: the refused
    step now changes nothing, and once linked the scaler's step is that of a run never refused."""
    model, twin = _tiny(), _tiny()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, compact_grads=True)
    twin_opt = SparseAdamW(twin.parameters(), lr=1e-2, density=0.2, compact_grads=True)
    scaler, twin_scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2))
    scaler.scale(_model_loss(model, 0)).backward()
    twin_scaler.scale(_model_loss(twin, 0)).backward()
    before = copy.deepcopy(opt.state_dict())
    opt.grad_scale, opt.found_inf = scaler._scale, torch.zeros(())  # a caller the step cannot find
    with pytest.raises(RuntimeError, match="optimizer.grad_scaler"):
        opt.step()
    assert not opt.loss_scaled and opt.grad_scaler is None
    _assert_same_tree(opt.state_dict(), before)
    del opt.grad_scale, opt.found_inf
    for model_, opt_, scaler_ in ((model, opt, scaler), (twin, twin_opt, twin_scaler)):
        opt_.grad_scaler = scaler_
        scaler_.step(opt_)
        scaler_.update()
    assert opt.loss_scaled
    _assert_same(model, opt, twin, twin_opt)
    _assert_same_tree(opt.state_dict(), twin_opt.state_dict())
