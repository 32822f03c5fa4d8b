"""`python -m sift.bench [suite ...] [--quick]`: run benchmark suites, print markdown tables,
save JSON and markdown under bench/results (or $SIFT_BENCH_DIR)."""

from __future__ import annotations

import argparse
import importlib

SUITES = {
    "adamw": "sift.bench.adamw",
    "delta": "sift.bench.delta",
    "heads": "sift.bench.heads",
    "memory": "sift.bench.memory",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sift.bench", description=__doc__)
    parser.add_argument("suites", nargs="*", default=["all"], help=f"any of {sorted(SUITES)} or 'all' (default)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run (figures not comparable)")
    args = parser.parse_args(argv)
    names = list(SUITES) if "all" in args.suites else args.suites
    for name in names:
        if name not in SUITES:
            parser.error(f"unknown suite {name!r}; choose from {sorted(SUITES)} or 'all'")
    for name in names:
        try:
            module = importlib.import_module(SUITES[name])
        except ModuleNotFoundError as exc:
            print(f"### {name}\n\nnot available in this build: {exc}\n")
            continue
        print(module.run(quick=args.quick))
        print()


if __name__ == "__main__":
    main()
