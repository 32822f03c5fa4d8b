"""The chat board's step time against its floor in one process (`python -m sift.bench.llm --timing --paired`).

The floor is the same model with nothing trained: the forward and the backward through the activations.
`sift.bench.llm.timing` runs each method in its own process, for step time, tokens/s and peak memory; this
holds the methods' models side by side and steps them in turn, for the step-time ratio at a few percent.
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sift.bench._harness import summary, time_interleaved
from sift.bench.chat_board import METHODS, TASKS, Config, batch_loss, encode_example, end_id
from sift.bench.llm_methods import setup


def paired_timing(folder: str, config: Config, methods: Sequence[str] = ("frozen", "sparta 1%", "lora matched"),
                  steps: int = 24, threads: int | None = None) -> dict[str, Any]:
    """Step time of `methods` in one process, step by step in turn, each step's ratio to the first method's.

    `timing` runs each method in its own process; their step times then move by up to 15% from one process to
    the next (where the allocator and the page cache put things), five times the 3% an overhead target asks
    about. Here every method's model is loaded once, side by side, and each of `steps` rounds runs one training
    step of each on the same batch, in turn (`time_interleaved`), so drift in the machine's load falls on both
    sides of every ratio. The first method (the frozen floor) is the reference.

    Args:
        folder: the chat model's folder.
        config: `batch_size` is the batch; the rest is unused (no scoring, no schedule).
        methods: names in `METHODS`, the reference first; each holds its own copy of the model.
        steps: timed rounds, after one selection step and one warm-up step per method.
        threads: torch threads (None: as set).

    Returns:
        {"markdown": the table, "samples_s": {method: [step seconds]}, "ratios": {method: [per-round ratio]} (the
        table's quantiles are `summary`'s),
        "loads": the 1-minute load average at the start and the end}.
    """
    from tqdm import tqdm

    from sift.demo.llm import load_smollm2

    if len(methods) < 2:
        raise ValueError(f"paired_timing needs a reference method and at least one other, got {list(methods)}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {sorted(METHODS)}")
    untrained = [m for m in methods if METHODS[m].kind == "zero-shot"]
    if untrained:
        raise ValueError(f"methods {untrained} take no training step to time")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if threads:
        torch.set_num_threads(threads)
    task = TASKS[next(iter(TASKS))]
    loads = [os.getloadavg()[0]]
    nets = {}
    for m in methods:
        model, tokenizer = load_smollm2(folder, bits=METHODS[m].bits)
        model.train()
        nets[m] = setup(METHODS[m], model, METHODS[m].lrs[len(METHODS[m].lrs) // 2], 0)
    pad_id = end_id(tokenizer)
    train = task.splits(config.test_items, config.val_items)["train"]
    rng = random.Random(0)
    batches = [[encode_example(tokenizer, task, w, a) for w, a in rng.sample(train, min(config.batch_size, len(train)))]
               for _ in range(steps + 2)]

    def stepper(m: str) -> Callable[[], None]:
        net, opt = nets[m]
        # Each method walks the same batches; the reference's walk shows the rounds' progress.
        walk = iter(tqdm(batches, desc="paired steps", unit="round", leave=False) if m == methods[0] else batches)

        def step() -> None:
            loss, _ = batch_loss(net, next(walk), pad_id)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    # Two untimed steps each first: the selection step, then a warm-up.
    timed = time_interleaved({m: stepper(m) for m in methods}, warmup=2, repeat=steps)
    samples = {m: [t / 1e3 for t in timed[m]["samples_ms"]] for m in methods}
    loads.append(os.getloadavg()[0])
    ref = methods[0]
    ratios = {m: [a / b for a, b in zip(samples[m], samples[ref])] for m in methods}
    lines = [f"#### Cost in one process, {next(iter(TASKS))} task: {steps} rounds of one step per method in turn, "
             f"batch {config.batch_size}, {torch.get_num_threads()} threads", "",
             f"Load average (1 min) at the start and the end: {loads[0]:.2f}, {loads[1]:.2f}", "",
             f"| method | s/step (median) | x {ref} per round: median (p20-p80) | x {ref} of the medians |",
             "|---|---|---|---|"]
    for m in methods:
        r = summary(ratios[m])
        lines.append(f"| {m} | {statistics.median(samples[m]):.3f} | {r['median_ms']:.3f} ({r['p20_ms']:.3f}-"
                     f"{r['p80_ms']:.3f}) | {statistics.median(samples[m]) / statistics.median(samples[ref]):.3f} |")
    return {"markdown": "\n".join(lines), "samples_s": samples, "ratios": ratios, "loads": loads}
