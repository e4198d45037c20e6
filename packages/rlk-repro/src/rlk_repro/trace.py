"""``rlk-repro run --trace``: profile one round of both sides and write ``kernel-trace.json`` (issue 37).

The first round of the attempt is profiled with ``torch.profiler``, the rollout (``generate``) and the train step
(forward, backward, optimizer step) each in its own profiling window; the weight sync is outside both. What each
window ran is written as *units* ``[name, context, count]`` (``rlk.kernel-trace.v1``, defined and classified in
:mod:`rlk_validate.kernel_trace`, which ``rlk-validate`` checks):

- on a CUDA device, every kernel: its name and the innermost rlk op (``rlk::<op>``, ``<op>_function``) or rlk
  collective range (``rlk.collective.<op>``) it was launched from, or null;
- on the CPU, where there are no kernels, every operator event outside all rlk ops (an rlk op counts as itself; the
  ``aten`` ops it runs inside are its implementation) and every rlk op — so the plumbing and the family counts run
  end to end on a CPU too, with operator names in place of kernel names.

The file goes into the run directory through the evidence writer like the rest and is sealed with it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlk_validate import evidence
from rlk_validate.kernel_trace import (
    KERNEL_TRACE,
    KERNEL_TRACE_SCHEMA,
    TRACE_SIDES,
    classify,
    families,
    rlk_op_family,
)


def add_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--trace", action="store_true",
                   help="profile the first round of both sides (torch.profiler) and write kernel-trace.json: the "
                   "kernels (on a CPU: operators) per family, which rlk-validate checks (an all-R run must run every "
                   "rlk family and no vendor GEMM / flash attention / NCCL all-reduce; docs/validate.md)")


def _units_cpu(events: Any) -> list[list[Any]]:
    """Operator events outside every rlk op, and the rlk ops (their insides are their implementation)."""
    counts: Counter[tuple[str, str | None]] = Counter()
    stack = [e for e in events if e.cpu_parent is None]
    while stack:
        e = stack.pop()
        counts[(e.name, None)] += 1
        if classify(e.name) == "other":
            stack.extend(e.cpu_children)
    return [[n, c, k] for (n, c), k in sorted(counts.items(), key=lambda x: (x[0][0], x[0][1] or ""))]


def _units_cuda(events: Any) -> list[list[Any]]:
    """Every kernel with the innermost rlk op or collective range it was launched from. Kernels the profiler
    could not link to a CPU operator (e.g. launched by the C++ fast path) are counted with context null."""
    counts: Counter[tuple[str, str | None]] = Counter()
    linked: Counter[str] = Counter()
    stack = [(e, None) for e in events if e.cpu_parent is None and _on_cpu(e)]
    while stack:
        e, ctx = stack.pop()
        here = e.name if rlk_op_family(e.name) else ctx
        for k in getattr(e, "kernels", ()) or ():
            counts[(k.name, here)] += 1
            linked[k.name] += 1
        stack.extend((c, here) for c in e.cpu_children)
    device: Counter[str] = Counter(e.name for e in events if not _on_cpu(e))
    for name, n in device.items():
        if n > linked[name]:
            counts[(name, None)] += n - linked[name]
    return [[n, c, k] for (n, c), k in sorted(counts.items(), key=lambda x: (x[0][0], x[0][1] or ""))]


def _on_cpu(e: Any) -> bool:
    return str(getattr(e, "device_type", "CPU")).endswith("CPU")


class Tracer:
    """Profiles the sides of one round (:meth:`side`) and writes the trace once both are in (:meth:`side` returns
    a context manager that does nothing for any other round, or when tracing is off)."""

    def __init__(self, enabled: bool, device: str, tp: int = 1) -> None:
        self.enabled, self.device, self.tp = enabled, device, tp
        self.round: int | None = None
        self.sides: dict[str, list[list[Any]]] = {}

    @contextlib.contextmanager
    def side(self, name: str, rnd: int) -> Iterator[None]:
        if not self.enabled or (self.round is not None and rnd != self.round) or name in self.sides:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.round = rnd
        with profile(activities=activities) as prof:
            yield
            if cuda:
                import torch

                torch.cuda.synchronize()
        events = prof.events()
        self.sides[name] = _units_cuda(events) if cuda else _units_cpu(events)

    def write(self, run_dir: str | Path) -> Path | None:
        """``kernel-trace.json`` once both sides of the traced round are in; None before (or when off)."""
        if not self.enabled or sorted(self.sides) != sorted(TRACE_SIDES) or self.round is None:
            return None
        import torch

        doc = {"schema": KERNEL_TRACE_SCHEMA, "source": f"torch.profiler (torch {torch.__version__})",
               "device": self.device, "units": "kernels" if self.device.startswith("cuda") else "cpu operators",
               "round": self.round, "tp": self.tp,
               "sides": {s: {"families": families(self.sides[s]), "units": self.sides[s]} for s in TRACE_SIDES}}
        path = Path(run_dir) / KERNEL_TRACE
        evidence.write_json_atomic(path, doc)
        self.enabled = False  # one round
        return path
