"""`python -m sift.env`: versions, the active backend of every op, and why any is off."""

from __future__ import annotations

import os
import platform
import subprocess

import torch

from sift import _ops
from sift._ext import extension_status
from sift._host import cpu_name


def _git_sha() -> str:
    if os.environ.get("SIFT_GIT_SHA"):  # a copy of the tree without .git (e.g. a benchmark machine)
        return os.environ["SIFT_GIT_SHA"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def machine_header() -> dict[str, str]:
    """The machine a result was measured on: CPU, cores, GPU, versions, git SHA."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu_name(),
        "cores": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git": _git_sha(),
    }


def cpp_simd(why: bool = False) -> str:
    """The SIMD form each C++ op runs, e.g. "sparse_adamw_ avx2 (measured), sparse_adamw_lean_ avx2
    (measured), sparse_weight_grad_ avx2, singular_values avx512": the optimizer steps run the form
    measured fastest on this machine (`sift._simd`), the other ops the widest this CPU has.
    `why`: each step's timings in place of "(measured)". "" when the extension is not loaded."""
    from sift import _simd

    if not extension_status()["ok"]:
        return ""
    forms = [f"{op} {_simd.describe(op, short=not why)}" for op in _simd.STEP_OPS]
    for op in ("sparse_weight_grad_", "singular_values"):
        probe = getattr(torch.ops.sift, f"{op.rstrip('_')}_isa", None)
        if probe is not None:
            forms.append(f"{op} {probe()}")
    return ", ".join(forms)


def report() -> str:
    """Human-readable environment report (what `python -m sift.env` prints)."""
    lines = ["# sift environment", ""]
    for key, value in machine_header().items():
        lines.append(f"{key:>14}: {value}")
    ext = extension_status()
    lines.append(f"{'C++ extension':>14}: " + (f"loaded ({ext['how']})" if ext["ok"] else f"off: {ext['why']}"))
    for err in ext.get("compiler_errors") or []:
        lines.append(f"{'':>14}  {err}")
    if ext["ok"]:
        lines.append(f"{'C++ SIMD':>14}: {cpp_simd(why=True)}")
    lines.append(f"{'SIFT_CPU_ISA':>14}: {os.environ.get('SIFT_CPU_ISA', '') or 'auto'}")
    forced = os.environ.get("SIFT_BACKEND", "") or "auto"
    lines.append(f"{'SIFT_BACKEND':>14}: {forced}")
    lines.append(f"{'TRITON_INTERPRET':>14}: {os.environ.get('TRITON_INTERPRET', '0')}")
    from sift.triton_kernels._launch import record_unavailable_reason

    why_opaque = record_unavailable_reason()
    if why_opaque is not None:
        compiled = f"Triton ops stay opaque in graphs: {why_opaque}"
    elif torch.cuda.is_available():
        compiled = "Triton launches recorded in graphs (CUDA)"
    else:
        # Nothing here runs Triton: what a CUDA machine would do is not this machine's behaviour.
        compiled = "each op one graph node (no CUDA device: the C++ CPU kernels, opaque to Inductor)"
    lines.append(f"{'torch.compile':>14}: {compiled}")
    if torch.cuda.is_available():
        from sift.bench._l2 import (
            get_l2_fetch_granularity,
            l2_fetch_granularity_unavailable,
        )

        # The bound on what an L2 miss fetches (bench/gpu_sector_ceiling.py times the gathers under it).
        why_not = l2_fetch_granularity_unavailable()
        lines.append(f"{'L2 fetch bound':>14}: " + (f"{get_l2_fetch_granularity()} B" if why_not is None
                                                     else f"unknown ({why_not})"))
    lines.append("")
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    lines.append("| op | device | active backend | other backends |")
    lines.append("|---|---|---|---|")
    for name, op in sorted(_ops.ops().items()):
        for dev in devices:
            try:
                active, _ = _ops.resolve(name, dev)
            except Exception as exc:
                active = f"error: {exc}"
            others = []
            for backend in sorted(op.impls):
                if backend == active:
                    continue
                why = _ops.backend_unavailable_reason(backend, dev)
                others.append(f"{backend}: {'available' if why is None else 'off (' + why + ')'}")
            lines.append(f"| {name} | {dev.type} | {active} | {'; '.join(others) or '-'} |")
    return "\n".join(lines)


def active_backends(device: torch.device | str = "cpu") -> dict[str, str]:
    """The backend each op runs on `device` now, e.g. {"sparse_adamw_": "cpp", ...}."""
    out = {}
    for name in sorted(_ops.ops()):
        try:
            out[name] = _ops.resolve(name, torch.device(device))[0]
        except Exception as exc:
            out[name] = f"error: {exc}"
    return out


def fallback_asked() -> bool:
    """Whether the user asked for the plain-torch kernels (SIFT_SKIP_EXT=1 or SIFT_BACKEND=torch)."""
    return os.environ.get("SIFT_SKIP_EXT", "0") == "1" or os.environ.get("SIFT_BACKEND", "").strip().lower() == "torch"


def missing_kernels() -> str | None:
    """Why the compiled kernels are missing although nobody asked for the fallback, else None.

    A machine with a C++ compiler must get the C++ extension: its absence there is a broken
    build, not a platform limit.
    """
    from sift._ext import compiler_present

    ext = extension_status()
    if ext["ok"] or fallback_asked() or not compiler_present():
        return None
    errors = ext.get("compiler_errors") or [str(ext["why"])]
    return "the C++ extension failed to build, so every CPU op runs the plain-torch fallback:\n  " + "\n  ".join(errors)


def backend_banner(device: torch.device | str | None = None) -> str:
    """One block naming the active backend of every op (what a benchmark table measured)."""
    devices = [torch.device(device)] if device is not None else (
        [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else []))
    lines = []
    for dev in devices:
        pairs = ", ".join(f"{name} {backend}" for name, backend in active_backends(dev).items())
        lines.append(f"backends ({dev.type}): {pairs}")
    ext = extension_status()
    if not ext["ok"]:
        lines.append(f"C++ extension off: {ext['why']}")
        lines.extend(f"  {err}" for err in ext.get("compiler_errors") or [])
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
