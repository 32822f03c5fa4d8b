"""The chat-model board's report: validity checks, tables, target verdicts and plots, read from the run files."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from sift.bench._harness import header_lines
from sift.bench.chat_board import (
    METHODS,
    TASKS,
    Config,
    best_constant,
    best_of,
    grid_state,
    load_runs,
    run_key,
)
from sift.env import machine_header


def _summary(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def rows(runs: Sequence[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """One row per (task, method) at its best learning rate: test and forgetting over the seeds run there.

    A method whose grid is not complete yet gets a row at the best rate run so far, marked `partial`.
    """
    out = []
    for task in TASKS:
        for method in METHODS:
            steps = 0 if METHODS[method].kind == "zero-shot" else config.steps_for(task)
            tried, todo = grid_state(runs, task, method, steps)
            if not tried:
                continue
            lr, partial = best_of(tried), bool(todo)
            mine = [r for r in runs if run_key(r)[:3] == (task, method, lr) and run_key(r)[4] == steps]
            if not mine:
                continue
            last = [r["train_info"]["metrics"][-1] for r in mine]
            other = next(t for t in TASKS if t != task)
            exact = [m["test exact"] for m in last]
            out.append({
                "task": task, "method": method, "lr": lr, "partial": partial, "seeds": sorted(run_key(r)[3] for r in mine),
                "test_exact": exact, "test_exact_mean": _summary(exact)[0], "test_exact_std": _summary(exact)[1],
                "val_exact": [m["val exact"] for m in last], "test_choice": [m["test choice"] for m in last],
                "other_choice": [m[f"{other} test choice"] for m in last], "chat_kl": [m["chat kl"] for m in last],
                "curve": [r["train_info"]["metrics"] for r in mine if run_key(r)[3] == 0][:1],
                "grid": tried,
                "trainable": mine[0]["train_info"]["num_trainable_params"],
                "file_bytes": mine[0]["train_info"]["file_size"],
                "step_s": statistics.median(m["step time median"] for m in last) if steps else None,
                "peak_rss_growth_mib": statistics.median((r["train_info"]["peak_rss_growth_bytes"] or 0) / 2**20
                                                         for r in mine),
            })
    return out


def markdown(table_rows: Sequence[dict[str, Any]], config: Config, timing: dict[str, Any] | None,
             earlier: Sequence[str] = ()) -> str:
    """The board: validity checks, then per task the methods at their best rate, then the mean over tasks."""
    base = {r["task"]: r for r in table_rows if r["method"] == "zero-shot"}
    lines = [f"### Chat-model board: SmolLM2-135M-Instruct (fp32), CPU, {config.describe_steps()} of {config.batch_size}, "
             f"{config.test_items} test / {config.val_items} validation items per task", "", *header_lines(), ""]
    lines += ["#### Validity", ""] + [f"- {v}" for v in validity(table_rows, config)] + [""]
    for task in TASKS:
        mine = [r for r in table_rows if r["task"] == task]
        if not mine:
            continue
        constant, share = best_constant(TASKS[task].splits(config.test_items, config.val_items)["test"])
        lines += [f"#### {task}: {TASKS[task].source}", "",
                  "| method | test exact % (mean ± std) | seeds | best lr (val exact % per lr) | trainable | "
                  f"{task} choice % | other task choice % (base → after) | chat KL (mean) | saved bytes |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            zero = base.get(task)
            grid = ", ".join(f"{lr:g}: {100 * v:.1f}" for lr, v in sorted(r["grid"].items()))
            before = statistics.fmean(zero["other_choice"]) if zero else float("nan")
            lines.append(
                f"| {r['method']}{' (default)' if r['method'] == default_method() else ''}"
                f"{' (grid incomplete)' if r.get('partial') else ''} | "
                f"{100 * r['test_exact_mean']:.1f} ± {100 * r['test_exact_std']:.1f} | {len(r['seeds'])} | "
                f"{r['lr']:g} ({grid}) | {r['trainable']:,} | {100 * statistics.fmean(r['test_choice']):.1f} | "
                f"{100 * before:.1f} → {100 * statistics.fmean(r['other_choice']):.1f} | "
                f"{statistics.fmean(r['chat_kl']):.4f} | {r['file_bytes']:,} |")
        lines += [f"| constant \"{constant}\" | {100 * share:.1f} | - | - | 0 | - | - | - | - |", "",
                  "Validation exact match % during training (seed 0 at the row's rate; the last point on all "
                  "validation items, the others on the first 100):", ""]
        lines += [f"- {r['method']}: " + ", ".join(f"step {m['step']}: {100 * m['val exact']:.0f}" for m in r["curve"][0])
                  for r in mine if r["curve"] and r["method"] != "zero-shot"] + [""]
    lines += verdicts(table_rows)
    if earlier:
        lines += ["", *earlier]
    if timing:
        lines += ["", timing["markdown"]]
    return "\n".join(lines)


def default_method() -> str:
    """The board row `SparseAdamW.for_model`'s defaults train (attention projections of Llama at 1%, by its
    default rule)."""
    from sift.targets import DEFAULT_SELECTION

    return {"random": "sparta 1%", "magnitude": "sift attn 1%"}[DEFAULT_SELECTION]


def validity(table_rows: Sequence[dict[str, Any]], config: Config) -> list[str]:
    """The board's own checks, each passed or not, with its figures."""
    out = []
    for task in TASKS:
        mine = {r["method"]: r for r in table_rows if r["task"] == task}
        trained = [r for r in mine.values() if r["method"] != "zero-shot"]
        if not trained:
            out.append(f"{task}: no trained method yet")
            continue
        best = max(trained, key=lambda r: r["test_exact_mean"])
        _, share = best_constant(TASKS[task].splits(config.test_items, config.val_items)["test"])
        zero = mine.get("zero-shot")
        top = 100 * best["test_exact_mean"]
        out.append(f"{task}: best trained ({best['method']}) {top:.1f}% vs constant {100 * share:.1f}% "
                   f"({top - 100 * share:+.1f} points; needs >= 15): {'pass' if top - 100 * share >= 15 else 'FAIL'}")
        if zero:
            z = 100 * zero["test_exact_mean"]
            out.append(f"{task}: best trained {top:.1f}% vs zero-shot {z:.1f}% ({top - z:+.1f} points; needs >= 15): "
                       f"{'pass' if top - z >= 15 else 'FAIL'}")
        full = mine.get("full")
        if full and full["curve"]:
            points = [(m["step"], m["val exact"]) for m in full["curve"][0]]
            (s1, a1), (s2, a2) = points[-2], points[-1]
            out.append(f"{task}: full fine-tuning's validation curve {', '.join(f'{s}: {100 * a:.1f}' for s, a in points)}"
                       f" ({100 * (a2 - a1):+.1f} points over the last {s2 - s1} steps)")
        for r in trained:
            if not r.get("partial") and len(r["grid"]) > 1 and r["lr"] in (min(r["grid"]), max(r["grid"])):
                out.append(f"{task}: {r['method']}'s best rate {r['lr']:g} is at the grid's edge after its extensions")
    return out


def verdicts(table_rows: Sequence[dict[str, Any]]) -> list[str]:
    """The targets, on the mean over tasks (only where every task has the rows), gaps against seed spread."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in (r for r in table_rows if not r.get("partial")):  # a verdict waits for the whole grid
        by.setdefault(r["method"], []).append(r)
    complete = {m: rs for m, rs in by.items() if len(rs) == len(TASKS)}

    def mean(m: str, key: str) -> float:
        return statistics.fmean(statistics.fmean(r[key]) for r in complete[m])

    def spread(m: str) -> float:
        return statistics.fmean(r["test_exact_std"] for r in complete[m])
    lines = ["#### Mean over the tasks (methods with every task run)", "",
             "| method | test exact % | seed std (mean over tasks) | other task choice % | chat KL | seeds |",
             "|---|---|---|---|---|---|"]
    for m in complete:
        lines.append(f"| {m} | {100 * mean(m, 'test_exact'):.1f} | {100 * spread(m):.1f} | "
                     f"{100 * mean(m, 'other_choice'):.1f} | {mean(m, 'chat_kl'):.4f} | "
                     f"{min(len(r['seeds']) for r in complete[m])} |")
    sift = default_method()
    lines += ["", "Targets (sift at the defaults):", ""]
    for ref, margin, what in (("lora matched", 2.0, ">= LoRA at the matched count + 2"),
                              ("lora r16 all", 0.0, ">= LoRA r=16 all-linear"), ("full", -1.0, "within 1 of full")):
        if sift not in complete or ref not in complete:
            lines.append(f"- accuracy {what}: not measured yet")
            continue
        a, b = 100 * mean(sift, "test_exact"), 100 * mean(ref, "test_exact")
        noise = 100 * max(spread(sift), spread(ref))
        ok = a >= b + margin
        lines.append(f"- accuracy {what}: {a:.1f} vs {b:.1f} ({a - b:+.1f} points): {'met' if ok else 'NOT met'}"
                     + (" (gap within the seed spread: within noise)" if abs(a - b) <= noise else ""))
    for ref in ("lora matched", "full"):
        if sift in complete and ref in complete:
            a, b = mean(sift, "chat_kl"), mean(ref, "chat_kl")
            lines.append(f"- chat KL <= {ref}'s: {a:.4f} vs {b:.4f}: {'met' if a <= b else 'NOT met'}")
            a, b = 100 * mean(sift, "other_choice"), 100 * mean(ref, "other_choice")
            lines.append(f"- other-task choice accuracy >= {ref}'s: {a:.1f} vs {b:.1f}: {'met' if a >= b else 'NOT met'}")
    return lines


def earlier_budget(runs: Sequence[dict[str, Any]], config: Config) -> list[str]:
    """The rows of tasks whose length was raised (`Config.task_steps`) at the board's shorter length: kept for
    reference, ranked by nothing (their full fine-tuning had not stopped improving)."""
    short = rows(runs, dataclasses.replace(config, task_steps=()))
    lines = []
    for task, steps in config.task_steps:
        mine = [r for r in short if r["task"] == task and r["method"] != "zero-shot"]
        if not mine or steps == config.steps:
            continue
        lines += [f"#### {task} at {config.steps} steps (too short: full fine-tuning was still improving; for "
                  "reference only)", "", "| method | test exact % (mean ± std) | seeds | best lr | chat KL (mean) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['method']}{' (default)' if r['method'] == default_method() else ''}"
                  f"{' (grid incomplete)' if r.get('partial') else ''} | "
                  f"{100 * r['test_exact_mean']:.1f} ± {100 * r['test_exact_std']:.1f} | {len(r['seeds'])} | "
                  f"{r['lr']:g} | {statistics.fmean(r['chat_kl']):.4f} |" for r in mine] + [""]
    return lines


def plot(table_rows: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]], stem: str) -> list[str]:
    """`<stem>-forgetting.png` (learning against forgetting, a point per method and seed) and
    `<stem>-curves.png` (validation exact match against steps, seed 0 at the best rate); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def forgetting(ax: Any, task: str) -> None:
        for i, r in enumerate(x for x in table_rows if x["task"] == task):
            ax.scatter(r["chat_kl"], [100 * v for v in r["test_exact"]], marker="osD^v<>PX*h"[i % 11], label=r["method"])
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlabel("forgetting: mean KL(base || tuned) on general chat prompts")
        ax.set_ylabel(f"learning: {task} test exact match (%)")

    def curves(ax: Any, task: str) -> None:
        for r in (x for x in table_rows if x["task"] == task and x["curve"]):
            points = [(m["step"], 100 * m["val exact"]) for m in r["curve"][0]]
            ax.plot(*zip(*points), marker="o", label=f"{r['method']} (lr {r['lr']:g})")
        ax.set_xlabel("step")
        ax.set_ylabel("validation exact match (%)")

    paths = []
    for suffix, draw in (("-forgetting.png", forgetting), ("-curves.png", curves)):
        fig, axes = plt.subplots(1, len(TASKS), figsize=(6 * len(TASKS), 4.5), squeeze=False)
        for ax, task in zip(axes[0], TASKS):
            draw(ax, task)
            ax.set_title(task)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(stem + suffix, dpi=110)
        plt.close(fig)
        paths.append(stem + suffix)
    return paths


def report(root: str, out: str, config: Config, quick: bool = False) -> str:
    """Read every run under `root`; write `<out>/llm-cpu[-quick].{md,json}` and the plots; the markdown."""
    runs = load_runs(root)
    table_rows = rows(runs, config)
    stem = os.path.join(out, "llm-cpu" + ("-quick" if quick else ""))
    timing = None
    if os.path.isfile(stem + "-timing.json"):
        with open(stem + "-timing.json") as f:
            timing = json.load(f)
    text = markdown(table_rows, config, timing, earlier_budget(runs, config))
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine_header(), "config": dataclasses.asdict(config), "rows": table_rows}, f, indent=1)
    try:
        plot(table_rows, runs, stem)
    except ImportError:
        print("sift.bench llm: matplotlib is not installed, so the plots were skipped")
    return text


