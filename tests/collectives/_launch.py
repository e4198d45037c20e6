"""Run one gloo test group (tests/collectives/_worker.py) with a deadline: never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parent / "_worker.py"


def run_group(scenario: str, world: int, timeout: float = 150.0) -> list[dict]:
    """Every rank's results (``[rank] -> dict``); raises with the ranks' stderr on a failure or timeout."""
    with tempfile.TemporaryDirectory(prefix="rlk-coll-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, str(WORKER), scenario, str(world), str(Path(tmp) / "init"), tmp],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group's own session: the worker and its rank children
            _, err = proc.communicate()
            raise AssertionError(f"scenario {scenario!r} at W={world} timed out after {timeout:.0f} s\n"
                                 f"{err[-6000:]}") from None
        if proc.returncode != 0:
            raise AssertionError(f"scenario {scenario!r} at W={world} failed (exit {proc.returncode})\n{err[-6000:]}")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
