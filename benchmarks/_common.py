"""Import path set-up shared by the bench scripts; the shape table and input builders are the GPU
tests' own (tests/gpu/_shapes.py), loaded by path so no ``tests`` package name can shadow them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_src = str(ROOT / "packages" / "rlk-core" / "src")
if _src not in sys.path:
    sys.path.insert(0, _src)

_spec = importlib.util.spec_from_file_location("rlk_gpu_shapes", ROOT / "tests" / "gpu" / "_shapes.py")
shapes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shapes)

M_LIST, MODELS, linear_shapes, randn = shapes.M_LIST, shapes.MODELS, shapes.linear_shapes, shapes.randn
