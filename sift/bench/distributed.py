"""`python -m sift.bench distributed`: FSDP2 (`fully_shard`) training steps of a small Llama on 2 CPU
processes (gloo), torch's AdamW against SparseAdamW in plain mode, in hook mode with the lean state, and
with the sparse backward and the lean state (each weight's gradient crosses ranks as k values).

Each decoder layer and the root are `fully_shard`ed (fp32 params, no mixed precision on the CPU); the
attention and MLP weights train (SparseAdamW: 5% of each, selected per shard), everything else is
frozen, as in the memory suite. Every step clips to a global norm of 1.0 (`max_grad_norm`; torch's
`clip_grad_norm_` for AdamW). Per mode and rank:

    sent/step   bytes each rank sends in one step's collectives, counted from the tensors handed to
                torch.distributed (patched while a step runs) under the ring model: all-gather and
                reduce-scatter send (w - 1) / w of the full buffer, all-reduce 2 (w - 1) / w
    gradients   of those, the reductions' bytes (reduce-scatter, all-reduce): the gradients' traffic
    compact     what this rank's chosen entries' gradients take as (index, fp32 value) pairs, k x 8 B
    step ms     median (p20, p80) of steps timed in interleaved rounds (mode A, B, C, A, B, C, ...),
                each step started after a barrier, the slower rank's time counted
                (DTensor ops, such as torch's `clip_grad_norm_` over DTensor gradients, run functional
                collectives this count misses: a few scalars a step)
    params      bytes of this rank's parameter shards (frozen ones included)
    grads       gradient bytes held when `step()` starts: dense shard `.grad`s, plus compact buffers
    optim       optimizer state bytes of this rank

The selection table times the selecting step itself, `sharded_selection="global"` (the default: the
whole weight's top-k by a threshold search across the ranks) against "per_shard" (each shard's own
top-k, no communication): fresh plain-mode optimizers on the same gradients, interleaved, the step's
collectives and bytes counted as above, and how the two choices differ (entries in common, the largest
rank's share of the entries, which sets the sparse backward's padded reduce-scatter).

A second table projects the per-rank figures to Llama-2-70B (fp32 sharded params, bf16 all-gathers,
fp32 reduce-scatters, attention and MLP weights trained at 5%) on 2 and 8 GPUs: see `project`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

from sift.bench._harness import markdown_table, save_results, summary

DENSITY = 0.05
MODES = ("FSDP2 + AdamW", "FSDP2 + SparseAdamW plain", "FSDP2 + SparseAdamW hook, lean",
         "FSDP2 + SparseAdamW sparse backward, lean")
COLUMNS = ("mode", "ranks", "sent/step/rank MiB", "gradients sent MiB", "compact grads MiB", "collectives/step",
           "step ms", "p20 ms", "p80 ms",
           "params/rank MiB", "grads/rank MiB", "optim/rank MiB", "sum/rank MiB")
SELECTION_COLUMNS = ("sharded_selection", "ranks", "collectives", "sent/rank KiB", "selecting step ms", "p20 ms",
                     "p80 ms", "entries", "common with per_shard", "largest rank's share")
SELECTION_RULES = ("global", "per_shard")
PROJECTED_COLUMNS = ("model", "mode", "GPUs", "sent/step/rank GiB", "params/rank GiB", "grads/rank GiB",
                     "optim/rank GiB", "sum/rank GiB")
MIB, GIB = 2**20, 2**30

SIZES = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, seq=128)
QUICK_SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, seq=16)
BATCH_PER_RANK = 2

# Llama-2-70B: 80 layers, hidden 8192, MLP 28672, 8 KV heads of 128, vocab 32000.
LLAMA2_70B = dict(layers=80, hidden=8192, intermediate=28672, kv=1024, vocab=32000)

_COLLECTIVES = {  # name -> (the full buffer's argument: position, name; factor of (w - 1) / w)
    "all_gather_single": (0, "output_tensor", 1.0), "all_gather_into_tensor": (0, "output_tensor", 1.0),
    "reduce_scatter_single": (1, "input", 1.0), "reduce_scatter_tensor": (1, "input", 1.0),
    "all_reduce": (0, "tensor", 2.0), "broadcast": (0, "tensor", 1.0),
}


class CollectiveCounter:
    """Patches torch.distributed's collectives to count, while `on`, the bytes this rank sends (ring model)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on = False
        self.bytes = 0.0
        self.reduced = 0.0  # of which reductions (reduce-scatter, all-reduce): the gradients' traffic
        self.calls = 0
        self._saved = {}
        for name, (position, argument, factor) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(original, position, argument, factor, name))

    def _wrap(self, original, position: int, argument: str, factor: float, name: str = ""):
        import torch.distributed as dist

        def counted(*args, **kwargs):
            if self.on:
                tensor = args[position] if len(args) > position else kwargs[argument]
                world = dist.get_world_size(kwargs.get("group"))
                sent = factor * (world - 1) / world * tensor.numel() * tensor.element_size()
                self.bytes += sent
                self.reduced += sent if name.startswith(("reduce_scatter", "all_reduce")) else 0.0
                self.calls += 1
            return original(*args, **kwargs)

        return counted

    def restore(self) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)


def _build(mode: str, sizes: dict[str, Any], world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sift.bench.memory import build_model
    from sift.optim import SparseAdamW

    torch.manual_seed(0)
    model = build_model(sizes, torch.device("cpu"), torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trained = [p for p in model.parameters() if p.requires_grad]
    if mode == "FSDP2 + AdamW":
        return model, torch.optim.AdamW(trained, lr=1e-4)
    lean = "lean" in mode
    opt = SparseAdamW(trained, lr=1e-4, density=DENSITY, max_grad_norm=1.0, compact_grads=lean,
                      state="lean" if lean else "exact")
    if "sparse backward" in mode:
        from sift.sparse_backward import enable_sparse_backward

        enable_sparse_backward(model, opt)
    return model, opt


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def _grad_bytes(model, opt) -> int:
    dense = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    return dense + int(opt.state_bytes()["compact_grad_bytes"]) if hasattr(opt, "state_bytes") else dense


def _optim_bytes(opt) -> int:
    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes()["state_bytes"])
    return _local_bytes(t for s in opt.state.values() for t in s.values())


def _compact_bytes(opt) -> int:
    """What the compact gradients of this rank's sparse weights would take as (index, fp32 value) pairs: k x 8 B."""
    from sift.optim.state import is_selected, num_entries

    return sum(8 * num_entries(st) for st in getattr(opt, "state", {}).values() if is_selected(st))


def _step(model, opt, batch: torch.Tensor, memory: dict | None = None) -> None:
    opt.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch).loss.backward()
    if memory is not None:
        memory["grads"] = _grad_bytes(model, opt)
    if isinstance(opt, torch.optim.AdamW):
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()


def _selection(model, batch: torch.Tensor, world: int, counter: CollectiveCounter, repeats: int) -> dict:
    """The selecting step of fresh plain-mode optimizers over one backward's gradients, per rule: its
    collectives, bytes sent and times, and this rank's chosen entries (global positions) of each weight."""
    import torch.distributed as dist

    from sift.optim import SparseAdamW
    from sift.optim.sharded import shard_offset

    trained = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch).loss.backward()
    grads = [p.grad for p in trained]
    out: dict[str, Any] = {rule: {"samples": []} for rule in SELECTION_RULES}
    saved = [p.detach().to_local().clone() for p in trained]
    for repeat in range(repeats + 1):
        for rule in SELECTION_RULES:
            opt = SparseAdamW(trained, lr=1e-4, density=DENSITY, max_grad_norm=1.0, sharded_selection=rule)
            for p, g in zip(trained, grads):
                p.grad = g  # the same gradients every time (the clip scales gathered copies, not .grad)
            dist.barrier()
            counter.on, counter.bytes, counter.calls = repeat == 0, 0.0, 0
            t0 = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([(time.perf_counter() - t0) * 1e3])
            counter.on = False
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat == 0:  # the first round warms up; its counts are the same every time
                out[rule].update(calls=counter.calls, sent=counter.bytes, entries=[
                    (opt.indices_of(p).long() + shard_offset(p)).tolist() for p in trained])
            else:
                out[rule]["samples"].append(float(elapsed))
            with torch.no_grad():
                for p, value in zip(trained, saved):
                    p.to_local().copy_(value)
    model.zero_grad(set_to_none=True)
    return out


def _worker(rank: int, world: int, init_file: str, out: str, quick: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        sizes = QUICK_SIZES if quick else SIZES
        gen = torch.Generator().manual_seed(rank)
        batch = torch.randint(0, sizes["vocab_size"], (BATCH_PER_RANK, sizes["seq"]), generator=gen)
        runs = {mode: _build(mode, sizes, world) for mode in MODES}
        counter = CollectiveCounter()
        rows = {}
        for mode, (model, opt) in runs.items():
            for _ in range(2):  # selection and the optimizers' allocations happen here
                _step(model, opt, batch)
            memory: dict[str, int] = {}
            counter.on, counter.bytes, counter.reduced, counter.calls = True, 0.0, 0.0, 0
            _step(model, opt, batch, memory)
            counter.on = False
            rows[mode] = {"sent": counter.bytes, "reduced": counter.reduced, "compact": _compact_bytes(opt),
                          "calls": counter.calls, "grads": memory["grads"],
                          "params": _local_bytes(model.parameters()), "optim": _optim_bytes(opt), "samples": []}
        selection_model, _ = _build("FSDP2 + AdamW", sizes, world)
        selection = _selection(selection_model, batch, world, counter, 2 if quick else 20)
        counter.restore()
        for _ in range(2 if quick else 30):
            for mode, (model, opt) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, opt, batch)
                elapsed = torch.tensor([(time.perf_counter() - t0) * 1e3])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step lasts as long as its slower rank
                rows[mode]["samples"].append(float(elapsed))
        rows["selection"] = selection
        per_rank = [None] * world
        dist.all_gather_object(per_rank, rows)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"ranks": per_rank, "sizes": sizes}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's threads can abort the interpreter's teardown after the work is done: leave at once.
    os._exit(0)


def project(model: dict[str, int], gpus: int, mode: str, density: float = DENSITY) -> dict[str, float]:
    """Per-GPU bytes of an FSDP2 step of a Llama with `model`'s sizes, trained on attention and MLP weights.

    FSDP2 with fp32 sharded params, bf16 all-gathers (MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)) and reshard after forward: each step all-gathers every param twice (forward,
    backward) and reduce-scatters the trained params' gradients in fp32; AdamW, plain and hook mode
    communicate the same (hook mode gathers after the reduce-scatter), the sparse backward reduce-scatters
    k fp32 values a weight instead (shards' k equal). Gradients held at the step: dense fp32 shard grads
    (AdamW, plain) or [k] fp32 compact buffers (hook: one layer's dense shard grad lives until its hook
    runs, counted too; sparse backward: one layer's [K] fp32 gradient before its reduce-scatter).
    Optimizer: AdamW 8 B per trained param, exact sparse 20 B per entry (fp32 weights keep a base), lean 6 B.
    """
    h, i, kv, layers = model["hidden"], model["intermediate"], model["kv"], model["layers"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    trained = layers * per_layer
    total = trained + 2 * model["vocab"] * h + (2 * layers + 1) * h
    share = (gpus - 1) / gpus
    sparse_backward = "sparse backward" in mode
    sent = 2 * share * total * 2 + share * trained * 4 * (density if sparse_backward else 1.0)
    grads = {"FSDP2 + AdamW": 4 * trained / gpus, "FSDP2 + SparseAdamW plain": 4 * trained / gpus,
             "FSDP2 + SparseAdamW hook, lean": 4 * density * trained / gpus + 4 * per_layer / gpus,
             "FSDP2 + SparseAdamW sparse backward, lean": 4 * density * trained / gpus + 4 * density * per_layer
             }[mode]
    optim = {"FSDP2 + AdamW": 8 * trained, "FSDP2 + SparseAdamW plain": 20 * density * trained,
             "FSDP2 + SparseAdamW hook, lean": 6 * density * trained,
             "FSDP2 + SparseAdamW sparse backward, lean": 6 * density * trained}[mode] / gpus
    params = 4 * total / gpus
    return {"sent": sent, "params": params, "grads": grads, "optim": optim, "sum": params + grads + optim}


def _selection_rows(ranks: list[dict], world: int) -> list[dict[str, Any]]:
    """The selection table's rows from every rank's `_selection` results."""
    chosen = {rule: [set().union(*(r["selection"][rule]["entries"][w] for r in ranks))
                     for w in range(len(ranks[0]["selection"][rule]["entries"]))] for rule in SELECTION_RULES}
    rows = []
    for rule in SELECTION_RULES:
        parts = [r["selection"][rule] for r in ranks]
        times = summary(parts[0]["samples"])
        per_rank = [sum(len(e) for e in part["entries"]) for part in parts]
        entries = sum(len(e) for e in chosen[rule])
        common = sum(len(a & b) for a, b in zip(chosen[rule], chosen["per_shard"]))
        rows.append({"sharded_selection": rule, "ranks": world, "collectives": max(p["calls"] for p in parts),
                     "sent/rank KiB": max(p["sent"] for p in parts) / 2**10, "selecting step ms": times["median_ms"],
                     "p20 ms": times["p20_ms"], "p80 ms": times["p80_ms"], "entries": entries,
                     "common with per_shard": f"{common / entries:.1%}",
                     "largest rank's share": f"{max(per_rank) / entries:.1%}"})
    return rows


def project_selection(model: dict[str, int], gpus: int, density: float = DENSITY) -> dict[str, float]:
    """What the global selection of a Llama's attention and MLP weights costs once, by the algorithm's counts
    (`sift.optim.selection`): per mesh, one all-reduce of a flag, then per chunk of weights (at most
    `SEARCH_BUDGET` elements of whole weights) one of the bounds, one per bisection round (32 for fp32 keys
    spanning the non-negative floats) and one of the [ranks, 2 x weights] tie table; int64 counts, the ring
    model's 2 (w - 1) / w for all-reduce. `passes`: the full reads of each rank's scores (min and max, the 8 rounds
    before the undecided keys are kept alone, that filter, the ties, the final pick); the later rounds read
    the undecided remainder only, not counted."""
    from sift.optim.selection import SEARCH_BUDGET

    h, i, kv, layers = model["hidden"], model["intermediate"], model["kv"], model["layers"]
    sizes = [h * h, h * kv, h * kv, h * h, h * i, h * i, i * h] * layers  # q k v o gate up down
    chunks, current = [], []
    for n in sizes:
        if current and sum(current) + n > SEARCH_BUDGET:
            chunks.append(current)
            current = []
        current.append(n)
    chunks.append(current)
    rounds = 32
    share = 2 * (gpus - 1) / gpus
    sent = share * (4 + 8 * sum(2 * len(c) + rounds * len(c) + gpus * 2 * len(c) for c in chunks))
    collectives, passes, scores = 1 + len(chunks) * (rounds + 2), 2 + 8 + 2 + 2 + 2, sum(sizes) / gpus
    # Assumed, not measured: a small NCCL all-reduce's latency, and an H200's memory bandwidth for the passes
    # over the fp32 scores.
    latency_s, bandwidth = 30e-6, 4e12
    return {"weights": len(sizes), "chunks": len(chunks), "collectives": collectives, "sent": sent, "passes": passes,
            "scores": scores, "density": density, "latency_s": collectives * latency_s,
            "read_s": passes * scores * 4 / bandwidth}


def run(quick: bool = False) -> str:
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), out, quick), nprocs=world, join=True)
        with open(out) as f:
            result = json.load(f)
    rows = []
    for mode in MODES:
        ranks = [r[mode] for r in result["ranks"]]
        times = summary(ranks[0]["samples"])
        row = {"mode": mode, "ranks": world,
               "sent/step/rank MiB": max(r["sent"] for r in ranks) / MIB,
               "gradients sent MiB": max(r["reduced"] for r in ranks) / MIB,
               "compact grads MiB": max(r["compact"] for r in ranks) / MIB,
               "collectives/step": max(r["calls"] for r in ranks),
               "step ms": times["median_ms"], "p20 ms": times["p20_ms"], "p80 ms": times["p80_ms"]}
        for key in ("params", "grads", "optim"):
            row[f"{key}/rank MiB"] = max(r[key] for r in ranks) / MIB
        row["sum/rank MiB"] = max(r["params"] + r["grads"] + r["optim"] for r in ranks) / MIB
        rows.append(row)
    sizes = result["sizes"]
    title = (f"FSDP2 on {world} CPU processes (gloo): Llama {sizes['num_hidden_layers']} layers, hidden "
             f"{sizes['hidden_size']}, seq {sizes['seq']}, batch {BATCH_PER_RANK} per rank, fp32, density "
             f"{DENSITY:.0%}, clip 1.0; largest rank shown")
    markdown = markdown_table(title, COLUMNS, rows)
    projected = []
    for gpus in (2, 8):
        for mode in MODES:
            figures = project(LLAMA2_70B, gpus, mode)
            projected.append({"model": "Llama-2-70B", "mode": mode, "GPUs": gpus,
                              **{f"{key}/rank GiB": figures[key if key != "sent/step" else "sent"] / GIB
                                 for key in ("sent/step", "params", "grads", "optim", "sum")}})
    selection_rows = _selection_rows(result["ranks"], world)
    markdown += "\n\n" + markdown_table(
        "The selecting step: sharded_selection global (the default) against per_shard, plain mode, clip 1.0",
        SELECTION_COLUMNS, selection_rows)
    markdown += "\n\n" + markdown_table("Projected (not measured): Llama-2-70B under FSDP2, see `project`",
                                        PROJECTED_COLUMNS, projected)
    selection_projected = project_selection(LLAMA2_70B, 8)
    markdown += ("\n\nProjected (not measured), the global selection of Llama-2-70B's attention and MLP weights at "
                 f"{DENSITY:.0%} on 8 GPUs, once per run: {selection_projected['collectives']} all-reduces "
                 f"({selection_projected['weights']} weights searched in {selection_projected['chunks']} chunks of "
                 f"at most 2**30 elements), {selection_projected['sent'] / 2**10:.0f} KiB sent per rank, "
                 f"{selection_projected['passes']} passes over each rank's "
                 f"{selection_projected['scores'] / 1e9:.2f} G scores: at an assumed 30 us an all-reduce and "
                 f"4 TB/s, about {selection_projected['latency_s']:.2f} s of latency and "
                 f"{selection_projected['read_s']:.2f} s of reads; see `project_selection`.")
    wire = next(row for row in rows if row["mode"].endswith("sparse backward, lean"))
    ratio = wire["gradients sent MiB"] / wire["compact grads MiB"] if wire["compact grads MiB"] else float("nan")
    markdown += ("\n\nGradients sent: the reductions' bytes (reduce-scatter, all-reduce; the rest is FSDP2's "
                 "all-gather of the parameters, the same in every mode). Compact grads: k x 8 B over this rank's "
                 f"chosen entries. Target, after selection the gradients on the wire at most 2x the compact "
                 f"gradients' size: the sparse backward sends {wire['gradients sent MiB']:.3f} MiB against "
                 f"{wire['compact grads MiB']:.3f} MiB, {ratio:.2f}x: {'met' if ratio <= 2 else 'MISSED'} "
                 f"(FSDP2 plain's dense reduce-scatter: {rows[1]['gradients sent MiB']:.3f} MiB).")
    base = rows[0]["step ms"]
    markdown += "\n\nStep time against FSDP2 + AdamW: " + ", ".join(
        f"{row['mode']} {row['step ms'] / base:.2f}x" for row in rows[1:]) + "."
    if hasattr(os, "getloadavg"):  # step times on a shared machine: how busy it was
        markdown += f" Load average over the run's last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    save_results("distributed", rows, markdown, extra={"projected": projected, "sizes": sizes,
                                                       "selection": selection_rows,
                                                       "selection_projected": selection_projected,
                                                       "samples_ms": {m: result["ranks"][0][m]["samples"]
                                                                      for m in MODES}}, quick=quick)
    return markdown


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
