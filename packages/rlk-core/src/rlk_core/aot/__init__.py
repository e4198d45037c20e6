"""Ahead-of-time kernels: every op's launch plan compiled for its build calls (:mod:`rlk_core.aot.build`;
``python -m rlk_core.aot build --target cuda:90 --out DIR``), launched by ``rlk_core._C`` (``csrc/rlk_cuda.cpp``)
as the backend ``rlk.cuda`` (:mod:`rlk_core.ops._cuda`, ``docs/compiled-ops.md``). Importing this package imports no
Triton."""
