"""Loading of the C++ extension: the CPU kernels of the ops `sift._ops` defines (`torch.ops.sift.*`).

The extension is built ahead of time as `sift._C` when torch was importable at build time.
Otherwise it is compiled from `csrc/*.cpp` with ninja on first use and cached by torch
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`). If neither works, the C++
backend is reported unavailable with the reason, and `import sift` is unaffected.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import threading

log = logging.getLogger("sift")

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "how": "", "why": "", "compiler_errors": []}

# Lines of compiler output worth showing: GCC/Clang diagnostics ("x.cpp:3:1: error: ..."),
# #error directives, and a missing compiler or header.
_ERROR_MARKERS = ("error:", "#error", "fatal error", "No such file", "not found", "undefined reference")


def compiler_error_lines(text: str, limit: int = 6) -> list[str]:
    r"""The first error lines of a failed build's output, skipping the command lines.

    torch's build error repeats each compiler command (hundreds of characters of flags) before
    the compiler's own output; a log line cut after the first line shows only the command.

    Args:
        text: the build's output (the exception text of `torch.utils.cpp_extension.load`).
        limit: at most this many lines.

    Returns:
        The first `limit` diagnostic lines, else the last non-empty lines of `text`.

    Example:
        >>> compiler_error_lines("[1/2] c++ -O3 -c x.cpp\nFAILED: x.o\nx.cpp:1:2: error: #error boom\n")
        ['x.cpp:1:2: error: #error boom']
    """
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]

    def is_command(line: str) -> bool:
        stripped = line.lstrip()
        return stripped.startswith(("[", "FAILED:", "ninja:", "c++ ", "g++ ", "gcc ", "clang", "/usr/")) and " -" in stripped

    found = [line for line in lines if not is_command(line) and any(m in line for m in _ERROR_MARKERS)]
    if not found:
        found = [line for line in lines if not is_command(line)][-limit:]
    return found[:limit]


def compiler_present() -> bool:
    """Whether a C++ compiler is on PATH ($CXX, else c++)."""
    import shutil

    return shutil.which(os.environ.get("CXX", "c++")) is not None


def _source_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "..", "csrc"), os.path.join(here, "csrc")):
        if glob.glob(os.path.join(cand, "*.cpp")):
            return os.path.normpath(cand)
    return None


def _source_files(src: str) -> list[str]:
    return sorted(glob.glob(os.path.join(src, "*.cpp")) + glob.glob(os.path.join(src, "*.h")))


# The flags of both builds (setup.py reads them from here). No -std=: torch's build helpers
# add the standard its headers need (C++17 up to torch 2.x, C++20 from ATen 2.14), and a
# later -std= of ours would override it. -fno-math-errno lets sqrt vectorise; -Wno-psabi
# silences GCC's note on 64-byte vector arguments in the generic copy of the SIMD code.
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]
LD_FLAGS = ["-fopenmp"]


def _prebuilt_stale_reason() -> str | None:
    """In a source checkout, a prebuilt sift._C older than csrc/ is stale: rebuild instead."""
    here = os.path.dirname(os.path.abspath(__file__))
    built = glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd"))
    src = _source_dir()
    if not built or src is None:
        return None
    newest_source = max(os.path.getmtime(f) for f in _source_files(src))
    if newest_source > min(os.path.getmtime(f) for f in built):
        return "prebuilt sift._C is older than csrc/ (edited sources)"
    return None


def sources_digest() -> str:
    """A digest of every C++ source file (headers included), or the package version where the
    sources are not shipped (an installed wheel with a prebuilt sift._C)."""
    src = _source_dir()
    if src is None:
        from sift._version import __version__

        return f"sift-{__version__}"
    digest = hashlib.sha1()
    for path in _source_files(src):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


# A JIT build that has not returned after this long is compiling (a cached one loads in well under it).
_ANNOUNCE_AFTER_S = 2.0
# Measured for the package's sources on the 2-core AMD EPYC these docs were written on (torch 2.13, g++ 12).
BUILD_TIME = "about 2.5 minutes on 2 cores"


def _jit_build() -> None:
    import time

    from torch.utils.cpp_extension import load

    src = _source_dir()
    if src is None:
        raise RuntimeError("no C++ sources found next to the package (csrc/*.cpp)")
    announced = threading.Event()

    def announce() -> None:
        announced.set()
        log.warning("sift: compiling the C++ extension from csrc/ (%s, once per torch version; cached in "
                    "TORCH_EXTENSIONS_DIR). To build it ahead of time: install torch first, then pip install the "
                    "package (the wheel then ships sift._C); SIFT_SKIP_EXT=1 uses plain torch instead; "
                    "SIFT_VERBOSE_BUILD=1 shows the compiler's progress.", BUILD_TIME)
    timer = threading.Timer(_ANNOUNCE_AFTER_S, announce)
    timer.daemon = True
    start = time.perf_counter()
    timer.start()
    try:
        load(
            name="sift_C",
            sources=[f for f in _source_files(src) if f.endswith(".cpp")],
            # torch's JIT cache hashes the .cpp sources only; a digest of every source file
            # (headers included) in the flags makes a header edit rebuild too.
            extra_cflags=CXX_FLAGS + [f"-DSIFT_SOURCES_DIGEST={sources_digest()}"],
            extra_ldflags=LD_FLAGS,
            is_python_module=False,
            verbose=os.environ.get("SIFT_VERBOSE_BUILD", "0") == "1",
        )
    finally:
        timer.cancel()
    if announced.is_set():
        log.warning("sift: the C++ extension compiled in %.0f s", time.perf_counter() - start)


def load_extension() -> bool:
    """Load the C++ extension once; returns whether the ops' C++ CPU kernels are registered.

    Returns:
        True when the extension is loaded (ahead-of-time build or JIT), else False, with
        the reason in `extension_status()["why"]`.
    """
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        _state["tried"] = True
        if os.environ.get("SIFT_SKIP_EXT", "0") == "1":
            _state["why"] = "SIFT_SKIP_EXT=1"
            return False
        # The schemas the C++ kernels register into are defined by sift._ops, which `import sift`
        # (run before this module is) has loaded: importing it here would close an import circle.

        prebuilt_error = _prebuilt_stale_reason()
        if prebuilt_error is None:
            try:
                from sift import _C  # noqa: F401  (ahead-of-time build registers the ops)

                _state.update(ok=True, how="prebuilt sift._C")
            except ImportError as exc:
                prebuilt_error = str(exc)
        if not _state["ok"]:
            try:
                _jit_build()
                _state.update(ok=True, how="compiled on first use (torch cpp_extension + ninja)")
            except Exception as exc:  # compiler missing, headers missing, ...
                errors = compiler_error_lines(str(exc)) or [type(exc).__name__]
                _state["compiler_errors"] = errors
                _state["why"] = f"no prebuilt sift._C ({prebuilt_error}); JIT build failed: {errors[0]}"
                log.warning("sift: the C++ extension failed to build; kernels fall back to plain torch. "
                            "Compiler errors:\n  %s", "\n  ".join(errors))
        if _state["ok"]:
            from sift import _simd

            _simd.choose(sources_digest())  # the steps' SIMD forms, the fastest measured here
        return bool(_state["ok"])


def extension_status() -> dict[str, object]:
    """Whether the C++ extension is loaded, how, and why not (tries to load it)."""
    load_extension()
    return dict(_state)
