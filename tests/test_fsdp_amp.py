"""SparseAdamW under FSDP2 (`fully_shard`) with a GradScaler, gloo on 2 and 3 processes.

FSDP2 uses the standard `torch.amp.GradScaler`: its inf check sees DTensor gradients and all-reduces
the flag over their mesh (torch's DTensor handler of `_amp_foreach_non_finite_check_and_unscale_`).
The compact buffers of hook mode and the sparse backward are plain per-rank tensors the scaler never
sees, so the optimizer agrees on their flag across the ranks itself.

Each case trains several steps with a scaler, an inf written into one rank's gradient on two of them
(before selection: a dense shard gradient; after: the compact buffer where the mode keeps one), and is
compared with one process that trains without a scaler on the global batches of the steps that ran
(the whole weight's top-k, FSDP2's default global selection, tests/test_fsdp.py). Every rank must skip the same steps,
select on the same step and end with the same scale.
"""

from __future__ import annotations

import pytest
import torch

import sift
from conftest import gloo_rank, run_ranks
from sift import SparseAdamW
from test_fsdp import BATCH, _data, _full, _groups, _model, _sharded_model, _snapshot

pytest.importorskip("torch.distributed.fsdp")

STEPS = 5
POISONED = {0: 0, 2: -1}  # step -> the rank (index into range(world)) whose gradient gets an inf
INIT_SCALE = 2.0**12  # powers of two: scaled fp32 training rounds as unscaled training does

CONFIGS = {
    "plain": dict(kwargs=dict(), micro=2, unscale_clip=True),
    "plain-step": dict(kwargs=dict(), micro=1),
    "hook": dict(kwargs=dict(compact_grads=True, select_steps=2), micro=2, unscale_clip=True),
    "hook-step": dict(kwargs=dict(compact_grads=True, max_grad_norm=0.5), micro=1),
    "hook-lean": dict(kwargs=dict(compact_grads=True, state="lean"), micro=2, unscale_clip=True),
    "sparse-backward": dict(kwargs=dict(compact_grads=True), micro=2, unscale_clip=True, sparse_backward=True),
    "sparse-backward-step": dict(kwargs=dict(compact_grads=True, max_grad_norm=0.5), micro=1, sparse_backward=True),
    "sparse-backward-lean": dict(kwargs=dict(compact_grads=True, state="lean"), micro=2, unscale_clip=True,
                                 sparse_backward=True),
    # FSDP1's scaler all-reduces the flag in unscale_ as well: the same result.
    "sparse-backward-sharded-scaler": dict(kwargs=dict(compact_grads=True), micro=2, unscale_clip=True,
                                           sparse_backward=True, sharded_scaler=True),
}
LEAN = {"hook-lean", "sparse-backward-lean"}
CLIP = 0.5


def _poison(model, opt) -> None:
    """Write an inf into this rank's gradient of a weight: its dense shard gradient while it has one, else the
    compact buffer the step reads (the global selection may leave a rank no entries of a weight)."""
    for weight in (model[2].weight, model[0].weight):
        target = weight.grad.to_local() if weight.grad is not None else opt.grads.compact.get(weight)
        if target is not None and target.numel():
            target.view(-1)[0] = float("inf")
            return
    raise AssertionError("no gradient on this rank to write an inf into")


def _train(model, opt, rank: int, world: int, micro: int, scaler=None, unscale_clip: bool = False,
           steps=range(STEPS)) -> list[bool]:
    """Each rank trains on its slice of every micro-batch; returns, per step, whether it ran."""
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ran = []
    for step in steps:
        opt.zero_grad()
        for m in range(micro):
            x, y = _data(step, m)
            # Not cross-entropy: over 2 classes the head's two rows get gradients of equal magnitude, ties
            # that the sums' rounding (another order on each rank) would break either way.
            target = torch.nn.functional.one_hot(y[shard], 2).float()
            loss = torch.nn.functional.mse_loss(model(x[shard]), target) / micro
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is None:
            if unscale_clip:
                sift.clip_grad_norm_(opt, CLIP)
            opt.step()
            continue
        if step in POISONED and rank == range(world)[POISONED[step]]:
            _poison(model, opt)
        if unscale_clip:
            scaler.unscale_(opt)
            sift.clip_grad_norm_(opt, CLIP)
        scaler.step(opt)
        scaler.update()
        ran.append(not opt.last_step_skipped)
    return ran


def _scaler(sharded: bool):
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1)
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1)


def _optimizer(model, config: dict, cls=SparseAdamW, **extra) -> SparseAdamW:
    opt = cls(_groups(model), lr=1e-2, **config["kwargs"], **extra)
    if config.get("sparse_backward"):
        sift.enable_sparse_backward(model, opt)
    return opt


def _refusal(world: int) -> dict:
    """update_in_backward under a scaler: refused at the first step, before any weight moves."""
    model = _sharded_model(world)
    before = [p.to_local().detach().clone() for p in model.parameters()]
    opt = SparseAdamW(_groups(model), lr=1e-2, update_in_backward=True)
    try:
        _train(model, opt, torch.distributed.get_rank(), world, 1, _scaler(False), steps=range(1, 2))
        error = None
    except (ValueError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "changed": any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))}


@gloo_rank
def _worker(rank: int, world: int, out: str) -> None:
    results = {}
    for name, config in CONFIGS.items():
        model = _sharded_model(world)
        opt = _optimizer(model, config)
        scaler = _scaler(config.get("sharded_scaler", False))
        first = _train(model, opt, rank, world, config["micro"], scaler, config.get("unscale_clip", False),
                       steps=range(1))
        selected_on_first = any(opt.state.get(p) for p in model.parameters())
        rest = _train(model, opt, rank, world, config["micro"], scaler, config.get("unscale_clip", False),
                      steps=range(1, STEPS))
        results[name] = {"snapshot": _snapshot(model, opt), "ran": first + rest, "scale": scaler.get_scale(),
                         "state-after-skip": selected_on_first}
        model = _sharded_model(world)
        opt = _optimizer(model, config)
        _train(model, opt, rank, world, config["micro"], unscale_clip=config.get("unscale_clip", False),
               steps=[step for step in range(STEPS) if step not in POISONED])
        results[f"{name}-unscaled"] = _snapshot(model, opt)
    results["refusal"] = _refusal(world)
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory):
    """(world, [what each rank saved])."""
    world = request.param
    return world, run_ranks(_worker, world, tmp_path_factory.mktemp(f"fsdp-amp{world}"))


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks, mode):
    """An inf in one rank's gradient skips the step on every rank: no selection on a skipped first step, the
    scale backed off everywhere, and the steps that ran equal the same ranks training unscaled on them."""
    world, per_rank = ranks
    expected = [step not in POISONED for step in range(STEPS)]
    for rank, r in enumerate(per_rank):
        assert r[mode]["ran"] == expected, (rank, r[mode]["ran"])
        assert not r[mode]["state-after-skip"], f"rank {rank}: the skipped first step selected"
        # 2 ** 12, halved twice and doubled on each of the 3 clean steps.
        assert r[mode]["scale"] == INIT_SCALE * 2, (rank, r[mode]["scale"])
        # Power-of-two scales: scaling and unscaling round nothing.
        for name, entry in r[mode]["snapshot"].items():
            other = r[f"{mode}-unscaled"][name]
            assert torch.equal(entry["param"], other["param"]), (rank, name)
            assert sorted(entry["state"]) == sorted(other["state"]), (rank, name)
            for key, value in entry["state"].items():
                assert torch.equal(value, other["state"][key]), (rank, name, key)
            assert torch.equal(entry.get("indices", torch.empty(0)), other.get("indices", torch.empty(0)))


@pytest.mark.parametrize("mode", sorted(set(CONFIGS) - LEAN))
def test_scaled_fsdp2_training_equals_one_process(ranks, mode):
    """The steps that ran equal one process training unscaled on their global batches (the whole weight's
    top-k). The lean modes are left to the test above: their shards round the moments from positions in the
    shard, which one process does not share (tests/test_fsdp.py)."""
    world, per_rank = ranks
    config = CONFIGS[mode]
    model = _model()
    opt = _optimizer(model, config)
    _train(model, opt, 0, 1, config["micro"], unscale_clip=config.get("unscale_clip", False),
           steps=[step for step in range(STEPS) if step not in POISONED])
    tol = dict(rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        got = _full([r[mode]["snapshot"] for r in per_rank], name, p.shape)
        state = opt.state[p]
        keys = ("exp_avg", "exp_avg_sq")
        if name.endswith("weight"):
            assert torch.equal(got["indices"], opt.indices_of(p).long()), (f"{mode} {name}: another selection",
                                                                           got["indices"], opt.indices_of(p))
            keys += ("delta",)
        torch.testing.assert_close(got["param"], p.detach(), **tol, msg=lambda m: f"{mode} {name}: {m}")
        for key in keys:
            # The increments are differences of weights: the weights' tolerance.
            torch.testing.assert_close(got[key], state[key].reshape(-1), **(dict(rtol=0, atol=1e-5) if key == "delta"
                                                                            else tol),
                                       msg=lambda m: f"{mode} {name} {key}: {m}")
        for rank, r in enumerate(per_rank):
            entry = r[mode]["snapshot"][name]
            if entry.get("indices", entry["param"]).numel():  # a rank holding none of a weight counts no steps
                assert torch.equal(entry["state"]["step"], state["step"]), (rank, name)


def test_update_in_backward_under_a_scaler_is_refused_before_any_weight_changes(ranks):
    world, per_rank = ranks
    for rank, r in enumerate(per_rank):
        result = r["refusal"]
        assert result["error"] is not None and "cannot be used with GradScaler" in result["error"], (rank, result)
        assert not result["changed"], f"rank {rank}: a weight moved"
