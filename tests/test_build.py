"""The C++ extension builds with the standard torch asks for, and a run without it says so:
the compiler's own error lines in `sift.env` and the log, a non-zero exit of `sift.bench`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import sift
from conftest import cpp_expected, requires_cpp, requires_triton
from sift import _ext, env, heads

# What torch's JIT build raised with ATen 2.14's headers and our old `-std=c++17`: the command
# line first, the compiler's diagnostic after it.
_TORCH_BUILD_ERROR = textwrap.dedent("""\
    Error building extension 'sift_C': [1/5] c++ -MMD -MF delta.o.d -DTORCH_EXTENSION_NAME=sift_C -isystem /x/include -fPIC -std=c++20 -O3 -fopenmp -std=c++17 -c /w/csrc/delta.cpp -o delta.o
    FAILED: delta.o
    c++ -MMD -MF delta.o.d -DTORCH_EXTENSION_NAME=sift_C -isystem /x/include -fPIC -std=c++20 -O3 -fopenmp -std=c++17 -c /w/csrc/delta.cpp -o delta.o
    In file included from /x/include/ATen/core/TensorBase.h:3,
    /x/include/c10/macros/Macros.h:12:2: error: #error C++20 or later compatible compiler is required to use ATen.
       12 | #error C++20 or later compatible compiler is required to use ATen.
    ninja: build stopped: subcommand failed.
    """)


def test_compiler_error_lines_skip_the_command_line():
    """The fallback log line showed the start of the compiler command, never the compiler's error."""
    lines = _ext.compiler_error_lines(_TORCH_BUILD_ERROR)
    assert lines[0].endswith("error: #error C++20 or later compatible compiler is required to use ATen.")
    assert not any(" -MMD " in line for line in lines)


def test_compiler_error_lines_without_a_diagnostic_keep_the_tail():
    assert _ext.compiler_error_lines("[1/1] c++ -c a.cpp\nsomething odd\nlast words\n") == ["something odd", "last words"]


def test_build_flags_leave_the_standard_to_torch():
    """`-std=c++17` after torch's own `-std=c++20` broke every build against torch 2.14's headers."""
    assert not any(flag.startswith("-std=") for flag in _ext.CXX_FLAGS)


@pytest.mark.skipif(not cpp_expected(), reason="no C++ compiler here (or SIFT_SKIP_EXT=1)")
def test_extension_loads_where_a_compiler_exists():
    assert _ext.load_extension(), _ext.extension_status()["why"]
    assert env.missing_kernels() is None


_BROKEN_BUILD = """
import logging, os, sys
import sift._ext as ext
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
src = sys.argv[1]
ext._source_dir = lambda: src
assert not ext.load_extension()
status = ext.extension_status()
print("WHY", status["why"])
for line in status["compiler_errors"]:
    print("ERR", line)
import sift.env
print("MISSING", sift.env.missing_kernels() is not None)
print(sift.env.report())
"""


@pytest.mark.skipif(not cpp_expected(), reason="no C++ compiler here (or SIFT_SKIP_EXT=1)")
def test_failed_build_reports_the_compiler_error(tmp_path):
    """A real failed build: the status, the log and `python -m sift.env` carry the compiler's error line."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "broken.cpp").write_text('#error sift-broken-build-probe\n')
    out = subprocess.run(
        [sys.executable, "-c", _BROKEN_BUILD, str(src)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), "SIFT_SKIP_EXT": "0"},
    )
    assert out.returncode == 0, out.stderr
    assert "error: #error sift-broken-build-probe" in out.stdout.split("ERR", 1)[1].splitlines()[0]
    assert "JIT build failed: " in out.stdout and "sift-broken-build-probe" in out.stdout.split("WHY", 1)[1].splitlines()[0]
    assert "MISSING True" in out.stdout
    assert "sift-broken-build-probe" in out.stderr  # the one log line names the error too


@pytest.fixture
def failed_build(monkeypatch):
    """The extension as it is after a failed build on a machine with a compiler."""
    monkeypatch.setattr(_ext, "_state", {"tried": True, "ok": False, "how": "", "why": "JIT build failed: x.cpp:1:2: error: boom",
                                         "compiler_errors": ["x.cpp:1:2: error: boom"]})
    monkeypatch.setattr(_ext, "compiler_present", lambda: True)
    monkeypatch.delenv("SIFT_SKIP_EXT", raising=False)
    monkeypatch.delenv("SIFT_BACKEND", raising=False)
    monkeypatch.setattr(sift._ops.registry, "_resolved", {})
    yield
    sift._ops.registry._resolved.clear()


def _fake_suite(monkeypatch):
    from sift.bench import __main__ as bench_main

    module = types.ModuleType("sift_fake_suite")
    module.run = lambda quick: "| a |\n|---|\n| 1 |"
    monkeypatch.setitem(sys.modules, "sift_fake_suite", module)
    monkeypatch.setattr(bench_main, "SUITES", {"fake": "sift_fake_suite"})
    return bench_main


def test_bench_exits_non_zero_without_compiled_kernels(failed_build, monkeypatch, capsys):
    """The benchmarks ran the plain-torch fallback after a failed build and exited 0."""
    bench_main = _fake_suite(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        bench_main.main(["fake"])
    assert "compiled kernels are missing" in str(exc.value.code)
    printed = capsys.readouterr().out
    header = printed.split("| a |")[0]
    assert "sparse_adamw_ torch" in header and "x.cpp:1:2: error: boom" in header


@pytest.mark.parametrize("env_var", [("SIFT_SKIP_EXT", "1"), ("SIFT_BACKEND", "torch")], ids=["skip-ext", "backend-torch"])
def test_bench_runs_the_fallback_when_asked(failed_build, monkeypatch, capsys, env_var):
    monkeypatch.setenv(*env_var)
    bench_main = _fake_suite(monkeypatch)
    bench_main.main(["fake"])
    assert "| 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"), pytest.param("cpp", id="cpp", marks=requires_cpp),
                                     pytest.param("triton", id="triton", marks=requires_triton)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_singular_values_refuse_non_finite_input(backend, bad):
    """The torch fallback raised LAPACK's `_LinAlgError` instead of the documented ValueError."""
    x = torch.randn(3, 9, 5)
    x[1, 4, 2] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        heads.singular_values(x, backend=backend)


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"), pytest.param("cpp", id="cpp", marks=requires_cpp)])
def test_singular_values_unchecked_give_nan_for_non_finite_matrices(backend):
    x = torch.randn(3, 9, 5)
    x[1, 4, 2] = float("inf")
    sigma = heads.singular_values(x, backend=backend, check_finite=False)
    assert torch.isnan(sigma[1]).any()
    torch.testing.assert_close(sigma[[0, 2]], heads.singular_values(x[[0, 2]], backend="torch"))


def test_score_heads_on_the_torch_fallback_names_the_non_finite_layer(monkeypatch):
    """On the plain-torch backend LAPACK raised `_LinAlgError` at the first batch instead of the layer's ValueError."""
    import transformers

    monkeypatch.setenv("SIFT_BACKEND", "torch")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    with torch.no_grad():
        model.encoder.layer[1].attention.self.value.weight[0, 0] = float("inf")
    batch = {"input_ids": torch.randint(0, 50, (3, 7)), "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"head outputs of layers \[1\] are not finite"):
        heads.score_heads(model, batch, n_samples=3, progress=False)


def test_a_slow_build_says_it_is_compiling_and_how_long_it_took(monkeypatch, caplog):
    """The first `import sift` that needed the C++ extension compiled for minutes with no message: it looked hung."""
    import time

    import torch.utils.cpp_extension

    monkeypatch.setattr(_ext, "_ANNOUNCE_AFTER_S", 0.05)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: time.sleep(0.3))
    with caplog.at_level("WARNING", logger="sift"):
        _ext._jit_build()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "compiling the C++ extension" in messages[0] and _ext.BUILD_TIME in messages[0]
    assert "SIFT_SKIP_EXT=1" in messages[0] and messages[1].startswith("sift: the C++ extension compiled in")
    caplog.clear()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: None)  # a cached build: silent
    with caplog.at_level("WARNING", logger="sift"):
        _ext._jit_build()
    assert caplog.records == []


def test_python_m_sift_help_lists_the_commands(capsys):
    """`python -m sift --help` printed the environment report instead of usage."""
    import sift.__main__ as cli

    cli.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m sift") and all(f"  {name} " in out for name in ("env", "bench", "demo"))
    with pytest.raises(SystemExit, match="unknown command 'nope'"):
        cli.main(["nope"])
