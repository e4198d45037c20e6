"""Build script for rlk-core.

rlk-core is pure Python unless the build host has a CUDA toolchain *and* a CUDA build of torch; then
the compiled ops in the repository's ``csrc/`` are built as ``rlk_core._C``. The decision is made from
the toolchain (``nvcc`` found, ``torch.version.cuda`` set), never from whether a GPU is present.
Build with ``pip install --no-build-isolation`` so the installed torch is the one compiled against.
Set ``RLK_BUILD_EXT=0`` to force a pure-Python install, ``RLK_BUILD_EXT=1`` to fail if it cannot build.
"""

import os
import shutil
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "csrc"


def _cuda_extensions():
    want = os.environ.get("RLK_BUILD_EXT", "auto")
    if want == "0":
        return [], {}
    sources = sorted(str(p) for p in CSRC.rglob("*") if p.suffix in {".cpp", ".cu"}) if CSRC.is_dir() else []
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        torch = None
    reason = None
    if torch is None:
        reason = "torch is not importable at build time (use --no-build-isolation)"
    elif torch.version.cuda is None:
        reason = "torch is a CPU build"
    elif shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        reason = "no CUDA toolchain (nvcc) found"
    elif not sources:
        reason = "no compiled sources in csrc/"
    if reason is not None:
        if want == "1":
            raise RuntimeError(f"RLK_BUILD_EXT=1 but the compiled ops cannot be built: {reason}")
        print(f"rlk-core: building pure Python ({reason})")
        return [], {}
    ext = CUDAExtension(
        name="rlk_core._C",
        sources=sources,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
