"""`python -m sift.bench delta`: sparse-delta merge and apply against plain torch, and file sizes.

One run puts side by side, on the same data:

    merge   8 deltas of 10M entries each (sorted unique random indices in a 1B-element space, fp32
            values, int32 indices): `torch.ops.sift.merge_sorted_deltas` (C++, sum and ties)
            against the best plain-torch pipeline, the faster of
              cat + sort + unique_consecutive(return_inverse) + index_add_  (segment sum)
              cat + unique(sorted, return_inverse) + index_add_
    apply   one 10M-entry delta onto a 1B-element fp32 weight (4 GB): `sparse_delta_apply_`
            (C++ scatter-add, alone and with the gather of the overwritten values that
            `SparseDelta.apply_` keeps for `remove_`) against `index_add_`, plus the whole
            `SparseDelta.apply_` (validation, fingerprint, gather, scatter)
    files   `SparseDelta.save` of the 10M-entry delta and of the merged one against a dense
            safetensors checkpoint of the same weight (its size computed, not written)

Byte models (GB/s). Merge: 8 B read per input entry (int32 index + fp32 value) and 8 B written per
output entry. Apply: 8 B per entry streamed, plus each distinct 64-byte line of the weight the
sorted indices touch read and written (128 B), plus 4 B per entry for the saved originals.

Memory: 640 MB of input deltas, ~3 GB at the peak of the torch merge, then the 4 GB weight: under
8 GB in all (the 24 GB machine also runs other work). `quick=True` shrinks everything 100x.

The workload builders (`workload_sizes`, `merge_workload`, `merge_routes`, `apply_workload`,
`apply_routes`) are shared with the pytest-benchmark cases in `bench/test_bench_delta.py`.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Callable

import torch

from sift import _ops
from sift.bench._harness import markdown_table, save_results, time_cpu, time_interleaved
from sift.delta import DeltaEntry, SparseDelta

# Targets on the 2-core CPU: speed-up over the plain-torch baselines. Printed, not asserted.
TARGET_SPEEDUP = {"merge": 5.0, "apply": 3.0}

COLUMNS = ("op", "implementation", "entries in", "entries out", "median ms", "p20 ms", "p80 ms", "x vs torch",
           "target x", "GB/s")
FILE_COLUMNS = ("artifact", "entries", "file MB", "bytes / entry", "dense fp32 checkpoint MB", "x smaller",
                "save ms", "load ms")


# The two plain-torch merge pipelines; the faster one is the baseline.
TORCH_MERGES = ("torch cat+sort+unique_consecutive+index_add_", "torch cat+unique+index_add_")


def workload_sizes(quick: bool) -> tuple[int, int, int]:
    """`(k, n, space)`: k deltas of n entries each in an index space of `space` elements.

    Example:
        >>> workload_sizes(quick=True)
        (8, 100000, 10000000)
    """
    return (8, 100_000, 10_000_000) if quick else (8, 10_000_000, 1_000_000_000)


def random_sorted_indices(n: int, space: int, gen: torch.Generator) -> torch.Tensor:
    """`n` distinct sorted positions drawn uniformly from `[0, space)`, int32 when they fit.

    Example:
        >>> random_sorted_indices(5, 100, torch.Generator().manual_seed(0)).shape
        torch.Size([5])
    """
    # Oversample, dedupe, then drop a random surplus: exact count without a `space`-sized permutation.
    draw = torch.randint(0, space, (n + n // 50 + 16,), generator=gen).unique()
    while draw.numel() < n:
        draw = torch.cat([draw, torch.randint(0, space, (n,), generator=gen)]).unique()
    keep = torch.randperm(draw.numel(), generator=gen)[:n].sort().values
    return draw[keep].to(torch.int32 if space < 2**31 else torch.int64)


def _torch_merge_sort(indices: list[torch.Tensor], values: list[torch.Tensor]):
    flat_idx, flat_val = torch.cat(indices), torch.cat(values)
    sorted_idx, perm = torch.sort(flat_idx)
    union, inverse = torch.unique_consecutive(sorted_idx, return_inverse=True)
    return union, torch.zeros(union.numel()).index_add_(0, inverse, flat_val[perm])


def _torch_merge_unique(indices: list[torch.Tensor], values: list[torch.Tensor]):
    union, inverse = torch.unique(torch.cat(indices), sorted=True, return_inverse=True)
    return union, torch.zeros(union.numel()).index_add_(0, inverse, torch.cat(values))


def _gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _row(op: str, impl: str, n_in: int, n_out: int, t: dict[str, float], base_ms: float | None,
         target: float | None, nbytes: float) -> dict[str, object]:
    return {
        "op": op, "implementation": impl, "entries in": n_in, "entries out": n_out,
        "median ms": t["median_ms"], "p20 ms": t["p20_ms"], "p80 ms": t["p80_ms"],
        "x vs torch": base_ms / t["median_ms"] if base_ms else "",
        "target x": f">= {target:g}" if target else "", "GB/s": _gbps(nbytes, t["median_ms"]),
    }


def merge_workload(k: int, n: int, space: int, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`k` random deltas of `n` entries in `[0, space)`: per delta, [n] sorted indices and [n] fp32 values.

    Example:
        >>> idx, val = merge_workload(2, 5, 100, torch.Generator().manual_seed(0))
        >>> [i.shape for i in idx], val[0].dtype
        ([torch.Size([5]), torch.Size([5])], torch.float32)
    """
    indices = [random_sorted_indices(n, space, gen) for _ in range(k)]
    values = [torch.randn(n, generator=gen) for _ in range(k)]
    return indices, values


def merge_routes(indices: list[torch.Tensor], values: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The merges compared on one workload: the `TORCH_MERGES` pipelines, then the C++ op ("sum", "ties").

    The C++ routes need the extension (`sift._ext.load_extension()`).
    """
    ones = [1.0] * len(indices)

    def cpp(ties: bool) -> Callable[[], object]:
        return lambda: torch.ops.sift.merge_sorted_deltas(indices, values, ones, [len(indices)], ties)

    return {
        TORCH_MERGES[0]: lambda: _torch_merge_sort(indices, values),
        TORCH_MERGES[1]: lambda: _torch_merge_unique(indices, values),
        "sum": cpp(False),
        "ties": cpp(True),
    }


def bench_merge(k: int, n: int, space: int, repeat: int, gen: torch.Generator) -> tuple[list[dict], dict]:
    """Times the k-way merge of `k` random deltas of `n` entries in `[0, space)`.

    Returns:
        The table rows and `{"deltas": [...], "merged": (indices, values)}` for the file sizes.
    """
    indices, values = merge_workload(k, n, space, gen)
    routes = merge_routes(indices, values)
    merged_idx, merged_val = (t[0] for t in routes["sum"]())
    ref_idx, ref_val = _torch_merge_sort(indices, values)
    if not torch.equal(merged_idx, ref_idx.to(merged_idx.dtype)):
        raise RuntimeError("C++ merge and torch disagree on the union of indices")
    torch.testing.assert_close(merged_val, ref_val, rtol=1e-5, atol=1e-6)
    del ref_idx, ref_val
    n_out = merged_idx.numel()
    nbytes = 8 * k * n + 8 * n_out
    t = time_interleaved(routes, warmup=1, repeat=repeat)
    best = min(TORCH_MERGES, key=lambda name: t[name]["median_ms"])
    base_ms = t[best]["median_ms"]
    rows = [_row("merge", f"{name}{' (baseline: best torch)' if name == best else ''}", k * n, n_out, t[name], None,
                 None, nbytes) for name in TORCH_MERGES]
    rows.append(_row("merge", "sift C++ merge_sorted_deltas (sum)", k * n, n_out, t["sum"], base_ms,
                     TARGET_SPEEDUP["merge"], nbytes))
    rows.append(_row("merge", "sift C++ merge_sorted_deltas (ties)", k * n, n_out, t["ties"], base_ms, None, nbytes))
    return rows, {"deltas": (indices, values), "merged": (merged_idx, merged_val)}


def apply_workload(n: int, space: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An `n`-entry delta and the weight it applies to: ([n] sorted indices, [n] fp32 values, [space] fp32 weight).

    Example:
        >>> idx, val, weight = apply_workload(5, 100, torch.Generator().manual_seed(0))
        >>> idx.shape, weight.shape
        (torch.Size([5]), torch.Size([100]))
    """
    idx = random_sorted_indices(n, space, gen)
    val = torch.randn(n, generator=gen) * 1e-3
    weight = torch.randn(space, generator=gen)  # fp32; values drift over repeats, which timing ignores
    return idx, val, weight


def apply_routes(idx: torch.Tensor, val: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The applies compared on one workload, each adding the delta to `weight` in place.

    "index_add_" (the baseline), "cpp" (`sparse_delta_apply_`), "cpp+save" (also gathers the
    overwritten values) and "api" (`SparseDelta.apply_` + `remove_`). The C++ routes need the
    extension.
    """
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(weight, requires_grad=False)
    delta = SparseDelta({"weight": DeltaEntry((weight.numel(),), torch.float32, idx, val)})

    def api_round_trip():
        delta.apply_(model)
        delta.remove_(model)

    return {
        "index_add_": lambda: weight.index_add_(0, idx, val),
        "cpp": lambda: torch.ops.sift.sparse_delta_apply_([weight], [idx], [val], 1.0, []),
        "cpp+save": lambda: torch.ops.sift.sparse_delta_apply_([weight], [idx], [val], 1.0,
                                                               _ops.originals_like([weight], [idx])),
        "api": api_round_trip,
    }


def bench_apply(n: int, space: int, repeat: int, gen: torch.Generator) -> tuple[list[dict], dict]:
    """Times adding an `n`-entry delta to a `space`-element fp32 weight, C++ against `index_add_`."""
    idx, val, weight = apply_workload(n, space, gen)
    lines = int(torch.unique_consecutive(idx.long() // 16).numel())
    stream = 8 * n + 128 * lines
    scratch = weight[: min(space, 1 << 16)].clone()
    # Check once, on a copy of a slice, that the op computes what index_add_ does.
    probe_idx = idx[idx < scratch.numel()]
    probe = scratch.clone()
    _ops.call("sparse_delta_apply_", [probe], [probe_idx], [val[: probe_idx.numel()]], 1.0, [], backend="cpp")
    if not torch.equal(probe, scratch.index_add(0, probe_idx, val[: probe_idx.numel()])):
        raise RuntimeError("C++ apply and index_add_ disagree")
    t = time_interleaved(apply_routes(idx, val, weight), warmup=2, repeat=repeat)
    t_torch, t_cpp, t_cpp_save, t_api = t["index_add_"], t["cpp"], t["cpp+save"], t["api"]
    base = t_torch["median_ms"]
    rows = [
        _row("apply", "torch index_add_ (baseline)", n, n, t_torch, None, None, stream),
        _row("apply", "sift C++ sparse_delta_apply_ (scatter-add)", n, n, t_cpp, base, TARGET_SPEEDUP["apply"],
             stream),
        _row("apply", "sift C++ sparse_delta_apply_ + gather of originals", n, n, t_cpp_save, base, None,
             stream + 4 * n),
        _row("apply", "SparseDelta.apply_ + remove_ (validate, fingerprint, apply, restore)", n, n, t_api, None,
             None, 2 * (stream + 4 * n)),
    ]
    return rows, {"weight_numel": space, "distinct_lines": lines}


def bench_files(artifacts: dict[str, tuple[torch.Tensor, torch.Tensor]], space: int) -> list[dict[str, object]]:
    """Saves each (indices, values) as a one-weight delta and compares with a dense fp32 checkpoint."""
    rows = []
    # safetensors layout of one dense [space] fp32 tensor: 8-byte length, JSON header, data.
    dense_bytes = 8 + 128 + 4 * space
    with tempfile.TemporaryDirectory() as tmp:
        for name, (idx, val) in artifacts.items():
            delta = SparseDelta({"weight": DeltaEntry((space,), torch.float32, idx, val)})
            path = os.path.join(tmp, f"{name}.safetensors")
            t_save = time_cpu(lambda: delta.save(path), warmup=0, repeat=1)
            t_load = time_cpu(lambda: SparseDelta.load(path), warmup=0, repeat=1)
            size = os.path.getsize(path)
            rows.append({
                "artifact": name, "entries": idx.numel(), "file MB": size / 1e6,
                "bytes / entry": size / max(1, idx.numel()), "dense fp32 checkpoint MB": dense_bytes / 1e6,
                "x smaller": dense_bytes / size, "save ms": t_save["median_ms"], "load ms": t_load["median_ms"],
            })
            os.remove(path)
    return rows


def run(quick: bool = False) -> str:
    """Benchmark delta merge, apply and file size against plain torch; print and save the tables.

    Args:
        quick: 100x smaller sizes for a smoke run (seconds; figures not comparable).

    Returns:
        The markdown (machine header, the timing table, the file-size table, notes).

    Example:
        >>> print(run(quick=True))  # doctest: +SKIP
    """
    from sift._ext import load_extension

    if not load_extension():
        return "### delta\n\nthe C++ extension is unavailable; nothing to compare (see `python -m sift.env`)\n"
    k, n, space = workload_sizes(quick)
    repeat = 5 if quick else 7  # rotations; the torch merge takes seconds per call at full size
    gen = torch.Generator().manual_seed(0)
    load_before = os.getloadavg()
    merge_rows, merge_data = bench_merge(k, n, space, repeat, gen)
    first_idx, first_val = merge_data["deltas"][0][0], merge_data["deltas"][1][0]
    files = {f"one delta ({n / 1e6:g}M entries)": (first_idx, first_val), f"merge of {k}": merge_data["merged"]}
    file_rows = bench_files(files, space)
    del merge_data, files, first_idx, first_val
    gc.collect()
    apply_rows, apply_info = bench_apply(n, space, repeat, gen)
    gc.collect()
    load_after = os.getloadavg()
    rows = merge_rows + apply_rows
    suffix = " [quick: sizes not comparable]" if quick else ""
    title = (f"Sparse deltas on cpu: merge {k} x {n / 1e6:g}M entries, apply {n / 1e6:g}M entries, "
             f"index space {space / 1e9:g}B{suffix}")
    merge_x = next(r["x vs torch"] for r in rows if r["implementation"].endswith("(sum)"))
    apply_x = next(r["x vs torch"] for r in rows if r["implementation"].endswith("(scatter-add)"))
    notes = [
        "",
        f"Merge: C++ {merge_x:.1f}x the best plain-torch pipeline (target >= {TARGET_SPEEDUP['merge']:g}x). "
        f"Apply: C++ {apply_x:.1f}x index_add_ (target >= {TARGET_SPEEDUP['apply']:g}x). Targets printed, "
        f"not asserted.",
        f"Byte model: merge 8 B per input entry read + 8 B per output entry written; apply 8 B per entry + "
        f"128 B per distinct 64-byte weight line touched ({apply_info['distinct_lines']} lines) + 4 B per saved "
        f"original.",
        f"CPU timing: perf_counter medians with warm-up, {torch.get_num_threads()} threads; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (the machine is shared: figures move with it).",
        f"Memory: inputs {k * n * 8 / 1e9:.2f} GB, the apply target {4 * space / 1e9:.1f} GB fp32 (allocated), "
        f"dense checkpoints sized, not written.",
    ]
    markdown = "\n".join([
        markdown_table(title, COLUMNS, rows),
        "",
        markdown_table(f"Sparse delta files vs a dense fp32 checkpoint of the same weight{suffix}", FILE_COLUMNS,
                       file_rows),
        *notes,
    ])
    save_results("delta", rows, markdown, extra={"files": file_rows, "quick": quick,
                                                 "load_average": [load_before, load_after]}, quick=quick)
    return markdown
