"""Which SIMD form the C++ optimizer steps run: the one measured fastest on this machine.

The C++ steps (`sparse_adamw_`, `sparse_adamw_lean_`) have a scalar loop and SIMD forms (AVX2,
AVX-512). The widest form the CPU has is not always the fastest (AVX-512's gathers and scatters
are slow on some AMD cores, and a step waiting on memory gains little from wider math), so when
the extension loads each step's forms are timed on a small synthetic step (a few milliseconds)
and the fastest becomes what `isa="auto"` runs (`torch.ops.sift.<op>_use_isa`). The timings are
cached in `<cache>/cpu-isa.json` (`$SIFT_CACHE`, else `$XDG_CACHE_HOME/sift`, else
`~/.cache/sift`), keyed by the CPU and the kernels' sources, so a later process only reads them.

`SIFT_CPU_ISA=generic|avx2|avx512` forces a form instead (the C++ step reads it on every call;
an op without that form runs its widest below it, a form the CPU lacks raises at the step).
`python -m sift.env` says which form each step runs and why.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time

import torch

from sift._host import cache_root, cpu_name
from sift._index import encode_lean_indices

log = logging.getLogger("sift")

# The step ops with a measured choice, and the file their timings are cached in.
STEP_OPS = ("sparse_adamw_", "sparse_adamw_lean_")
CACHE_FILE = "cpu-isa.json"
# Cached keys kept: one per op, CPU and kernel sources met.
CACHE_ENTRIES = 16

# The synthetic step: TENSORS fp32 weights of NUMEL elements with a dense gradient, one entry
# chosen about every STRIDE elements. Its 7000 entries make 14 chunks of the C++ step, which run
# on the calling thread (a step of 16 chunks or fewer does not wake OpenMP's threads, whose
# wake-up on a loaded machine would swamp the timing), and the lines they touch miss L2 but stay
# in the last-level cache: the timing compares the forms' own costs per entry.
NUMEL = 1 << 20
TENSORS = 2
STRIDE = 300
ROUNDS = 15

_choices: dict[str, dict] = {}


def forced() -> str | None:
    """The form `SIFT_CPU_ISA` forces, or None (unset, empty or "auto")."""
    value = os.environ.get("SIFT_CPU_ISA", "")
    return None if value in ("", "auto") else value


def levels(op: str) -> list[str]:
    """The forms of `op` this CPU runs, scalar first, e.g. `["generic", "avx2"]`."""
    return getattr(torch.ops.sift, f"{op.rstrip('_')}_isa_levels")().split(",")


def _step_call(op: str, numel: int = NUMEL, tensors: int = TENSORS, stride: int = STRIDE):
    """`(run(isa), entries)`: one synthetic step of `op` on fresh tensors, and its entry count."""
    gen = torch.Generator().manual_seed(0)
    k = numel // stride
    # Sorted, distinct, irregular gaps: one position drawn in each stride-wide bin.
    idx = (torch.arange(k) * stride + torch.randint(0, stride, (k,), generator=gen)).int()
    params = [torch.full((numel,), 0.5) for _ in range(tensors)]
    grads = [torch.full((numel,), 0.25) for _ in range(tensors)]
    steps = [torch.ones(()) for _ in range(tensors)]
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, False, False)
    if op == "sparse_adamw_":
        state = [[idx] * tensors, *([torch.zeros(k) for _ in range(tensors)] for _ in range(3)),
                 [p[idx.long()].clone() for p in params]]
        lists = (params, grads, *state, steps)
    else:
        low, offsets = encode_lean_indices(idx.long(), numel)
        moments = ([torch.zeros(k, dtype=torch.bfloat16) for _ in range(tensors)] for _ in range(2))
        lists = (params, grads, [low] * tensors, [offsets] * tensors, *moments, [], steps)
    fn = getattr(torch.ops.sift, op)
    return (lambda isa: fn(*lists, *hyper, isa)), k * tensors


def measure(op: str, forms: list[str], rounds: int = ROUNDS) -> dict[str, float]:
    """Nanoseconds per entry of each form of `op` on the synthetic step: the median of `rounds`
    steps taken in turn (form after form), after one untimed step each."""
    run, entries = _step_call(op)
    for isa in forms:
        run(isa)
    samples: dict[str, list[float]] = {isa: [] for isa in forms}
    for _ in range(rounds):
        for isa in forms:
            t0 = time.perf_counter()
            run(isa)
            samples[isa].append(time.perf_counter() - t0)
    return {isa: 1e9 * statistics.median(s) / entries for isa, s in samples.items()}


def fastest(ns_per_entry: dict[str, float]) -> str:
    """The form with the fewest nanoseconds per entry (a tie goes to the narrower form)."""
    return min(ns_per_entry, key=lambda isa: (ns_per_entry[isa], list(ns_per_entry).index(isa)))


def _cache_key(op: str, forms: list[str], sources: str) -> str:
    return f"{op}|{cpu_name()}|{','.join(forms)}|{sources}"


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: str, data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(list(data.items())[-CACHE_ENTRIES:]), f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home only costs a measurement per process
        log.debug("sift: could not write %s: %s", path, exc)


def choose(sources: str) -> None:
    """Measure (or read from the cache) the fastest form of every step op and make it what
    `isa="auto"` runs. `sources` names the kernels' build (a digest of csrc/), part of the key.

    Called by `sift._ext.load_extension` once the extension is loaded; never raises (a failure
    leaves the widest form, with the reason in `describe`).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    path = os.path.join(cache_root(), CACHE_FILE)
    cache = _read_cache(path)
    dirty = False
    for op in STEP_OPS:
        try:
            forms = levels(op)
            if len(forms) == 1:
                _choices[op] = {"isa": forms[0], "why": "the only form this CPU runs"}
                continue
            key = _cache_key(op, forms, sources)
            hit = cache.get(key)
            fresh = hit is None or set(hit.get("ns_per_entry", {})) != set(forms)
            if fresh:
                start = time.perf_counter()
                with _disable_current_modes(), torch.no_grad():
                    timings = measure(op, forms)
                hit = {"ns_per_entry": timings, "ms": round(1e3 * (time.perf_counter() - start), 1),
                       "when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg()[0]}
                cache.pop(key, None)  # re-inserted last: the newest entries are the ones kept
                cache[key] = hit
                dirty = True
            isa = fastest(hit["ns_per_entry"])
            getattr(torch.ops.sift, f"{op.rstrip('_')}_use_isa")(isa)
            _choices[op] = {"isa": isa, "ns_per_entry": hit["ns_per_entry"], "when": hit["when"], "fresh": fresh}
        except Exception as exc:  # a measurement must never cost the extension
            _choices[op] = {"isa": None, "why": f"measurement failed ({type(exc).__name__}: {exc}); the widest form runs"}
            log.warning("sift: could not time the SIMD forms of %s: %s", op, exc)
    if dirty:
        _write_cache(path, cache)


def describe(op: str, short: bool = False) -> str:
    """The form `op`'s `isa="auto"` runs now and why, e.g.
    "avx2 (measured fastest here: generic 9.8, avx2 6.1 ns/entry; now)", or with `short`
    "avx2 (measured)"."""
    try:
        running = getattr(torch.ops.sift, f"{op.rstrip('_')}_isa")()
    except RuntimeError as exc:  # SIFT_CPU_ISA names a form this CPU cannot run
        return f"none: {str(exc).splitlines()[0]}"
    if forced() is not None:
        return f"{running} (SIFT_CPU_ISA={forced()})"
    choice = _choices.get(op)
    if choice is None:
        return f"{running} (widest, not measured)"
    if "why" in choice:
        return f"{running} ({choice['why']})"
    if short:
        return f"{running} (measured)"
    timings = ", ".join(f"{isa} {ns:.1f}" for isa, ns in choice["ns_per_entry"].items())
    when = "now" if choice["fresh"] else f"{choice['when']}, cached in {os.path.join(cache_root(), CACHE_FILE)}"
    return f"{running} (measured fastest here: {timings} ns/entry; {when})"
