"""Build script: packages `sift` (with `triton_kernels/` installed as `sift.triton_kernels`)
and, when torch is importable at build time, compiles the C++ extension `sift._C`.

Environment switches:
    SIFT_SKIP_EXT=1   build no extension (it is then compiled on first use, or the
                      plain-torch reference is used).
    MAX_JOBS=N        parallel compile jobs (honoured by torch's BuildExtension).
"""

import glob
import os

from setuptools import find_packages, setup

ext_modules = []
cmdclass = {}

if os.environ.get("SIFT_SKIP_EXT", "0") == "1":
    print("sift: SIFT_SKIP_EXT=1, not building the C++ extension")
else:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "sift: torch is not importable at build time; the C++ extension will be "
            "compiled with ninja on first use and cached"
        )
    else:
        # The compile flags live in sift/_ext.py (the JIT build's), read from that file alone:
        # importing the package here would import all of sift.
        import importlib.util

        spec = importlib.util.spec_from_file_location("_sift_ext_flags", os.path.join("sift", "_ext.py"))
        _ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_ext)
        cu_sources = glob.glob("csrc/*.cu")
        if cu_sources:
            print("sift: CUDA sources are not built (GPU kernels are Triton): " + ", ".join(cu_sources))
        ext_modules.append(
            CppExtension(
                "sift._C",
                sorted(glob.glob("csrc/*.cpp")),
                depends=sorted(glob.glob("csrc/*.h")),
                extra_compile_args=_ext.CXX_FLAGS,
                extra_link_args=_ext.LD_FLAGS,
            )
        )
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(
    packages=find_packages(include=["sift", "sift.*"]) + ["sift.triton_kernels"],
    package_dir={"sift.triton_kernels": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
