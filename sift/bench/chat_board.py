"""The chat-model board's tasks, methods, scoring and plan (`python -m sift.bench llm`; see `sift.bench.llm`).

Tasks from human labels asked as chat, scoring without generation (exact match and choice), the forgetting
measure (KL on general chat prompts), the methods and their learning-rate grids, and the plan of runs
(which are done, which learning rate won, what is left).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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

    kind: "zero-shot", "sift", "lora", "shira", "full" or "frozen" (the timing rows' floor). For sift: `targets`, `density`,
    `selection` (a `SparseAdamW` rule, or the board's own "column-normalized", `llm_methods.choose_column_normalized`),
    `select_steps`, `reselect_every`. For LoRA and SHiRA: `rank` (None: matched to the entry
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
# A random mask's best rates are higher than top-|grad|'s (1e-2 to 3e-2 at 1% on both tasks): its entries sit in
# ordinary input columns, where top-|grad| favours the massive-activation ones.
RANDOM_LRS = (3e-3, 1e-2, 3e-2)
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
    Method("sift attn 1% colnorm", "sift", SIFT_LRS, "1% of q/k/v/o by |grad| over its input column's RMS |grad|",
           selection="column-normalized"),
    Method("sift attn 1% nf4", "sift", SIFT_LRS, "sift attn 1% as a sparse delta over the NF4 model", bits=4),
    Method("lora matched", "lora", LORA_LRS, "peft LoRA on q/k/v/o, rank matched to sift attn 1%'s entries"),
    Method("lora r16 all", "lora", LORA_LRS, "peft LoRA r=16, alpha 32, all linear layers", targets="all-linear",
           rank=16),
    Method("qlora r16 all", "lora", LORA_LRS, "LoRA r=16 all linear layers over the NF4 model",
           targets="all-linear", rank=16, bits=4),
    Method("shira matched", "shira", SIFT_LRS, "peft SHiRA (random mask) on q/k/v/o, sift attn 1%'s count"),
    Method("sparta 1%", "sift", RANDOM_LRS, "SpaRTA's recipe: random 1% of q/k/v/o (sift selection='random')",
           selection="random"),
    Method("sparta all 0.25%", "sift", RANDOM_LRS, "random 0.25% of every linear layer (the attention 1% budget)",
           targets=ALL_LINEAR, density=ALL_AT_ATTENTION_BUDGET, selection="random"),
    Method("sparta 0.5%", "sift", RANDOM_LRS, "random 0.5% of q/k/v/o", density=0.005, selection="random"),
    Method("sparta 2%", "sift", RANDOM_LRS, "random 2% of q/k/v/o", density=0.02, selection="random"),
    Method("sparta 5%", "sift", RANDOM_LRS, "random 5% of q/k/v/o", density=0.05, selection="random"),
    Method("sparta 1% nf4", "sift", RANDOM_LRS, "the default (random 1% of q/k/v/o) as a sparse delta over the NF4 "
           "model", selection="random", bits=4),
    Method("full", "full", FULL_LRS, "every parameter, torch AdamW"),
    Method("frozen", "frozen", (0.0,), "the step's floor (timing only): forward and backward through the "
           "activations, nothing trained"),
)}
# The order the plan fills: the comparison's main rows first, then the ablations of sift's defaults.
PRIORITY = ("zero-shot", "sift attn 1%", "lora matched", "full", "lora r16 all", "sift all 0.25%", "sift all 1%",
            "sparta 1%", "shira matched", "qlora r16 all", "sift attn 1% nf4", "sift attn 2%", "sift attn 5%",
            "sift all 0.5%", "sift all 2%", "sift all 5%", "sift attn 1% saliency", "sift attn 1% select 4",
            "sift attn 1% reselect", "sift attn 1% colnorm", "sparta all 0.25%", "sparta 2%", "sparta 1% nf4",
            "sparta 0.5%", "sparta 5%")


@dataclass(frozen=True)
class Config:
    """The sizes of one board."""

    steps: int = 64
    # Tasks that need another length, (task, steps): chosen from full fine-tuning's validation curve.
    task_steps: tuple[tuple[str, int], ...] = ()
    batch_size: int = 8
    curve_every: int = 16  # validation accuracy every this many steps
    curve_items: int = 100  # on the first this many validation items (the last point: all of them); seed 0 only
    seeds: tuple[int, ...] = (0, 1, 2)
    test_items: int = TEST_ITEMS
    val_items: int = VAL_ITEMS
    kl_prompts: int = len(CHAT_PROMPTS)
    threads: int | None = 1
    eval_batch: int = 50
    evaluate: bool = True  # False: train only (the timing rows)

    def steps_for(self, task: str) -> int:
        """The training length of `task`'s runs."""
        return dict(self.task_steps).get(task, self.steps)

    def describe_steps(self) -> str:
        """"64 steps", or "64 steps (emotion: 128)"."""
        extra = ", ".join(f"{task}: {steps}" for task, steps in self.task_steps)
        return f"{self.steps} steps" + (f" ({extra})" if extra else "")


# Emotion's full fine-tuning still rose over the last 16 of 64 steps (35 -> 41% validation at 1e-4); at 128 it
# levels off (58 -> 58.5%), so emotion trains 128 steps.
FULL = Config(task_steps=(("emotion", 128),))
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


# ------------------------------------------------------------------------------------------- the plan


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


def load_runs(root: str) -> list[dict[str, Any]]:
    """Every run file under `root`."""
    runs = []
    for directory, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".json"):
                with open(os.path.join(directory, name)) as f:
                    runs.append(json.load(f))
    return runs


def run_key(run: dict[str, Any]) -> tuple[str, str, float, int, int]:
    c = run["run_info"]["train_config"]
    return c["task"], c["method"], c["optimizer_kwargs"]["lr"], c["seed"], c["max_steps"]


MAX_GRID_EXTENSIONS = 2  # rates added past each end of a method's grid when its best rate sits at that end


def _neighbour(lr: float, up: bool) -> float:
    """The next rate on the 1-3-10 ladder the grids use (3e-3 -> 1e-2 up, 1e-3 -> 3e-4 down)."""
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = round(lr / 10**exponent)
    if up:
        return float(f"{3 if mantissa == 1 else 1}e{exponent if mantissa == 1 else exponent + 1}")
    return float(f"{1 if mantissa == 3 else 3}e{exponent if mantissa == 3 else exponent - 1}")


def best_of(tried: dict[float, float]) -> float:
    """The rate with the best validation exact match in {rate: score} (ties: the lower rate)."""
    return max(sorted(tried), key=lambda lr: (tried[lr], -lr))


def grid_state(runs: Sequence[dict[str, Any]], task: str, method: str, steps: int
               ) -> tuple[dict[float, float], list[float]]:
    """({rate: final validation exact match} of the seed-0 runs so far, the rates still to run).

    The rates to run are the method's grid, then, while the best rate found sits at an end of the rates tried,
    the next rate past that end (at most `MAX_GRID_EXTENSIONS` a side), so the chosen rate is an interior one.
    """
    grid = METHODS[method].lrs
    tried = {lr: run["train_info"]["metrics"][-1]["val exact"] for run in runs for t, m, lr, seed, s in [run_key(run)]
             if t == task and m == method and seed == 0 and s == steps}
    missing = [lr for lr in grid if lr not in tried]
    if missing or len(grid) < 2:
        return tried, missing
    best = best_of(tried)
    for end, up in ((min(tried), False), (max(tried), True)):
        past = [lr for lr in tried if (lr > max(grid) if up else lr < min(grid))]
        if best == end and len(past) < MAX_GRID_EXTENSIONS:
            return tried, [_neighbour(end, up)]
    return tried, []


def best_lr(runs: Sequence[dict[str, Any]], task: str, method: str, steps: int) -> float | None:
    """The rate with the best final validation exact match at seed 0 (ties: the lower rate), or None while the
    grid (with its extensions, `grid_state`) is incomplete."""
    tried, todo = grid_state(runs, task, method, steps)
    return None if todo or not tried else best_of(tried)


def pending(runs: Sequence[dict[str, Any]], config: Config, tasks: Sequence[str], methods: Sequence[str]
            ) -> list[RunSpec]:
    """The runs still to do, in the order the plan fills them: the learning-rate grids at seed 0 (zero-shot:
    one run), middle rate first for every method in `methods`' order, then the grids' other rates, then the
    other seeds at each grid's best rate; a board stopped early then compares every method at one rate."""
    done = {run_key(r) for r in runs}
    grids: list[tuple[int, RunSpec]] = []
    seeds: list[RunSpec] = []
    for method in methods:
        m = METHODS[method]
        for task in tasks:
            if m.kind == "zero-shot":
                grids.append((0, RunSpec(task, method, 0.0, config.seeds[0], 0)))
                continue
            middle, steps = len(m.lrs) // 2, config.steps_for(task)
            grids += [(0 if i == middle else 1, RunSpec(task, method, lr, config.seeds[0], steps))
                      for i, lr in enumerate(m.lrs)]
            grids += [(2, RunSpec(task, method, lr, config.seeds[0], steps))
                      for lr in grid_state(runs, task, method, steps)[1] if lr not in m.lrs]
            lr = best_lr(runs, task, method, steps)
            if lr is not None:
                seeds += [RunSpec(task, method, lr, seed, steps) for seed in config.seeds[1:]]
    grids.sort(key=lambda pair: pair[0])  # stable: methods' and tasks' order kept within each pass
    return [c for c in [g for _, g in grids] + seeds if (c.task, c.method, c.lr, c.seed, c.steps) not in done]


