"""Fixed selection vs periodic re-selection (drop and grow) on `python -m sift.bench llm`'s chat benchmark:
SmolLM2-135M-Instruct answering NRC word emotions, sift's 1% of q/k/v/o, three configurations side by side.

    python bench/reselection_llm.py [--quick] [--every 8] [--seeds 0 1 2] [--memory plain|low]

Configurations (all `SparseAdamW.for_model(model, density=0.01, lr=<sift-1%'s lr>, memory=<--memory>)`, so the
same number of trainable entries): fixed selection (SIFT); re-selection every `--every` updates of 20% of each
weight's entries, SpIEL's rules (drop the least-moved, grow the largest |grad|), the dropped increments merged
into the weight; the same with the dropped entries reverted to their value at selection.

Runs go seed-major (every configuration's seed 0, then seed 1, ...), each in its own process, so its peak RSS
growth is its own and the shared machine's drifting load falls on every configuration alike. Words, order,
steps, batch, learning rate and its linear decay are `sift.bench.llm`'s. A step counts as re-selecting when it
changed some weight's chosen entries (checked against a copy of the indices, outside the timed region).
`--memory low` (the default preset: hook and sparse backward, dense gradients only on re-selecting steps) writes
`reselection-llm-low-cpu`, "plain" (dense gradients every step) `reselection-llm-cpu`, each `[-quick].{md,json}`
in `bench/results/`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from sift.bench import llm
from sift.bench._harness import header_lines, reset_peak_rss, results_dir, rss_kib
from sift.env import machine_header


def configurations(every: int) -> list[dict[str, Any]]:
    """The compared configurations: a name and the re-selection arguments given to `for_model`."""
    spiel = {"reselect_every": every, "reselect_fraction": 0.2, "reselect_schedule": "constant",
             "reselect_rule": "spiel"}
    return [
        {"name": "fixed (SIFT)", "kwargs": {}},
        {"name": f"re-select every {every}, 20%, spiel, merge", "kwargs": {**spiel, "reselect_drop": "merge"}},
        {"name": f"re-select every {every}, 20%, spiel, revert", "kwargs": {**spiel, "reselect_drop": "revert"}},
    ]


def _indices(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s["indices"].clone() for s in opt.state.values() if "indices" in s]


def _retired(opt: torch.optim.Optimizer) -> int:
    return sum(int(s["retired_indices"].numel()) for s in opt.state.values() if "retired_indices" in s)


def train_once(config: dict[str, Any], folder: str, run: llm.Config, seed: int, train: list, test: list,
               memory: str = "plain") -> dict[str, Any]:
    """One configuration and seed, as `sift.bench.llm.train_once` trains sift-1%, with every step's time kept."""
    import sift
    from sift.demo.llm import load_smollm2

    if run.threads:
        torch.set_num_threads(run.threads)
    load_start = os.getloadavg()[0]
    model, tokenizer = load_smollm2(folder)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    reset = reset_peak_rss()
    loaded_kib = rss_kib("VmRSS")
    model.train()
    opt = sift.SparseAdamW.for_model(model, density=llm.DENSITY, lr=llm.METHODS["sift-1%"].lr,
                                     selection="magnitude", seed=seed, memory=memory, **config["kwargs"])
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    examples = [llm.encode_example(tokenizer, *train[i]) for i in order[:run.steps * run.batch_size]]
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / run.steps)
    step_s, reselected, losses, before = [], [], [], None
    for step in range(run.steps):
        start = time.perf_counter()
        loss, _ = llm.batch_loss(model, examples[step * run.batch_size:(step + 1) * run.batch_size], pad_id)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        step_s.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        after = _indices(opt)
        reselected.append(before is not None and any(not torch.equal(a, b) for a, b in zip(before, after)))
        before = after
    accuracy, answers = llm.evaluate(model, tokenizer, test, run.max_new_tokens)
    peak_kib = rss_kib("VmHWM") if reset else None  # read where sift.bench.llm reads it, before saving
    with tempfile.TemporaryDirectory() as tmp:
        file_bytes = llm.save_fine_tune("sift-1%", model, opt, os.path.join(tmp, "fine-tune"))
    return {"name": config["name"], "kwargs": config["kwargs"], "memory": memory, "seed": seed, "accuracy": accuracy,
            "sample_answers": answers[:5], "step_s": step_s, "reselected": reselected,
            "train_loss_last5": statistics.fmean(losses[-5:]),
            "trainable": llm.trainable_entries(model, opt), "retired": _retired(opt), "file_bytes": file_bytes,
            "peak_rss_growth_mib": (peak_kib - loaded_kib) / 1024 if peak_kib and loaded_kib else None,
            "load_1min": [load_start, os.getloadavg()[0]], "pid": os.getpid()}


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration (in first-seen order): accuracy per seed, mean and std; step-time medians
    over every seed's steps pooled, re-selecting and other steps apart (the first, selecting step left out);
    peak RSS growth's median over seeds; the load averages seen."""
    rows = []
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        acc = [r["accuracy"] for r in mine]
        resel = [t for r in mine for t, flag in zip(r["step_s"][1:], r["reselected"][1:]) if flag]
        other = [t for r in mine for t, flag in zip(r["step_s"][1:], r["reselected"][1:]) if not flag]
        growth = [r["peak_rss_growth_mib"] for r in mine if r["peak_rss_growth_mib"] is not None]
        rows.append({
            "name": name, "kwargs": mine[0]["kwargs"], "seeds": [r["seed"] for r in mine], "accuracies": acc,
            "accuracy_mean": statistics.fmean(acc), "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "reselect_step_s": statistics.median(resel) if resel else None,
            "other_step_s": statistics.median(other) if other else None,
            "reselections_per_run": [sum(r["reselected"]) for r in mine],
            "peak_rss_growth_mib": statistics.median(growth) if growth else None,
            "trainable": sorted({r["trainable"] for r in mine}), "retired": [r["retired"] for r in mine],
            "file_bytes": statistics.median(r["file_bytes"] for r in mine),
            "load_1min": [r["load_1min"] for r in mine],
        })
    return rows


def markdown(rows: Sequence[dict[str, Any]], run: llm.Config, every: int, command: str, wall_s: float,
             memory: str = "plain") -> str:
    """The table headed by the machine and the command, with a note on each column."""
    loads = [v for r in rows for pair in r["load_1min"] for v in pair]
    title = (f"### Fixed selection vs re-selection, NRC word emotions as chat, SmolLM2-135M-Instruct (fp32), CPU: "
             f"{run.steps} steps of {run.batch_size} words, {run.test_words} held-out words, torch threads "
             f"{run.threads or 'default'}, memory=\"{memory}\"")
    load = (f"Command: `{command}`; wall time {wall_s:.0f} s. Load average (1 min) at each run's start and end: "
            f"mean {statistics.fmean(loads):.1f}, min {min(loads):.1f}, max {max(loads):.1f}.")
    head = ("| selection | exact match % per seed | mean ± std | re-selections per run | s/step re-selecting "
            "(median) | s/step other (median) | peak RSS growth MiB | trainable entries | retired entries "
            "| saved bytes | load 1 min (start, end) per seed |")
    lines = [title, "", *header_lines(), load, "", head, "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    for r in rows:
        lines.append(
            f"| {r['name']} | {' / '.join(f'{100 * a:.0f}' for a in r['accuracies'])} | "
            f"{100 * r['accuracy_mean']:.1f} ± {100 * r['accuracy_std']:.1f} | "
            f"{', '.join(map(str, r['reselections_per_run']))} | {cell(r['reselect_step_s'], '.2f')} | "
            f"{cell(r['other_step_s'], '.2f')} | {cell(r['peak_rss_growth_mib'], '.0f')} | "
            f"{', '.join(f'{t:,}' for t in r['trainable'])} | {', '.join(f'{n:,}' for n in r['retired'])} | "
            f"{r['file_bytes']:,.0f} | {'; '.join(f'{a:.1f}, {b:.1f}' for a, b in r['load_1min'])} |")
    fixed = rows[0]
    diffs = [f"{r['name']}: {100 * (r['accuracy_mean'] - fixed['accuracy_mean']):+.1f} points (per seed "
             + ", ".join(f"{100 * (a - b):+.0f}" for a, b in zip(r["accuracies"], fixed["accuracies"])) + ")"
             for r in rows[1:]]
    note = (
        f"All three: `SparseAdamW.for_model(model, density={llm.DENSITY}, lr={llm.METHODS['sift-1%'].lr:g}, "
        f"memory=\"{memory}\")` on `for_model`'s Llama targets (every layer's q/k/v/o, as sift-1% in "
        f"`llm-cpu.md`), linear learning-rate decay; re-selection replaces 20% of each weight's entries "
        f"(`reselect_fraction=0.2`, constant) before the weight's updates {every} + 1, 2 x {every} + 1, ..., "
        f"so {run.steps} steps allow {max(0, (run.steps - 1) // every)} re-selections. Exact match: the set of "
        f"emotions in the greedy answer equals the lexicon's set; one word is {100 / max(1, run.test_words):.0f} "
        "point(s). Step time: forward, backward, `step()`, zero_grad and the scheduler, one step; medians over "
        "the steps of every seed pooled, the first (selecting) step left out; a step is re-selecting when it "
        "changed some weight's chosen entries. Peak RSS growth: each run's own process, peak resident set "
        "(VmHWM reset after loading) minus the resident set after loading, over training and generation "
        "(read where `sift.bench.llm` reads it); median over seeds. Trainable entries: active entries "
        "(`state_bytes()`), the same budget in every row. Retired entries: per seed, dropped entries whose "
        "increment stays in the weight and in the delta file (\"merge\"); \"revert\" writes them back and keeps "
        "none. Saved bytes: `SparseDelta.save_pretrained` of the fine-tune (median over seeds).")
    lines += ["", f"Against fixed selection (mean; per seed, same words and order): {'; '.join(diffs)}.", "", note]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps of 2 words, 6 test words, seed 0, "
                        "re-selecting every update (a smoke run of every path)")
    parser.add_argument("--every", type=int, default=None, help="re-select every N updates (default 8; quick 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--memory", choices=("plain", "low"), default="plain",
                        help="for_model's memory preset for every configuration (default plain)")
    args = parser.parse_args()
    run = llm.QUICK if args.quick else llm.FULL
    if args.seeds:
        run = llm.Config(**{**run.__dict__, "seeds": tuple(args.seeds)})
    every = args.every or (1 if args.quick else 8)
    command = " ".join(["python", *sys.argv])
    from sift.demo.llm import smollm2_dir

    folder = smollm2_dir()
    train, test = llm.load_words(test_words=run.test_words, evoking_only=run.evoking_only)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["sift", "transformers", "sift.bench.llm"])
    start = time.perf_counter()
    runs = []
    for seed in run.seeds:
        for config in configurations(every):
            # One process per run: a second run in a process reuses the heap the first freed (RSS reads low).
            with context.Pool(1) as pool:
                runs.append(pool.apply(train_once, (config, folder, run, seed, train, test, args.memory)))
            r = runs[-1]
            print(f"{r['name']}, seed {seed}: accuracy {r['accuracy']:.2f}, re-selecting steps "
                  f"{[i for i, f in enumerate(r['reselected']) if f]}, median step {statistics.median(r['step_s']):.2f} s",
                  flush=True)
    rows = aggregate(runs)
    table = markdown(rows, run, every, command, time.perf_counter() - start, args.memory)
    name = "reselection-llm-cpu" if args.memory == "plain" else f"reselection-llm-{args.memory}-cpu"
    stem = os.path.join(results_dir(), name + ("-quick" if args.quick else ""))
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine_header(), "command": command, "memory": args.memory, "rows": rows, "runs": runs},
                  f, indent=1)
    print(table)
    print(f"saved {stem}.md and .json")


if __name__ == "__main__":
    main()
