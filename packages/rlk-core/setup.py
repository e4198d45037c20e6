"""Build script for rlk-core.

rlk-core is pure Python unless the build host has a CUDA toolchain *and* a CUDA build of torch; then
the compiled ops in the repository's ``csrc/`` are built as ``rlk_core._C``. The decision is made from
the toolchain (``nvcc`` found, ``torch.version.cuda`` set), never from whether a GPU is present.
Build with ``pip install --no-build-isolation`` so the installed torch is the one compiled against.
Set ``RLK_BUILD_EXT=0`` to force a pure-Python install, ``RLK_BUILD_EXT=1`` to fail if it cannot build.

With the extension, the ahead-of-time cubins of ``rlk_core.aot`` (Triton's compiler, no GPU needed) are built
for each of ``RLK_BUILD_TARGETS`` (default ``cuda:90``) into the package data ``rlk_core/_aot/<target>/``
(``manifest.json`` + one cubin per variant), ``RLK_BUILD_JOBS`` compiles in parallel (default: the CPU
count), ``RLK_BUILD_OPS`` / ``RLK_BUILD_DTYPES`` limit them to some kernel families / input dtypes (default: all).
A failed variant fails the build. The variables are declared in ``rlk_core.envs`` (docs/envvars.md);
this script reads them directly, as it runs before rlk-core is installed. An in-place build
(``build_ext --inplace``) compiles them through one Triton cache folder, ``rlk_core/_aot/triton-cache`` (git-ignored,
never package data): each compile there has the key Triton's JIT gives the same launch, so rlk.triton pointed at it
(``TRITON_CACHE_DIR``) runs these very compiles instead of compiling them again (the GPU tests do).
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
            # in place (a development tree): the same compiles also through one Triton cache folder beside them,
            # where rlk.triton's JIT finds them (the GPU tests point it there); never part of a wheel
            cache = root / "rlk_core" / "_aot" / TRITON_CACHE if self.inplace else None
            for target in aot_targets():
                build_cubins(target, root / "rlk_core" / "_aot" / target.replace(":", "_"), cache)

    return [ext], {"build_ext": BuildWithCubins}


def aot_targets() -> list[str]:
    raw = os.environ.get("RLK_BUILD_TARGETS", "") or "cuda:90"
    return [t.strip() for t in raw.split(",") if t.strip()]


TRITON_CACHE = "triton-cache"  # in-place builds: rlk_core/_aot/triton-cache (git-ignored, not package data)


def build_cubins(target: str, out: Path, triton_cache: Path | None = None) -> None:
    """``python -m rlk_core.aot build`` of this source tree, in a child process (the build's worker pool
    spawns processes, which must not re-run this script); ``triton_cache``: its ``--triton-cache``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "src"), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "rlk_core.aot", "build", "--target", target, "--out", str(out)]
    if os.environ.get("RLK_BUILD_JOBS"):
        cmd += ["--jobs", os.environ["RLK_BUILD_JOBS"]]
    for var, flag in (("RLK_BUILD_OPS", "--families"), ("RLK_BUILD_DTYPES", "--dtypes")):
        if os.environ.get(var, "").strip():  # the aot CLI refuses unknown names
            cmd += [flag, os.environ[var]]
    if triton_cache is not None:
        cmd += ["--triton-cache", str(triton_cache)]
    print(f"rlk-core: building the AOT cubins for {target} into {out}")
    subprocess.run(cmd, env=env, check=True)  # exits non-zero if any variant failed


ext_modules, cmdclass = _cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
