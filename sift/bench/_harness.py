"""Shared benchmark harness: timing, markdown tables headed by the machine, JSON results.

Benchmarks measure; tests assert. Nothing here makes a pass/fail decision.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from sift.env import cpp_simd, machine_header


def time_cpu(fn: Callable[[], object], warmup: int = 3, repeat: int = 10) -> dict[str, float]:
    """Time `fn` on the CPU with `time.perf_counter`.

    Args:
        fn: the work to time (called `warmup + repeat` times).
        warmup: untimed calls first.
        repeat: timed calls.

    Returns:
        `{"median_ms", "p20_ms", "p80_ms"}` over the timed calls, and `"samples_ms"`, the
        calls themselves (to pool timings taken at several points of a run: `summary`).

    Example:
        >>> time_cpu(lambda: sum(range(1000)), warmup=1, repeat=5)["median_ms"] > 0
        True
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {**summary(samples), "samples_ms": samples}


def time_interleaved(fns: dict[str, Callable[[], object]], warmup: int, repeat: int) -> dict[str, dict[str, float]]:
    """Times several functions in rotation, so load from other work on the machine hits all alike.

    Returns:
        name -> `{"median_ms", "p20_ms", "p80_ms", "samples_ms"}`; the i-th samples of all names
        were taken one after the other (`paired_ratio` compares them pair by pair).

    Example:
        >>> t = time_interleaved({"a": lambda: None, "b": lambda: None}, warmup=1, repeat=3)
        >>> sorted(t)
        ['a', 'b']
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
            gc.collect()
    return {name: {**summary(s), "samples_ms": s} for name, s in samples.items()}


def paired_ratio(numerator: dict, denominator: dict) -> float:
    """Median over rounds of numerator / denominator time, from two `time_interleaved` results: each
    round's two timings saw the same load, so the ratio moves less than one of medians.

    Example:
        >>> paired_ratio({"samples_ms": [2.0, 9.0, 4.0]}, {"samples_ms": [4.0, 10.0, 8.0]})
        0.5
    """
    return statistics.median(a / b for a, b in zip(numerator["samples_ms"], denominator["samples_ms"]))


def time_gpu(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> dict[str, float]:
    """Time `fn` on the GPU with `triton.testing.do_bench` (CUDA events, L2 flushed).

    Returns:
        `{"median_ms", "p20_ms", "p80_ms"}`.
    """
    from triton.testing import do_bench

    med, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return {"median_ms": float(med), "p20_ms": float(p20), "p80_ms": float(p80)}


class CudaStamp:
    """A CUDA event recorded on the current stream when the stamp is made.

    `later - earlier` waits for `later`'s event and returns the device time between the two
    stamps in seconds, which is what pytest-benchmark's runner computes from its timer.
    """

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def __sub__(self, earlier: CudaStamp) -> float:
        self.event.synchronize()
        return earlier.event.elapsed_time(self.event) / 1e3  # elapsed_time is in milliseconds


def cuda_event_timer() -> CudaStamp:
    """A pytest-benchmark timer that reads CUDA events instead of the host clock.

    The runner calls the timer before and after the work and subtracts: with this timer the
    difference is the GPU time of the work queued in between (`bench/conftest.py` gives it to
    the benchmarks that run on CUDA, in pedantic rounds with the queue drained before each).

    Example:
        >>> @pytest.mark.benchmark(timer=cuda_event_timer)  # doctest: +SKIP
        ... def test_step(benchmark): ...
    """
    return CudaStamp()


def bench_device() -> torch.device:
    """The device the suites measure: CUDA when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def time_fn(fn: Callable[[], object], device: torch.device | str, **kwargs) -> dict[str, float]:
    """`time_gpu` for CUDA devices, `time_cpu` otherwise."""
    if torch.device(device).type == "cuda":
        return time_gpu(fn, **{k: v for k, v in kwargs.items() if k in ("warmup_ms", "rep_ms")})
    return time_cpu(fn, **{k: v for k, v in kwargs.items() if k in ("warmup", "repeat")})


def summary(samples: Sequence[float]) -> dict[str, float]:
    """`{"median_ms", "p20_ms", "p80_ms"}` of timings in milliseconds."""
    ordered = sorted(samples)

    def q(frac: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(frac * (len(ordered) - 1))))]

    return {"median_ms": statistics.median(ordered), "p20_ms": q(0.2), "p80_ms": q(0.8)}


def header_lines() -> list[str]:
    """Markdown lines naming the machine (CPU, cores, GPU, versions, git SHA)."""
    h = machine_header()
    simd = cpp_simd()
    return [
        f"Machine: {h['cpu']} ({h['cores']} cores, torch threads {h['torch_threads']}); GPU: {h['gpu']}; "
        f"torch {h['torch']}; triton {h['triton']}; python {h['python']}; git {h['git']}"
        + (f"; C++ SIMD: {simd}" if simd else "")
    ]


def markdown_table(title: str, columns: Sequence[str], rows: Sequence[dict[str, object]]) -> str:
    """Render `rows` (dicts keyed by `columns`) as a markdown table headed by the machine."""
    lines = [f"### {title}", "", *header_lines(), ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def results_dir() -> str:
    """Where results are written: `$SIFT_BENCH_DIR`, else `bench/results` in a checkout, else cwd."""
    env = os.environ.get("SIFT_BENCH_DIR")
    if env:
        return env
    repo_bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "results")
    return os.path.normpath(repo_bench) if os.path.isdir(os.path.dirname(repo_bench)) else os.getcwd()


def save_results(name: str, rows: Sequence[dict[str, object]], markdown: str, extra: dict | None = None,
                 quick: bool = False) -> str:
    """Write `<name>-<device>.json` and `.md` under `results_dir()`; returns the JSON path.

    A `quick` (smoke) run writes `<name>-<device>-quick.*` instead, so it never replaces the
    measured results kept in the repository.
    """
    out = results_dir()
    os.makedirs(out, exist_ok=True)
    tag = ("gpu" if torch.cuda.is_available() else "cpu") + ("-quick" if quick else "")
    path = os.path.join(out, f"{name}-{tag}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_header(), "rows": list(rows), **(extra or {})}, f, indent=1)
    with open(os.path.join(out, f"{name}-{tag}.md"), "w") as f:
        f.write(markdown + "\n")
    return path


def rss_kib(field: str = "VmRSS") -> int | None:
    """A memory field of this process from /proc/self/status in KiB (VmRSS, VmHWM, ...), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
