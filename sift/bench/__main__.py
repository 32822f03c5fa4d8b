"""`python -m sift.bench [suite ...] [--quick] [--results-dir DIR]`: run benchmark suites, print
markdown tables, save JSON and markdown under DIR: by default `$SIFT_BENCH_DIR`, else a cache folder
(`~/.cache/sift/bench-results`), never the checkout's tracked bench/results unless asked for with
`--results-dir bench/results`.

On Linux the run asks torch to put its large CPU allocations on 2 MiB transparent huge pages
(`THP_MEM_ALLOC_ENABLE=1`, unless already set: `THP_MEM_ALLOC_ENABLE=0` measures 4 KiB
pages). Dense steps barely notice; the sparse gathers, which touch a new 4 KiB page every few
entries, miss the TLB far less. The adamw table reports how much memory actually sat on huge
pages. torch reads the switch once, at its first large allocation, so `main` sets it before
any suite allocates.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os

SUITES = {
    "adamw": "sift.bench.adamw",
    "backward": "sift.bench.backward",
    "delta": "sift.bench.delta",
    "distributed": "sift.bench.distributed",
    "heads": "sift.bench.heads",
    "llm": "sift.bench.llm",
    "memory": "sift.bench.memory",
    "quantized": "sift.bench.quantized",
    "serving": "sift.bench.serving",
}


# Packages a suite needs beyond the base install (found without importing them); --quick runs the llm
# board on a tiny random Llama, so it needs only the labels.
OPTIONAL_PACKAGES = {"llm": ("gguf", "nrclex", "afinn")}
QUICK_PACKAGES = {"llm": ("nrclex", "afinn")}
# Wall time of each suite on the 2-core CPU shared with other work where the committed results were made
# (load average 3-7 while timed; bench/results/engine-before-after-cpu.md has the runs).
DURATIONS = {
    "adamw": "about 5 min (fp32 and bf16, with the machine-limit probe; 11 min at load 6-8; --quick: under 1 min)",
    "backward": "about 6 min (--quick: under 1 min)",
    "delta": "about 2 min (--quick: under 1 min)",
    "distributed": "about 1 min (--quick: under 1 min)",
    "heads": "about 1 min (--quick: under 1 min)",
    "llm": "runs accumulate: 4-9 min a run, about 200 runs for the whole board, a rerun continues; "
           "--report only rewrites the tables (--quick: about 2 min, a tiny random Llama)",
    "memory": "under 1 min (--quick: about 1 min)",
    "quantized": "about 25 min (--quick: about 2 min)",
    "serving": "about 3 min, plus about 8 for the SmolLM2 table where the model is installed (--quick: under 1 min)",
}


def default_results_dir() -> str:
    """`$SIFT_BENCH_DIR`, else `~/.cache/sift/bench-results` (`$SIFT_CACHE` / `$XDG_CACHE_HOME` honoured)."""
    from sift.demo.llm import cache_root

    return os.environ.get("SIFT_BENCH_DIR") or os.path.join(cache_root(), "bench-results")


def unavailable_suites(quick: bool = False) -> dict[str, list[str]]:
    """{suite: its optional packages that are not installed}, for the suites that cannot run here."""
    out = {}
    for name, packages in (QUICK_PACKAGES if quick else OPTIONAL_PACKAGES).items():
        missing = [pkg for pkg in packages if importlib.util.find_spec(pkg) is None]
        if missing:
            out[name] = missing
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sift.bench", description=__doc__)
    durations = "; ".join(f"{name}: {DURATIONS.get(name, 'not timed here')}" for name in sorted(SUITES))
    parser.add_argument("suites", nargs="*", default=["all"],
                        help=f"any of {sorted(SUITES)} or 'all' (default). Time here: {durations}")
    parser.add_argument("--results-dir", default=None,
                        help="where to write results (default: $SIFT_BENCH_DIR, else ~/.cache/sift/bench-results; "
                             "pass bench/results to update the committed files)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, for a smoke run (figures not comparable; saved as <suite>-<device>-quick.*)")
    args = parser.parse_args(argv)
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    names = list(SUITES) if "all" in args.suites else args.suites
    for name in names:
        if name not in SUITES:
            parser.error(f"unknown suite {name!r}; choose from {sorted(SUITES)} or 'all'")
    if "all" in args.suites:
        # The chat-model suite needs the [llm] extra (its model and labels ship as packages): "all" says it skips
        # it rather than failing a plain install; asked for by name, a missing package raises as usual.
        for name, missing in unavailable_suites(args.quick).items():
            names.remove(name)
            print(f"sift.bench: skipping the {name} suite: {', '.join(missing)} not installed "
                  "(pip install 'sift-kernels[llm]')")
    out = args.results_dir or default_results_dir()
    os.environ["SIFT_BENCH_DIR"] = out  # every suite writes through `results_dir()`
    print(f"sift.bench: results go to {os.path.abspath(out)}")
    from sift.env import backend_banner, missing_kernels

    failed = []
    for name in names:
        print(f"sift.bench: {name} suite starting (time here: {DURATIONS.get(name, 'not timed')})", flush=True)
        # Every table is headed by what it measured: a fallback run must not pass for the kernels.
        print(backend_banner())
        print()
        module = importlib.import_module(SUITES[name])
        try:
            print(module.run(quick=args.quick))
        except Exception as exc:  # one broken suite must not hide the others' results
            failed.append(name)
            print(f"### {name}\n\nfailed: {type(exc).__name__}: {exc}\n")
        print()
    problem = missing_kernels()
    if problem is not None:
        print(f"sift.bench: {problem}")
    if failed or problem is not None:
        reasons = ([f"benchmark suites failed: {', '.join(failed)}"] if failed else []) + (
            ["the compiled kernels are missing (set SIFT_SKIP_EXT=1 or SIFT_BACKEND=torch to measure the "
             "plain-torch fallback on purpose)"] if problem is not None else [])
        raise SystemExit("; ".join(reasons))


if __name__ == "__main__":
    main()
