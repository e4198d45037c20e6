"""``rlk-repro doctor``: is this machine ready for the routes it is asked to run?

Each check gives ``ok``, ``warn`` or ``FAIL`` with a reason; a FAIL means the requested run would not
do what it says (a device that is not there, an R route whose ops would run another implementation
than the other side's, an environment variable that does not parse). ``--selfcheck`` adds the op
contract checks of ``rlk-selfcheck`` on the device. Exit code 0 when nothing failed, 1 otherwise.
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL = "ok", "warn", "FAIL"
TRITON_ID = "rlk.triton"


@dataclass
class Check:
    name: str
    status: str
    detail: str


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as exc:  # a broken install is a finding, not a crash
        return f"import failed: {type(exc).__name__}: {exc}"


def diagnose(device: str, plan, selfcheck: bool = False, progress=None) -> list[Check]:
    """The checks, in order; ``progress(line)`` (e.g. :meth:`rlk_repro.progress.Progress.callback`) is told
    each self-check as it runs."""
    import torch

    from rlk_core import envs, routes
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import OP_CONTRACTS
    from rlk_core.errors import RlkConfigError

    out = [Check("python", OK, platform.python_version()),
           Check("torch", OK, f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")]
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        out.append(Check("device", FAIL, f"{device} asked for, but this torch sees no CUDA GPU"))
        return out
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    out.append(Check("device", OK, f"{device}: {name}"))

    triton = _version("triton")
    if dev.type == "cuda":
        out.append(Check("triton", OK if triton and not triton.startswith("import") else FAIL,
                         triton or "not installed: CUDA ops would run rlk.reference (slow, and not the bits of a "
                         "side that has Triton)"))
    else:
        out.append(Check("triton", OK, triton or "not installed (only needed on a GPU)"))

    try:
        envs.snapshot()
        out.append(Check("environment", OK, "every RL_KERNEL_* / RLK_* variable parses"))
    except RlkConfigError as exc:
        out.append(Check("environment", FAIL, str(exc)))

    import rlk_core.ops  # noqa: F401  (registers every op's backends)

    r_ops = routes.rlk_ops(plan, "train", backward=True) | routes.rlk_ops(plan, "rollout")
    for op in sorted(OP_CONTRACTS):
        candidates = REGISTRY.candidates(op, dev.type)
        registered = [b.id for b in REGISTRY.backends(op)]
        if not candidates:
            status = FAIL if op in r_ops else WARN
            out.append(Check(f"op {op}", status, f"no backend available on {dev.type} (registered: {registered})"))
            continue
        first = candidates[0]
        detail = f"{first.id} ({first.contract_id}); registered: {', '.join(registered)}"
        status = OK
        if dev.type == "cuda" and first.id != TRITON_ID and TRITON_ID in registered:
            ok, why = REGISTRY.is_available(REGISTRY.get(op, TRITON_ID), "cuda")
            status, detail = (FAIL if op in r_ops else WARN), f"{detail}; rlk.triton unavailable: {why}"
        if not first.builtin:
            qualified, why = REGISTRY.qualify(first, dev.type)
            status = status if qualified else (FAIL if op in r_ops else WARN)
            detail += f"; third-party ({first.origin}): {'qualified' if qualified else 'NOT qualified: ' + why}"
        out.append(Check(f"op {op}", status, detail + (" [used by the R routes]" if op in r_ops else "")))

    validate = _version("rlk_validate")
    out.append(Check("rlk-validate", OK if validate else FAIL, validate or "not installed: runs cannot be checked"))
    mpl = _version("matplotlib")
    out.append(Check("matplotlib", OK if mpl else WARN,
                     mpl or "not installed: rlk-repro report and rlk-validate --report write no plots"))
    if selfcheck:
        from rlk_core.selfcheck import run as run_selfcheck

        rep = run_selfcheck(dev.type, progress=progress)
        failed = [f"{r['op']}.{k}" for r in rep["ops"] for k, c in r["checks"].items() if not c["passed"]]
        total = sum(len(r["checks"]) for r in rep["ops"])
        detail = f"{total - len(failed)}/{total} contract checks passed on {dev.type}"
        out.append(Check("selfcheck", FAIL if failed else OK, detail + (f"; failed: {failed}" if failed else "")))
    return out


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{c.name.ljust(width)}  {c.status.ljust(4)}  {c.detail}" for c in checks]
    failed = sum(c.status == FAIL for c in checks)
    warned = sum(c.status == WARN for c in checks)
    lines.append(f"\nrlk-repro doctor: {'FAILED' if failed else 'ready'} ({failed} failed, {warned} warnings)")
    return "\n".join(lines)


def as_json(checks: list[Check], device: str, plan) -> dict[str, Any]:
    return {"schema": "rlk.repro-doctor.v1", "device": device, "plan": plan.as_dict(),
            "ready": not any(c.status == FAIL for c in checks), "checks": [asdict(c) for c in checks]}
