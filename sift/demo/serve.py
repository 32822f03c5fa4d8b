"""`python -m sift.demo.serve`: three sparse fine-tunes of one chat model, served from one base in one batch.

Three fine-tunes of SmolLM2-135M-Instruct, each `SparseAdamW.for_model` at its defaults (1% of each attention
projection) on its own task from human labels shipped on PyPI, asked as chat:

    sentiment   AFINN-en-165: is the word positive or negative?
    emotion     NRC emotion lexicon: which of eight emotions does the word evoke?
    strength    AFINN-en-165: the word's rating, -5 to 5

Each is saved as a fine-tune directory, then all three are loaded into one `sift.ServedDeltas` over one base
model, and one `generate` call answers a batch whose rows each name their fine-tune (or `None`, the base). The
demo checks what serving promises: every row's greedy answer equals its fine-tune's own greedy answer (the
fine-tune applied in place, alone), and the base rows equal the base's. It reports each fine-tune's exact-match
accuracy on its task's held-out words, scored on the mixed batch: each fine-tune answers its own task.

Results: `serving-demo-cpu.{md,json}` under `--results-dir` (default `$SIFT_BENCH_DIR`, else
`~/.cache/sift/bench-results`). `--quick` runs the same code on a tiny random Llama in seconds (its answers are
noise; the equalities still hold).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from sift.bench.chat_board import TASKS, Task, batch_loss, encode_example, end_id, left_pad, prompt_ids

STEPS, BATCH, LR, TEST_WORDS = 48, 8, 1e-3, 24
RATINGS = tuple(str(s) for s in (-5, -4, -3, -2, -1, 1, 2, 3, 4, 5))


@dataclasses.dataclass(frozen=True)
class StrengthTask(Task):
    """AFINN's rating itself (not its sign) as the answer."""

    def items(self) -> list[tuple[str, str]]:
        from sift.bench.chat_board import _package_file

        with open(_package_file("afinn", "data", "AFINN-en-165.txt"), encoding="utf-8") as f:
            rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        return sorted((w, str(int(s))) for w, s in rows if " " not in w and int(s) != 0)


DEMO_TASKS: dict[str, Task] = {
    "sentiment": TASKS["sentiment"],
    "emotion": TASKS["emotion"],
    "strength": StrengthTask("strength", "Rate the sentiment of the word '{word}' from -5 (very negative) to 5 (very "
                             "positive). Answer with the number only.", RATINGS,
                             "AFINN-en-165 (afinn package), the word's rating"),
}


def fine_tune(folder: str, tokenizer: Any, task: Task, out: str, steps: int, batch: int, lr: float, seed: int = 0,
              base_model: str | None = None) -> str:
    """Train one sift fine-tune of the model in `folder` on `task`'s training words; its directory `out`."""
    import transformers
    from tqdm import tqdm

    import sift

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    model.config.use_cache = False
    # SIFT's rule, at the rate the committed run used (bench/results/serving-demo-cpu.md).
    opt = sift.SparseAdamW.for_model(model, density=0.01, lr=lr, selection="magnitude")
    train = task.splits()["train"]
    order = random.Random(seed)
    pad = end_id(tokenizer)
    model.train()
    for _ in tqdm(range(steps), desc=f"sift.demo.serve: fine-tuning on {task.name}", unit="step", file=sys.stderr):
        examples = [encode_example(tokenizer, task, w, a) for w, a in order.sample(train, batch)]
        loss, _ = batch_loss(model, examples, pad)
        loss.backward()
        opt.step()
        opt.zero_grad()
    sift.SparseDelta.from_optimizer(opt, model).save_pretrained(out, model, base_model=base_model)
    return out


@torch.inference_mode()
def serve(folder: str, tokenizer: Any, tunes: dict[str, str], words: int, new_tokens: int = 4) -> dict[str, Any]:
    """Load every fine-tune in `tunes` ({name: directory}) over one base, answer one mixed batch (each task's
    `words` test words with its fine-tune, plus two base rows) with one greedy `generate` call, and check each row
    against its fine-tune applied alone. Returns the rows, the checks and each fine-tune's accuracy."""
    import transformers

    from sift import ServedDeltas

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    served = ServedDeltas(base)
    for name, path in tunes.items():
        served.load_delta(name, path)
    asks: list[tuple[str | None, str, str, str]] = []  # (fine-tune, task, word, label)
    for name in tunes:
        asks += [(name, name, w, a) for w, a in DEMO_TASKS[name].splits(test=max(words, 2), val=0)["test"][:words]]
    asks += [(None, name, *DEMO_TASKS[name].splits(test=2, val=0)["test"][0]) for name in list(tunes)[:2]]
    ids, mask, _ = left_pad([prompt_ids(tokenizer, DEMO_TASKS[t].question.format(word=w)) for _, t, w, _ in asks],
                            end_id(tokenizer))
    names = [n for n, *_ in asks]
    settings = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=end_id(tokenizer))
    start = time.perf_counter()
    mixed = served.generate(ids, delta_names=names, **settings)[:, ids.shape[1]:]
    mixed_s = time.perf_counter() - start
    alone: dict[str | None, torch.Tensor] = {}
    for name in [*tunes, None]:
        served.switch_to(name)  # the fine-tune in the weights, alone: what the row must answer
        alone[name] = base.generate(ids, **settings)[:, ids.shape[1]:]
    served.switch_to(None)
    served.close()

    def text(tokens: torch.Tensor) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True).strip()

    rows = [{"fine_tune": n, "task": t, "word": w, "label": a, "answer": text(mixed[i]),
             "equals_alone": bool(torch.equal(mixed[i], alone[n][i])), "tokens": mixed[i].tolist(),
             "base_tokens": alone[None][i].tolist()} for i, (n, t, w, a) in enumerate(asks)]
    accuracy = {name: sum(r["answer"] == r["label"] for r in rows if r["fine_tune"] == name) / words
                for name in tunes}
    return {"rows": rows, "accuracy": accuracy, "every_row_equals_alone": all(r["equals_alone"] for r in rows),
            "mixed_generate_s": mixed_s, "batch": len(asks), "new_tokens": new_tokens}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"### Three sift fine-tunes of {result['model']}, served from one base in one `generate` call",
             "",
             f"Machine: {result['machine']}; each fine-tune {result['steps']} steps of {result['batch_size']} at lr "
             f"{result['lr']}, `SparseAdamW.for_model`, top-|grad| 1% of each attention projection; training "
             f"{result['train_s']:.0f} s in all. One mixed batch of {result['serve']['batch']} rows, greedy, "
             f"{result['serve']['new_tokens']} new tokens: {result['serve']['mixed_generate_s']:.2f} s.",
             "",
             f"Every row equals its fine-tune applied alone (base rows: the base): "
             f"**{'yes' if result['serve']['every_row_equals_alone'] else 'NO'}**.",
             "",
             "| fine-tune | its task's held-out words, exact match in the mixed batch |",
             "|---|---|"]
    lines += [f"| {name} | {acc * 100:.0f}% |" for name, acc in result["serve"]["accuracy"].items()]
    lines += ["", "| row's fine-tune | task | word | label | answer | equals alone |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['fine_tune'] or 'none (base)'} | {r['task']} | {r['word']} | {r['label']} | {r['answer']!r} | "
              f"{'yes' if r['equals_alone'] else 'NO'} |" for r in result["serve"]["rows"]]
    return "\n".join(lines) + "\n"


def run(quick: bool = False, results_dir: str | None = None, steps: int | None = None, lr: float = LR
        ) -> dict[str, Any]:
    """The demo end to end; writes `serving-demo-cpu[-quick].{md,json}` and returns the result."""
    import platform

    import transformers

    from sift.bench._harness import results_dir as default_results_dir
    from sift.demo.llm import cache_root, smollm2_dir

    if quick:
        from sift.bench.llm import tiny_llama_dir

        folder, name = tiny_llama_dir(os.path.join(cache_root(), "tiny-llama-chat")), "a tiny random Llama"
    else:
        folder, name = smollm2_dir(progress=True), "SmolLM2-135M-Instruct (fp32)"
    hub_name = None if quick else "HuggingFaceTB/SmolLM2-135M-Instruct"
    steps = steps or (2 if quick else STEPS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tunes = {t: fine_tune(folder, tokenizer, DEMO_TASKS[t], os.path.join(tmp, t), steps, BATCH, lr,
                               base_model=hub_name)
                 for t in DEMO_TASKS}
        train_s = time.perf_counter() - start
        served = serve(folder, tokenizer, tunes, 3 if quick else TEST_WORDS)
    result = {"model": name, "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads", "steps": steps, "batch_size": BATCH, "lr": lr,
              "train_s": train_s, "serve": served}
    out = results_dir or default_results_dir()
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "serving-demo-cpu" + ("-quick" if quick else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sift.demo.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama, 2 steps per fine-tune")
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--steps", type=int, default=None, help=f"steps per fine-tune (default {STEPS})")
    args = parser.parse_args(argv)
    print(markdown(run(args.quick, args.results_dir, args.steps)))


if __name__ == "__main__":
    main()
