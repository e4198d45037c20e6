"""Helpers of the framework tests: probes, launchers, and reading a worker's JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def hybrid_model() -> tuple[bool, str]:
    """Whether megatron-core has ``HybridModel`` (0.19+), found without importing megatron-core."""
    spec = importlib.util.find_spec("megatron")
    paths = list(spec.submodule_search_locations or []) if spec is not None else []
    ok = any((Path(p) / "core" / "models" / "hybrid" / "hybrid_model.py").is_file() for p in paths)
    return ok, "needs megatron-core >= 0.19 (HybridModel)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
            str(free_port())]


def child_env(**extra: str) -> dict[str, str]:
    """This environment without route variables (each worker sets its own) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_KERNEL_") and k != "VLLM_PLUGINS"}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


class Worker:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path

    def __call__(self, cmd: list[str], timeout: float, name: str = "worker", env: dict | None = None,
                 cwd: Path = REPO) -> subprocess.CompletedProcess:
        """Run ``cmd`` to the end (or ``timeout`` seconds), its output in ``<tmp>/<name>.log``."""
        log = self.tmp / f"{name}.log"
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, cwd=cwd, env=env or child_env(), stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        proc.log = log.read_text(errors="replace")
        return proc


def checks(path: Path) -> dict[str, dict]:
    """A worker's checks by name (``pass`` / ``passed`` as it writes them)."""
    doc = json.loads(path.read_text())
    return {c["name"]: c for c in doc["checks"]}


def failed(proc: subprocess.CompletedProcess, path: Path) -> str:
    """What to show when a worker run did not pass: its failed checks and stages, else its log's tail."""
    if path.is_file():
        doc = json.loads(path.read_text())
        bad = doc.get("failed") or [c["name"] for c in doc.get("checks", []) if c.get("required") and not c["passed"]]
        stages = {n: s.get("error") for n, s in doc.get("stages", {}).items() if s.get("error")}
        return (f"exit {proc.returncode}; failed: {bad}; stage errors: {stages}; evaluate: {doc.get('evaluate_error')}"
                f"\n{proc.log[-3000:]}")
    return f"exit {proc.returncode}, no {path.name}\n{proc.log[-6000:]}"
