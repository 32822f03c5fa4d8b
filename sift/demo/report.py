"""The demo's report: the markdown table headed by the machine (`markdown`), the accuracy plot
(`plot`), and the files under the results folder (`save`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any


MAJORITY_NOTE = "majority class (negative)"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _rss_cell(row: dict[str, Any]) -> str:
    growth = row.get("peak_rss_growth_mib")
    return f"{row['peak_rss_mib']:.0f}" + ("" if growth is None else f" (+{growth:.0f})")


def markdown(rows: Sequence[dict[str, Any]], steps: int, batch_size: int, seeds: Sequence[int], threads: int | None,
             isolate: bool = True) -> str:
    """The results as a markdown table headed by the machine, with a note on each column."""
    from sift.bench._harness import header_lines

    title = (f"### Word sentiment (AFINN-en-165, 2,704 train / 676 test words), all-MiniLM-L6-v2, CPU: "
             f"{steps} steps of {batch_size} words, seeds {list(seeds)}, torch threads {threads or 'default'}")
    lines = [title, "", *header_lines(), ""]
    lines.append("| method | test accuracy % (mean ± std) | trainable params | optimizer state MiB | "
                 "params+grads+state MiB | peak RSS MiB (process, after load; growth) | s/step (median) | lr |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| {r['method']} | unavailable: {r['unavailable']} | | | | | | {r['lr']:g} |")
            continue
        lines.append(
            f"| {r['method']} | {100 * r['accuracy_mean']:.1f} ± {100 * r['accuracy_std']:.1f} | {r['trainable']:,} | "
            f"{_mib(r['state_bytes'])} | {_mib(r['train_bytes'])} | {_rss_cell(r)} | "
            f"{r['sec_per_step']:.3f} | {r['lr']:g} |")
    lines += ["", f"Test accuracy of always answering the {MAJORITY_NOTE}: 65.2%. Trainable params: entries the "
              "optimizer updates (SparseAdamW: its chosen entries plus the dense head). Optimizer state: the "
              "optimizer's state tensors. params+grads+state: all parameters, the gradients held after the last "
              "backward (SIFT in plain mode keeps the dense gradient of each target weight), and the state. "
              + ("Peak RSS: the method's own process (forked from a server that imported torch, transformers "
                 "and peft), peak resident set since the pretrained model was loaded (VmHWM reset after loading; "
                 "it includes torch, the tokenizer and the data, and the library pages the process touched); "
                 "in brackets, its growth over the RSS right after loading: what training added. " if isolate else
                 "Peak RSS: all methods ran in one process, so it includes what earlier methods left allocated; "
                 "in brackets, its growth over the RSS after the method's model was loaded (freed memory returned "
                 "to the system first). ")
              + "s/step: forward, backward and optimizer step, median over steps 2.. of all seeds."]
    for r in rows:
        if "merged_accuracy_mean" in r:
            lines += ["", f"{r['method']}, its delta merged into the 16-bit model (`SparseDelta.apply_`, served without "
                      f"the 4-bit base): test accuracy {100 * r['merged_accuracy_mean']:.1f} ± "
                      f"{100 * r['merged_accuracy_std']:.1f}% (on the 4-bit model: {100 * r['accuracy_mean']:.1f} ± "
                      f"{100 * r['accuracy_std']:.1f}%)."]
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Accuracy against trainable parameters (log x), one marker per method with its seed spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "osD^v<>PXh"
    for i, r in enumerate(r for r in rows if "unavailable" not in r):
        ax.errorbar(r["trainable"], 100 * r["accuracy_mean"], yerr=100 * r["accuracy_std"], fmt=markers[i % 10],
                    capsize=4, markersize=7, label=r["method"])
    ax.axhline(65.2, color="grey", linestyle="--", linewidth=1, label="majority class")
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("AFINN word sentiment, all-MiniLM-L6-v2 (CPU)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(rows: Sequence[dict[str, Any]], table: str, config: dict[str, Any], quick: bool) -> str:
    """Write demo-cpu[-quick].{md,json,png} under the results folder; the stem's path."""
    from sift.bench._harness import results_dir
    from sift.env import machine_header

    out = results_dir()
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "demo-cpu" + ("-quick" if quick else ""))
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine_header(), "config": config, "rows": list(rows)}, f, indent=1)
    try:
        plot(rows, stem + ".png")
    except ImportError:  # matplotlib comes with the [demo] extra; the table and numbers do not need it
        print("sift.demo: matplotlib is not installed, so the plot was skipped (pip install 'sift-kernels[demo]')")
        if os.path.exists(stem + ".png"):
            os.remove(stem + ".png")  # an earlier run's plot would not show these rows
    return stem
