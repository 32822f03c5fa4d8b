"""`bench/reselection_llm.py`'s aggregation: which steps count as re-selecting, and the per-row figures."""

from __future__ import annotations

import pytest
from reselection_llm import aggregate, configurations


def _run(name: str, seed: int, accuracy: float, step_s: list[float], reselected: list[bool]) -> dict:
    return {"name": name, "kwargs": {}, "seed": seed, "accuracy": accuracy, "step_s": step_s,
            "reselected": reselected, "trainable": 100, "retired": 0, "file_bytes": 10,
            "peak_rss_growth_mib": 50.0 + seed, "load_1min": [1.0, 2.0]}


def test_aggregate_splits_reselecting_steps_and_leaves_out_the_selecting_step():
    runs = [
        _run("fixed", 0, 0.1, [9.0, 1.0, 1.2, 1.1], [False] * 4),
        _run("resel", 0, 0.2, [9.0, 1.0, 3.0, 1.4], [False, False, True, False]),
        _run("fixed", 1, 0.3, [9.0, 1.3, 1.0, 1.0], [False] * 4),
        _run("resel", 1, 0.4, [9.0, 2.0, 5.0, 1.0], [False, False, True, False]),
    ]
    fixed, resel = aggregate(runs)
    assert [fixed["name"], resel["name"]] == ["fixed", "resel"]
    assert fixed["accuracies"] == [0.1, 0.3] and fixed["accuracy_mean"] == pytest.approx(0.2)
    assert fixed["accuracy_std"] == pytest.approx(0.1414213, rel=1e-5)
    assert fixed["reselect_step_s"] is None
    assert fixed["other_step_s"] == pytest.approx(1.05)  # median of 1.0, 1.2, 1.1, 1.3, 1.0, 1.0; 9.0 left out
    assert resel["reselect_step_s"] == pytest.approx(4.0)  # 3.0 and 5.0 pooled over the seeds
    assert resel["other_step_s"] == pytest.approx(1.2)  # 1.0, 1.4, 2.0, 1.0
    assert resel["reselections_per_run"] == [1, 1]
    assert fixed["peak_rss_growth_mib"] == pytest.approx(50.5)


def test_configurations_differ_only_in_the_drop():
    fixed, merge, revert = configurations(8)
    assert fixed["kwargs"] == {}
    assert {k: v for k, v in merge["kwargs"].items() if k != "reselect_drop"} == \
        {k: v for k, v in revert["kwargs"].items() if k != "reselect_drop"}
    assert (merge["kwargs"]["reselect_drop"], revert["kwargs"]["reselect_drop"]) == ("merge", "revert")
    assert merge["kwargs"]["reselect_every"] == 8 and merge["kwargs"]["reselect_rule"] == "spiel"
