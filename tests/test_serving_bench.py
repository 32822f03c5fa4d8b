"""The serving benchmark against peft runs in its quick setting (a tiny random Llama) and saves its two tables."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")


def test_serving_llm_quick(tmp_path, monkeypatch):
    from sift.bench import serving_llm

    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = serving_llm.run_llm(quick=True)
    assert "peft LoRA at the matched entry count" in markdown and "Memory per loaded fine-tune" in markdown
    tag = ("gpu" if torch.cuda.is_available() else "cpu") + "-quick"
    with open(tmp_path / f"serving-llm-{tag}.json") as f:
        saved = json.load(f)
    assert len(saved["rows"]) == 2 * sum(s <= serving_llm.BATCHES[0] for s in serving_llm.SPREADS)  # quick: batch 8 only
    assert all(r["sift ms"] > 0 and r["peft LoRA ms"] > 0 and r["base ms"] > 0 for r in saved["rows"])
    assert [r["fine-tune"] for r in saved["memory"]] == ["d0", "d1"]
    assert all(r["bytes held"] > 0 and r["file bytes"] > 0 for r in saved["memory"])
    assert len(saved["switch"]) == 1 and saved["switch"][0]["switch_to median ms"] > 0


def test_the_smollm2_table_says_it_is_not_run_without_the_model(monkeypatch, capsys):
    # The base install (`pip install -e .`) has no GGUF reader: the main job must go on and say why.
    import sift.demo.llm
    from sift.bench import serving_llm

    def missing(download=True):
        raise ImportError("transformers reads GGUF files with the 'gguf' package")

    monkeypatch.setattr(sift.demo.llm, "smollm2_dir", missing)
    monkeypatch.setattr(serving_llm, "bench_llm", lambda *a, **k: pytest.fail("timed without a model"))
    text = serving_llm.run_llm(quick=False)
    assert "not run" in text and "gguf" in text
    assert "SmolLM2 table is not run" in capsys.readouterr().err
