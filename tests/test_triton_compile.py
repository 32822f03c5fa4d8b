"""The Triton kernels compile, as the package launches them, for the GPUs users run (sm_80 A100,
sm_90 H100/H200), on a machine without a GPU: the interpreter, which runs them in the other tests,
never lowers them to PTX, so a construct the GPU backend rejects, a spill in a streaming kernel or
a fused multiply-add the contract does not make would otherwise surface only on a GPU.

`triton_compile_cases.py` calls every public launcher with the arguments the ops pass and
compiles each specialization those calls reach (see its docstring); it also writes
bench/results/gpu-compile.md, which the last test keeps current.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import struct
import time
from pathlib import Path

import pytest
import torch

from conftest import requires_triton

triton = pytest.importorskip("triton")
import triton_compile_cases as cases  # noqa: E402  (after the skip: it needs triton)

REPORT = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu-compile.md"


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    """Each target's specializations, compiled once for the module (about two minutes on 2 cores)."""
    from triton import knobs

    if not os.path.exists(knobs.nvidia.ptxas.path):
        pytest.skip("this Triton build ships no ptxas")
    start = time.perf_counter()
    results = cases.compile_all()
    print(f"compiled {sum(map(len, results.values()))} specializations in {time.perf_counter() - start:.0f} s")
    return results


def _kernel_names() -> set[str]:
    import sift.triton_kernels as package

    names = set()
    for module in pkgutil.iter_modules(package.__path__):
        mod = importlib.import_module(f"sift.triton_kernels.{module.name}")
        names |= {name for name, obj in vars(mod).items() if name.endswith("_kernel") and hasattr(obj, "fn")}
    return names


def test_every_kernel_compiles_for_each_target_from_its_launcher(compiled):
    assert set(compiled) == set(cases.TARGETS)
    for target, rows in compiled.items():
        assert {r["kernel"] for r in rows} == _kernel_names(), target
    # One launch sequence, so both targets meet the same specializations in the same order.
    assert [r["launch"] for r in compiled["sm_80"]] == [r["launch"] for r in compiled["sm_90"]]
    launches = {r["launch"] for r in compiled["sm_90"]}
    for kind in ("bf16 base compact int64 lr-tensor table", "fp16 base dense int32 lr-float recorded"):
        assert f"sparse_adamw_ {kind}" in launches
    assert "sparse_adamw_lean_ 4-bit delta values recorded" in launches


# Measured exceptions, by Triton version: Triton 3.8 (the one torch 2.14.1 resolves) gives two recorded bf16 compact
# lean launches 8 bytes of spill on sm_90 at 40 registers; 3.9 spills nothing anywhere. Any other spill fails.
KNOWN_SPILLS = {
    ("3.8", "sm_90", "sparse_adamw_lean_ bf16 compact lr-float recorded"): (8, 8, 8),
    ("3.8", "sm_90", "sparse_adamw_lean_ bf16 compact maximize recorded"): (8, 8, 8),
}


def test_streaming_kernels_do_not_spill(compiled):
    import triton

    version = ".".join(triton.__version__.split(".")[:2])
    for target, rows in compiled.items():
        for r in rows:
            if r["kernel"] in cases.STREAMING:
                expected = KNOWN_SPILLS.get((version, target, r["launch"]), (0, 0, 0))
                assert (r["spill_stores"], r["spill_loads"], r["stack"]) == expected, (target, r)


def test_rounded_kernels_have_no_fused_multiply_add_in_any_launch(compiled):
    """Regression: the lean step's separate roundings were a launch option torch.compile drops, and the
    delta apply contracted old + scale * val into one FMA."""
    fused = {}
    for target, rows in compiled.items():
        for kernel in cases.ROUNDED:
            mine = [r for r in rows if r["kernel"] == kernel]
            assert mine, kernel
            if kernel != "_sparse_delta_apply_kernel":  # the step kernels' DIRECT launches, as Inductor compiles them
                assert any(r["launch"].endswith("recorded") for r in mine), kernel
            fused.update({(target, r["launch"]): r["fma_32"] for r in mine if r["fma_32"]})
            # fp64 (the step's bias corrections): only the FMAs inside libdevice's two exp2 calls.
            exp2_calls = 0 if kernel == "_sparse_delta_apply_kernel" else 2
            fused.update({(target, r["launch"], "fp64"): r["fma_64"] for r in mine
                          if r["fma_64"] != exp2_calls * r["exp2_fp64_fma"]})
    assert fused == {}


def test_report_is_current(compiled):
    tools = cases.versions()
    committed = REPORT.read_text()
    if f"triton {tools['triton']}, ptxas {tools['ptxas']}," not in committed:
        pytest.skip(f"{REPORT.name} was made with another toolchain")
    assert committed == cases.report(compiled, tools), \
        f"regenerate: python tests/triton_compile_cases.py --write {REPORT.relative_to(REPORT.parents[2])}"


@requires_triton
@pytest.mark.parametrize("case", ["fma-sensitive", "negative-scale"])
def test_delta_apply_rounds_scale_times_value_before_the_add(case):
    """Regression: the delta apply rounded old + scale * val once (an FMA), the contract twice."""
    from sift._ops import sparse_delta_apply_ref
    from sift.triton_kernels.delta import sparse_delta_apply_

    one_plus = struct.unpack("<f", struct.pack("<I", 0x3F800003))[0]  # 1 + 3 * 2**-23
    scale = one_plus if case == "fma-sensitive" else -one_plus
    old = -1.0 if case == "fma-sensitive" else 1.0
    want, got = torch.full((5,), old), torch.full((5,), old)
    idx, val = torch.tensor([0, 3]), torch.full((2,), one_plus)
    sparse_delta_apply_ref([want], [idx], [val], scale, [])
    sparse_delta_apply_([got], [idx], [val], scale, [])
    expected = 6 * 2.0**-23 * (1 if case == "fma-sensitive" else -1)  # 0x1.8p-21: the product rounded first
    assert want[0].item() == expected
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
