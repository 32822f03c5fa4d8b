"""Training and measuring: one run of one method (`train_once`, `evaluate`), every seed of a method
in one process with its peak resident set (`run_method`), and every method, each in a process of
its own (`run_demo`)."""

from __future__ import annotations

import concurrent.futures
import copy
import ctypes
import gc
import math
import multiprocessing
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from sift.bench._harness import reset_peak_rss, rss_kib
from sift.demo.data import Encoded, load_afinn, load_model, split
from sift.demo.methods import DEFAULT_BATCH, DEFAULT_SEEDS, DEFAULT_STEPS, METHODS, QUANTIZED, _setup


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    # The state tensors of every param (for SparseAdamW the same as its state_bytes()).
    return sum(_tensor_bytes(v for k, v in s.items() if k != "score") for s in opt.state.values())


def _trainable(opt: torch.optim.Optimizer) -> int:
    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes()["trainable_entries"])
    return sum(p.numel() for g in opt.param_groups for p in g["params"] if p.requires_grad)


@torch.inference_mode()
def evaluate(model: torch.nn.Module, data: Encoded, batch_size: int = 512) -> float:
    """Accuracy of `model` on `data`, in batches of words of one token length.

    Grouping by length leaves nothing to pad: the test words average 3.7 tokens against 7 for
    the longest, so padded batches would run the model on almost twice the tokens.

    Args:
        model: a sequence classifier; called as `model(input_ids=[b, S], attention_mask=[b, S])`.
        data: the words to classify, `input_ids` [n, S_max].
        batch_size: most words per forward.

    Returns:
        The share of the n words whose argmax logit is their label.

    Example:
        >>> model, tokenizer = load_model()  # doctest: +SKIP
        >>> evaluate(model, Encoded.of(split(load_afinn())[1], tokenizer))  # doctest: +SKIP
    """
    was_training = model.training
    model.eval()
    lengths = data.attention_mask.sum(1)
    correct = 0
    for length in lengths.unique().tolist():
        same = (lengths == length).nonzero().flatten()
        for rows in same.split(batch_size):
            logits = model(**data.batch(rows, labels=False)).logits
            correct += int((logits.argmax(-1) == data.labels[rows]).sum())
    model.train(was_training)
    return correct / data.labels.numel()


def train_once(method: str, base: torch.nn.Module, train: Encoded, test: Encoded, *, seed: int, steps: int,
               batch_size: int, progress: Any = None) -> dict[str, Any]:
    """Fine-tune a copy of `base` with `method` for `steps` steps; its test accuracy and costs."""
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.classifier.weight, std=model.config.initializer_range)
    torch.nn.init.zeros_(model.classifier.bias)
    model.train()
    setup_start = time.perf_counter()
    net, opt = _setup(method, model, train, seed, steps)
    setup_s = time.perf_counter() - setup_start
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
    gen = torch.Generator().manual_seed(seed)
    epochs = math.ceil(steps * batch_size / train.labels.numel())
    order = torch.cat([torch.randperm(train.labels.numel(), generator=gen) for _ in range(epochs)])
    step_s, losses, grad_bytes = [], [], 0
    for step in range(steps):
        batch = train.batch(order[step * batch_size:(step + 1) * batch_size])
        start = time.perf_counter()
        loss = net(**batch).loss
        loss.backward()
        if step == steps - 1:  # the gradients held at their peak, just before the step
            grad_bytes = _tensor_bytes(p.grad for p in net.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        step_s.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        if progress is not None:
            progress.update(1)
    accuracy = evaluate(net, test)
    param_bytes = _tensor_bytes(net.parameters())
    state_bytes = _optimizer_state_bytes(opt)
    merged = None
    if method == "sift-1% 4-bit":
        # The fine-tune for serving without the 4-bit base: its delta merged into the 16-bit model.
        from sift.delta import SparseDelta

        full, _ = load_model()
        SparseDelta.from_optimizer(opt, net).apply_(full)
        merged = evaluate(full, test)
        del full
    return {
        "method": method, "seed": seed, "accuracy": accuracy, "trainable": _trainable(opt),
        "state_bytes": state_bytes, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
        # The first step also selects (SIFT) and warms up; the median is over the others.
        "sec_per_step": statistics.median(step_s[1:] or step_s), "setup_s": setup_s,
        "final_loss": statistics.fmean(losses[-5:]), "merged_accuracy": merged,
    }


def _peak_rss_mib(reset: bool) -> float:
    hwm = rss_kib("VmHWM") if reset else None
    if hwm is not None:
        return hwm / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _release_free_memory() -> None:
    # Memory freed by an earlier method in this process stays resident in malloc's arenas, where the
    # next method would reuse it unseen; returning it first keeps that method's RSS growth its own.
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _saliency_available() -> bool:
    import sift

    try:
        sift.SparseAdamW([torch.nn.Parameter(torch.zeros(2, 2))], selection="saliency")
    except ValueError as exc:
        if "selection" in str(exc):
            return False
        raise
    return True


def run_method(method: str, seeds: Sequence[int], steps: int, batch_size: int, threads: int | None = None,
               progress: bool = True, eval_limit: int | None = None) -> list[dict[str, Any]]:
    """Every seed of one method in this process; one result dict per seed (plus `peak_rss_mib`, `cpu_s`)."""
    cpu_start = time.process_time()
    if threads:
        torch.set_num_threads(threads)
    if method == "saliency-1%" and not _saliency_available():
        return [{"method": method, "seed": s, "unavailable": "SparseAdamW has no selection='saliency' yet"}
                for s in seeds]
    base, tokenizer = load_model(bits=4 if method in QUANTIZED else None)
    train_rows, test_rows = split(load_afinn())
    train, test = Encoded.of(train_rows, tokenizer), Encoded.of(test_rows[:eval_limit], tokenizer)
    _release_free_memory()
    reset = reset_peak_rss()  # the peak then excludes model loading
    loaded_rss = rss_kib("VmRSS")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(seeds) * steps, desc=f"{method:>12}", leave=False, file=sys.stderr)
    results = [train_once(method, base, train, test, seed=s, steps=steps, batch_size=batch_size, progress=bar)
               for s in seeds]
    if bar is not None:
        bar.close()
    peak = _peak_rss_mib(reset)
    # What training added to the process: the same on any start method, where the absolute peak
    # also counts the library pages that this process happened to touch.
    growth = peak - loaded_rss / 1024 if reset and loaded_rss is not None else None
    cpu_s = time.process_time() - cpu_start
    for r in results:
        r["cpu_s"] = cpu_s
        r["peak_rss_mib"] = peak
        r["peak_rss_growth_mib"] = growth
        r["peak_rss_kind"] = "VmHWM since model load" if reset else "ru_maxrss (whole process)"
    return results


def _aggregate(method: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"method": method, "description": METHODS[method].description, "lr": METHODS[method].lr}
    if "unavailable" in results[0]:
        return {**row, "unavailable": results[0]["unavailable"]}
    acc = [r["accuracy"] for r in results]
    row.update(
        accuracy_mean=statistics.fmean(acc), accuracy_std=statistics.stdev(acc) if len(acc) > 1 else 0.0,
        accuracies=acc, seeds=[r["seed"] for r in results], trainable=results[0]["trainable"],
        state_bytes=results[0]["state_bytes"],
        train_bytes=results[0]["param_bytes"] + results[0]["grad_bytes"] + results[0]["state_bytes"],
        peak_rss_mib=results[0]["peak_rss_mib"], peak_rss_growth_mib=results[0]["peak_rss_growth_mib"],
        peak_rss_kind=results[0]["peak_rss_kind"], cpu_s=results[0]["cpu_s"],
        sec_per_step=statistics.median(r["sec_per_step"] for r in results),
        setup_s=statistics.median(r["setup_s"] for r in results),
        final_loss=statistics.fmean(r["final_loss"] for r in results),
    )
    merged = [r["merged_accuracy"] for r in results if r.get("merged_accuracy") is not None]
    if merged:
        row.update(merged_accuracy_mean=statistics.fmean(merged),
                   merged_accuracy_std=statistics.stdev(merged) if len(merged) > 1 else 0.0)
    return row


# What every method's process imports; the fork server imports it once, before any torch work.
# Each child imports sift.demo itself when it unpickles its task (`run_method`, found by its module's name).
_PRELOAD = ["sift", "transformers.models.bert.modeling_bert", "transformers.models.bert.tokenization_bert", "peft"]


def _worker_context() -> multiprocessing.context.BaseContext:
    """Where each method's process comes from: forks of one server that has imported `_PRELOAD`.

    A spawned process would import torch, transformers and peft again for every method; a fork
    of the server starts with them loaded and still has its own peak RSS. The server never runs
    a torch op, so no OpenMP pool is forked. Spawn where the platform has no fork server.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run_demo(methods: Sequence[str] = tuple(METHODS), seeds: Sequence[int] = DEFAULT_SEEDS,
             steps: int = DEFAULT_STEPS, batch_size: int = DEFAULT_BATCH, *, isolate: bool = True,
             threads: int | None = 1, progress: bool = True, eval_limit: int | None = None) -> list[dict[str, Any]]:
    """Train every method on every seed; one aggregated row per method.

    Args:
        methods: names from `METHODS`.
        seeds: training seeds (head init, batch order, LoRA init, random selection).
        steps: optimizer steps per run.
        batch_size: words per step.
        isolate: run each method in a process of its own (forked from a server that has the
            imports done, see `_worker_context`), so its peak RSS is its own.
        threads: torch threads per run (1 by default: on a shared 2-core machine a second
            OpenMP thread that waits for a busy core slows a step several times).
        progress: tqdm bars.
        eval_limit: evaluate on the first `eval_limit` test words only (for quick tests).

    Returns:
        Rows with `accuracy_mean`, `accuracy_std`, `trainable`, `state_bytes`, `train_bytes`,
        `peak_rss_mib`, `sec_per_step`, `cpu_s` (CPU time of the method's process: on a busy
        machine a truer measure of its work than `wall_s`), ... (or `unavailable` with the reason).

    Example:
        >>> rows = run_demo(["probe", "sift-1%"], seeds=[0], steps=3, isolate=False)  # doctest: +SKIP
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
    context = _worker_context() if isolate else None
    rows = []
    for method in methods:
        args = (method, list(seeds), steps, batch_size, threads, progress, eval_limit)
        start = time.perf_counter()
        if context is not None:
            # An executor, not a Pool: a worker that dies raises BrokenProcessPool instead of hanging.
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                results = pool.submit(run_method, *args).result()
        else:
            results = run_method(*args)
        rows.append({**_aggregate(method, results), "wall_s": time.perf_counter() - start})
    return rows
