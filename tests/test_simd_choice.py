"""The C++ steps run the SIMD form measured fastest here (sift/_simd.py), cached per machine, unless
SIFT_CPU_ISA forces one; `python -m sift.env` says which and why."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import cpu_isa_levels, exact_step_lists, requires_cpp

pytestmark = requires_cpp

OPS = ("sparse_adamw_", "sparse_adamw_lean_")


def _isa(op: str) -> str:
    return getattr(torch.ops.sift, f"{op.rstrip('_')}_isa")()


def _use(op: str, isa: str) -> None:
    getattr(torch.ops.sift, f"{op.rstrip('_')}_use_isa")(isa)


@pytest.fixture
def restore_choice():
    """Each step op's measured choice, put back after the test."""
    from sift import _simd

    saved = {op: _isa(op) for op in OPS}, dict(_simd._choices)
    yield
    for op, isa in saved[0].items():
        _use(op, isa)
    _simd._choices.clear()
    _simd._choices.update(saved[1])


@pytest.mark.parametrize("op", OPS)
def test_levels_start_with_the_scalar_loop_and_hold_the_choice(op):
    levels = cpu_isa_levels(op)
    assert levels[0] == "generic" and set(levels) <= {"generic", "avx2", "avx512"}
    assert _isa(op) in levels


def test_fastest_takes_the_fewest_ns_and_breaks_ties_toward_the_narrower_form():
    from sift._simd import fastest

    assert fastest({"generic": 9.0, "avx2": 6.0, "avx512": 7.5}) == "avx2"
    assert fastest({"generic": 5.0, "avx2": 5.0}) == "generic"


@pytest.mark.parametrize("op", OPS)
def test_forced_form_runs_and_the_report_names_the_switch(op, monkeypatch):
    from sift import _simd

    for isa in cpu_isa_levels(op):
        monkeypatch.setenv("SIFT_CPU_ISA", isa)
        assert _isa(op) == isa
        assert _simd.describe(op) == f"{isa} (SIFT_CPU_ISA={isa})"


def test_forcing_a_form_the_cpu_lacks_or_an_unknown_one_raises_at_the_step(monkeypatch):
    lists = exact_step_lists(torch.float32, seed=0)
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0, False, False)
    missing = [isa for isa in ("avx2", "avx512") if isa not in cpu_isa_levels()]
    for isa, message in [(m, "asks for a form this CPU cannot run") for m in missing] + [("sse9", "isa must be one of")]:
        monkeypatch.setenv("SIFT_CPU_ISA", isa)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.sift.sparse_adamw_(*lists, *hyper)
    monkeypatch.setenv("SIFT_CPU_ISA", "generic")
    torch.ops.sift.sparse_adamw_(*lists, *hyper)


def test_lean_step_forced_to_avx512_runs_its_widest_form_below(monkeypatch):
    """The lean step has no AVX-512 form: SIFT_CPU_ISA=avx512 on an AVX-512 CPU runs its AVX2 form."""
    if "avx512" not in cpu_isa_levels():
        pytest.skip("this CPU has no AVX-512 form")
    monkeypatch.setenv("SIFT_CPU_ISA", "avx512")
    assert torch.ops.sift.sparse_adamw_lean_isa() == "avx2"


def test_use_isa_refuses_a_form_beyond_the_widest(restore_choice):
    with pytest.raises(RuntimeError, match="not supported by this CPU or build"):
        torch.ops.sift.sparse_adamw_lean_use_isa("avx512")


def test_choice_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch, restore_choice):
    """The first choice times every form and writes the cache; a later one reads it (no timing) and
    runs its fastest; a cache entry of other forms (another CPU's) is timed again."""
    from sift import _simd

    monkeypatch.setenv("SIFT_CACHE", str(tmp_path))
    monkeypatch.delenv("SIFT_CPU_ISA", raising=False)
    _simd.choose("test-sources")
    path = tmp_path / _simd.CACHE_FILE
    cache = json.loads(path.read_text())
    for op in OPS:
        levels = cpu_isa_levels(op)
        if len(levels) == 1:
            assert "the only form" in _simd.describe(op)
            continue
        (key,) = [k for k in cache if k.startswith(op + "|") and "test-sources" in k]
        timings = cache[key]["ns_per_entry"]
        assert list(timings) == levels and all(ns > 0 for ns in timings.values())
        assert _isa(op) == _simd.fastest(timings)
        assert "measured fastest here" in _simd.describe(op) and "; now)" in _simd.describe(op)
        # Another process: the cached timings decide (the slowest made fastest here), nothing is timed.
        cache[key]["ns_per_entry"] = {isa: (1.0 if isa == levels[-1] else 2.0) for isa in levels}
    path.write_text(json.dumps(cache))

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached choice was timed again")

    monkeypatch.setattr(_simd, "measure", no_timing)
    _simd.choose("test-sources")
    for op in OPS:
        levels = cpu_isa_levels(op)
        assert _isa(op) == levels[-1]
        if len(levels) > 1:
            assert "cached in" in _simd.describe(op)


def test_env_report_says_which_form_and_why():
    from sift.env import cpp_simd, report

    text = report()
    assert "SIFT_CPU_ISA" in text
    line = next(line for line in text.splitlines() if "C++ SIMD" in line)
    for op in OPS:
        assert f"{op} {_isa(op)} (" in line
    if len(cpu_isa_levels()) > 1:
        assert "measured fastest here" in line or "SIFT_CPU_ISA=" in line
        assert f"sparse_adamw_ {_isa('sparse_adamw_')} (" in cpp_simd()
