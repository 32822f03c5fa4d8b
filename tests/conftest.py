import os
import platform
import shutil

import pytest
import torch

# Triton kernels execute on CPU tensors through the interpreter when no GPU is present, so
# CI runs the real kernel code. Must be set before any @triton.jit function is created.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
