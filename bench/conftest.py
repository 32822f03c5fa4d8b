"""pytest-benchmark runs of the microbenchmarks: `pytest bench/ --benchmark-only`.

The workloads come from the suites of `python -m sift.bench` (`sift/bench/adamw.py`,
`delta.py`, `heads.py`); the files here only hand them to pytest-benchmark. Sizes are the
suites' quick ones unless `--bench-full` (or `SIFT_BENCH_FULL=1`) asks for the full ones.

Timing: cases on the CPU use pytest-benchmark's calibrated rounds of `time.perf_counter`.
Cases on CUDA (those taking the `device` fixture on a machine with a GPU) are timed by CUDA
events (`sift.bench._harness.cuda_event_timer`) in pedantic rounds, with the device queue
drained before each round so that a round times its own work only.

`pytest bench/ --benchmark-disable` runs every case once, untimed: a smoke test.
"""

from __future__ import annotations

import os

# As `python -m sift.bench` does: torch's large CPU allocations on 2 MiB pages, so the figures
# compare with the suites'. torch reads the switch at its first large allocation.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sift.bench import heads  # noqa: E402
from sift.bench._harness import bench_device, cuda_event_timer  # noqa: E402

# Pedantic rounds on CUDA: at least this many (or --benchmark-min-rounds), after the warm-up ones.
CUDA_ROUNDS = 20
CUDA_WARMUP_ROUNDS = 3


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bench-full", action="store_true", default=False,
                     help="time the full sizes of `python -m sift.bench` instead of its quick ones "
                          "(also SIFT_BENCH_FULL=1)")


def full_sizes(config: pytest.Config) -> bool:
    """Whether the run asked for the suites' full sizes (`--bench-full` or SIFT_BENCH_FULL=1)."""
    return bool(config.getoption("--bench-full")) or os.environ.get("SIFT_BENCH_FULL", "0") == "1"


def _timed_on_cuda(item: pytest.Item) -> bool:
    return "device" in getattr(item, "fixturenames", ()) and bench_device().type == "cuda"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The singular-value batches depend on --bench-full, so they are parametrized here, with
    # their sizes as ids (a full run never compares against a quick one by name).
    if "sv_shape" in metafunc.fixturenames:
        shapes = heads.workload_shapes(quick=not full_sizes(metafunc.config))
        metafunc.parametrize("sv_shape", shapes, ids=[f"{n}x{s}x{d}" for n, s, d in shapes])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _timed_on_cuda(item):
            item.add_marker(pytest.mark.benchmark(timer=cuda_event_timer))


@pytest.fixture(scope="session")
def quick(pytestconfig: pytest.Config) -> bool:
    """True unless the run asked for the suites' full sizes."""
    return not full_sizes(pytestconfig)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the suites measure: CUDA when there is one, else the CPU."""
    return bench_device()


@pytest.fixture(scope="session")
def cpp_extension() -> None:
    """Skips the case when the C++ extension is unavailable (see `python -m sift.env`)."""
    from sift._ext import load_extension

    if not load_extension():
        pytest.skip("the C++ extension is unavailable")


@pytest.fixture
def measure(benchmark, request: pytest.FixtureRequest):
    """`measure(fn, group=..., **info)`: time `fn()` with pytest-benchmark and return its result.

    `group` puts the cases of one comparison side by side in the report; `info` lands in the
    JSON (`extra_info`), e.g. the workload's sizes.
    """
    on_cuda = _timed_on_cuda(request.node)

    def run(fn, *, group: str, **info):
        benchmark.group = group
        benchmark.extra_info.update(info)
        if on_cuda:
            rounds = max(CUDA_ROUNDS, request.config.getoption("benchmark_min_rounds"))
            return benchmark.pedantic(fn, setup=torch.cuda.synchronize, rounds=rounds,
                                      warmup_rounds=CUDA_WARMUP_ROUNDS)
        return benchmark(fn)

    return run
