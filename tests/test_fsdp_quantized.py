"""4-bit sparse deltas over a bitsandbytes base sharded by FSDP2 (`fully_shard`), gloo on 2 processes.

`for_model` comes first; `replicated_quantized_deltas` keeps each layer's [k] delta values out of FSDP2
(`ignored_params`) and has the layer average their gradient across ranks, so FSDP2 shards only the packed
weights. Each rank trains on its half of every global batch; the reference is one process on the whole
batch. One spawn runs every case; the tests read what the ranks saved.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from conftest import gloo_rank
from sift import SparseAdamW, SparseDelta

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("torch.distributed.fsdp")

WORLD = 2
STEPS = 4
BATCH = 12
DENSITY = 0.1
TOL = dict(rtol=1e-5, atol=1e-6)

CONFIGS = {
    "plain": dict(kwargs={}, micro=1),
    "select-2-accumulate-clip": dict(kwargs=dict(select_steps=2, max_grad_norm=0.05), micro=2),
    "saliency": dict(kwargs=dict(selection="saliency"), micro=1),
    "lean": dict(kwargs=dict(state="lean"), micro=2),
    "update-in-backward": dict(kwargs=dict(update_in_backward=True), micro=1),
    "bf16-storage": dict(kwargs={}, micro=1, storage=torch.bfloat16),
}

# The modes whose export needs no base= (a lean optimizer's does: it keeps no increments).
EXPORTED = {"plain", "select-2-accumulate-clip", "update-in-backward"}


def _model(storage: torch.dtype = torch.uint8) -> nn.Module:
    """Two NF4 layers with odd shapes (24 and 9 rows of packed bytes split 12/12 and 5/4 over 2 ranks)."""
    torch.manual_seed(0)

    def layer(n_in, n_out):
        return bnb.nn.Linear4bit(n_in, n_out, compute_dtype=torch.float32, quant_type="nf4", quant_storage=storage)

    return nn.Sequential(layer(40, 24), nn.Tanh(), layer(24, 9)).to("cpu")  # bitsandbytes quantizes on the move


def _for_model(model: nn.Module, **kwargs) -> SparseAdamW:
    return SparseAdamW.for_model(model, density=DENSITY, lr=1e-2, weight_decay=0.0, target_modules=["0", "2"],
                                 **kwargs)


def _shard(model: nn.Module, ignored: set | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for i in (0, 2):
        fully_shard(model[i], mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)


def _data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(BATCH, 40, generator=gen), torch.randn(BATCH, 9, generator=gen)


def _train(model, opt, rank: int, world: int, steps: int, micro: int) -> None:
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = _data(step, m)
            ((model(x[rows]) - y[rows]).square().mean() / micro).backward()
        opt.step()


def _packed(model: nn.Module) -> dict[int, torch.Tensor]:
    """Each layer's packed bytes on this rank (its shard under FSDP2)."""
    return {i: (w.to_local() if hasattr(w, "to_local") else w.data).detach().clone()
            for i, w in ((i, model[i].weight) for i in (0, 2))}


def _snapshot(model: nn.Module, opt: SparseAdamW) -> dict:
    out = {}
    for i in (0, 2):
        route = model[i]._sift_quantized
        state = opt.state[route.values]
        out[i] = {"values": route.values.detach().clone(), "indices": route.indices.long().clone(),
                  "state": {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}}
    return out


def _entries(delta: SparseDelta) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (e.indices.long().clone(), e.values.clone()) for name, e in delta.entries.items()}


def _refusals() -> dict:
    """Each misuse on this rank: its error, and whether a delta or packed weight moved."""
    from sift.optim.sharded import replicated_quantized_deltas

    results = {}

    def attempt(name, build):
        model = _model()
        before = _packed(model)
        deltas = []
        try:
            opt = build(model)
            deltas = [(p, p.detach().clone()) for p in opt.grads.quantized]
            _train(model, opt, torch.distributed.get_rank(), WORLD, 1, 1)
            error = None
        except ValueError as exc:
            error = str(exc)
        moved = any(not torch.equal(p.detach(), kept) for p, kept in deltas)
        packed = _packed(model)
        moved |= any(not torch.equal(packed[i], before[i]) for i in packed if packed[i].shape == before[i].shape)
        results[name] = {"error": error, "moved": moved}

    def sharded_first(model):
        _shard(model, None)
        return _for_model(model)

    def deltas_sharded(model):
        opt = _for_model(model)
        _shard(model, None)
        return opt

    def not_averaged(model):
        opt = _for_model(model)
        _shard(model, set(opt.grads.quantized))
        return opt

    def trains_more(model):
        opt = _for_model(model)
        opt.add_param_group({"params": [("2.bias", model[2].bias)], "density": 1.0})  # FSDP2 would replace it
        _shard(model, replicated_quantized_deltas(opt))
        return opt

    attempt("for-model-after-fully-shard", sharded_first)
    attempt("deltas-sharded-by-fsdp2", deltas_sharded)
    attempt("deltas-ignored-but-not-averaged", not_averaged)
    attempt("optimizer-trains-more-than-deltas", trains_more)
    return results


@gloo_rank
def _worker(rank: int, world: int, out: str) -> None:
    from sift.optim.sharded import replicated_quantized_deltas

    results = {}
    for name, config in CONFIGS.items():
        model = _model(config.get("storage", torch.uint8))
        packed = _packed(model)
        opt = _for_model(model, **config["kwargs"])
        _shard(model, replicated_quantized_deltas(opt))
        sharded = all(type(model[i].weight).__name__ == "DTensor" for i in (0, 2))
        _train(model, opt, rank, world, STEPS, config["micro"])
        results[name] = {"trained": _snapshot(model, opt), "packed-before": packed, "packed-after": _packed(model),
                         "sharded": sharded}
        if name in EXPORTED:
            results[name]["delta"] = _entries(SparseDelta.from_optimizer(opt, model))
    results["refusals"] = _refusals()
    # Plain DDP over an unsharded 4-bit model: the ranks chose their entries from their own gradients.
    model = _model()
    opt = _for_model(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    _train(ddp, opt, rank, world, STEPS, 1)
    results["ddp"] = {"trained": _snapshot(model, opt)}
    model = _model()
    opt = _for_model(model, update_in_backward=True)
    before = [p.detach().clone() for p in opt.grads.quantized]
    try:
        _train(nn.parallel.DistributedDataParallel(model), opt, rank, world, 1, 1)
        results["ddp-uib"] = {"error": None}
    except RuntimeError as exc:
        results["ddp-uib"] = {"error": str(exc), "moved": any(not torch.equal(p.detach(), b)
                                                              for p, b in zip(opt.grads.quantized, before))}
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("fsdp-4bit") / "result")
    mp.spawn(_worker, args=(WORLD, f"{out}.init", out), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]


def _reference(config: dict, delta: bool = False) -> dict:
    model = _model(config.get("storage", torch.uint8))
    opt = _for_model(model, **config["kwargs"])
    _train(model, opt, 0, 1, STEPS, config["micro"])
    return _entries(SparseDelta.from_optimizer(opt, model)) if delta else _snapshot(model, opt)


def test_ddp_ranks_choose_the_4_bit_entries_of_the_global_batch(ranks):
    """Under DDP each rank chose a 4-bit layer's entries from its own half of the batch, and DDP averaged [k]
    values taken at different positions without an error; the ranks now choose from the averaged gradient."""
    want = _reference(CONFIGS["plain"])
    for rank, r in enumerate(ranks):
        got = r["ddp"]["trained"]
        for i in (0, 2):
            assert torch.equal(got[i]["indices"], want[i]["indices"]), f"rank {rank} layer {i}: entries"
            torch.testing.assert_close(got[i]["values"], want[i]["values"], **TOL, msg=f"rank {rank} layer {i}")


def test_ddp_with_the_update_in_backward_over_4_bit_deltas_is_refused_before_anything_moves(ranks):
    """Stepped inside backward, a 4-bit delta took each rank's own gradient before DDP averaged it."""
    for r in ranks:
        assert "update_in_backward=True in a job of 2 processes" in (r["ddp-uib"]["error"] or "")
        assert not r["ddp-uib"]["moved"]


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_two_ranks_over_a_sharded_4_bit_base_equal_one_process_on_the_whole_batch(ranks, mode):
    want = _reference(CONFIGS[mode])
    for rank, r in enumerate(ranks):
        got = r[mode]["trained"]
        for i in (0, 2):
            assert torch.equal(got[i]["indices"], want[i]["indices"]), f"rank {rank} layer {i}: entries"
            torch.testing.assert_close(got[i]["values"], want[i]["values"], **TOL, msg=f"rank {rank} layer {i}")
            assert sorted(got[i]["state"]) == sorted(want[i]["state"])
            for key, value in want[i]["state"].items():
                # The lean state's bf16 moments round stochastically: an fp32 ulp apart may round apart.
                tol = dict(rtol=1e-2, atol=1e-6) if mode == "lean" and value.is_floating_point() else TOL
                torch.testing.assert_close(got[i]["state"][key].float(), value.float(), **tol,
                                           msg=f"rank {rank} layer {i} {key}")
    assert any(float(want[i]["values"].abs().max()) > 0 for i in (0, 2)), "nothing trained: the test cannot fail"


@pytest.mark.parametrize("mode", sorted(EXPORTED))
def test_every_rank_exports_the_one_process_delta(ranks, mode):
    want = _reference(CONFIGS[mode], delta=True)
    for rank, r in enumerate(ranks):
        got = r[mode]["delta"]
        assert sorted(got) == sorted(want) == ["0.weight", "2.weight"], rank
        for name, (indices, values) in want.items():
            assert torch.equal(got[name][0], indices), f"rank {rank} {name}"
            torch.testing.assert_close(got[name][1], values, **TOL, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_fsdp2_shards_the_packed_weights_and_they_never_change(ranks, mode):
    for rank, r in enumerate(ranks):
        run = r[mode]
        assert run["sharded"], f"rank {rank}: the packed weights are not DTensors"
        for i in (0, 2):
            whole, shard = run["packed-before"][i], run["packed-after"][i]
            rows = torch.arange(whole.shape[0]).chunk(WORLD)[rank]  # FSDP2 shards dim 0 as torch.chunk does
            assert shard.dtype == whole.dtype and shard.shape[0] == rows.numel() < whole.shape[0], (rank, i)
            # Bytes, not values: bf16 storage holds bit patterns that read as NaN.
            assert torch.equal(shard.view(torch.uint8), whole[rows].view(torch.uint8)), \
                f"rank {rank} layer {i}: the packed weight changed"


@pytest.mark.parametrize("misuse, expected", [
    ("for-model-after-fully-shard", "must come before fully_shard"),
    ("deltas-sharded-by-fsdp2", "fully_shard (FSDP2) replaced it with its own param"),
    ("deltas-ignored-but-not-averaged", "nothing averages its sift_delta gradient"),
    ("optimizer-trains-more-than-deltas", "besides the 4-bit deltas"),
])
def test_misuses_are_refused_before_anything_changes(ranks, misuse, expected):
    for rank, r in enumerate(ranks):
        result = r["refusals"][misuse]
        assert result["error"] is not None and expected in result["error"], (rank, result)
        assert not result["moved"], f"rank {rank}: a delta or packed weight moved"
