"""The mode-by-route matrix: every memory mode on every weight source, schedule and process layout.

A cell is one value of each factor in `FACTORS`. It trains a small model (two target linears trained
sparsely, a dense head) for `STEPS` steps and either

- matches its reference: the same cell in plain mode (`memory="plain"`, same state layout) in one process
  on the global batch, under the promise docs/modes.md and docs/distributed.md make (bit for bit in one
  process without the sparse backward; `TOL` where a sum runs in another order), with the same entries; or
- is refused: an exception from the package, raised before any state changed (the model's tensors,
  `requires_grad` and the optimizer's `state_dict` equal what they were before the call that raised).

Under fp16 + GradScaler an inf is injected into one rank's loss (the second rank's half of the global
batch) on the selecting step, so the step is skipped on every rank and the selection stays pending (and on
a re-selecting cell's second re-selecting step, which is then skipped and never scored).

`covering_cells()` is a covering subset (every pair of factor values in at least one cell, found greedily,
deterministic); `all_cells()` is the full product.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn

import sift

FACTORS: dict[str, list] = {
    "memory": ["plain", "low", "lowest", "compact_grads", "lean", "update_in_backward"],
    "dtype": ["fp32", "bf16", "fp16+scaler", "nf4", "int8"],
    "accumulation": [1, 2],
    "select_steps": [1, 2],
    "clip": [False, True],
    "resume": ["none", "during-selection", "after-selection"],
    "route": ["one-process", "ddp", "process-group", "fsdp2"],
    "reselect": [False, True],
}
# A re-selecting cell replaces half of each weight's entries before every update after its first (a packed base
# cannot take a dropped entry's increment: quantized cells revert them).
RESELECT = dict(reselect_every=1, reselect_fraction=0.5)
# memory= presets, and the explicit flags on top of plain mode.
MEMORY_KWARGS = {
    "plain": dict(memory="plain"),
    "low": dict(memory="low"),
    "lowest": dict(memory="lowest"),
    "compact_grads": dict(memory="plain", compact_grads=True),
    "lean": dict(memory="plain", state="lean"),
    "update_in_backward": dict(memory="plain", update_in_backward=True),
}
STEPS, WORLD, BATCH = 4, 2, 8
MAX_NORM = 0.05
# The sparse backward (and the ranks' averaging) sums each entry's gradient in another order than one
# process's dense matmul: the documented tolerance. A bf16 weight's dense gradient is rounded to bf16 where the
# sparse backward keeps fp32, so each update may differ by lr * 2**-8 of Adam's unit step, and the weight by
# an ulp of its own: lr * STEPS * 2**-7 bounds both.
LR = 1e-2
TOL = {"fp32": dict(rtol=1e-5, atol=1e-6), "fp16+scaler": dict(rtol=1e-5, atol=1e-6),
       "nf4": dict(rtol=1e-5, atol=1e-6), "int8": dict(rtol=1e-5, atol=1e-6),
       "bf16": dict(rtol=2 ** -7, atol=LR * STEPS * 2 ** -7)}
# Lean moments round stochastically, so a lean run follows its plain-mode twin closely but not exactly.
LEAN_TOL = dict(rtol=1e-3, atol=5e-4)


@dataclass(frozen=True)
class Cell:
    memory: str
    dtype: str
    accumulation: int
    select_steps: int
    clip: bool
    resume: str
    route: str
    reselect: bool = False
    # Whether the head trains densely: not over a quantized base under FSDP2, where only the 4-bit deltas can
    # train (docs/distributed.md); not a factor of the matrix.
    head: bool | None = None

    def __post_init__(self):
        if self.head is None:
            object.__setattr__(self, "head", not (self.quantized and self.route == "fsdp2"))

    @property
    def quantized(self) -> bool:
        return self.dtype in ("nf4", "int8")

    @property
    def id(self) -> str:
        values = [str(v) for k, v in asdict(self).items() if k != "head"]
        return "-".join(values + ([] if self.head else ["no-head"]))

    def reference(self) -> Cell:
        """Plain mode in one process, no resume, with this cell's state layout (and head)."""
        layout = "lean" if self.lean else "plain"
        return Cell(layout, self.dtype, self.accumulation, self.select_steps, self.clip, "none", "one-process",
                    self.reselect, self.head)

    @property
    def lean(self) -> bool:
        return self.memory in ("lean", "lowest")


def all_cells() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*FACTORS.values())]


def covering_cells() -> list[Cell]:
    """A subset holding every pair of values of any two factors (greedy: each new cell covers the most
    uncovered pairs; ties to the first in product order, so the subset is the same on every run)."""
    names = list(FACTORS)
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
                 for a in range(len(FACTORS[names[i]])) for b in range(len(FACTORS[names[j]]))}
    product = list(itertools.product(*(range(len(v)) for v in FACTORS.values())))
    chosen = []
    while uncovered:
        best = max(product, key=lambda c: sum((i, c[i], j, c[j]) in uncovered
                                              for i, j in itertools.combinations(range(len(names)), 2)))
        uncovered -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(names)), 2)}
        chosen.append(Cell(*(FACTORS[n][v] for n, v in zip(names, best))))
    return chosen


# ------------------------------------------------------------------------------------------- the model

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(40, 24)
        self.fc2 = nn.Linear(24, 24)
        self.head = nn.Linear(24, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.head(torch.tanh(self.fc2(h)).to(self.head.weight.dtype))


def build_model(cell: Cell) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if cell.dtype == "bf16":
        model = model.to(torch.bfloat16)
    if cell.dtype in ("nf4", "int8"):
        import bitsandbytes as bnb

        for name in ("fc1", "fc2"):
            dense = getattr(model, name)
            layer = (bnb.nn.Linear8bitLt(dense.in_features, dense.out_features, has_fp16_weights=False)
                     if cell.dtype == "int8" else
                     bnb.nn.Linear4bit(dense.in_features, dense.out_features, compute_dtype=torch.float32,
                                       quant_type="nf4"))
            layer.load_state_dict(dense.state_dict())
            setattr(model, name, layer.to("cpu"))  # bitsandbytes quantizes on the move
    return model


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(BATCH, 40, generator=g), torch.randn(BATCH, 9, generator=g)


def injects_inf(cell: Cell, step: int) -> bool:
    """The selecting step of a GradScaler cell gets an inf in the second rank's half of the batch, and so does
    the second re-selecting step of a re-selecting one."""
    return cell.dtype == "fp16+scaler" and (step == cell.select_steps - 1
                                            or (cell.reselect and step == cell.select_steps + 1))


def resume_after(cell: Cell) -> int | None:
    """After how many steps the run is saved and resumed into a fresh model and optimizer."""
    if cell.resume == "none":
        return None
    # With select_steps 1 there is no step in the middle of a selection: resume after the first step.
    return max(1, cell.select_steps - 1) if cell.resume == "during-selection" else cell.select_steps + 1


# ------------------------------------------------------------------------------------------- one run

def _shard(cell: Cell, model: nn.Module, ignored: set | None = None) -> nn.Module:
    """FSDP2 shards each layer and the root: before the optimizer is built over a 16-bit model, after it over a
    quantized one, its deltas kept out (docs/distributed.md's two orders)."""
    if cell.route == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in (model.fc1, model.fc2, model.head):
            fully_shard(layer, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model


def _optimizer(cell: Cell, model: nn.Module, scaler) -> sift.SparseAdamW:
    kwargs = dict(MEMORY_KWARGS[cell.memory])
    if scaler is not None:  # the recipe of docs/modes.md: the scaler that scales the loss is linked
        kwargs["grad_scaler"] = scaler
    if cell.route == "process-group":
        import torch.distributed as dist

        kwargs["process_group"] = dist.group.WORLD
    if cell.reselect:
        # The lean state keeps no delta to rank: it re-selects by the gradient. So do quantized cells: their deltas
        # carry no weight decay, so entries grown one step earlier all moved by lr (Adam's first step) and tie on
        # |delta| to the last bits, which the ranks' averaging order changes (one process breaks such ties alike).
        kwargs.update(RESELECT, reselect_drop="revert" if cell.quantized else "merge",
                      reselect_rule="magnitude" if cell.lean or cell.quantized else "spiel")
    if not cell.head:
        model.head.requires_grad_(False)
    # SIFT's top-|grad|, whose scoring over select_steps, micro-batches and ranks the cells exercise (for_model's
    # default, a random mask, reads no gradient to choose).
    return sift.SparseAdamW.for_model(model, density=0.1, lr=LR, target_modules=["fc1", "fc2"],
                                      dense_modules=["head"] if cell.head else [], select_steps=cell.select_steps,
                                      selection="magnitude", **kwargs)


def _wrap(cell: Cell, model: nn.Module) -> nn.Module:
    """The module the loop calls: DDP wraps the model after `for_model`, as the recipe says."""
    return nn.parallel.DistributedDataParallel(model) if cell.route == "ddp" else model


def _prepare(cell: Cell):
    """(the module to call, the model, its optimizer, the scaler) as the docs' recipe for the route builds them;
    a refusal by `for_model` raises `Refused`."""
    scaler = _scaler(cell)
    if cell.quantized:
        from sift.optim.sharded import replicated_quantized_deltas

        model = build_model(cell)
        opt = _guarded(model, None, lambda: _optimizer(cell, model, scaler))
        if cell.route == "fsdp2":
            deltas = _guarded(model, opt, lambda: replicated_quantized_deltas(opt))
            _shard(cell, model, deltas)
    else:
        model = _shard(cell, build_model(cell))
        opt = _guarded(model, None, lambda: _optimizer(cell, model, scaler))
    return _wrap(cell, model), model, opt, scaler


def _snapshot(model: nn.Module, opt: sift.SparseAdamW | None) -> dict:
    """What a refusal must leave as it was."""
    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    snap = {"params": {n: (local(p), p.requires_grad) for n, p in model.named_parameters()},
            "buffers": {n: local(b) for n, b in model.named_buffers()}}
    if opt is not None:
        snap["optim"] = copy.deepcopy(opt.state_dict())
    return snap


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class Refused(Exception):
    """A cell refused by the package; `clean` says whether nothing had changed."""

    def __init__(self, message: str, clean: bool):
        super().__init__(message)
        self.clean = clean


def _guarded(model: nn.Module, opt, call):
    """Run `call()`; an exception becomes `Refused`, noting whether the state was left as it was."""
    before = _snapshot(model, opt)
    try:
        return call()
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        raise Refused(f"{type(error).__name__}: {error}", _same(before, _snapshot(model, opt))) from error


def _save(cell: Cell, model: nn.Module, opt, scaler, directory: str) -> dict:
    if cell.route == "fsdp2":
        import torch.distributed.checkpoint as dcp

        from sift.optim.sharded import ShardedOptimizerState

        dcp.save({"model": model.state_dict(), "optim": ShardedOptimizerState(opt)}, checkpoint_id=directory)
        return {"scaler": copy.deepcopy(scaler.state_dict()) if scaler is not None else None}
    # What a fine-tune keeps: the trained tensors (a 4-bit base is loaded again from the pretrained weights).
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"model": trained, "optim": copy.deepcopy(opt.state_dict()),
            "scaler": copy.deepcopy(scaler.state_dict()) if scaler is not None else None}


def _load(cell: Cell, saved: dict, directory: str):
    caller, model, opt, scaler = _prepare(cell)
    if cell.route == "fsdp2":
        import torch.distributed.checkpoint as dcp

        from sift.optim.sharded import ShardedOptimizerState

        dcp.load({"model": model.state_dict(), "optim": ShardedOptimizerState(opt)}, checkpoint_id=directory)
    else:
        missing = set(saved["model"]) - {n for n, _ in model.named_parameters()}
        assert not missing, f"the fresh model lacks the trained tensors {sorted(missing)}"
        model.load_state_dict(saved["model"], strict=False)
        _guarded(model, opt, lambda: opt.load_state_dict(saved["optim"]))
    if scaler is not None:
        scaler.load_state_dict(saved["scaler"])
    return caller, model, opt, scaler


def _scaler(cell: Cell):
    if cell.dtype != "fp16+scaler":
        return None
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)


def _one_step(cell: Cell, step: int, caller: nn.Module, model: nn.Module, opt, scaler, rank: int,
              world: int) -> None:
    for micro in range(cell.accumulation):
        x, y = batch(step, micro)
        halves = range(WORLD) if world == 1 else [rank]
        per = BATCH // WORLD

        def backward():
            # One forward over this process's samples; the loss is the mean of the ranks' half-batch means.
            rows = slice(0, BATCH) if world == 1 else slice(rank * per, (rank + 1) * per)
            inputs = x[rows].to(torch.bfloat16 if cell.dtype == "bf16" else torch.float32)
            out = caller(inputs).float()
            loss = 0.0
            for h in halves:
                lo = h * per - rows.start
                part = (out[lo:lo + per] - y[h * per:(h + 1) * per]).square().mean()
                if h == 1 and injects_inf(cell, step):
                    part = part * float("inf")
                loss = loss + part
            loss = loss / (len(halves) * cell.accumulation)
            (scaler.scale(loss) if scaler is not None else loss).backward()

        _guarded(model, opt, backward)
    if cell.clip:
        if scaler is not None:
            _guarded(model, opt, lambda: scaler.unscale_(opt))
        _guarded(model, opt, lambda: sift.clip_grad_norm_(opt, MAX_NORM))
    if scaler is not None:
        _guarded(model, opt, lambda: scaler.step(opt))
        scaler.update()
    else:
        _guarded(model, opt, opt.step)
    opt.zero_grad()


def _effective(model: nn.Module, name: str) -> torch.Tensor:
    """The weight a target layer computes with (a 4-bit or int8 layer: its dequantized base plus the delta)."""
    module = getattr(model, name)
    route = getattr(module, "_sift_quantized", None)
    if route is not None:
        if hasattr(module, "unshard"):  # FSDP2 holds the packed bytes sharded outside forward
            module.unshard()
        try:
            return route.weight(torch.float32, module.sift_delta.detach(), route.indices)
        finally:
            if hasattr(module, "reshard"):
                module.reshard()
    w = module.weight.detach()
    return (w.full_tensor() if hasattr(w, "full_tensor") else w).float().clone()


def _result(model: nn.Module, opt, scaler) -> dict:
    out = {name: _effective(model, name) for name in ("fc1", "fc2", "head")}
    for name in ("fc1", "fc2"):
        module = getattr(model, name)
        route = getattr(module, "_sift_quantized", None)
        p = module.weight
        if route is not None:
            out[f"{name}.entries"] = None if route.indices is None else route.indices.long().clone()
        elif not hasattr(p, "to_local"):
            state = opt.state.get(p, {})
            selected = "indices" in state or "indices_low" in state
            out[f"{name}.entries"] = opt.indices_of(p).long().clone() if selected else None
    if scaler is not None:
        out["scale"] = float(scaler.get_scale())
    return out


def run_cell(cell: Cell, rank: int = 0, world: int = 1, directory: str = "") -> dict:
    """Train `cell` and return {"result": ...} or {"refused": message, "clean": bool}."""
    step = -1  # a refusal by for_model
    try:
        caller, model, opt, scaler = _prepare(cell)
        resume = resume_after(cell)
        for step in range(STEPS):
            if step == resume:
                path = os.path.join(directory, f"{cell.id}-checkpoint")
                saved = _save(cell, model, opt, scaler, path)
                opt.remove_hooks() if hasattr(opt, "remove_hooks") else None
                caller, model, opt, scaler = _load(cell, saved, path)
            _one_step(cell, step, caller, model, opt, scaler, rank, world)
    except Refused as refused:
        return {"refused": str(refused), "clean": refused.clean, "step": step}
    return {"result": _result(model, opt, scaler)}


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    return len(set(a.tolist()) & set(b.tolist())) / max(1, b.numel())


def compare(cell: Cell, got: dict, want: dict) -> list[str]:
    """The differences between a cell's result and its reference's, as readable lines (none: it matches)."""
    if cell.dtype == "bf16" and cell.route != "one-process":
        return _compare_bf16_ranks(got, want)
    problems = []
    exact = (cell.route == "one-process" and cell.memory in ("plain", "compact_grads", "lean")
             and cell.dtype != "bf16")
    tol = TOL[cell.dtype]
    # The lean moments' stochastic rounding follows the gradient's last bits, which another mode or the ranks'
    # averaging change: the looser of the two tolerances, entry by entry.
    if cell.lean and (cell.memory != cell.reference().memory or cell.route != "one-process"):
        tol = {key: max(LEAN_TOL[key], tol[key]) for key in tol}
    for key, value in want.items():
        mine = got.get(key)
        if key.endswith(".entries") or key == "scale":
            if not _same(mine, value) and not (key.endswith(".entries") and mine is None and cell.route == "fsdp2"):
                problems.append(f"{key} differs")
            continue
        if exact and cell.memory == cell.reference().memory:
            same = torch.equal(mine, value)
        else:
            same = torch.allclose(mine, value, **tol)
        if not same:
            diff = (mine - value).abs().max().item()
            problems.append(f"{key}: max difference {diff:.3g}")
    return problems


def _compare_bf16_ranks(got: dict, want: dict) -> list[str]:
    """bf16 gradients are averaged across ranks in bf16 (DDP, the process group, FSDP2's reduce-scatter), so the
    gradient differs from one process's by its rounding: entries whose scores lie within it may swap, and an
    entry whose gradient is near 0 may take Adam's unit step the other way. The promise: at least 90% of the
    entries in common, and the weights within one Adam step a step (`LR * STEPS`) of the reference, on average
    within a tenth of one."""
    problems = []
    for key, value in want.items():
        mine = got.get(key)
        if key.endswith(".entries"):
            if mine is not None and _overlap(mine, value) < 0.9:
                problems.append(f"{key}: only {_overlap(mine, value):.0%} in common")
        elif key != "scale":
            diff = (mine - value).abs()
            if diff.max() > LR * STEPS or diff.mean() > LR / 10:
                problems.append(f"{key}: max difference {diff.max():.3g}, mean {diff.mean():.3g}")
    return problems


def ranks_agree(outcomes: list[dict]) -> list[str]:
    """Replicas (DDP, a process group) and FSDP2's gathered weights must be the same on every rank, bit for bit."""
    results = [o.get("result") for o in outcomes]
    if any(r is None for r in results):
        return []
    return [f"{key} differs between ranks" for key in results[0] if not _same(results[0][key], results[1][key])]


def gloo_cells(rank: int, world: int, init_file: str, cells: list[Cell], directory: str, out: str) -> None:
    """One rank of a 2-process gloo job running `cells` in order; saves {cell id: outcome} to `out.<rank>`."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    outcomes = {}
    try:
        for cell in cells:
            try:
                outcomes[cell.id] = run_cell(cell, rank, world, directory)
            except Exception as error:  # noqa: BLE001 - reported as the cell's failure, not a refusal
                outcomes[cell.id] = {"error": f"{type(error).__name__}: {error}"}
            # Saved after each cell: a collective mismatch aborts the process, and the parent then knows which.
            torch.save(outcomes, f"{out}.{rank}")
            dist.barrier()
    finally:
        dist.destroy_process_group()
    # What gloo leaves behind can abort the interpreter's teardown: leave at once (conftest.spawned_rank).
    os._exit(0)
