"""Fixed selection vs periodic re-selection on the demo's MiniLM task (`python -m sift.demo`'s data,
model and loop): test accuracy, step time on re-selecting steps vs the others, peak resident memory.

    python bench/reselection_demo.py [--steps 50] [--seeds 0 1 2] [--every 10]

Each configuration runs its seeds in a process of its own, so its peak resident set is its own.
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import os
import platform
import statistics
import time

import torch


def _run(config: dict, seeds: list[int], steps: int, batch_size: int) -> dict:
    import resource

    import sift
    from sift.demo.data import Encoded, load_afinn, load_model, split
    from sift.demo.methods import METHODS
    from sift.demo.training import evaluate

    torch.set_num_threads(1)
    base, tokenizer = load_model()
    train_rows, test_rows = split(load_afinn())
    train, test = Encoded.of(train_rows, tokenizer), Encoded.of(test_rows, tokenizer)
    lr = METHODS["sift-1%"].lr
    rows = []
    for seed in seeds:
        model = copy.deepcopy(base)
        torch.manual_seed(seed)
        torch.nn.init.normal_(model.classifier.weight, std=model.config.initializer_range)
        torch.nn.init.zeros_(model.classifier.bias)
        model.train()
        kwargs = {"selection": "magnitude", **config["kwargs"]}  # SIFT's fixed top-|grad| is the reference row
        opt = sift.SparseAdamW.for_model(model, density=0.01, lr=lr, seed=seed, memory="plain", **kwargs)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
        gen = torch.Generator().manual_seed(seed)
        epochs = math.ceil(steps * batch_size / train.labels.numel())
        order = torch.cat([torch.randperm(train.labels.numel(), generator=gen) for _ in range(epochs)])
        every = config["kwargs"].get("reselect_every")
        plain_s, reselect_s = [], []
        for step in range(steps):
            batch = train.batch(order[step * batch_size:(step + 1) * batch_size])
            start = time.perf_counter()
            net_loss = model(**batch).loss
            net_loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
            elapsed = time.perf_counter() - start
            if step == 0:
                continue  # the selecting step
            # Step `step` applies update step + 1; it re-selects when `step` updates came before it.
            (reselect_s if every and step % every == 0 else plain_s).append(elapsed)
        rows.append({"seed": seed, "accuracy": evaluate(model, test), "plain_s": statistics.median(plain_s),
                     "reselect_s": statistics.median(reselect_s) if reselect_s else None})
    return {"name": config["name"], "rows": rows, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    configs = [
        {"name": "fixed (SIFT)", "kwargs": {}},
        {"name": f"re-select every {args.every}, 20% constant", "kwargs": {"reselect_every": args.every}},
        {"name": f"re-select every {args.every}, 20% cosine", "kwargs": {
            "reselect_every": args.every, "reselect_schedule": "cosine", "reselect_total_steps": args.steps}},
        {"name": f"re-select every {args.every}, 20% constant, revert", "kwargs": {
            "reselect_every": args.every, "reselect_drop": "revert"}},
    ]
    ctx = multiprocessing.get_context("spawn")
    results = []
    for config in configs:
        load_start = os.getloadavg()[0]
        with ctx.Pool(1) as pool:
            results.append(pool.apply(_run, (config, args.seeds, args.steps, args.batch_size)))
        results[-1]["load_1min"] = (load_start, os.getloadavg()[0])
    from sift.env import machine_header

    sha = machine_header()["git"]  # honours SIFT_GIT_SHA, for a copy of the package run from elsewhere
    print(f"Machine: {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores (shared), "
          f"1 torch thread, torch {torch.__version__}, git {sha}. MiniLM demo task, density 1% (for_model, "
          f"memory='plain'), {args.steps} steps, batch {args.batch_size}, seeds {args.seeds}.\n")
    print("| selection | accuracy per seed | mean | step s (other steps, median) | step s (re-selecting, median) "
          "| peak RSS MiB | load 1 min (start, end) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        accs = [row["accuracy"] for row in r["rows"]]
        plain = statistics.median(row["plain_s"] for row in r["rows"])
        resel = [row["reselect_s"] for row in r["rows"] if row["reselect_s"] is not None]
        print(f"| {r['name']} | {', '.join(f'{a:.4f}' for a in accs)} | {statistics.fmean(accs):.4f} | "
              f"{plain:.3f} | {f'{statistics.median(resel):.3f}' if resel else '-'} | {r['peak_rss_mib']:.0f} | "
              f"{r['load_1min'][0]:.1f}, {r['load_1min'][1]:.1f} |")


if __name__ == "__main__":
    main()
