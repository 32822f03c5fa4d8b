"""Smoke tests of the benchmark suites: they run, their tables have the promised shape, and the
results land on disk headed by the machine. Benchmarks measure; nothing here checks a timing."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import requires_triton
from sift.bench import adamw, memory


def _table(markdown: str, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """Parse the one markdown table in `markdown` into rows keyed by `columns` (checked)."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == list(columns)
    assert set(lines[1].strip("|").split("|")) == {"---"}
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def _saved(tmp_path, name: str) -> dict:
    """A quick run's saved results (`<name>-<device>-quick.*`, never the measured files)."""
    tag = ("gpu" if torch.cuda.is_available() else "cpu") + "-quick"
    assert not (tmp_path / f"{name}-{tag[:3]}.json").exists()
    assert (tmp_path / f"{name}-{tag}.md").is_file()
    with open(tmp_path / f"{name}-{tag}.json") as f:
        saved = json.load(f)
    for key in ("cpu", "cores", "gpu", "torch", "triton", "git"):
        assert saved["machine"][key], key
    return saved


def test_adamw_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = adamw.run(quick=True)
    assert markdown.splitlines()[2].startswith("Machine: ")
    rows = _table(markdown, adamw.COLUMNS)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = ("float32", "bfloat16") if device.type == "cuda" else ("float32",)
    backends = adamw.sparse_backends(device)
    assert backends, "no sparse backend to time"
    expected = {(f"AdamW({f})", "torch", dt, "100%") for f in ("foreach", "fused") for dt in dtypes}
    expected |= {("SparseAdamW", b, dt, f"{100 * d:g}%") for b in backends for dt in dtypes for d in adamw.DENSITIES}
    # Every dtype again on the fast backend with state="lean".
    expected |= {("SparseAdamW", f"{backends[0]}, lean", dt, f"{100 * d:g}%") for dt in dtypes for d in adamw.DENSITIES}
    # The fast backend again with clip_grad_norm_ before each step.
    expected |= {("SparseAdamW", f"{backends[0]}, clip", dt, f"{100 * d:g}%") for dt in dtypes for d in adamw.DENSITIES}
    if device.type == "cpu":
        # The machine-limit probe, in turn with the cpp and cpp-lean rows, which report their share of its speed.
        expected |= {("machine-limit probe", form, dt, f"{100 * d:g}%") for dt in dtypes
                     for d in adamw.DENSITIES for form in adamw.PROBE_FORMS}
    if device.type == "cuda":
        expected |= {("SparseAdamW", "triton+graph", dt, f"{100 * d:g}%") for dt in dtypes for d in adamw.DENSITIES}
        expected |= {("SparseAdamW", "triton+graph, lean", dt, f"{100 * d:g}%") for dt in dtypes for d in adamw.DENSITIES}
    got = [(r["optimizer"], r["backend"], r["dtype"], r["density"]) for r in rows]
    # Where the driver lets the run bound the L2 fetch size, each triton and fused row is
    # timed again under the bound ("..., L2 fetch 32 B").
    l2 = [g for g in got if "L2 fetch" in g[1]]
    assert all(g[1].startswith(("triton", "torch")) for g in l2), l2
    assert sorted(g for g in got if "L2 fetch" not in g[1]) == sorted(expected)
    for r in rows:
        assert float(r["median ms"]) > 0
        if device.type == "cpu" and r["backend"] in ("cpp", "cpp, lean"):
            # The share against the fastest of the probe's forms, each named in the note.
            assert float(r["% of probe"]) > 0, r
        if r["optimizer"] == "SparseAdamW":
            # 20 B per entry for fp32, 18 for bf16 (index, moments, delta, base); plus each tensor's
            # 4-byte step counter (0.04 B an entry at the quick sizes' 99 entries per tensor on CPU).
            per_entry = 4 + 8 + 4 + (4 if r["dtype"] == "float32" else 2)
            assert per_entry <= 20 and float(r["state B/entry"]) <= per_entry + 0.05, r
            if r["backend"].endswith(", lean"):
                # 6 B (fp32) or 7 B, plus the step and a 4-byte window offset per 65536 elements.
                assert float(r["state B/entry"]) <= (6 if r["dtype"] == "float32" else 7) + 0.2, r
            if r["backend"].endswith(", clip"):
                assert r["target x vs fused"] == "" and "`clip_grad_norm_` + step against the step alone" in markdown
            else:
                assert float(r["target x vs fused"]) == adamw.TARGET_SPEEDUP[device.type][float(r["density"][:-1]) / 100]
    saved = _saved(tmp_path, "adamw")
    assert len(saved["rows"]) == len(rows)
    if device.type == "cpu":
        shared = [r for r in saved["rows"] if r["backend"] in ("cpp", "cpp, lean")]
        assert shared and all(set(r["% of probe, per form"]) == set(adamw.PROBE_FORMS)
                              and r["% of probe"] == min(r["% of probe, per form"].values()) for r in shared)
    assert saved["config"]["quick"] is True


def test_sparse_step_bytes_counts_shared_lines_once():
    """Four entries in one 64-byte line of fp32 cost one line per pass, not four."""
    idx = torch.tensor([0, 3, 7, 15, 16], dtype=torch.int32)
    assert adamw.transactions_touched([idx], 4, 64) == 2
    assert adamw.transactions_touched([idx], 4, 32) == 3
    # Exact: index, moments and delta (28 B) and the base; the grad read and the weight write per line.
    assert adamw.sparse_step_bytes([idx], torch.float32, 64) == 5 * 32 + 2 * 64 * 2
    assert adamw.sparse_step_bytes([idx], torch.bfloat16, 32) == 5 * 30 + 2 * 32 * 2
    # Lean: no base, so the weight is read as well.
    assert adamw.sparse_step_bytes([idx], torch.float32, 64, lean=True) == 5 * 10 + 3 * 64 * 2


def test_memory_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = memory.run(quick=True)
    on_cuda = torch.cuda.is_available()
    columns = memory.COLUMNS if on_cuda else memory.CPU_COLUMNS
    # On CPU the measured table comes first, then the one projected to the full model.
    sections = markdown.split("### ")[1:]
    rows = _table(sections[0], columns)
    expected = [(label, gc) for label, _, _, _ in memory.CONFIGS for gc in ("no", "yes")]
    assert [(r["optimizer"], r["GC"]) for r in rows] == expected
    by = {(r["optimizer"], r["GC"]): r for r in rows}
    label = {(kind, state): name for name, kind, state, _ in memory.CONFIGS}
    dense, plain, lora = label[("dense", "")], label[("plain", "exact")], label[("lora", "")]
    for gc in ("no", "yes"):
        # Memory accounting is deterministic: the point of SIFT must show in it.
        assert float(by[(plain, gc)]["Optim"]) < float(by[(dense, gc)]["Optim"])
        assert float(by[(plain, gc)]["Params"]) == float(by[(dense, gc)]["Params"]) < float(by[(lora, gc)]["Params"])
        for state in ("exact", "lean"):
            hook, uib = label[("hook", state)], label[("hook_uib", state)]
            sparse, sparse_uib = label[("sparse_backward", state)], label[("sparse_backward_uib", state)]
            assert float(by[(hook, gc)]["Grad"]) < float(by[(plain, gc)]["Grad"])
            assert float(by[(sparse, gc)]["Grad"]) == float(by[(hook, gc)]["Grad"])
            # One scratch buffer of the largest k instead of a buffer per weight.
            assert float(by[(uib, gc)]["Grad"]) == float(by[(sparse_uib, gc)]["Grad"]) < float(by[(hook, gc)]["Grad"])
            assert float(by[(hook, gc)]["Params"]) == float(by[(dense, gc)]["Params"])
        assert float(by[(label[("hook", "lean")], gc)]["Optim"]) < float(by[(label[("hook", "exact")], gc)]["Optim"])
    assert float(by[(dense, "yes")]["Activation"]) < float(by[(dense, "no")]["Activation"])
    saved = _saved(tmp_path, "memory")
    assert len(saved["rows"]) == len(expected)
    assert saved["config"]["density"] == pytest.approx(memory.DENSITY)
    if on_cuda:
        return
    assert sections[1].startswith("PROJECTED")
    projected = _table(sections[1], memory.PROJECTED_COLUMNS)
    assert [(r["optimizer"], r["GC"]) for r in projected] == expected
    assert len(saved["projected"]) == len(expected)
    # The paper's Table 1, quoted beside its rows.
    sift_gc = next(r for r in projected if r["optimizer"] == label[("hook", "exact")] and r["GC"] == "yes")
    assert sift_gc["paper Total"] == "16.50" and sift_gc["paper Activation"] == "0.81"
    for r in saved["projected"]:
        p = r["projected_bytes"]
        assert p["total"] == pytest.approx(p["params"] + p["grad"] + p["optim"] + p["activation"])


def test_bench_cli_rejects_unknown_suites(capsys):
    from sift.bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["nonsense"])
    assert "unknown suite 'nonsense'" in capsys.readouterr().err


def test_bench_cli_runs_a_quick_suite(tmp_path, monkeypatch, capsys):
    from sift.bench.__main__ import main

    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    main(["heads", "--quick"])
    assert "### heads: batched singular values" in capsys.readouterr().out
    assert (tmp_path / "heads-cpu-quick.json").exists() and not (tmp_path / "heads-cpu.json").exists()


@requires_triton
def test_gpu_sector_ceiling_script_runs_through_the_interpreter():
    """The GPU experiment script must not be broken when a GPU session finally runs it."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "bench", "gpu_sector_ceiling.py")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, script, "--numel", "20000"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "%" in line.split("|")[1]]
    assert len(rows) == 3 * 6  # 3 densities x (5 patterns + the real kernel)


def test_bench_dir_collects_every_microbenchmark():
    """`pytest bench/` (pytest-benchmark) collects the step (exact and lean), delta, singular-value and
    weight-gradient cases."""
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([sys.executable, "-m", "pytest", "bench/", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    for name in ("test_bench_adamw.py::test_fused_adamw", "test_bench_adamw.py::test_sparse_adamw[fp32-1%-cpp]",
                 "test_bench_adamw.py::test_sparse_adamw[bf16-1%-cpp-lean]",
                 "test_bench_delta.py::test_merge[cpp-sum]", "test_bench_delta.py::test_apply[cpp]",
                 "test_bench_heads.py::test_singular_values", "test_bench_backward.py::test_sparse_weight_grad[1%-float32]",
                 "test_bench_backward.py::test_dense_weight_grad[float32]"):
        assert any(name in i for i in ids), name


def test_plain_pytest_collects_tests_only():
    """Plain `pytest` must not run the benchmarks: testpaths names tests/ alone."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    assert config["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]


def test_cuda_event_timer_reports_seconds_between_events(monkeypatch):
    """pytest-benchmark subtracts two timer readings: the CUDA-event timer must give seconds."""
    from sift.bench import _harness

    class FakeEvent:
        clock_ms = 0.0

        def __init__(self, enable_timing):
            assert enable_timing
            self.at_ms, self.synced = None, False

        def record(self):
            self.at_ms = FakeEvent.clock_ms

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, end):
            assert end.synced, "read before the later event completed"
            return end.at_ms - self.at_ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    start = _harness.cuda_event_timer()
    FakeEvent.clock_ms = 2.5
    end = _harness.cuda_event_timer()
    assert end - start == pytest.approx(2.5e-3)


def test_backward_quick(tmp_path, monkeypatch):
    from sift.bench import backward, train_step

    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = backward.run(quick=True)
    assert "One training step" in markdown and "Targets (CPU" in markdown
    saved = _saved(tmp_path, "backward")
    methods = [r["method"] for r in saved["rows"] if "method" in r]
    assert methods == list(train_step.METHODS)
    for r in saved["rows"]:
        if "method" in r:
            assert float(r["median s/step"]) > 0 and int(r["trainable"]) > 0


def test_memory_suite_runs_only_the_named_configurations(monkeypatch):
    """`SIFT_BENCH_MEMORY_ONLY` picks configurations by label, in the order given; an unknown label is an error."""
    monkeypatch.setenv("SIFT_BENCH_MEMORY_ONLY", "SparseAdamW lean, hook; AdamW(fused=True)")
    assert [c[0] for c in memory._chosen_configs()] == ["SparseAdamW lean, hook", "AdamW(fused=True)"]
    monkeypatch.setenv("SIFT_BENCH_MEMORY_ONLY", "SparseAdamW lean, hook;no such row")
    with pytest.raises(ValueError, match="no such row"):
        memory._chosen_configs()
    monkeypatch.delenv("SIFT_BENCH_MEMORY_ONLY")
    assert memory._chosen_configs() == memory.CONFIGS


def test_distributed_quick(tmp_path, monkeypatch):
    """FSDP2 on 2 gloo processes: one row per mode; hook mode adds no communication to plain mode's, the sparse
    backward sends less, and each sparse mode holds less optimizer state (and hook mode fewer gradient bytes)
    per rank than the one before."""
    from sift.bench import distributed

    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = distributed.run(quick=True)
    assert "Projected (not measured): Llama-2-70B" in markdown
    rows = {r["mode"]: r for r in _saved(tmp_path, "distributed")["rows"]}
    assert list(rows) == list(distributed.MODES)
    adamw, plain, hook, sparse_backward = (rows[m] for m in distributed.MODES)
    sizes = distributed.QUICK_SIZES
    trained = sizes["num_hidden_layers"] * (4 * sizes["hidden_size"] ** 2
                                            + 3 * sizes["hidden_size"] * sizes["intermediate_size"])
    # At least each trained param's reduce-scatter and one all-gather of it, half of each sent by each rank.
    assert adamw["sent/step/rank MiB"] * 2**20 >= 0.5 * 4 * 2 * trained
    assert plain["sent/step/rank MiB"] == hook["sent/step/rank MiB"] > 0
    assert adamw["params/rank MiB"] == plain["params/rank MiB"] == hook["params/rank MiB"]
    assert hook["optim/rank MiB"] < plain["optim/rank MiB"] < adamw["optim/rank MiB"]
    assert hook["grads/rank MiB"] < plain["grads/rank MiB"] == adamw["grads/rank MiB"]
    # The sparse backward's weights cross ranks as k values each: fewer bytes than FSDP2's dense reduce-scatters.
    assert sparse_backward["sent/step/rank MiB"] < hook["sent/step/rank MiB"]
    assert sparse_backward["optim/rank MiB"] == hook["optim/rank MiB"]
    assert all(r["step ms"] > 0 for r in rows.values())
    # The gradients' share of the traffic, and the k x 8 B it is held against.
    assert 0 < sparse_backward["gradients sent MiB"] < plain["gradients sent MiB"] <= plain["sent/step/rank MiB"]
    assert sparse_backward["compact grads MiB"] == hook["compact grads MiB"] > 0 == adamw["compact grads MiB"]
    assert "gradients on the wire at most 2x" in markdown


def test_all_suites_skip_the_llm_suite_when_its_packages_are_missing(monkeypatch):
    """`python -m sift.bench` (all suites), the README's main job, failed on a plain install: the llm suite needs
    the [llm] extra's packages."""
    import importlib.util

    import sift.bench.__main__ as bench_main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    assert bench_main.unavailable_suites() == {"llm": ["gguf"]}
    assert bench_main.unavailable_suites(quick=True) == {}  # --quick: a tiny random Llama, no GGUF


def test_serving_quick(tmp_path, monkeypatch):
    from sift.bench import serving

    monkeypatch.setenv("SIFT_BENCH_DIR", str(tmp_path))
    markdown = serving.run(quick=True)
    assert "Mixed deltas in one batch" in markdown and "switch_to between two deltas" in markdown
    saved = _saved(tmp_path, "serving")
    assert len(saved["rows"]) == 3 * len(serving.DENSITIES) and len(saved["switch"]) == len(serving.DENSITIES)
    assert all(r["deltas median ms"] > 0 and r["dense x W^T median ms"] > 0 for r in saved["rows"])
