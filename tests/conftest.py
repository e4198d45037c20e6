"""Hardware markers become skips here, never ``if`` statements in test bodies.

``gpu`` needs CUDA; ``multi_gpu`` two devices; ``vllm`` / ``megatron`` the real packages. With
``RLK_REQUIRE_GPU=1`` (set on the GPU machine) a ``gpu``/``multi_gpu`` test that would be skipped — for want of
the device or of a framework it also needs (``tests/frameworks``) — fails instead, so a GPU run cannot pass by
skipping.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

# Prelude of the scripts that run rlk.triton kernels under the Triton interpreter (CPU). The variable
# must be set before Triton is imported, hence a subprocess. numpy >= 2.4 refuses int() of a 1-element
# array, which the interpreter uses for loop bounds computed from loaded values: read the element.
_INTERPRETER_PRELUDE = '''
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton.runtime.interpreter as interp

_orig = interp._patch_lang_tensor


def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interp._patch_lang_tensor = _patched

from rlk_core.ops._plan import jit_plan  # noqa: E402

CPU = jit_plan(torch.device("cpu"))  # the launch plans' JIT runner on the interpreter (first argument of a plan)
'''


@pytest.fixture
def run_interpreted():
    """``run_interpreted(body, timeout=300)``: run ``body`` (after the interpreter prelude, which imports
    ``torch``) in a fresh Python; it must exit 0 and print ``ok`` last."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")

    def run(body: str, timeout: int = 300) -> None:
        script = _INTERPRETER_PRELUDE + textwrap.dedent(body)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]
    return run


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _probes():
    n = _cuda_count()
    return {
        "gpu": (n >= 1, "needs a CUDA GPU"),
        "multi_gpu": (n >= 2, "needs two or more CUDA GPUs"),
        "vllm": (importlib.util.find_spec("vllm") is not None, "needs the vllm package"),
        "megatron": (importlib.util.find_spec("megatron") is not None, "needs megatron-core"),
    }


def _require_gpu() -> bool:
    return os.environ.get("RLK_REQUIRE_GPU", "0").lower() in ("1", "true", "yes", "on")


def pytest_collection_modifyitems(config, items):
    probes = _probes()
    for item in items:
        hardware = "gpu" in item.keywords or "multi_gpu" in item.keywords
        for marker, (ok, reason) in probes.items():
            if marker in item.keywords and not ok:
                if _require_gpu() and hardware:
                    item.user_properties.append(("rlk_missing_hardware", reason))
                else:
                    item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item):
    for key, reason in item.user_properties:
        if key == "rlk_missing_hardware":
            pytest.fail(f"RLK_REQUIRE_GPU=1 but this test {reason}")


@pytest.fixture
def clean_registry():
    """The backend registry, restored after the test (backends, plug-ins, qualification and probe caches)."""
    from rlk_core.backends import REGISTRY

    REGISTRY.backends("linear")  # the entry-point plug-ins are loaded
    before = {op: dict(REGISTRY._backends[op]) for op in REGISTRY._backends}
    plugins = list(REGISTRY._plugins)
    REGISTRY.refresh()
    yield REGISTRY
    REGISTRY._plugins[:] = plugins
    for op, backends in before.items():
        REGISTRY._backends[op] = backends
    REGISTRY.refresh()


@pytest.fixture
def benchmark_script():
    """``load(name)``: the script ``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    def load(name: str):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"rlk_benchmark_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
