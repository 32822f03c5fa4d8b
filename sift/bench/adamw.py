"""`python -m sift.bench adamw`: SparseAdamW step time against dense torch AdamW.

One run puts side by side, on the same parameters and fixed gradients:

    torch.optim.AdamW(foreach=True)    dense, 8 bytes of state per element
    torch.optim.AdamW(fused=True)      dense, the one to beat
    sift.SparseAdamW, each backend     at densities 0.1%, 1%, 5% (cpp + torch on CPU,
                                       triton + torch on CUDA, triton also under a CUDA graph)
    on CUDA, the fused and triton rows again with the L2 fetch granularity bounded to 32 B
    on CPU, a machine-limit probe (`bench/adamw_probe.cpp`, `sift/bench/_adamw_probe.py`): the
                                       step's access pattern as one plain loop and nothing else,
                                       alone and with software prefetch 32 or 64 entries ahead,
                                       timed in turn with the cpp rows, whose speed it reports as
                                       "% of probe" (of the fastest of the three loops)

Only `optimizer.step()` is timed: the first step (state allocation, and for SparseAdamW the
top-|grad| selection) runs before timing, and a random gradient is assigned once.

Byte model (what the access pattern must move per step, for GB/s). Per trainable entry the
sparse step streams the index (4 B int32), reads and writes exp_avg, exp_avg_sq and delta
(24 B), and reads the base (4 B for fp32, 2 for bf16/fp16). The gathers and the scatter touch
whole memory transactions, counted from the actual sorted indices as distinct 32-byte sectors
on GPU and 64-byte lines on CPU: one read of the gradient's and one write of the weight's (the
weights are rebuilt from base + delta, never read). Every dtype also runs on the fast backend
with state="lean" (rows "..., lean"): per entry a 2-byte index half, bf16 moments read and
written (8 B), an int8 residual read and written for bf16/fp16 (2 B), and a read of the
weight's transactions as well (the lean state keeps no base). Dense AdamW reads param, grad, exp_avg, exp_avg_sq and writes param,
exp_avg, exp_avg_sq: 7 elements per entry, states in the param dtype.

Working set: 8 matrices of 4096x4096 fp32 on CPU (512 MB of params, past the last-level
cache), 8 of 8192x16384 (1.07B elements) on CUDA.

The workload builders (`workload_shapes`, `make_params`, `dense_adamw`, `sparse_adamw`) are
shared with the pytest-benchmark cases in `bench/test_bench_adamw.py`.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence

import torch

from sift import _ops
from sift.bench._l2 import l2_fetch_granularity, l2_fetch_granularity_unavailable
from sift.bench._adamw_probe import AdamWProbe
from sift.bench._harness import (bench_device, markdown_table, paired_ratio, save_results, summary, time_cpu, time_gpu,
                                time_interleaved)
from sift.optim import SparseAdamW, clip_grad_norm_

DENSITIES = (0.001, 0.01, 0.05)
CLIP_NORM = 1.0  # below the gradients' norm, so every timed clip scales
TARGET_CLIP_RATIO = 1.6
# Target on CPU: the step at 1% at least this share of the machine-limit probe's speed. Printed, not asserted.
TARGET_PROBE_PERCENT = 90.0
# The probe's forms (rows "machine-limit probe") and their prefetch distances in entries: none,
# the exact step's and the lean step's (csrc/sparse_adamw.cpp, csrc/sparse_adamw_lean.cpp).
PROBE_PLAIN = "C++ -O3 -march=native"
PROBE_FORMS = {PROBE_PLAIN: 0, f"{PROBE_PLAIN}, prefetch 32": 32, f"{PROBE_PLAIN}, prefetch 64": 64}
# Targets: speed-up over torch.optim.AdamW(fused=True) per density. Printed, not asserted.
TARGET_SPEEDUP = {"cpu": {0.001: 40.0, 0.01: 6.0, 0.05: 2.0}, "cuda": {0.001: 100.0, 0.01: 20.0, 0.05: 5.0}}
H200_PEAK_GBPS = 4800.0
TARGET_PEAK_FRACTION = 0.70
# The granule a gather or scatter moves: an L2/DRAM sector on NVIDIA GPUs, a cache line on x86.
TRANSACTION_BYTES = {"cpu": 64, "cuda": 32}
# On CUDA the triton rows are also timed with the L2 fetch granularity bounded to one sector
# (sift/bench/_l2.py): a miss that fetches 64 B where a gather needs 32 B moves bytes nobody reads.
L2_FETCH_BYTES = 32

COLUMNS = (
    "optimizer", "backend", "dtype", "density", "median ms", "p20 ms", "p80 ms", "% of probe", "x vs fused",
    "x vs foreach", "target x vs fused", "state MB", "state B/entry", "model MB", "GB/s", "% peak",
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def workload_shapes(device: torch.device, quick: bool) -> list[tuple[int, int]]:
    """The weight shapes of the suite: 8 x 4096x4096 on CPU, 8 x 8192x16384 on CUDA, 4 x 256x384 when `quick`.

    Example:
        >>> workload_shapes(torch.device("cpu"), quick=True)
        [(256, 384), (256, 384), (256, 384), (256, 384)]
    """
    if quick:
        return [(256, 384)] * 4
    return [(8192, 16384)] * 8 if device.type == "cuda" else [(4096, 4096)] * 8


def default_dtypes(device: torch.device, quick: bool = False) -> tuple[str, ...]:
    """Weight dtypes the suite runs by default: fp32 and bf16, and fp32 alone for a quick run on CPU."""
    return ("float32",) if quick and device.type == "cpu" else ("float32", "bfloat16")


def make_params(shapes: Sequence[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> list[torch.nn.Parameter]:
    """Random weights with one fixed random gradient each.

    Args:
        shapes: one `[rows, cols]` per weight.
        dtype: weight and gradient dtype.
        device: where they live.
        seed: generator seed.

    Returns:
        Parameters whose `.grad` is set once and never changes.

    Example:
        >>> ps = make_params([(4, 8)], torch.float32, torch.device("cpu"))
        >>> ps[0].grad.shape
        torch.Size([4, 8])
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device).normal_(generator=gen))
        p.grad = torch.empty_like(p).normal_(generator=gen)
        params.append(p)
    return params


def transactions_touched(indices: Sequence[torch.Tensor], elem_size: int, transaction_bytes: int) -> int:
    """Distinct memory transactions (sectors or lines) a gather at `indices` touches.

    Assumes each tensor starts on a transaction boundary (torch's allocators align far more).

    Args:
        indices: per tensor, [k_i] sorted flat positions.
        elem_size: bytes per gathered element.
        transaction_bytes: 32 (GPU sector) or 64 (CPU line).

    Example:
        >>> transactions_touched([torch.tensor([0, 1, 15, 16])], 4, 64)
        2
    """
    per = max(1, transaction_bytes // elem_size)
    return sum(int(torch.unique_consecutive(idx.long() // per).numel()) for idx in indices)


def sparse_step_bytes(indices: Sequence[torch.Tensor], w_dtype: torch.dtype, transaction_bytes: int,
                      lean: bool = False) -> int:
    """Bytes one SparseAdamW step must move (see the module docstring's byte model).

    `lean`: the lean state (16-bit index halves, bf16 moments, int8 residual for bf16/fp16).

    Example:
        >>> sparse_step_bytes([torch.tensor([0, 100], dtype=torch.int32)], torch.float32, 64)
        320
    """
    entries = sum(int(i.numel()) for i in indices)
    elem = torch.empty((), dtype=w_dtype).element_size()
    has_base = not lean
    per_entry = indices[0].element_size() + 6 * 4 + (elem if has_base else 0)
    if lean:
        per_entry = 2 + 4 * 2 + (2 if w_dtype != torch.float32 else 0)
    weight_passes = 2 if has_base else 3  # grad read, weight read (without a base), weight write
    return entries * per_entry + weight_passes * transaction_bytes * transactions_touched(indices, elem,
                                                                                         transaction_bytes)


def probe_step_bytes(indices: Sequence[torch.Tensor], w_dtype: torch.dtype, transaction_bytes: int) -> int:
    """Bytes one step of the machine-limit probe moves: per entry the index (4 B) and fp32 m, v
    read and written (16 B), and the gradient's and the weight's lines read and the weight's written.

    Example:
        >>> probe_step_bytes([torch.tensor([0, 100], dtype=torch.int32)], torch.float32, 64)
        424
    """
    entries = sum(int(i.numel()) for i in indices)
    elem = torch.empty((), dtype=w_dtype).element_size()
    return entries * 20 + 3 * transaction_bytes * transactions_touched(indices, elem, transaction_bytes)


def dense_adamw(params: Sequence[torch.nn.Parameter], flavour: str) -> torch.optim.AdamW:
    """torch's AdamW (`flavour` "fused" or "foreach") past its first step, ready to time `step()`.

    Example:
        >>> opt = dense_adamw(make_params([(4, 8)], torch.float32, torch.device("cpu")), "foreach")
        >>> len(opt.state)
        1
    """
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, **{flavour: True})
    opt.step()  # allocates the state outside timing
    _sync(params[0].device)
    return opt


def sparse_adamw(params: Sequence[torch.nn.Parameter], density: float, backend: str,
                 indices: Sequence[torch.Tensor] | None = None, state: str = "exact") -> SparseAdamW:
    """SparseAdamW past its first step (selection and state allocation), ready to time `step()`.

    Args:
        params: weights with a fixed `.grad` (`make_params`).
        density: fraction of each weight's entries to train.
        backend: the kernel backend ("cpp", "triton", "torch").
        indices: per param, [k] sorted flat positions to use instead of selecting, so that
            several optimizers step the same entries; None selects the top |grad|.
        state: the optimizer state layout, "exact" or "lean".

    Example:
        >>> ps = make_params([(4, 8)], torch.float32, torch.device("cpu"))
        >>> sparse_adamw(ps, 0.25, "torch").state[ps[0]]["indices"].numel()
        8
    """
    opt = SparseAdamW(params, lr=1e-3, weight_decay=1e-2, density=density, backend=backend, state=state)
    if indices is not None:
        for p, idx in zip(params, indices):
            opt.set_indices(p, idx)
    opt.step()  # with indices=None: selection (top-|grad| of the fixed gradient) + first update
    _sync(params[0].device)
    return opt


def dense_step_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes one dense AdamW step must move: read p, g, m, v; write p, m, v."""
    return sum(7 * p.numel() * p.element_size() for p in params)


def copy_bandwidth_gbps(device: torch.device, nbytes: int, repeat: int = 10) -> float:
    """Best bandwidth of a plain tensor copy over `repeat` tries (all bytes moved counted).

    The best, not the median: it stands for what this machine's memory can do, the roof the
    other rows are compared with, and on a shared machine the median mostly measures neighbours.
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults outside timing
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    # A copy moves 3 bytes per byte on CPU (read src, write-allocate read of dst, write dst) and 2 on GPU.
    return (3 if device.type == "cpu" else 2) * nbytes / best / 1e9


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (Linux), else None.

    The sparse gathers touch one 4 KiB page per entry at low density, so whether the weights
    and gradients sit on 2 MiB pages changes the CPU figures severalfold (TLB reach).
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _timer(device: torch.device, repeat: int = 10, warmup: int = 3) -> Callable[[Callable[[], object]], dict]:
    if device.type == "cuda":
        return lambda fn: time_gpu(fn)
    return lambda fn: time_cpu(fn, warmup=warmup, repeat=repeat)


def graphed(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """Capture `step` in a CUDA graph (after side-stream warm-up) and return its replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def sparse_backends(device: torch.device) -> list[str]:
    """The sparse_adamw_ backends that run on `device`, fastest first (the suite's order)."""
    order = ("triton", "cpp", "torch") if device.type == "cuda" else ("cpp", "torch")
    return [b for b in order if b in _ops.ops()["sparse_adamw_"].impls
            and _ops.backend_unavailable_reason(b, device) is None]


def _row(optimizer: str, backend: str, dtype: str, density: float | str, timing: dict, state: dict,
         model_bytes: int, peak_gbps: float) -> dict[str, object]:
    gbps = model_bytes / (timing["median_ms"] * 1e-3) / 1e9
    return {
        "optimizer": optimizer, "backend": backend, "dtype": dtype,
        "density": density if isinstance(density, str) else f"{100 * density:g}%",
        "median ms": timing["median_ms"], "p20 ms": timing["p20_ms"], "p80 ms": timing["p80_ms"],
        "state MB": state["state_bytes"] / 1e6, "state B/entry": state["bytes_per_entry"],
        "model MB": model_bytes / 1e6, "GB/s": gbps, "% peak": 100 * gbps / peak_gbps,
    }


def bench_dtype(shapes: Sequence[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                densities: Sequence[float], repeat_dense: int, repeat_sparse: int, peak_gbps: float,
                graphs: bool, info: dict[str, object] | None = None) -> list[dict[str, object]]:
    """All rows for one weight dtype: dense foreach/fused, then each density and sparse backend.

    `info`, when given, receives facts about the run that explain the figures (huge pages on CPU).
    """
    kind = device.type
    dtype_name = str(dtype).removeprefix("torch.")
    params = make_params(shapes, dtype, device)
    elements = sum(p.numel() for p in params)
    if info is not None and device.type == "cpu":
        info["huge_page_bytes"] = huge_page_bytes()
        info["param_and_grad_bytes"] = 2 * sum(p.numel() * p.element_size() for p in params)
    rows: list[dict[str, object]] = []
    extra_dense: list[dict[str, object]] = []
    # Why the machine-limit probe could not run, per dtype (reported under the table).
    probe_unavailable: dict[str, str] = info.setdefault("probe_unavailable", {}) if info is not None else {}
    # The L2 fetch-bound rows only where the driver lets us read (and so set) the bound.
    l2_why_not = l2_fetch_granularity_unavailable(device) if kind == "cuda" else "not CUDA"
    l2_rows = l2_why_not is None
    if kind == "cuda" and info is not None:
        info["l2_fetch_bound"] = l2_why_not or "available"
    dense_ms: dict[str, float] = {}
    # On the shared CPU machine fused AdamW, the yardstick, is timed again before each density
    # and every "x vs fused" uses the median of all its steps, so a neighbour's load during one
    # part of the run does not skew the ratios of another.
    pool_fused = kind == "cpu"
    fused_opt = None
    fused_slots: list[list[float]] = []
    for flavour in ("foreach", "fused"):
        opt = dense_adamw(params, flavour)
        timing = _timer(device, repeat=repeat_dense, warmup=2)(opt.step)
        state = {"state_bytes": 8.0 * elements, "bytes_per_entry": 8.0}  # fp32 exp_avg + exp_avg_sq
        if dtype != torch.float32:
            state = {"state_bytes": 2.0 * dtype.itemsize * elements, "bytes_per_entry": 2.0 * dtype.itemsize}
        rows.append(_row(f"AdamW({flavour})", "torch", dtype_name, "100%", timing, state,
                         dense_step_bytes(params), peak_gbps))
        dense_ms[flavour] = timing["median_ms"]
        if pool_fused and flavour == "fused":
            fused_opt, fused_row, fused_state, fused_slots = opt, rows[-1], state, [timing["samples_ms"]]
        if l2_rows and flavour == "fused":
            # Does a 32-byte L2 fetch bound (which may help the sparse gathers) cost a streaming step?
            with l2_fetch_granularity(L2_FETCH_BYTES, device):
                timing = _timer(device)(opt.step)
            row = _row(f"AdamW({flavour})", f"torch, L2 fetch {L2_FETCH_BYTES} B", dtype_name, "100%", timing,
                       state, dense_step_bytes(params), peak_gbps)
            extra_dense.append(row)
        del opt
        _free(device)
    rows += extra_dense
    for density in densities:
        if fused_opt is not None:
            fused_slots.append(_timer(device, repeat=3, warmup=1)(fused_opt.step)["samples_ms"])
        selected: list[torch.Tensor] | None = None
        # The plain loop and the loop with the steps' prefetch distances; the limit is the fastest.
        probes: dict[str, AdamWProbe] = {}
        probe_samples: dict[str, list[float]] = {name: [] for name in PROBE_FORMS}
        # Every dtype also with state="lean", on the fast backend, next to its exact row.
        runs = [(b, "exact") for b in sparse_backends(device)]
        runs.insert(1, (runs[0][0], "lean"))
        for backend, layout in runs:
            opt = sparse_adamw(params, density, backend, indices=selected, state=layout)  # same entries
            if selected is None:
                selected = [opt.indices_of(p) for p in params]
                if kind == "cpu" and dtype_name not in probe_unavailable:
                    try:
                        probes = {name: AdamWProbe(params, selected, prefetch=PROBE_FORMS[name])
                                  for name in probe_samples}
                    except RuntimeError as exc:  # no compiler, an installed wheel without bench/, ...
                        probe_unavailable[dtype_name] = str(exc)
            model_bytes = sparse_step_bytes(selected, dtype, TRANSACTION_BYTES[kind], layout == "lean")
            label = f"{backend}, lean" if layout == "lean" else backend
            # (name, step, L2 fetch bound or None for the driver's default)
            variants: list[tuple[str, Callable[[], object], int | None]] = [(label, opt.step, None)]
            if backend == runs[0][0] and layout == "exact":
                # Global-norm clipping over the used entries, then the step: the cost clipping adds.
                def clip_and_step(opt=opt):
                    clip_grad_norm_(opt, CLIP_NORM)
                    opt.step()

                variants.append((f"{label}, clip", clip_and_step, None))
            if graphs and backend == "triton":
                try:
                    variants.append((label.replace("triton", "triton+graph"), graphed(opt.step, device), None))
                except Exception as exc:  # the benchmark reports a failed capture instead of dying
                    rows.append({"optimizer": "SparseAdamW", "backend": f"triton+graph: {type(exc).__name__}",
                                 "dtype": dtype_name, "density": f"{100 * density:g}%"})
            if l2_rows and backend == "triton":
                variants += [(f"{name}, L2 fetch {L2_FETCH_BYTES} B", fn, L2_FETCH_BYTES) for name, fn, _ in variants]
            for name, fn, fetch in variants:
                shares: dict[str, float] = {}
                if probes and backend == "cpp" and name == label:
                    # In turn with the probes, so all see the same load; a share is the median over
                    # rounds of probe time / step time, and the row's is against the fastest probe.
                    timed = time_interleaved({"step": fn, **probes}, warmup=3, repeat=repeat_sparse)
                    timing = timed["step"]
                    shares = {p: 100 * paired_ratio(timed[p], timing) for p in probes}
                    for p in probes:
                        probe_samples[p] += timed[p]["samples_ms"]
                elif fetch is None:
                    timing = _timer(device, repeat=repeat_sparse)(fn)
                else:
                    with l2_fetch_granularity(fetch, device):
                        timing = _timer(device, repeat=repeat_sparse)(fn)
                row = _row("SparseAdamW", name, dtype_name, density, timing, opt.state_bytes(), model_bytes,
                           peak_gbps)
                row["target x vs fused"] = TARGET_SPEEDUP[kind][density] if density in TARGET_SPEEDUP[kind] else ""
                if name.endswith(", clip"):
                    row["target x vs fused"] = ""
                    row["clip + step / step"] = timing["median_ms"] / rows[-1]["median ms"]
                row["% of probe"] = min(shares.values()) if shares else ""
                if shares:
                    row["% of probe, per form"] = shares
                rows.append(row)
            del opt, variants
            _free(device)
        for form, samples in probe_samples.items():
            if samples:
                rows.append(_row("machine-limit probe", form, dtype_name, density, summary(samples),
                                 {"state_bytes": 8.0 * sum(i.numel() for i in selected), "bytes_per_entry": 8.0},
                                 probe_step_bytes(selected, dtype, TRANSACTION_BYTES[kind]), peak_gbps))
        del probes
    if fused_opt is not None:
        pooled = summary([t for slot in fused_slots for t in slot])
        fused_row.update(_row("AdamW(fused)", "torch", dtype_name, "100%", pooled, fused_state,
                              dense_step_bytes(params), peak_gbps))
        dense_ms["fused"] = pooled["median_ms"]
        if info is not None:
            info["fused_slot_medians_ms"] = [summary(slot)["median_ms"] for slot in fused_slots]
        del fused_opt
    for row in rows:  # every ratio against the final yardsticks
        if "median ms" in row:
            row["x vs fused"] = dense_ms["fused"] / row["median ms"]
            row["x vs foreach"] = dense_ms["foreach"] / row["median ms"]
    del params
    _free(device)
    return rows


def run(quick: bool = False, dtypes: Sequence[str] | None = None) -> str:
    """Benchmark the SparseAdamW step against dense torch AdamW; print and save the table.

    Args:
        quick: tiny sizes for a smoke run (seconds; figures not comparable).
        dtypes: weight dtypes to run ("float32", "bfloat16"); default both (fp32 alone for a quick run on CPU).

    Returns:
        The markdown table (headed by the machine) with notes on targets and the byte model.

    Example:
        >>> print(run(quick=True))  # doctest: +SKIP
    """
    device = bench_device()
    kind = device.type
    shapes = workload_shapes(device, quick)
    if quick:
        repeat_dense, repeat_sparse = 3, 5
    elif kind == "cuda":
        repeat_dense = repeat_sparse = 0  # do_bench picks its own count
    else:
        repeat_dense, repeat_sparse = 7, 20
    if dtypes is None:
        dtypes = default_dtypes(device, quick)
    elements = sum(r * c for r, c in shapes)
    if kind == "cuda":
        peak_gbps, peak_what = H200_PEAK_GBPS, "H200 HBM3e spec 4.8 TB/s"
    else:
        copy_bytes = 16 * 2**20 if quick else 256 * 2**20
        peak_gbps = copy_bandwidth_gbps(device, copy_bytes)
        peak_what = (f"this CPU's best tensor-copy bandwidth ({peak_gbps:.1f} GB/s counting read, write-allocate and write, "
                     f"{copy_bytes // 2**20} MiB)")
    rows: list[dict[str, object]] = []
    info: dict[str, object] = {}
    load_at_start = os.getloadavg()
    for name in dtypes:
        rows += bench_dtype(shapes, _DTYPES[name], device, DENSITIES, repeat_dense, repeat_sparse, peak_gbps,
                            graphs=kind == "cuda", info=info)
    title = (f"SparseAdamW step vs torch AdamW: {len(shapes)} x {shapes[0][0]}x{shapes[0][1]} "
             f"({elements / 1e6:.0f}M elements) on {kind}" + (" [quick: sizes not comparable]" if quick else ""))
    targets = ", ".join(f"{100 * d:g}%: >= {x:g}x" for d, x in TARGET_SPEEDUP[kind].items())
    notes = [
        "",
        f"Targets vs AdamW(fused) on {kind} (printed, not asserted): {targets}"
        + (f"; >= {100 * TARGET_PEAK_FRACTION:.0f}% of {H200_PEAK_GBPS / 1000:g} TB/s" if kind == "cuda" else "")
        + ".",
        f"Byte model: per entry idx 4 B + m, v, delta read and written 24 B + the base read; gathers and scatter "
        f"counted in distinct {TRANSACTION_BYTES[kind]}-byte transactions from the actual sorted indices (grad read, "
        f"weight write; the lean rows also read the weight, having no base). Dense AdamW: 7 elements per entry. "
        f"% peak is against {peak_what}.",
        "Timed: `optimizer.step()` only, after selection and state allocation; gradients fixed. "
        + ("GPU: triton.testing.do_bench (L2 flushed), median and p20/p80." if kind == "cuda" else
           f"CPU: perf_counter medians over {repeat_dense} dense / {repeat_sparse} sparse steps after warm-up, "
           f"{torch.get_num_threads()} threads."),
    ]
    if kind == "cpu":
        huge, total = info.get("huge_page_bytes"), info.get("param_and_grad_bytes")
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
        notes.append(f"Transparent huge pages: {'unknown' if huge is None else f'{huge / 2**20:.0f} MiB'} of anonymous "
                     f"memory on huge pages for {float(total or 0) / 2**20:.0f} MiB of weights + grads "
                     f"(THP_MEM_ALLOC_ENABLE={thp}). Load average at the start: "
                     f"{', '.join(f'{x:.1f}' for x in load_at_start)}; at the end: "
                     f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores (shared machine).")
        slots = info.get("fused_slot_medians_ms")
        if slots:
            notes.append(f"AdamW(fused) was timed before the sparse rows ({repeat_dense} steps) and again before each "
                         f"density (3 steps each); its row and every 'x vs fused' use the median of all "
                         f"{repeat_dense + 3 * (len(slots) - 1)} steps. Slot medians: "
                         f"{', '.join(f'{x:.1f}' for x in slots)} ms.")
    probe_rows = [r for r in rows if r.get("% of probe") not in (None, "") and r["optimizer"] == "SparseAdamW"]
    if probe_rows:
        notes.append(
            "% of probe: the step's speed as a share of the machine-limit probe's (bench/adamw_probe.cpp: gather the "
            "gradient and the weight at the same indices, fp32 AdamW moments, scatter the weight, nothing else; one plain "
            f"loop, -O3 -march=native, {torch.get_num_threads()} OpenMP threads), alone and with software prefetch "
            "32 and 64 entries ahead (the exact and the lean step's distances), each step timed in turn with all three "
            "and the share the median of the rounds' probe / step times, against the fastest form; above 100% the "
            f"step is faster than every loop. Target at 1%: >= {TARGET_PROBE_PERCENT:g}% (printed, not asserted); per "
            "cell the share of the plain / prefetch 32 / prefetch 64 loop: "
            + ", ".join(f"{r['backend']} {r['dtype']} {r['density']} {r['% of probe']:.0f}% "
                        f"({' / '.join(f'{x:.0f}' for x in r['% of probe, per form'].values())})"
                        for r in probe_rows) + ".")
    for name, why in (info.get("probe_unavailable") or {}).items():
        notes.append(f"Machine-limit probe unavailable for {name}: {why}")
    clip_rows = [r for r in rows if "clip + step / step" in r]
    if clip_rows:
        notes.append(f"`clip_grad_norm_` + step against the step alone (target at 1%: <= {TARGET_CLIP_RATIO:g}x, "
                     "printed, not asserted): " + ", ".join(f"{r['dtype']} {r['density']} {r['clip + step / step']:.2f}x"
                                                         for r in clip_rows) + ".")
    met = _speedup_targets_met(rows)
    notes.append("Speed-up target met: " + ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in met.items()) + ".")
    markdown = markdown_table(title, COLUMNS, rows) + "\n" + "\n".join(notes)
    save_results("adamw", rows, markdown, extra={
        "config": {"shapes": shapes, "densities": list(DENSITIES), "dtypes": list(dtypes), "quick": quick,
                   "transaction_bytes": TRANSACTION_BYTES[kind], "peak_gbps": peak_gbps, "peak_what": peak_what,
                   **info},
        "targets": {"speedup_vs_fused": {str(k): v for k, v in TARGET_SPEEDUP[kind].items()},
                    **({"peak_fraction": TARGET_PEAK_FRACTION} if kind == "cuda" else {})},
    }, quick=quick)
    return markdown


def _speedup_targets_met(rows: Sequence[dict[str, object]]) -> dict[str, bool]:
    """Which sparse rows meet their target (for the summary line; never asserted)."""
    return {f"{r['backend']} {r['dtype']} {r['density']}": float(r["x vs fused"]) >= float(r["target x vs fused"])
            for r in rows if r.get("target x vs fused") not in (None, "")}
