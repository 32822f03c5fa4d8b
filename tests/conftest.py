import os
import platform
import shutil

import pytest
import torch

# Triton kernels execute on CPU tensors through the interpreter when no GPU is present, so
# CI runs the real kernel code. Must be set before any @triton.jit function is created.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker takes its share of the cores: OpenMP threads beyond them spin against each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# One tolerance table for every dtype: (rtol, atol) of a kernel against its fp32 reference.
TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (8e-3, 1e-5),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cpp: needs the C++ extension (fails, not skips, when it should build)")
    config.addinivalue_line("markers", "requires_triton: needs Triton (fails, not skips, on Linux where it is a dependency)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def triton_expected() -> bool:
    """Triton is a dependency on Linux: there a missing Triton is a broken install, not a reason to skip."""
    return platform.system() == "Linux"


def triton_available() -> bool:
    """Whether Triton kernels can run on CPU tensors here (through the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


def cpp_expected() -> bool:
    """The C++ extension must load unless it was switched off or there is no compiler to build it."""
    if os.environ.get("SIFT_SKIP_EXT", "0") == "1":
        return False
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def cpp_available() -> bool:
    from sift._ext import load_extension

    return load_extension()


def pytest_runtest_setup(item):
    # A test of a kernel that failed to build must fail: a skip would let a broken build pass CI.
    if item.get_closest_marker("requires_cpp") is not None and not cpp_available():
        from sift._ext import extension_status

        why = extension_status()["why"]
        if cpp_expected():
            pytest.fail(f"the C++ extension did not load although a compiler is present: {why}", pytrace=False)
        pytest.skip(f"C++ extension unavailable: {why}")
    if item.get_closest_marker("requires_triton") is not None and not triton_available():
        if triton_expected() and os.environ.get("TRITON_INTERPRET") == "1":
            pytest.fail("triton is a dependency on Linux but is not importable", pytrace=False)
        pytest.skip("triton interpreter unavailable")


requires_cpp = pytest.mark.requires_cpp
requires_triton = pytest.mark.requires_triton

# The optimizer-step backends and weight dtypes every kernel test runs over.
BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("cpp", id="cpp", marks=requires_cpp),
    pytest.param("triton", id="triton", marks=requires_triton),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]


def cpu_isa_levels(op: str = "sparse_adamw_") -> list[str]:
    """The forms of C++ step `op` this CPU runs, scalar first (["generic"] without the extension)."""
    if not cpp_available():
        return ["generic"]
    from sift import _simd

    return _simd.levels(op)


def with_cpu_isas(backends: list, op: str = "sparse_adamw_") -> list:
    """`backends` as (backend, cpu_isa) params, the C++ one once per form of `op` this CPU runs (the
    other backends with None): `_forced_cpu_isa` sets SIFT_CPU_ISA to it, so the C++ step's
    isa="auto" runs that form."""
    out = []
    for param in backends:
        name = param.values[0]
        isas = cpu_isa_levels(op) if name == "cpp" else [None]
        out += [pytest.param(name, isa, id=f"{param.id}-{isa}" if isa else param.id, marks=param.marks)
                for isa in isas]
    return out


@pytest.fixture(autouse=True)
def _forced_cpu_isa(request, monkeypatch):
    """SIFT_CPU_ISA for a test parametrized with a `cpu_isa` (`with_cpu_isas`)."""
    callspec = getattr(request.node, "callspec", None)
    isa = callspec.params.get("cpu_isa") if callspec is not None else None
    if isa is not None:
        monkeypatch.setenv("SIFT_CPU_ISA", isa)


def exact_step_lists(dtype: torch.dtype, seed: int, compact: bool = False) -> list[list[torch.Tensor]]:
    """Random operands of `sparse_adamw_` (the eight lists of `ExactState`): two odd shapes, a third
    of each weight's entries; `compact`: gradients already gathered ([k] fp32)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype) for s in ((37, 29), (513,))]
    indices = [torch.randperm(p.numel(), generator=gen)[: p.numel() // 3].sort().values.int() for p in params]
    moments = [[torch.rand(i.numel(), generator=gen) * 0.01 for i in indices] for _ in range(3)]
    bases = [p.reshape(-1)[i.long()].clone() for p, i in zip(params, indices)] if dtype != torch.float32 else []
    grads = ([torch.randn(i.numel(), generator=gen) for i in indices] if compact
             else [torch.randn(p.shape, generator=gen).to(dtype) for p in params])
    return [params, grads, indices, *moments, bases, [torch.tensor(3.0) for _ in params]]


def lean_step_lists(dtype: torch.dtype, seed: int, compact: bool = False) -> list[list[torch.Tensor]]:
    """Random operands of `sparse_adamw_lean_` (the eight lists of `LeanState`): a weight over two
    index windows and a tiny one."""
    from sift import _ops

    gen = torch.Generator().manual_seed(seed)
    lists = [[] for _ in range(8)]
    for n, k in ((70001, 301), (13, 5)):
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        low, off = _ops.encode_lean_indices(idx, n)
        grad = torch.randn(k, generator=gen) if compact else torch.randn(n, generator=gen).to(dtype)
        for j, t in enumerate((torch.randn(n, generator=gen).to(dtype), grad, low, off,
                               (torch.randn(k, generator=gen) * 0.1).bfloat16(),
                               (torch.rand(k, generator=gen) * 0.01).bfloat16(),
                               torch.randint(-128, 128, (k,), generator=gen, dtype=torch.int8), torch.tensor(5.0))):
            lists[j].append(t)
    if dtype == torch.float32:
        lists[6] = []
    return lists


def capture_step(opt) -> "torch.cuda.CUDAGraph":
    """One `opt.step()` warmed up on a side stream (as CUDA graphs require), then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph


def spawned_rank(worker):
    """Decorate a `torch.multiprocessing.spawn` worker so that a rank that returns exits at once.

    The worker destroys its process group itself; what is left of gloo's threads can then abort
    the process during interpreter teardown (SIGABRT, "terminate called without an active
    exception"), failing a rank whose work succeeded. A worker that raises is unchanged: the
    exception propagates and spawn reports it.
    """
    import functools
    import sys

    @functools.wraps(worker)
    def run(*args):
        worker(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return run


def backward_and_step(opt, loss, scaler=None) -> None:
    """`loss.backward()` and `opt.step()`, or their GradScaler forms (`scale`, `step`, `update`) with a scaler."""
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def step_and_zero(opt, scaler=None) -> None:
    """`opt.step()` (or `scaler.step` and `scaler.update` with a scaler), then `opt.zero_grad()`."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()


def gloo_rank(worker=None, *, timeout_s: float | None = None):
    """A `torch.multiprocessing.spawn` worker `worker(rank, world, *args)` run as one rank of a gloo
    process group: spawned with `(rank, world, init_file, *args)`, it joins the group through the
    file, runs on one thread, always leaves the group, and exits at once when it returns
    (`spawned_rank`). `@gloo_rank(timeout_s=30)`: collectives time out, so a rank left alone in one
    fails the test instead of hanging it."""
    import datetime
    import functools

    import torch.distributed as dist

    if worker is None:
        return functools.partial(gloo_rank, timeout_s=timeout_s)
    extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}

    @functools.wraps(worker)
    def run(rank, world, init_file, *args):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, **extra)
        torch.set_num_threads(1)
        try:
            worker(rank, world, *args)
        finally:
            dist.destroy_process_group()

    return spawned_rank(run)


def run_ranks(worker, world: int, directory) -> list:
    """Spawn a `gloo_rank` worker on `world` processes, each saving its results to `<out>.<rank>` for
    `out = directory / "result"` (the worker gets `out`), and load what each rank saved."""
    import torch.multiprocessing as mp

    out = str(directory / "result")
    mp.spawn(worker, args=(world, f"{out}.init", out), nprocs=world, join=True)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


def assert_best_checkpoint_loaded(trainer, model, saved: dict) -> int:
    """With `load_best_model_at_end`, after 3 steps saved as checkpoints 1-3 (`saved`: step -> the params then): the
    model holds the best checkpoint's params, which are not the last's. Returns the best step."""
    best = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1])
    assert best != 3 and sorted(saved) == [1, 2, 3]
    assert any(not torch.equal(saved[best][n], saved[3][n]) for n in saved[3])
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[best][name]), name
    return best


def assert_only_chosen_entries_moved(model, before: dict, opt) -> None:
    """Every param of `model` equals `before[name]` except at the entries `opt` chose; some chosen entry moved."""
    moved = 0
    for name, p in model.named_parameters():
        changed = (p.detach() != before[name].detach()).reshape(-1)
        if "indices" in opt.state.get(p, {}):
            outside = torch.ones_like(changed)
            outside[opt.state[p]["indices"].long()] = False
            assert not changed[outside].any(), name
            moved += int(changed.any())
        else:
            assert not changed.any(), name
    assert moved > 0


def require_backend(backend: str) -> None:
    """Skip only what this machine cannot run on purpose; a C++ build failure fails the test."""
    if backend == "cpp":
        if os.environ.get("SIFT_SKIP_EXT") == "1":
            pytest.skip("SIFT_SKIP_EXT=1")
        from sift._ext import extension_status

        assert cpp_available(), f"C++ extension failed to load: {extension_status()['why']}"
    elif backend == "triton" and not triton_available():
        pytest.skip("triton interpreter unavailable")


def served_and_applied(base, deltas: dict):
    """A `ServedDeltas` over `base` holding `deltas` ({name: SparseDelta}), the base's state, and per name the
    state `delta.apply_(base)` gives: what `switch_to(name)` must leave in the weights."""
    from sift import ServedDeltas

    served = ServedDeltas(base)
    for name, delta in deltas.items():
        served.load_delta(name, delta)
    original = {n: p.clone() for n, p in base.state_dict().items()}
    want = {}
    for name, delta in deltas.items():
        delta.apply_(base)
        want[name] = {n: p.clone() for n, p in base.state_dict().items()}
        delta.remove_(base)
    return served, original, want
