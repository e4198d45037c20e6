"""Ahead-of-time kernels (issue 21): every specialisation ``rlk.triton`` can launch,
enumerated from the launchers' own rules (:mod:`rlk_core.aot.specs`) and compiled to cubins with a
manifest (:mod:`rlk_core.aot.build`; ``python -m rlk_core.aot build --target cuda:90 --out DIR``).

``rlk_core._C`` (``csrc/rlk_cuda.cpp``) launches the cubins as the backend ``rlk.cuda``
(``docs/compiled-ops.md``). Importing this package imports no Triton.
"""

from rlk_core.aot.specs import LAYOUTS, OPS, Spec, enumerate_specs, linear_launch_specs, not_built

__all__ = ["LAYOUTS", "OPS", "Spec", "build", "enumerate_specs", "linear_launch_specs", "not_built"]


def build(*args, **kwargs):
    """:func:`rlk_core.aot.build.build` (imported on call)."""
    from rlk_core.aot.build import build as _build

    return _build(*args, **kwargs)
