"""The ranks of a data-parallel SparseAdamW take each step's decisions together (gloo, 2 processes).

`for_model`'s default memory mode (hook mode and the sparse backward) under DDP (built before the wrap, as
documented) and with an explicit `process_group`: an inf/NaN in one rank's gradient must skip the step on
every rank, back the scaler off alike, and leave what one process on the global batch gets from the steps
that ran; the dense head, which DDP already averages, must not be averaged again inside `step()`.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sift
from conftest import gloo_rank
from sift import SparseAdamW

WORLD = 2
BATCH = 12
INIT_SCALE = 2.0**12  # powers of two: scaled fp32 training rounds as unscaled training does
# case -> {step: (rank whose gradient gets an inf, where)}; "sparse": a sparse weight's dense .grad while
# its entries are not chosen, "head": the dense head's .grad, "compact": a sparse weight's [k] buffer.
CASES = {
    "selecting-step": dict(steps=4, poison={0: (0, "sparse")}),
    "normal-step": dict(steps=5, poison={2: (0, "head"), 3: (1, "compact")}),
    # scaler.unscale_ and sift.clip_grad_norm_ every step: the clip averages before the step agrees.
    "unscale-clip": dict(steps=4, poison={0: (1, "sparse"), 2: (0, "head")}, clip=0.5),
    # A clip before the first step() under DDP clipped by each rank's local norm: the default group the step
    # adopts for the sparse weights was not adopted yet (found by the full matrix).
    "clip-from-the-first-step": dict(steps=3, poison={}, clip=0.05),
}
MODES = ["ddp", "process-group"]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _optimizer(model, **kwargs) -> SparseAdamW:
    # memory="low" (the default): compact gradients and the sparse backward; the head "4" trains densely.
    return SparseAdamW.for_model(model, density=0.2, lr=1e-2, target_modules=["0", "2"], dense_modules=["4"],
                                 **kwargs)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 12, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen)


def _poison(model, opt, where: str) -> None:
    if where == "sparse":
        assert model[0].weight.grad is not None, "the sparse weight should still have its dense gradient"
        model[0].weight.grad[1, 2] = float("inf")
    elif where == "head":
        model[4].weight.grad[0, 0] = float("inf")
    else:
        opt.grads.compact[model[2].weight][0] = float("inf")


def _train(net, model, opt, rank: int, world: int, steps, scaler=None, poison=None, clip=None) -> list[bool]:
    """Each rank trains on its slice of every batch (clipping to `clip` with sift.clip_grad_norm_); returns, per
    step, whether it ran."""
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ran = []
    for step in steps:
        x, y = _data(step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[shard]), y[shard])
        if scaler is None:
            loss.backward()
            if clip is not None:
                sift.clip_grad_norm_(opt, clip)
            opt.step()
            ran.append(True)
            continue
        scaler.scale(loss).backward()
        if poison and step in poison and poison[step][0] == rank:
            _poison(model, opt, poison[step][1])
        if clip is not None:
            scaler.unscale_(opt)
            sift.clip_grad_norm_(opt, clip)
        scaler.step(opt)
        scaler.update()
        ran.append(not opt.last_step_skipped)
    return ran


def _build(mode: str):
    model = _model()
    if mode == "ddp":
        opt = _optimizer(model)  # before the wrap: the sparse weights are left to the optimizer
        return torch.nn.parallel.DistributedDataParallel(model), model, opt
    return model, model, _optimizer(model, process_group=dist.group.WORLD)


def _scaled_run(rank: int, world: int, mode: str, case: str) -> dict:
    net, model, opt = _build(mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1)
    config = CASES[case]
    ran = _train(net, model, opt, rank, world, range(config["steps"]), scaler, config["poison"], config.get("clip"))
    return {"ran": ran, "scale": scaler.get_scale(),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "indices": {n: opt.indices_of(p) for n, p in model.named_parameters() if "indices" in opt.state.get(p, {})}}


def _head_reductions(rank: int, world: int, mode: str) -> list[int]:
    """How many times `step()` all-reduces the head's gradients (weight and bias), per step."""
    net, model, opt = _build(mode)
    real = dist.all_reduce
    reduced: list[torch.Tensor] = []

    def recording(tensor, *args, **kwargs):
        reduced.append(tensor)
        return real(tensor, *args, **kwargs)

    counts = []
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(3):
        x, y = _data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[shard]), y[shard]).backward()
        reduced.clear()
        dist.all_reduce = recording
        try:
            opt.step()
        finally:
            dist.all_reduce = real
        head = [model[4].weight.grad, model[4].bias.grad]
        counts.append(sum(any(t is g for g in head) for t in reduced))
    return counts


def _disagreement(rank: int, world: int, mode: str) -> dict:
    """The selecting step after a backward that did not reach a sparse weight on rank 1: every rank must refuse
    (none may enter the selection's collectives alone), changing nothing."""
    net, model, opt = _build(mode)
    x, y = _data(0)
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    torch.nn.functional.cross_entropy(net(x[shard]), y[shard]).backward()
    if rank == 1:
        model[2].weight.grad = None
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "changed": any(not torch.equal(a, p) for a, p in zip(before, model.parameters())),
            "state": any(opt.state.get(p) for p in model.parameters())}


def _scaled_disagreement(rank: int, world: int, mode: str) -> dict:
    """Under GradScaler, with one weight's entries chosen (its compact buffer loss-scaled) and one still pending: a
    backward that did not reach the pending weight on rank 1 must be refused before the step unscales, links the
    scaler or marks the optimizer loss-scaled."""
    net, model, opt = _build(mode)
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    x, y = _data(0)
    torch.nn.functional.cross_entropy(net(x[shard]), y[shard]).backward()
    model[2].weight.grad = None  # on every rank: "0" chooses its entries, "2" stays pending
    opt.step()
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    x, y = _data(1)
    scaler.scale(torch.nn.functional.cross_entropy(net(x[shard]), y[shard])).backward()
    if rank == 1:
        model[2].weight.grad = None
    buffer = opt.grads.compact[model[0].weight]
    before = buffer.clone()
    scaled_before = set(opt.amp.scaled_compact)
    try:
        scaler.step(opt)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "selected": "indices" in opt.state[model[0].weight],
            "buffer": torch.equal(buffer, before) and bool(before.abs().sum() > 0),
            "scaled": opt.amp.scaled_compact == scaled_before and model[0].weight in scaled_before,
            "loss_scaled": opt.loss_scaled, "linked": opt.grad_scaler is not None}


@gloo_rank(timeout_s=30)
def _worker(rank: int, world: int, mode: str, out: str) -> None:
    results = {case: _scaled_run(rank, world, mode, case) for case in CASES}
    results["head-reductions"] = _head_reductions(rank, world, mode)
    results["disagreement"] = _disagreement(rank, world, mode)
    results["scaled-disagreement"] = _scaled_disagreement(rank, world, mode)
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module", params=MODES)
def ranks(request, tmp_path_factory):
    """(mode, [what each rank saved])."""
    out = str(tmp_path_factory.mktemp(request.param) / "result")
    mp.spawn(_worker, args=(WORLD, f"{out}.init", request.param, out), nprocs=WORLD, join=True)
    return request.param, [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks, case):
    """Regression: each rank decided to skip on its own gradients before they were averaged, so one rank skipped
    while the other stepped on the averaged inf (or entered the selection's all-reduce alone); now every rank
    skips, the scales stay equal, and the result equals one process on the global batches of the steps that ran."""
    _, per_rank = ranks
    per_rank = [r[case] for r in per_rank]
    steps, poison = CASES[case]["steps"], CASES[case]["poison"]
    expected = [step not in poison for step in range(steps)]
    for rank, r in enumerate(per_rank):
        assert r["ran"] == expected, (rank, r["ran"])
        assert r["scale"] == INIT_SCALE * 2.0 ** (sum(expected) - len(poison)), (rank, r["scale"])
    model = _model()
    opt = _optimizer(model)
    _train(model, model, opt, 0, 1, [step for step in range(steps) if step not in poison], clip=CASES[case].get("clip"))
    for name, p in model.named_parameters():
        for rank, r in enumerate(per_rank):
            assert torch.equal(r["params"][name], per_rank[0]["params"][name]), f"rank {rank} drifted at {name}"
            torch.testing.assert_close(r["params"][name], p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        if "indices" in opt.state.get(p, {}):
            for r in per_rank:
                assert torch.equal(r["indices"][name], opt.indices_of(p)), f"{name}: another selection"
    assert per_rank[0]["indices"], "nothing was selected"


def test_the_dense_head_is_averaged_once(ranks):
    """Regression: under DDP the optimizer, which averages the sparse weights DDP leaves to it, all-reduced the
    dense head's gradient a second time after DDP had; with an explicit process_group (no DDP) it averages
    the head itself, once a step."""
    mode, per_rank = ranks
    expected = [0] * 3 if mode == "ddp" else [2] * 3  # weight and bias
    for rank, r in enumerate(per_rank):
        assert r["head-reductions"] == expected, (rank, r["head-reductions"])


def test_plain_4_bit_selection_steps_report_a_check_to_the_scaler():
    """Regression: 4-bit deltas in plain mode with select_steps > 1 kept no `.grad` on the scoring step, so the
    step reported no inf check and `scaler.update()` raised; scaled training now equals unscaled training."""
    pytest.importorskip("bitsandbytes")
    from test_quantized import _pair, _train as train_quantized

    runs = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1), None):
        quantized, _ = _pair()
        opt = SparseAdamW.for_model(quantized, density=0.1, lr=1e-2, target_modules=["0", "2"], memory="plain",
                                    select_steps=2)
        assert all(group["density"] >= 1.0 for group in opt.param_groups), "the deltas should be the only params"
        train_quantized(quantized, opt, 4, scaler=scaler)
        runs.append((quantized, opt))
        if scaler is not None:
            assert scaler.get_scale() == 2.0**12
    (model, opt), (ref_model, ref_opt) = runs
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert any(route.selected for route in opt.grads.quantized.values())


def test_ranks_selecting_different_weights_refuse_together(ranks):
    """Regression: a rank whose backward did not reach a sparse weight skipped its average on the selecting step
    while the other ranks waited in it; now every rank refuses at the agreement, before anything changes."""
    _, per_rank = ranks
    for rank, r in enumerate(per_rank):
        result = r["disagreement"]
        assert result["error"] is not None and "disagree" in result["error"], (rank, result)
        assert not result["changed"] and not result["state"], (rank, result)


def test_a_refused_scaled_step_leaves_the_scale_state_untouched(ranks):
    """Regression: the ranks' refusal came after the step had unscaled the compact buffers, linked the scaler and
    marked the optimizer loss-scaled, so the refused step changed state (a retry would unscale twice)."""
    _, per_rank = ranks
    for rank, r in enumerate(per_rank):
        result = r["scaled-disagreement"]
        assert result["error"] is not None and "disagree" in result["error"], (rank, result)
        assert result["selected"] and result["buffer"] and result["scaled"], (rank, result)
        assert not result["loss_scaled"] and not result["linked"], (rank, result)
