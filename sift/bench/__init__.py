"""Microbenchmarks and memory benchmarks: `python -m sift.bench [adamw|delta|heads|memory|all]`."""
