"""benchmarks/vllm_plugin_overhead.py's null ops take the place of the route layer's calls: a routed call runs the
null op inside the recorder's scope and is counted there (the route table holds ``(function, scope)`` pairs). In a
fresh interpreter: the script sets the run's ``RL_KERNEL_*`` variables when it is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import importlib.util, json, sys
sys.path.insert(0, "benchmarks")
spec = importlib.util.spec_from_file_location("vllm_plugin_overhead", "benchmarks/vllm_plugin_overhead.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
import torch
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.routes import SideRoutes

plan = RoutePlan("R/R", "R/R", "R/R")
recorder = ReadbackRecorder("vllm", "rollout", plan, mode="strict")
routes = SideRoutes(plan, "rollout", recorder)
bench._null_ops(routes)
x, w = torch.randn(3, 8), torch.randn(5, 8)
out = routes.call("attention", "linear", x, w, None)
again = routes.call("attention", "linear", x, w, None)
linear = recorder.to_dict()["modules"]["attention"]["ops"]["linear"]
print(json.dumps({"shape": list(out.shape), "cached": out is again, "zeros": bool((out == 0).all()),
                  "backend": linear["backend_id"], "calls": linear["call_count"], "null": bench.NULL_BACKEND}))
"""


def test_the_null_ops_serve_the_routed_calls_in_the_recorders_scope():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"shape": [3, 5], "cached": True, "zeros": True, "backend": got["null"], "calls": 2,
                   "null": "rlk.bench.null"}
