"""Build script for rlk-core.

rlk-core is pure Python unless the build host has a CUDA toolchain *and* a CUDA build of torch; then
the compiled ops in the repository's ``csrc/`` are built as ``rlk_core._C``. The decision is made from
the toolchain (``nvcc`` found, ``torch.version.cuda`` set), never from whether a GPU is present.
Build with ``pip install --no-build-isolation`` so the installed torch is the one compiled against.
Set ``RLK_BUILD_EXT=0`` to force a pure-Python install, ``RLK_BUILD_EXT=1`` to fail if it cannot build.

With the extension, the ahead-of-time cubins of ``rlk_core.aot`` (Triton's compiler, no GPU needed) are built
for each of ``RLK_BUILD_TARGETS`` (default ``cuda:90``) into the package data ``rlk_core/_aot/<target>/``
(``manifest.json`` + one cubin per variant), ``RLK_BUILD_JOBS`` compiles in parallel (default: the CPU
count). A failed variant fails the build. The variables are declared in ``rlk_core.envs`` (docs/envvars.md);
this script reads them directly, as it runs before rlk-core is installed.
"""

import os
import shutil
import subprocess
import sys
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
        libraries=["dl"],
    )

    class BuildWithCubins(BuildExtension):
        """The extension, then the AOT cubins of every target into the package data."""

        def run(self) -> None:
            super().run()
            root = (HERE / "src") if self.inplace else Path(self.build_lib)
            for target in aot_targets():
                build_cubins(target, root / "rlk_core" / "_aot" / target.replace(":", "_"))

    return [ext], {"build_ext": BuildWithCubins}


def aot_targets() -> list[str]:
    raw = os.environ.get("RLK_BUILD_TARGETS", "") or "cuda:90"
    return [t.strip() for t in raw.split(",") if t.strip()]


def build_cubins(target: str, out: Path) -> None:
    """``python -m rlk_core.aot build`` of this source tree, in a child process (the build's worker pool
    spawns processes, which must not re-run this script)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "src"), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "rlk_core.aot", "build", "--target", target, "--out", str(out)]
    if os.environ.get("RLK_BUILD_JOBS"):
        cmd += ["--jobs", os.environ["RLK_BUILD_JOBS"]]
    print(f"rlk-core: building the AOT cubins for {target} into {out}")
    subprocess.run(cmd, env=env, check=True)  # exits non-zero if any variant failed


ext_modules, cmdclass = _cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
