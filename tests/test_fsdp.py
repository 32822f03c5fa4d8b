"""SparseAdamW under FSDP2 (`fully_shard`), gloo on 2 and 3 processes (an odd count puts shard
boundaries mid-weight and leaves one rank an empty shard of the 2-row head).

The global selection (the default) is compared with plain `SparseAdamW` in one process on the same global
batches, on a model whose middle layer's dead rows leave every rank but the first 0 of its entries;
`sharded_selection="per_shard"` with one process selecting per block of rows as the ranks do (FSDP2's
`torch.chunk` shards, k = ceil(density * block numel)). Each mode is compared after several steps (params,
entries, moments, increments). One spawn per world size runs every case; the tests read what ranks saved.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import sift
from conftest import gloo_rank, run_ranks
from sift import SparseAdamW, SparseDelta
from sift._index import entries_for, index_dtype, top_k_positions
from sift.optim.selection import Selector

pytest.importorskip("torch.distributed.fsdp")

STEPS = 4
BATCH = 12  # splits evenly over 1, 2 and 3 ranks
DENSITY = 0.2

CONFIGS = {
    "plain": dict(kwargs=dict(max_grad_norm=0.5), micro=1),
    "hook": dict(kwargs=dict(compact_grads=True, max_grad_norm=0.5, select_steps=2), micro=2),
    "hook-noclip": dict(kwargs=dict(compact_grads=True), micro=1),
    "update-in-backward": dict(kwargs=dict(update_in_backward=True), micro=1),
    "plain-lean": dict(kwargs=dict(state="lean", max_grad_norm=0.5), micro=2),
    "hook-lean": dict(kwargs=dict(compact_grads=True, state="lean", max_grad_norm=0.5), micro=2),
    "sparse-backward": dict(kwargs=dict(compact_grads=True, max_grad_norm=0.5, select_steps=2), micro=2,
                            sparse_backward=True),
    "sparse-backward-lean": dict(kwargs=dict(compact_grads=True, state="lean", max_grad_norm=0.5), micro=2,
                                 sparse_backward=True),
}
LEAN = {"plain-lean", "hook-lean", "sparse-backward-lean"}
PER_SHARD = dict(sharded_selection="per_shard")
# Global selection only: the other rules.
GLOBAL_CONFIGS = {**CONFIGS,
                  "saliency": dict(kwargs=dict(selection="saliency", max_grad_norm=0.5), micro=1),
                  "random": dict(kwargs=dict(compact_grads=True, selection="random", seed=3), micro=1)}


def _model(dead: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    # 15 and 16 rows split 8/7 and 6/6/4; the 2-row head leaves the third rank an empty shard.
    model = torch.nn.Sequential(torch.nn.Linear(12, 15), torch.nn.ReLU(), torch.nn.Linear(15, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    if dead:
        with torch.no_grad():
            # Rows 6 on of the middle layer never fire: their gradients are 0, so its whole-weight top-k
            # (48 of 240) lies in the first rank's rows and the other ranks get none of its entries.
            model[2].bias[6:] = -100.0
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "density": DENSITY},
            {"params": [p for n, p in named if n.endswith("bias")], "density": 1.0}]


def _data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(BATCH, 12, generator=gen), torch.randint(0, 2, (BATCH,), generator=gen)


def _train(model, opt, rank: int, world: int, steps: int, micro: int, first: int = 0) -> None:
    """Each rank trains on its slice of every micro-batch; FSDP2 averages the shard gradients over ranks."""
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(first, first + steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = _data(step, m)
            (torch.nn.functional.cross_entropy(model(x[shard]), y[shard]) / micro).backward()
        opt.step()


class RowBlockSelector(Selector):
    """One process selecting as FSDP2 ranks do: the top-k of each block of rows (`torch.chunk` over `world`)."""

    def choose(self, group, p, score):
        rows, per_row = p.shape[0], p.numel() // p.shape[0]
        chunk = -(-rows // self.opt.world)
        flat, chosen = score.reshape(-1), []
        for first in range(0, rows, chunk):
            block = flat[first * per_row:min(first + chunk, rows) * per_row]
            k = max(1, entries_for(group["density"], block.numel()))
            chosen.append(top_k_positions(block, k) + first * per_row)
        return torch.cat(chosen).to(index_dtype(p.numel()))


class RowBlockSparseAdamW(SparseAdamW):
    PARTS = tuple((name, RowBlockSelector if name == "selector" else part) for name, part in SparseAdamW.PARTS)

    def __init__(self, *args, world: int, **kwargs):
        self.world = world
        super().__init__(*args, **kwargs)


def _sharded_model(world: int, dead: bool = False) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(dead)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # one reduce-scatter (and hook round) per layer
    fully_shard(model, mesh=mesh)
    return model


def _column_sharded_model(world: int) -> torch.nn.Module:
    """FSDP2 sharding the weights by columns (`Shard(1)`), which the global selection does not support."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)),
                # FSDP2 shards dim 1 evenly only: the first weight's 12 columns split over 2 and 3 ranks.
                shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % world == 0 else Shard(0))
    return model


@contextlib.contextmanager
def _reduce_scatters(log: list[tuple[str, int]]):
    """Record (whose, input numel) of every reduce-scatter: FSDP2's of dense gradients ("dense") and the sparse
    backward's of [k] entries ("sparse")."""
    import torch.distributed as dist

    from sift.optim.sharded import ShardedSparseGrad

    names = [name for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)]
    originals = {name: getattr(dist, name) for name in names}
    original_reduce = ShardedSparseGrad.reduce
    inside = []

    def counted(original):
        def run(*args, **kwargs):
            log.append(("sparse" if inside else "dense", (args[1] if len(args) > 1 else kwargs["input"]).numel()))
            return original(*args, **kwargs)
        return run

    def reduce(self, gradient):
        inside.append(True)
        try:
            return original_reduce(self, gradient)
        finally:
            inside.pop()

    for name, original in originals.items():
        setattr(dist, name, counted(original))
    ShardedSparseGrad.reduce = reduce
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        ShardedSparseGrad.reduce = original_reduce


def _snapshot(model, opt) -> dict:
    """This rank's shards: local params, where each begins in its weight, and its optimizer state."""
    from sift.optim.sharded import shard_offset

    out = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        entry = {"param": p.to_local().detach().clone(), "offset": shard_offset(p),
                 "state": {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                           for k, v in state.items() if isinstance(v, torch.Tensor) and k != "score"}}
        if "indices" in state or "indices_low" in state:
            entry["indices"] = opt.indices_of(p).long().clone()
        out[name] = entry
    return out


def _delta_dict(delta: SparseDelta) -> dict:
    return {"entries": {n: (e.shape, e.dtype, e.indices.clone(), e.values.clone()) for n, e in delta.entries.items()},
            "dense": {n: t.clone() for n, t in delta.dense.items()}, "fingerprint": delta.base.to_json()}


def _refusals(world: int) -> dict:
    """Each refused combination on this rank: its error, and whether any weight moved."""
    results = {}

    def attempt(name, build, model_fn=None):
        model = (model_fn or _sharded_model)(world)
        before = [p.to_local().detach().clone() for p in model.parameters()]
        try:
            opt = build(model)
            _train(model, opt, torch.distributed.get_rank(), world, 1, 1)
            error = None
        except (ValueError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        changed = any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        results[name] = {"error": error, "changed": changed}

    def sparse_backward(model):
        opt = SparseAdamW(_groups(model), lr=1e-2, update_in_backward=True)
        sift.enable_sparse_backward(model, opt)
        return opt

    attempt("sparse-backward-update-in-backward", sparse_backward)
    attempt("for-model-sparse-backward-update-in-backward", lambda model: SparseAdamW.for_model(
        model, density=DENSITY, target_modules=["0", "2"], dense_modules=["4"], sparse_backward=True,
        update_in_backward=True))
    attempt("process-group", lambda model: SparseAdamW(_groups(model), lr=1e-2, compact_grads=True,
                                                       process_group=torch.distributed.group.WORLD))
    attempt("update-in-backward-clip", lambda model: SparseAdamW(_groups(model), lr=1e-2, update_in_backward=True,
                                                                 max_grad_norm=0.5))
    attempt("global-shard-dim-1", lambda model: SparseAdamW(_groups(model), lr=1e-2), _column_sharded_model)
    attempt("per-shard-shard-dim-1", lambda model: SparseAdamW(_groups(model), lr=1e-2, **PER_SHARD),
            _column_sharded_model)
    return results


def _optimizer(model, kwargs: dict, sparse_backward: bool = False, cls=SparseAdamW, **extra) -> SparseAdamW:
    opt = cls(_groups(model), lr=1e-2, **kwargs, **extra)
    if sparse_backward:
        sift.enable_sparse_backward(model, opt)
    return opt


def _checkpoint_resume(rank: int, world: int, directory: str, kwargs: dict, micro: int,
                       sparse_backward: bool = False, dead: bool = False) -> dict:
    """2 steps, a DCP save of model and optimizer, 2 more; and a fresh model that loads the save and runs the
    same 2: both snapshots, which must be equal."""
    import torch.distributed.checkpoint as dcp

    from sift.optim.sharded import ShardedOptimizerState

    model = _sharded_model(world, dead)
    opt = _optimizer(model, kwargs, sparse_backward)
    _train(model, opt, rank, world, 2, micro)
    dcp.save({"model": model.state_dict(), "optim": ShardedOptimizerState(opt)}, checkpoint_id=directory)
    _train(model, opt, rank, world, 2, micro, first=2)
    uninterrupted = _snapshot(model, opt)
    model = _sharded_model(world, dead)  # the initial weights: the load must replace them
    opt = _optimizer(model, kwargs, sparse_backward)
    dcp.load({"model": model.state_dict(), "optim": ShardedOptimizerState(opt)}, checkpoint_id=directory)
    _train(model, opt, rank, world, 2, micro, first=2)
    return {"uninterrupted": uninterrupted, "resumed": _snapshot(model, opt)}


def _set_indices_midway(model, opt, rank: int, world: int, blocks: int) -> None:
    """2 steps, then every shard (one process: block of rows, of `blocks`) of the middle weight trains its first
    k entries instead, then 2 more steps."""
    from sift.optim.sharded import refresh_sparse_backward

    _train(model, opt, rank, world, 2, 1)
    weight = model[2].weight
    if hasattr(weight, "to_local"):
        opt.set_indices(weight, torch.arange(opt.indices_of(weight).numel()))
        refresh_sparse_backward(opt)  # the sparse backward's cross-rank entries, rebuilt on every rank
    else:  # one process: the first k entries of each block of rows
        per_row, chunk = weight.shape[1], -(-weight.shape[0] // blocks)
        old = opt.indices_of(weight).long()
        blocks = [first * per_row for first in range(0, weight.shape[0], chunk)]
        counts = [int(((old >= start) & (old < start + chunk * per_row)).sum()) for start in blocks]
        opt.set_indices(weight, torch.cat([start + torch.arange(k) for start, k in zip(blocks, counts)]))
    _train(model, opt, rank, world, 2, 1, first=2)


def _for_model(model, cls=SparseAdamW, **kwargs) -> SparseAdamW:
    """The recipe of docs/distributed.md on the small model: for_model, sparse backward, lean state, clipping; with
    SIFT's top-|grad| rule, which the per-shard reference ranks by."""
    return cls.for_model(model, density=DENSITY, lr=1e-2, target_modules=["0", "2"], dense_modules=["4"],
                         sparse_backward=True, state="lean", max_grad_norm=0.5, selection="magnitude", **kwargs)


# Scores for `sharded_top_k` alone, each split over the ranks as FSDP2 splits rows (`torch.chunk`), with the
# k to take: ties within and across ranks, NaN, signed zeros, negatives, infinities, an empty shard.
TOP_K_CASES = {
    "all-equal": (torch.ones(10), 4),
    "ties-across-ranks": (torch.tensor([3.0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 0, 1]), 9),
    "nan": (torch.tensor([float("nan"), 1.0, float("nan"), 2.0, 0.5, 0.0]), 3),
    "nan-all": (torch.tensor([float("nan"), 1.0, float("nan"), 2.0, 0.5, 0.0]), 6),
    "signed-zeros": (torch.tensor([0.0, -0.0, -0.0, 0.0, 1.0, 0.0]), 3),
    "negative": (torch.tensor([-1.0, -2.0, 3.0, -0.5, -0.5, -3.0]), 3),
    "inf-subnormal": (torch.tensor([float("inf"), 1e-40, 3e-45, 0.0, float("inf"), 1e-40]), 4),
    "empty-shard": (torch.tensor([0.5, 0.25]), 1),
    "k-is-one": (torch.tensor([1.0, 5.0, 5.0, 2.0, 5.0, 1.0, 0.0]), 1),
    "many-ties": ((torch.rand(1000, generator=torch.Generator().manual_seed(5)) * 10).floor(), 137),
}


def _top_k_parts(rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's part of every TOP_K_CASES top-k, as positions of the whole vector (one search for all)."""
    from sift.optim.selection import sharded_top_k

    mine, offsets = [], []
    for full, _ in TOP_K_CASES.values():
        blocks = list(full.chunk(world)) + [full[:0]] * world
        mine.append(blocks[rank].clone())
        offsets.append(sum(b.numel() for b in blocks[:rank]))
    got = sharded_top_k(mine, [k for _, k in TOP_K_CASES.values()], torch.distributed.group.WORLD)
    return {name: idx + offset for name, idx, offset in zip(TOP_K_CASES, got, offsets)}


def _run_mode(rank: int, world: int, name: str, config: dict, extra: dict, dead: bool) -> dict:
    """STEPS steps of one mode; the last one's reduce-scatters logged. Returns what the tests read."""
    model = _sharded_model(world, dead)
    opt = _optimizer(model, {**config["kwargs"], **extra}, config.get("sparse_backward", False))
    _train(model, opt, rank, world, STEPS - 1, config["micro"])
    log: list[tuple[str, int]] = []
    with _reduce_scatters(log):  # the last step's, long after selection
        _train(model, opt, rank, world, 1, config["micro"], first=STEPS - 1)
    out = {"snapshot": _snapshot(model, opt), "reduce-scatters": log,
           "plans-final": opt.grads.sharded_plans_final}
    base = _model(dead).state_dict() if name in LEAN else None
    if name in ("plain", "hook", "hook-lean", "sparse-backward"):
        out["snapshot"]["delta"] = _delta_dict(SparseDelta.from_optimizer(opt, model, base=base))
    return out


@gloo_rank
def _worker(rank: int, world: int, out: str) -> None:
    results = {}
    for prefix, configs, extra, dead in (("", CONFIGS, PER_SHARD, False), ("global-", GLOBAL_CONFIGS, {}, True)):
        for name, config in configs.items():
            run = _run_mode(rank, world, name, config, extra, dead)
            results[f"{prefix}{name}"] = run["snapshot"]
            results[f"{prefix}{name}-reduce-scatters"] = run["reduce-scatters"]
            results[f"{prefix}{name}-plans-final"] = run["plans-final"]
    model = _sharded_model(world)
    opt = _for_model(model, **PER_SHARD)
    _train(model, opt, rank, world, STEPS, 2)
    results["for-model"] = _snapshot(model, opt)
    model = _sharded_model(world, dead=True)
    opt = _for_model(model)
    _train(model, opt, rank, world, STEPS, 2)
    results["global-for-model"] = _snapshot(model, opt)
    model = _sharded_model(world)
    opt = _optimizer(model, dict(compact_grads=True, **PER_SHARD), sparse_backward=True)
    _set_indices_midway(model, opt, rank, world, world)
    results["set-indices"] = _snapshot(model, opt)
    results["refusals"] = _refusals(world)
    results["top-k"] = _top_k_parts(rank, world)
    for prefix, extra, dead in (("", PER_SHARD, False), ("global-", {}, True)):
        for name in ("hook", "hook-lean", "sparse-backward-lean"):
            config = CONFIGS[name]
            results[f"checkpoint-{prefix}{name}"] = _checkpoint_resume(
                rank, world, f"{out}.dcp-{prefix}{name}", {**config["kwargs"], **extra}, config["micro"],
                config.get("sparse_backward", False), dead)
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request, tmp_path_factory):
    """(world, [what each rank saved])."""
    world = request.param
    return world, run_ranks(_worker, world, tmp_path_factory.mktemp(f"fsdp{world}"))


def _reference(world: int, config: dict):
    model = _model()
    opt = _optimizer(model, config["kwargs"], config.get("sparse_backward", False), RowBlockSparseAdamW, world=world)
    _train(model, opt, 0, 1, STEPS, config["micro"])
    return model, opt


def _global_reference(config: dict):
    """One process on the global batches, plain SparseAdamW (the whole weight's top-k), the dead-row model."""
    model = _model(dead=True)
    opt = _optimizer(model, config["kwargs"], config.get("sparse_backward", False))
    _train(model, opt, 0, 1, STEPS, config["micro"])
    return model, opt


def _assert_equals_one_process(per_rank: list[dict], mode: str, model, opt, lean: bool,
                               lean_tol: dict | None = None) -> None:
    """Params, chosen entries and moments (and increments) of the ranks' shards joined equal one process's."""
    for name, p in model.named_parameters():
        got = _full(per_rank, name, p.shape)
        # Lean moments round stochastically from each entry's index in its own shard: close, not equal.
        tol = (lean_tol or dict(rtol=1e-3, atol=1e-4)) if lean else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["param"], p.detach(), **tol, msg=f"{mode} {name}")
        state = opt.state[p]
        if name.endswith("weight"):
            assert torch.equal(got["indices"], opt.indices_of(p).long()), f"{mode} {name}: another selection"
            keys = ("exp_avg", "exp_avg_sq") + (() if lean else ("delta",))
        else:
            keys = ("exp_avg", "exp_avg_sq")
        for key in keys:
            torch.testing.assert_close(got[key].float(), state[key].reshape(-1).float(),
                                       **(dict(rtol=2e-2, atol=1e-5) if lean else tol), msg=f"{mode} {name} {key}")


def _full(per_rank: list[dict], name: str, shape) -> dict:
    """One weight's shards joined in rank order: its param, global chosen entries and per-entry state."""
    parts = [r[name] for r in per_rank]
    out = {"param": torch.cat([e["param"].reshape(-1) for e in parts]).view(shape)}
    if "indices" in parts[0]:
        out["indices"] = torch.cat([e["offset"] + e["indices"] for e in parts if "indices" in e])
    for key in parts[0]["state"]:
        if key != "step" and parts[0]["state"][key].dim() > 0 and key not in ("indices", "indices_low",
                                                                               "window_offsets"):
            out[key] = torch.cat([e["state"][key].reshape(-1) for e in parts if key in e["state"]])
    return out


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_mode_equals_one_process_selecting_per_row_block(ranks, mode):
    """Params, chosen entries and optimizer state equal one process on the global batch whose optimizer
    selects per block of rows (accumulation, several selection steps and the global-norm clip included)."""
    world, per_rank = ranks
    model, opt = _reference(world, CONFIGS[mode])
    _assert_equals_one_process([r[mode] for r in per_rank], mode, model, opt, mode in LEAN)


@pytest.mark.parametrize("mode", list(GLOBAL_CONFIGS))
def test_global_selection_equals_one_process(ranks, mode):
    """The default under FSDP2: params, chosen entries and optimizer state equal one process on the global
    batch (the whole weight's top-k), in every mode and rule, though all but one rank hold 0 entries of the
    middle weight."""
    world, per_rank = ranks
    model, opt = _global_reference(GLOBAL_CONFIGS[mode])
    # A shard's lean entries round from their positions in it, which the global k moves: as the lean deltas.
    _assert_equals_one_process([r[f"global-{mode}"] for r in per_rank], mode, model, opt, mode in LEAN,
                               lean_tol=dict(rtol=0, atol=5e-4))
    counts = [r[f"global-{mode}"]["2.weight"]["indices"].numel() for r in per_rank]
    if mode != "random":
        assert counts[0] == opt.indices_of(model[2].weight).numel() and not any(counts[1:]), counts


@pytest.mark.parametrize("case", list(TOP_K_CASES))
def test_sharded_top_k_equals_one_process_top_k_ties_included(ranks, case):
    """The ranks' parts, joined, are the whole vector's `top_k_positions`: ties to the lowest flat position
    across rank boundaries, NaN lowest, -0.0 equal to +0.0; a rank may take 0."""
    world, per_rank = ranks
    full, k = TOP_K_CASES[case]
    got = torch.cat([r["top-k"][case] for r in per_rank])
    assert torch.equal(got, top_k_positions(full, k)), (case, got)


def test_sharded_selection_bad_value_is_refused_and_nothing_changes():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="sharded_selection must be 'global' or 'per_shard', got 'rows'"):
        SparseAdamW(model.parameters(), sharded_selection="rows")
    with pytest.raises(ValueError, match="got None"):
        SparseAdamW.for_model(model, density=DENSITY, target_modules=["0"], sharded_selection=None)
    assert all(p.requires_grad for p in model.parameters())  # for_model froze nothing
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("mode, partner", [("hook-noclip", "update-in-backward"), ("plain-lean", "hook-lean")],
                         ids=["hook=update-in-backward", "plain-lean=hook-lean"])
def test_modes_that_promise_the_same_result_agree_on_every_rank(ranks, mode, partner):
    world, per_rank = ranks
    for rank, r in enumerate(per_rank):
        for name, entry in r[mode].items():
            other = r[partner][name]
            torch.testing.assert_close(entry["param"], other["param"], rtol=0, atol=0, msg=f"rank {rank} {name}")
            for key, value in entry["state"].items():
                torch.testing.assert_close(value, other["state"][key], rtol=0, atol=0, msg=f"rank {rank} {name} {key}")


@pytest.mark.parametrize("mode", [f"{prefix}{name}" for prefix in ("", "global-")
                                  for name in ("plain", "hook", "hook-lean", "sparse-backward")])
def test_delta_from_sharded_optimizer_equals_one_process(ranks, mode):
    """Every rank builds the same delta from its shards' entries, equal to one process's with the same selection."""
    world, per_rank = ranks
    base_mode = mode.removeprefix("global-")
    dead = mode != base_mode
    model, opt = _global_reference(CONFIGS[base_mode]) if dead else _reference(world, CONFIGS[base_mode])
    mode_is_lean = base_mode in LEAN
    want = _delta_dict(SparseDelta.from_optimizer(opt, model, base=_model(dead).state_dict() if mode_is_lean
                                                  else None))
    for rank, r in enumerate(per_rank):
        got = r[mode]["delta"]
        assert sorted(got["entries"]) == sorted(want["entries"])
        for name, (shape, dtype, idx, values) in want["entries"].items():
            g_shape, g_dtype, g_idx, g_values = got["entries"][name]
            assert (g_shape, g_dtype) == (shape, dtype) and g_idx.dtype == idx.dtype
            assert torch.equal(g_idx, idx), f"rank {rank} {name}"
            # Lean increments are differences of weights that drift by the moments' stochastic rounding.
            torch.testing.assert_close(g_values, values, **(dict(rtol=0, atol=5e-4) if mode_is_lean else
                                                            dict(rtol=1e-5, atol=1e-6)), msg=f"rank {rank} {name}")
        assert sorted(got["dense"]) == sorted(want["dense"])
        for name, t in want["dense"].items():
            torch.testing.assert_close(got["dense"][name], t, **(dict(rtol=1e-3, atol=1e-4) if mode_is_lean else
                                                                 dict(rtol=1e-5, atol=1e-6)))
        assert got["fingerprint"] == want["fingerprint"], f"rank {rank}"


@pytest.mark.parametrize("mode", [f"{prefix}{name}" for prefix in ("", "global-")
                                  for name in ("hook", "hook-lean", "sparse-backward-lean")])
def test_dcp_save_and_load_mid_run_resumes_identically(ranks, mode):
    """Per shard and globally (where ranks hold 0 entries of a weight)."""
    world, per_rank = ranks
    for rank, r in enumerate(per_rank):
        run = r[f"checkpoint-{mode}"]
        for name, entry in run["uninterrupted"].items():
            resumed = run["resumed"][name]
            assert torch.equal(entry["param"], resumed["param"]), f"rank {rank} {name}"
            assert sorted(entry["state"]) == sorted(resumed["state"])
            for key, value in entry["state"].items():
                assert torch.equal(value, resumed["state"][key]), f"rank {rank} {name} {key}"


@pytest.mark.parametrize("combination, expected", [
    ("sparse-backward-update-in-backward", "does not support update_in_backward=True"),
    ("for-model-sparse-backward-update-in-backward", "does not support update_in_backward=True"),
    ("update-in-backward-clip", "max_grad_norm with update_in_backward=True"),
    ("process-group", "FSDP2 already reduce-scatters"),
])
def test_refused_combinations_raise_before_any_weight_changes(ranks, combination, expected):
    world, per_rank = ranks
    for rank, r in enumerate(per_rank):
        result = r["refusals"][combination]
        assert result["error"] is not None and expected in result["error"], (rank, result)
        assert result["error"].startswith("ValueError"), result
        assert not result["changed"], f"rank {rank}: a weight moved"


@pytest.mark.parametrize("mode", [f"{prefix}{name}" for prefix in ("", "global-")
                                  for name in ("hook", "sparse-backward", "sparse-backward-lean")])
def test_sparse_backward_reduces_k_entries_a_weight_and_fsdp2_no_dense_weight_gradient(ranks, mode):
    """After selection FSDP2 reduce-scatters only the biases' dense gradients under the sparse backward; each
    weight's gradient crosses ranks as one reduce-scatter of world x (largest k of a shard) values a
    micro-batch (per shard the k of the largest shard; globally the most entries any rank holds, which the
    dead rows put all on the first rank). Hook mode, for contrast, lets FSDP2 reduce-scatter every dense
    gradient."""
    world, per_rank = ranks
    micro = CONFIGS[mode.removeprefix("global-")]["micro"]
    padded, widths = {}, []
    for name, p in _model().named_parameters():
        rows, per_row = p.shape[0], p.numel() // p.shape[0]
        padded[name] = -(-rows // world) * world * per_row  # FSDP2 pads dim 0 to a multiple of the world
        if name.endswith("weight"):  # the largest k of a shard: what the padded reduce-scatter carries a rank
            widths.append(max(r[mode][name]["indices"].numel() for r in per_rank if "indices" in r[mode][name]))
            if not mode.startswith("global-"):
                assert widths[-1] == max(max(1, entries_for(DENSITY, len(block) * per_row))
                                         for block in torch.arange(rows).chunk(world))
    biases = sum(n for name, n in padded.items() if name.endswith("bias"))
    weights = sum(n for name, n in padded.items() if name.endswith("weight"))
    for rank, r in enumerate(per_rank):
        log = r[f"{mode}-reduce-scatters"]
        dense = sum(n for kind, n in log if kind == "dense")
        sparse = sorted(n for kind, n in log if kind == "sparse")
        if mode.endswith("hook"):
            assert dense == micro * (biases + weights) and sparse == [], (rank, log)
        else:
            assert dense == micro * biases, (rank, log)
            assert sparse == sorted(world * width for width in widths * micro), (rank, log)
            # Entries chosen everywhere: the steps stopped checking for changed plans (a collective and a
            # host read each).
            assert r[f"{mode}-plans-final"] is True, rank


def test_global_selection_refuses_a_sharding_other_than_rows_and_per_shard_trains(ranks):
    world, per_rank = ranks
    for rank, r in enumerate(per_rank):
        refused = r["refusals"]["global-shard-dim-1"]
        assert refused["error"].startswith("ValueError") and "sharded_selection='per_shard'" in refused["error"]
        assert not refused["changed"], rank
        trained = r["refusals"]["per-shard-shard-dim-1"]
        assert trained["error"] is None and trained["changed"], (rank, trained)


def test_sparse_backward_follows_set_indices_after_refresh(ranks):
    """Entries changed mid-run by set_indices on every rank, then refresh_sparse_backward: the sparse backward
    reduces the new entries, as one process does with the same entries."""
    world, per_rank = ranks
    model = _model()
    opt = _optimizer(model, dict(compact_grads=True), True, RowBlockSparseAdamW, world=world)
    _set_indices_midway(model, opt, 0, 1, world)
    for name, p in model.named_parameters():
        got = _full([r["set-indices"] for r in per_rank], name, p.shape)
        torch.testing.assert_close(got["param"], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        if name.endswith("weight"):
            assert torch.equal(got["indices"], opt.indices_of(p).long()), name
            for key in ("exp_avg", "exp_avg_sq", "delta"):
                torch.testing.assert_close(got[key], opt.state[p][key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.parametrize("rule", ["per-shard", "global"])
def test_for_model_with_the_sparse_backward_and_lean_state_equals_one_process(ranks, rule):
    """docs/distributed.md's recipe (for_model after fully_shard, sparse backward, lean, clipping, accumulation),
    per shard against the row-block reference, globally against plain SparseAdamW."""
    world, per_rank = ranks
    model = _model(dead=rule == "global")
    opt = _for_model(model) if rule == "global" else _for_model(model, RowBlockSparseAdamW, world=world)
    _train(model, opt, 0, 1, STEPS, 2)
    for name, p in model.named_parameters():
        got = _full([r["for-model" if rule == "per-shard" else "global-for-model"] for r in per_rank], name, p.shape)
        # Lean moments round stochastically from each entry's index in its own shard: close, not equal (globally
        # the k moves those positions: as the lean deltas).
        tol = dict(rtol=1e-3, atol=1e-4) if rule == "per-shard" else dict(rtol=0, atol=5e-4)
        torch.testing.assert_close(got["param"], p.detach(), **tol, msg=name)
        if "indices_low" in opt.state.get(p, {}):
            assert torch.equal(got["indices"], opt.indices_of(p).long()), name
    assert sum("indices_low" in opt.state.get(p, {}) for p in model.parameters()) == 2  # 0.weight and 2.weight
