"""Smoke test of `python -m sift.bench quantized --quick`: it runs, writes its quick files, and its tables
have every configuration. Benchmarks measure; nothing here checks a timing or a target."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from sift.bench import quantized  # noqa: E402


def _tables(markdown: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `markdown`, as rows keyed by their header."""
    tables, block = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            header = [c.strip() for c in block[0].strip("|").split("|")]
            assert set(block[1].strip("|").split("|")) == {"---"}
            tables.append([dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in block[2:]])
            block = []
    return tables


def test_quantized_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = quantized.run(quick=True)
    tag = ("gpu" if torch.cuda.is_available() else "cpu") + "-quick"
    assert (tmp_path / f"quantized-{tag}.md").read_text().strip() == markdown.strip()
    assert not (tmp_path / f"quantized-{tag[:3]}.json").exists(), "a quick run must not replace the measured results"
    with open(tmp_path / f"quantized-{tag}.json") as f:
        saved = json.load(f)
    assert saved["machine"]["cpu"] and saved["config"]["quick"] is True

    measured, projected, timing = _tables(markdown)
    assert list(measured[0]) == list(quantized.MEASURED_COLUMNS)
    assert list(projected[0]) == list(quantized.PROJECTED_COLUMNS)
    assert list(timing[0]) == list(quantized.TIMING_COLUMNS)
    assert all(column.startswith("projected") for column in quantized.PROJECTED_COLUMNS[2:])

    names = ["sift 1% exact", "sift 1% lean", "sift 1% lean, UIB", "sift 5% exact", "QLoRA r=16", "QLoRA r=64",
             "SHiRA"]
    small, big = quantized.QUICK_7B["name"], quantized.QUICK_70B["name"]
    # Measured: every configuration on both layer shapes, without and with checkpointing.
    got = sorted((r["config"].split(" r=")[0] if r["config"].startswith("SHiRA") else r["config"], r["GC"])
                 for r in measured)
    assert got == sorted((n, gc) for n in names for gc in ("no", "yes") for _ in range(2))
    for row in measured:
        parts = [float(row[c]) for c in ("Params", "Grad", "Optim", "Activation")]
        # Stepped in backward, the UIB row holds no gradient after it; every other row does.
        assert all(p > 0 for p in parts) or (row["config"].endswith("UIB") and parts[1] == 0), row
        assert float(row["Total"]) == pytest.approx(sum(parts), rel=0.02, abs=1e-3)
    # Projected: every configuration to both full models.
    for model in (small, big):
        rows = [r for r in projected if r["model"].startswith(model + " (")]
        assert [r["config"].split(" r=")[0] if r["config"].startswith("SHiRA") else r["config"] for r in rows] == names
    assert "PROJECTED" in markdown
    # Timed: sift 1% (exact, lean UIB), QLoRA r=16, SHiRA; ratios against QLoRA and sift.
    assert [r["config"].split(" r=")[0] if r["config"].startswith("SHiRA") else r["config"] for r in timing] == [
        "sift 1% exact", "sift 1% lean, UIB", "QLoRA r=16", "SHiRA"]
    by = {r["config"].split(" r=")[0] if r["config"].startswith("SHiRA") else r["config"]: r for r in timing}
    assert float(by["sift 1% exact"]["x vs sift 1%"]) == 1.0 and float(by["QLoRA r=16"]["x vs QLoRA r=16"]) == 1.0
    # Every target is printed, met or not.
    assert len(saved["targets"]) == 13  # three memory targets for each sift 1% row, two step ones for each timed
    for check in saved["targets"]:
        assert f"- {check['target']}: {check['figure']}: {'met' if check['met'] else 'MISSED'}" in markdown


def test_sift_counts_what_the_optimizer_holds():
    """Per layer: sift's Optim is exactly its moments and int32 indices (and steps); SHiRA matches sift 1%'s count."""
    sizes = dict(quantized.layer_sizes(quantized.QUICK_7B))
    model = quantized.build_quantized(sizes)
    base, outside = quantized.model_bytes(model)
    assert base > outside > 0 and quantized.quant_state_bytes(model) > 0
    method = quantized.Method(model, "sift", 0.01)
    k = quantized.sift_entries(model, 0.01)
    assert method.entries == k and method.adapter_bytes == 4 * k
    batch = torch.randint(0, sizes["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    m = quantized.measure_step(method, batch, base)
    assert m["params"] == base + 4 * k and m["grad"] == 4 * k
    assert m["optim"] == 12 * k + 4 * len(quantized.shapes_of(model))  # exp_avg, exp_avg_sq, delta_indices; steps
    # The forward alone saves what the step's backward read (the affine fit of `project` rests on it).
    assert m["saved_forward"][8] == m["activation"] > 0 and m["saved_forward"][16] > m["activation"]

    shapes = quantized.shapes_of(model)
    r = quantized.shira_rank(model, 0.01)
    best = min(range(1, 64), key=lambda q: abs(q * sum(o + i for o, i in shapes) - k))
    assert r == best


def test_the_suite_says_it_skipped_without_bitsandbytes(monkeypatch):
    """`python -m sift.bench` on an install without the [quant] extra: one line, no failure."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert "skipped: bitsandbytes not installed" in quantized.run(quick=True)
