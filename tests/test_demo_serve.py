"""The serving demo: three fine-tunes over one base in one generate call, each row its own fine-tune's answer."""

from __future__ import annotations

import json

from sift.demo import serve


def test_three_fine_tunes_in_one_batch_answer_as_each_alone(tmp_path):
    # A large rate so two steps move the tiny model's greedy answers: the equalities below are then not trivial.
    result = serve.run(quick=True, results_dir=str(tmp_path), steps=2, lr=0.05)
    rows = result["serve"]["rows"]
    assert {r["fine_tune"] for r in rows} == {"sentiment", "emotion", "strength", None}
    assert result["serve"]["every_row_equals_alone"] and all(r["equals_alone"] for r in rows)
    base_rows = [r for r in rows if r["fine_tune"] is None]
    assert all(r["tokens"] == r["base_tokens"] for r in base_rows)
    tuned = [r for r in rows if r["fine_tune"] is not None]
    assert any(r["tokens"] != r["base_tokens"] for r in tuned), "no fine-tune changed an answer: nothing was tested"
    saved = json.loads((tmp_path / "serving-demo-cpu-quick.json").read_text())
    assert saved["serve"]["accuracy"].keys() == {"sentiment", "emotion", "strength"}
    assert "Every row equals its fine-tune applied alone" in (tmp_path / "serving-demo-cpu-quick.md").read_text()


def test_strength_task_reads_afinn_ratings():
    items = serve.DEMO_TASKS["strength"].items()
    assert len(items) > 2000 and all(a in serve.RATINGS for _, a in items)
    assert dict(items)["outstanding"] == "5" and dict(items)["bastard"] == "-5"
