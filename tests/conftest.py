import os

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def triton_available() -> bool:
    """Whether Triton kernels can run on CPU tensors here (through the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


def cpp_available() -> bool:
    from sift._ext import load_extension

    return load_extension()


requires_triton = pytest.mark.skipif(not triton_available(), reason="triton interpreter unavailable")
